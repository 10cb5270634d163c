# Thin wrapper: the logic lives in llmpipe.steps.evaluate.
from llmpipe import steps

steps.evaluate(snakemake)  # noqa: F821 - injected by Snakemake
