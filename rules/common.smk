# Helpers shared by all rule files: config access, step identity (params), resources and input paths.
# Only light imports here: `snakemake -n` must not import torch.
import os
import sys

sys.path.insert(0, workflow.basedir)

from llmpipe import config as cfg
from llmpipe.preflight import check_results_dir

RESULTS = config["results_dir"]
LOGS = f"{RESULTS}/logs"
check_results_dir(RESULTS)
cfg.check_top_level_keys(config, os.path.join(workflow.basedir, "config", "config.yaml"))
cfg.check_section_keys(config, os.path.join(workflow.basedir, "config", "config.yaml"))


wildcard_constraints:
    run=r"(?!data$|tokenizers$|logs$|report$|scaling$|bench$)[A-Za-z0-9_.-]+",
    corpus=r"[A-Za-z0-9_.-]+",
    tokenizer=r"[A-Za-z0-9_.-]+",
    concat=r"\d+",
    label=r"[A-Za-z0-9_.-]+",


# ------------------------------------------------------------------------------------------- step identity
# Each step module of llmpipe/steps/ gives its identity as a dict; identity_text makes it the canonical text a
# rule's `params: identity=` holds, here at the rule boundary only. Snakemake reruns a step when that text changes.
from llmpipe.identity import identity_text
from llmpipe.steps import allreduce as allreduce_steps
from llmpipe.steps import convert as convert_steps
from llmpipe.steps import data as data_steps
from llmpipe.steps import evaluate as eval_steps
from llmpipe.steps import generate as generate_steps
from llmpipe.steps import scaling as scaling_steps
from llmpipe.steps import train as train_steps


def run_cfg(wildcards):
    """Validated settings of the run in the target path (clear ConfigError if it is wrong)."""
    return cfg.validate_run(config, wildcards.run)


def dataset_path(wildcards, leaf):
    d = run_cfg(wildcards)["data"]
    return f"{RESULTS}/data/{d['corpus']}/{d['tokenizer']}/concat{d['concat_tokens']}/{leaf}"


def verified_dataset(wildcards):
    """The verification record of the run's dataset (its MDS shards are beside it, in mds/)."""
    return dataset_path(wildcards, "verified.json")


def tokenizer_manifest_of_run(wildcards):
    return f"{RESULTS}/tokenizers/{run_cfg(wildcards)['data']['tokenizer']}/manifest.json"


def icl_task_files(wildcards):
    corpus = run_cfg(wildcards)["data"]["corpus"]
    return [f"{RESULTS}/data/{corpus}/icl/{t['label']}.jsonl" for t in config["eval"]["icl_tasks"]]


_PREFLIGHT_DONE = set()


def preflight(step, run=None):
    """On the Slurm profile, check the step's request against the cluster while the DAG is built (dry run too),
    so a request that can never run fails now instead of waiting in the queue forever."""
    if config["dispatch"]["executor"] != "slurm" or (step, run) in _PREFLIGHT_DONE:
        return
    from llmpipe import slurm

    where = f"models.{run}.resources" if step == "train" else ("data_resources" if step == "data" else f"{step}.resources")
    slurm.preflight(config, cfg.step_resources(config, step, run), where=where)
    _PREFLIGHT_DONE.add((step, run))


def refuse_local_multi_node_trainings():
    """Without the Slurm profile, stop before any job runs when a training or finetune that has to run asks for more
    than one node: the local executor uses this one machine (llmpipe.dispatch.check_executor). Runs from
    ``onstart``, i.e. only for real executions: dry runs still show the multi-node plan, and reports, DAG plots or
    evaluations of runs already trained elsewhere are not affected."""
    if config["dispatch"]["executor"] == "slurm":
        return
    from llmpipe.dispatch import check_executor

    for job in workflow.dag.needrun_jobs():
        if job.rule.name in ("train", "finetune"):
            run = job.wildcards.run
            where = f"{'finetunes' if job.rule.name == 'finetune' else 'models'}.{run}.resources"
            check_executor(config, int(job.resources.get("nodes", 1) or 1), f"{where} (rule {job.rule.name})")


onstart:
    refuse_local_multi_node_trainings()


def res(step, key, default=0):
    """A resource of a step for Snakemake's `resources:` (shown by the dry run; never rerun triggers)."""

    def get(wildcards):
        run = getattr(wildcards, "run", None)
        preflight(step, run)
        return int(cfg.step_resources(config, step, run).get(key, default) or 0)

    return get


def dispatch_threads(resources, *args):
    """Cores a dispatching rule takes from Snakemake's --cores: all the CPUs of its job when the job runs here
    (``resources(*args)``: the step's resources, computed only then), none when the rule only waits on Slurm. With
    none, the Slurm profile's ``jobs`` alone bounds how many rules wait at once; ``cores: all`` of profiles/default
    (which wins over the Slurm profile's keys) would otherwise cap them at the login node's core count."""
    if config["dispatch"]["executor"] != "local":
        return 0
    r = resources(*args)
    return max(1, int(r["cpus_per_task"]) * int(r["tasks_per_node"]))


def step_threads(step):
    """``threads:`` of a rule that dispatches ``step`` (:func:`dispatch_threads`)."""

    def get(wildcards):
        return dispatch_threads(cfg.step_resources, config, step, getattr(wildcards, "run", None))

    return get
