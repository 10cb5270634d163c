# Thin wrapper: the logic lives in llmpipe.steps.mds.
from llmpipe import steps

steps.mds(snakemake)  # noqa: F821 - injected by Snakemake
