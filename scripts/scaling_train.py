# Thin wrapper: the logic lives in llmpipe.scaling.train_step (rule scaling_train).
from llmpipe import scaling

scaling.main(snakemake)  # noqa: F821 - injected by Snakemake
