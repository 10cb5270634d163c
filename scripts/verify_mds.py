# Thin wrapper: the logic lives in llmpipe.steps.verify_mds.
from llmpipe import steps

steps.verify_mds(snakemake)  # noqa: F821 - injected by Snakemake
