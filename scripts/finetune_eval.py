# Thin wrapper: the logic lives in llmpipe.finetune.step_eval.
from llmpipe import finetune

finetune.step_eval(snakemake)  # noqa: F821 - injected by Snakemake
