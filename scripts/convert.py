# Thin wrapper: the logic lives in llmpipe.steps.convert.
from llmpipe import steps

steps.convert(snakemake)  # noqa: F821 - injected by Snakemake
