# Thin wrapper: the logic lives in llmpipe.steps.tokenizer.
from llmpipe import steps

steps.tokenizer(snakemake)  # noqa: F821 - injected by Snakemake
