# Thin wrapper: the logic lives in llmpipe.steps.corpus.
from llmpipe import steps

steps.corpus(snakemake)  # noqa: F821 - injected by Snakemake
