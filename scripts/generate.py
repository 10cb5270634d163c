# Thin wrapper: the logic lives in llmpipe.steps.generate.
from llmpipe import steps

steps.generate(snakemake)  # noqa: F821 - injected by Snakemake
