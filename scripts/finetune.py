# Thin wrapper: the logic lives in llmpipe.finetune.step_finetune.
from llmpipe import finetune

finetune.step_finetune(snakemake)  # noqa: F821 - injected by Snakemake
