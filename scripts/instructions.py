# Thin wrapper: the logic lives in llmpipe.finetune.step_instructions.
from llmpipe import finetune

finetune.step_instructions(snakemake)  # noqa: F821 - injected by Snakemake
