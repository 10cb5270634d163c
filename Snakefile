# llmpipe: C4 -> tokenizer -> MDS -> MPT pretraining -> Hugging Face export -> generation -> evaluation.
# This file is only the table of contents; each stage has its own rule file and its logic lives in llmpipe/.
#   snakemake --cores all                                  # the embedded default: results/mpt-tiny/eval.json
#   snakemake -n results/mpt-1b/eval.json                  # the plan for MPT-1B, with each step's resources
#   snakemake --profile slurm results/mpt-1b/eval.json     # the same DAG on a Slurm cluster
import os
import time

from snakemake.utils import min_version

min_version("9.0")


configfile: os.path.join(workflow.basedir, "config", "config.yaml")


include: "rules/common.smk"
include: "rules/data.smk"
include: "rules/train.smk"
include: "rules/convert.smk"
include: "rules/generate.smk"
include: "rules/eval.smk"


rule all:
    default_target: True
    input:
        f"{RESULTS}/mpt-tiny/train.json",
        f"{RESULTS}/mpt-tiny/generate.json",
        f"{RESULTS}/mpt-tiny/eval.json",


include: "rules/bench.smk"
include: "rules/scaling.smk"
include: "rules/report.smk"
include: "rules/finetune.smk"
include: "rules/lm_eval.smk"


_STARTED = time.time()


onsuccess:
    from llmpipe.report.chain_summary import print_summary

    print_summary(RESULTS, since=_STARTED)  # each changed run's loss, held-out loss, gauntlet average, folder
