# Thin wrapper: the logic lives in llmpipe.scaling.table_step (rule scaling_table).
from llmpipe import scaling

scaling.main(snakemake)  # noqa: F821 - injected by Snakemake
