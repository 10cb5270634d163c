# Thin wrapper: the logic lives in llmpipe.allreduce (rules allreduce, allreduce_plot, allreduce_gate).
from llmpipe import allreduce

allreduce.main(snakemake)  # noqa: F821 - injected by Snakemake
