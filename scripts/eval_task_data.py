# Rule script: runs the rule's step from llmpipe.steps (llmpipe/steps/__init__.py: RULES names it).
from llmpipe.steps import run_rule

run_rule(snakemake)  # noqa: F821 - injected by Snakemake
