# Thin wrapper: the logic lives in llmpipe.steps.train.
from llmpipe import steps

steps.train(snakemake)  # noqa: F821 - injected by Snakemake
