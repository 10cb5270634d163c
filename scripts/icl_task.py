# Thin wrapper: the logic lives in llmpipe.steps.icl_task.
from llmpipe import steps

steps.icl_task(snakemake)  # noqa: F821 - injected by Snakemake
