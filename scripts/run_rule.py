# Every rule's script: runs the step registered under the rule's name (llmpipe/steps/registry.py).
from llmpipe.steps import run_rule

run_rule(snakemake)  # noqa: F821 - injected by Snakemake
