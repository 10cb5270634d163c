# Thin wrapper: the logic lives in llmpipe.report (rule report).
from llmpipe import report

report.main(snakemake)  # noqa: F821 - injected by Snakemake
