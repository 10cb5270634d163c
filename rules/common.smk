# What the rules/*.smk files take from the config: its validation, then each rule's params (step identity), resources
# and input paths, one section per stage; those files hold only rules (snakemake --lint) and this one none. What the
# workflow checks and says while the DAG is built (Slurm preflight, memory and time plans, notes) is
# llmpipe/plan/dag_checks.py; every rule's script is scripts/run_rule.py, running the step registered under the rule's
# name (llmpipe/steps/registry.py). No heavy imports: `snakemake -n` must not import torch.
import inspect
import re
import sys

sys.path.insert(0, workflow.basedir)
import llmpipe

# Scripts and the jobs they start import llmpipe by name; this workflow's copy comes first for them too (an editable
# install of another checkout would win otherwise), and a process that imports another copy stops, naming both.
llmpipe.use_only_this_copy(workflow.basedir)

from snakemake.exceptions import ResourceValidationError, WorkflowError, print_exception
from snakemake.utils import validate

from llmpipe.bench import allreduce_bw as allreduce_mod
from llmpipe.config import runs as cfg
from llmpipe.config.settings import ConfigError
from llmpipe.evaluation import suites as eval_tasks
from llmpipe.report import tables as report_mod
from llmpipe.bench import scaling_study as scaling_mod
from llmpipe.config import schema
from llmpipe.plan.dag_checks import DagChecks, PreflightRefused
from llmpipe.dispatch.jobs import check_executor
from llmpipe.dispatch.orphans import interrupt_rule_scripts_on_signal
from llmpipe.config.identity import identity_text
from llmpipe.steps import allreduce as allreduce_steps
from llmpipe.steps import convert as convert_steps
from llmpipe.steps import prepare as data_steps
from llmpipe.steps import evaluate as eval_steps
from llmpipe.steps import generate as generate_steps
from llmpipe.steps import lm_eval_harness as lm_eval_steps
from llmpipe.steps import scaling as scaling_steps
from llmpipe.steps import training as train_steps

# The config against schemas/config.schema.yaml: --config values typed as in a YAML file, then an unknown key or a
# wrong value stops here naming its path and the fix (ConfigError); validate() fills the settings' defaults.
try:
    schema.prepare(config)
except ConfigError as exc:  # name the user's file (or --config) the wrong value is written in
    given = [str(f) for f in workflow.config_settings.configfiles]  # --configfile: over the Snakefile's own
    files = [str(f) for f in workflow.configfiles if str(f) not in given] + given
    raise schema.with_origin(exc, files, workflow.config_settings.config) from None
validate(config, str(schema.SCHEMA_PATH))

RESULTS = config["results_dir"]
LOGS = f"{RESULTS}/logs"
# The DAG-time checks, each done once (llmpipe.plan.dag_checks): settings no rule owns, then notes on live jobs and lost
# trainings; each rule's resources below go through CHECKS.resources (preflight and plans).
CHECKS = DagChecks(config, main_process=workflow.is_main_process)
CHECKS.check_settings()
CHECKS.print_notes()


# Before its first job starts, a real run makes the dry run's checks (Slurm preflight, plans) of every job it will run,
# in the dry run's order (DagChecks.check_jobs): Snakemake evaluates a job's resources only when the job is ready. A
# refusal is printed as the dry run prints it, naming the rule (raised through this block, Snakemake would name this
# file instead); on exit Snakemake releases its lock, and no job was started or flagged incomplete.
onstart:
    levels = workflow.dag.toposorted(set(workflow.dag.needrun_jobs()))
    try:
        CHECKS.check_jobs(job for level in levels for job in level)
    except WorkflowError as exc:
        print_exception(exc.with_traceback(None), workflow.linemaps)
        sys.exit(1)
    CHECKS.refuse_local_multi_node(workflow.dag.needrun_jobs())
    interrupt_rule_scripts_on_signal()  # SIGINT/SIGTERM to Snakemake alone stop its steps as Ctrl-C does


# A run is never one of the folders results/ keeps for itself (the look-ahead sees the "/" after the name).
wildcard_constraints:
    run=r"(?!(?:data|tokenizers|logs|report|scaling|bench|tracking)/)[A-Za-z0-9_.-]+",
    corpus=r"[A-Za-z0-9_.-]+",
    tokenizer=r"[A-Za-z0-9_.-]+",
    concat=r"\d+",
    label=r"[A-Za-z0-9_.-]+",
    suite=r"[A-Za-z0-9_.-]+",


# ------------------------------------------------------------------------------------------- params and resources


def identity(step_identity, check=None):
    """A rule's ``params: identity=``: the canonical text (llmpipe.config.identity.identity_text) of
    ``step_identity(config, ...)``, a step module's identity function, whose other parameters are the rule's
    wildcards of the same names (typed as annotated: ``concat: int``). ``check(config, ...)``, with the same
    arguments, runs first and names a wrong setting (ConfigError). Snakemake reruns a step when the text changes."""
    params = list(inspect.signature(step_identity, eval_str=True).parameters.values())[1:]

    def get(wildcards):
        args = [int(getattr(wildcards, p.name)) if p.annotation is int else getattr(wildcards, p.name) for p in params]
        if check is not None:
            check(config, *args)
        return identity_text(step_identity(config, *args))

    return get


def res(rule, key):
    """Resource ``key`` of the job the registered step dispatches (step named by its rule), as a value of Snakemake's
    resources (shown by the dry run; never a rerun trigger), checked while the DAG is built
    (llmpipe.plan.dag_checks.DagChecks.resources)."""

    def get(wildcards):
        try:
            return int(CHECKS.resources(rule, wildcards).get(key) or 0)
        except PreflightRefused as exc:  # Snakemake shows a resource error as its message alone, no traceback
            raise ResourceValidationError(f"ConfigError: {exc}") from None

    return get


def threads(rule):
    """The threads of a dispatching rule, i.e. its job's CPUs when the job runs here and none when the rule only
    waits on Slurm (llmpipe.plan.dag_checks.DagChecks.dispatch_threads)."""

    def get(wildcards):
        return CHECKS.dispatch_threads(rule, wildcards)

    return get


# ------------------------------------------------------------------------------------------- input paths


def run_cfg(wildcards):
    """Validated settings of the run in the target path (clear ConfigError if it is wrong, already in a dry run)."""
    return cfg.validate_run(config, wildcards.run)


def dataset_path(wildcards, leaf):
    d = run_cfg(wildcards)["data"]
    return f"{RESULTS}/data/{d['corpus']}/{d['tokenizer']}/concat{d['concat_tokens']}/{leaf}"


def verified_dataset(wildcards):
    """The verification record of the run's dataset (its MDS shards are beside it, in mds/)."""
    return dataset_path(wildcards, "verified.json")


def tokenizer_manifest_of_run(wildcards):
    return f"{RESULTS}/tokenizers/{run_cfg(wildcards)['data']['tokenizer']}/manifest.json"


def convert_inputs(wildcards):
    """The convert rule's inputs: the run's train.json and tokenizer, and a LoRA finetune's base export when the
    base is our own run (its checkpoints hold the adapters only: conversion reads the base weights there)."""
    rc = run_cfg(wildcards)
    inputs = {
        "train": f"{RESULTS}/{wildcards.run}/train.json",
        "tokenizer": tokenizer_manifest_of_run(wildcards),
    }
    if rc.get("lora") and (rc.get("base") or {}).get("run"):
        inputs["base"] = f"{RESULTS}/{rc['base']['run']}/hf/manifest.json"
    return inputs


def icl_task_files(wildcards):
    """The ICL task files of the run's suite that are inputs: those the project builds and local ones (the suite
    is checked here, in the dry run too: llmpipe.evaluation.suites.check_suite); llm-foundry's standard files come
    with eval_task_data_input. A finetune's are built from its ICL corpus (the base run's by default)."""
    corpus = run_cfg(wildcards)["data"]["corpus"]
    name, suite = eval_tasks.check_suite(config, wildcards.run)
    return [
        eval_tasks.task_path(t, results_dir=RESULTS, corpus=corpus, suite=name)
        for t in suite["icl_tasks"]
        if eval_tasks.data_source(t) != "foundry"
    ]


# ------------------------------------------------------------------------------------------- data (rules/data.smk)


def tokenizer_inputs(wildcards):
    t = cfg.validate_tokenizer(config, wildcards.tokenizer)
    return [f"{RESULTS}/data/{t['corpus']}/raw/manifest.json"] if t["source"] == "train" else []


# ------------------------------------------------------------------------------------------- evaluation (rules/eval.smk)


def eval_task_data_input(wildcards):
    """The manifest of the run's suite's llm-foundry task files (rule eval_task_data); [] when it has none."""
    name, suite = eval_tasks.run_suite(config, wildcards.run)
    files = eval_tasks.foundry_files(suite["icl_tasks"])
    eval_tasks.check_task_data(config, files)
    return [f"{RESULTS}/data/eval-tasks/{name}/manifest.json"] if files else []


def generation_of_run(wildcards):
    """The run's generation: the evaluation target runs every stage. ancient(): a new generation (a prompt
    change) never reruns the evaluation."""
    return ancient(f"{RESULTS}/{wildcards.run}/generate.json")


# ------------------------------------------------------------------------------------------- second harness (rules/lm_eval.smk)


def lm_eval_data_files(wildcards):
    """Every file of lm_eval.data_dir (task YAMLs and data: a changed one reruns the harness), once the settings
    are checked (a ConfigError names the setting when the harness is off, lm_eval is missing or a task has no YAML)."""
    return lm_eval_steps.lm_eval_inputs(config, wildcards.run)


# ------------------------------------------------------------------------------------------- finetuning (rules/finetune.smk)


FINETUNES = sorted(config.get("finetunes") or {})
FINETUNE_RUN = "|".join(re.escape(r) for r in FINETUNES) if FINETUNES else "(?!)"


def instructions_manifest(wildcards):
    """The prepared instruction set the finetune trains and is evaluated on."""
    return f"{RESULTS}/data/instructions/{run_cfg(wildcards)['data']['instructions']}/manifest.json"


def finetune_inputs(wildcards):
    """The finetune rule's inputs, i.e. instruction set, tokenizer, the base run's export (own bases) and the
    all-reduce gate."""
    rc = run_cfg(wildcards)
    inputs = {
        "instructions": instructions_manifest(wildcards),
        "tokenizer": f"{RESULTS}/tokenizers/{rc['data']['tokenizer']}/manifest.json",
    }
    if rc["base"].get("run"):  # our own model: its Hugging Face export (retraining it reruns this finetune)
        inputs["base"] = f"{RESULTS}/{rc['base']['run']}/hf/manifest.json"
    gate = allreduce_gate_input(wildcards)
    if gate:
        inputs["gate"] = gate
    return inputs


# ------------------------------------------------------------------------------------------- all-reduce bench and gate (rules/bench.smk)


def allreduce_check(wildcards):
    """No input files: checks the sweep and the executor while the DAG is built."""
    nodes = int(wildcards.nodes)
    allreduce_mod.settings(config)
    check_executor(config, nodes, f"the all-reduce bench (results/bench/allreduce/nodes{nodes}.csv)")
    return []


def allreduce_csvs(wildcards):
    """The bench's CSV at every node count of allreduce.nodes."""
    return [f"{RESULTS}/bench/allreduce/nodes{n}.csv" for n in allreduce_mod.settings(config)["nodes"]]


def allreduce_gate_input(wildcards):
    """The all-reduce gate's record, an input of the training rules when allreduce.gate is on and the training
    has more than one rank; [] otherwise.

    ancient(): a rerun bench or a changed threshold re-checks the gate but never retrains a finished model."""
    if allreduce_mod.gate_nodes(config, wildcards.run) is None:
        return []
    return ancient(f"{RESULTS}/bench/allreduce/gate/{wildcards.run}.json")


def allreduce_gate_inputs(wildcards):
    """The gate's inputs: the bench's CSV at the training's node count and, with allreduce.health on, the health
    check's per-GPU lines there."""
    nodes = allreduce_mod.gate_nodes(config, wildcards.run, getattr(wildcards, "nodes", None))
    if nodes is None:
        raise ConfigError(
            f"no all-reduce gate for {wildcards.run}: allreduce.gate is off or the training has a "
            f"single rank. Fix: set allreduce.gate: {{size_bytes: ..., min_busbw_gbps: ...}}."
        )
    inputs = {"csv": f"{RESULTS}/bench/allreduce/nodes{nodes}.csv"}
    if allreduce_mod.settings(config).get("health"):
        inputs["health"] = f"{RESULTS}/bench/allreduce/health/nodes{nodes}.json"
    return inputs


# ------------------------------------------------------------------------------------------- node-scaling studies (rules/scaling.smk)


def scaling_check(wildcards):
    """Validate the whole study (every node count, and the one in the path) while the DAG is built; return node
    count -> resources."""
    checked = scaling_mod.check_study(config, wildcards.run)
    nodes = int(getattr(wildcards, "nodes", 0) or 0)
    if nodes and nodes not in checked:
        checked.update(scaling_mod.check_study(config, wildcards.run, [nodes]))
    return checked


def study_trainings(wildcards):
    """The train.json of every node count of the study."""
    return [f"{RESULTS}/scaling/{wildcards.run}/nodes{n}/train.json" for n in scaling_check(wildcards)]


def scaling_tables(wildcards):
    """The table of every study in scaling.runs."""
    return [f"{RESULTS}/scaling/{r}/scaling.csv" for r in scaling_mod.settings(config)["runs"]]


def scaling_inputs(wildcards):
    """Once the study is checked: a pretraining run's dataset and tokenizer, or a finetune's inputs
    (rules/finetune.smk), and the all-reduce gate at this node count when allreduce.gate is on (rules/bench.smk)."""
    scaling_check(wildcards)
    if cfg.is_finetune(config, wildcards.run):
        inputs = {k: v for k, v in finetune_inputs(wildcards).items() if k != "gate"}
    else:
        inputs = {"data": dataset_path(wildcards, "verified.json"), "tokenizer": tokenizer_manifest_of_run(wildcards)}
    if allreduce_mod.gate_nodes(config, wildcards.run, int(wildcards.nodes)) is not None:
        inputs["gate"] = ancient(f"{RESULTS}/bench/allreduce/gate/{wildcards.run}/nodes{wildcards.nodes}.json")
    return inputs


# ------------------------------------------------------------------------------------------- report (rules/report.smk)


def report_inputs(wildcards):
    """Requested runs (report.runs: built if missing) and runs, studies and benches whose results already exist;
    each run's page (rule report_run)."""
    files = []
    for run in report_mod.report_runs(config, RESULTS):
        files += report_mod.run_inputs(config, RESULTS, run)
        files += [f"{RESULTS}/report/runs/{run}/{leaf}" for leaf in ("loss.png", "mfu.png", "tracking.html")]
    files += [f"{RESULTS}/scaling/{r}/scaling.csv" for r in report_mod.scaling_runs(config, RESULTS)]
    files += [f"{RESULTS}/bench/allreduce/nodes{n}.csv" for n in report_mod.allreduce_nodes(config, RESULTS)]
    return files


def requested_runs(wildcards):
    return report_mod.report_runs(config, RESULTS)


def requested_scaling_studies(wildcards):
    return report_mod.scaling_runs(config, RESULTS)


def requested_allreduce_nodes(wildcards):
    return report_mod.allreduce_nodes(config, RESULTS)
