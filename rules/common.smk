# What the rules/*.smk files compute (config access, step identity, resources, input paths), one section per
# stage; those files hold only rules (snakemake --lint) and this one none. No heavy imports: `snakemake -n` must
# not import torch.
import os
import re
import sys

sys.path.insert(0, workflow.basedir)
import llmpipe

# Scripts and the jobs they start import llmpipe by name; this workflow's copy comes first for them too (an editable
# install of another checkout would win otherwise), and a process that imports another copy stops, naming both.
llmpipe.use_only_this_copy(workflow.basedir)

from snakemake.utils import validate

from llmpipe import config as cfg
from llmpipe import schema
from llmpipe.preflight import check_results_dir
from llmpipe.tracking import settings as tracking_settings

# The config against schemas/config.schema.yaml: --config values typed as in a YAML file, then an unknown key or a
# wrong value stops here naming its path and the fix (ConfigError); validate() fills the settings' defaults.
try:
    schema.prepare(config)
except cfg.ConfigError as exc:  # name the user's file (or --config) the wrong value is written in
    given = [str(f) for f in workflow.config_settings.configfiles]  # --configfile: over the Snakefile's own
    files = [str(f) for f in workflow.configfiles if str(f) not in given] + given
    raise schema.with_origin(exc, files, workflow.config_settings.config) from None
validate(config, str(schema.SCHEMA_PATH))

RESULTS = config["results_dir"]
LOGS = f"{RESULTS}/logs"
check_results_dir(RESULTS)
# The GPU the plans assume: an unknown gpu_type stops here, naming the known ones (llmpipe.plan).
from llmpipe import plan as plan_mod

cfg.gpu_memory(config)
# a tracking logger whose package is missing stops the dry run (llmpipe.tracking.settings names the fix)
tracking_settings(config)

# Jobs another (or a killed) Snakemake submitted that are still live: say so, also in a dry run, which a locked
# folder does not stop (a run re-attaches to them: llmpipe.dispatch).
if workflow.is_main_process:
    from llmpipe import live_jobs

    for line in live_jobs.notes(config["dispatch"]["state_dir"]):
        print(line, file=sys.stderr)


# A run is never one of the folders results/ keeps for itself (the look-ahead sees the "/" after the name).
wildcard_constraints:
    run=r"(?!(?:data|tokenizers|logs|report|scaling|bench|tracking)/)[A-Za-z0-9_.-]+",
    corpus=r"[A-Za-z0-9_.-]+",
    tokenizer=r"[A-Za-z0-9_.-]+",
    concat=r"\d+",
    label=r"[A-Za-z0-9_.-]+",
    suite=r"[A-Za-z0-9_.-]+",


# ------------------------------------------------------------------------------------------- step identity
# Each step module of llmpipe/steps/ gives its identity as a dict; identity_text makes it the canonical text a
# rule's `params: identity=` holds, here at the rule boundary only. Snakemake reruns a step when that text changes.
from llmpipe import allreduce as allreduce_mod
from llmpipe import eval_tasks
from llmpipe import report as report_mod
from llmpipe import scaling as scaling_mod
from llmpipe.dispatch import check_executor, executor_kind
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
    """The ICL task files of the run's suite that are inputs: those the project builds and local ones (the suite
    is checked here, in the dry run too: llmpipe.eval_tasks.check_suite); llm-foundry's standard files come
    with eval_task_data_input."""
    corpus = run_cfg(wildcards)["data"]["corpus"]
    name, suite = eval_tasks.check_suite(config, wildcards.run)
    return [
        eval_tasks.task_path(t, results_dir=RESULTS, corpus=corpus, suite=name)
        for t in suite["icl_tasks"]
        if eval_tasks.data_source(t) != "foundry"
    ]


_PREFLIGHT_DONE = set()


def preflight(step, run=None):
    """On the Slurm profile, check the step's request against the cluster while the DAG is built (dry run too),
    so a request that can never run fails now instead of waiting in the queue forever."""
    if config["dispatch"]["executor"] != "slurm" or (step, run) in _PREFLIGHT_DONE:
        return
    from llmpipe import slurm

    where = (
        f"models.{run}.resources" if step == "train" else ("data_resources" if step == "data" else f"{step}.resources")
    )
    try:
        slurm.preflight(config, cfg.step_resources(config, step, run), where=where)
    except cfg.ConfigError as exc:
        # Snakemake shows a resource error as its message alone ("WorkflowError in rule ..."), not as an input
        # function's traceback
        from snakemake.exceptions import ResourceValidationError

        raise ResourceValidationError(f"{type(exc).__name__}: {exc}") from None
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


_PLANNED = set()


def memory_plan(step, run):
    """The per-GPU memory plan (and a training's projected time) of a GPU step, printed once while the DAG is built
    (dry run too); a step that clearly cannot fit the GPUs of ``gpu_type`` stops here, naming what to change
    (llmpipe.plan)."""
    if step not in ("train", "convert", "generate", "eval") or run is None or (step, run) in _PLANNED:
        return
    r = cfg.step_resources(config, step, run)
    rc = cfg.run_config(config, run)
    if "d_model" not in (rc.get("arch") or {}):  # a hub base without its architecture: nothing to plan from
        return
    overheads = plan_mod.job_overheads()
    if step == "convert":  # host memory and time: the export runs on the host (llmpipe.convert)
        if overheads and workflow.is_main_process:
            t = plan_mod.convert_time(rc, overheads)
            m = plan_mod.convert_memory(rc, overheads)
            print(
                f"plan convert {run}: host memory {m['total_gb']:.1f} GiB (bf16 export {m['export_gb']:.1f}, "
                f"verification reload {m['verify_gb']:.1f}; requested: mem_gb {r['mem_gb']}); "
                f"time {plan_mod.human_time(t['seconds'])} ({t['basis']})",
                file=sys.stderr,
            )
        _PLANNED.add((step, run))
        return
    if int(r["gpus_per_node"]) <= 0:
        return
    where = cfg.section_path(config, run)
    gpu_type = config["gpu_type"]
    capacity = cfg.gpu_memory(config)
    proj = None
    if step == "train":
        mem = plan_mod.train_memory(
            rc, nodes=int(r["nodes"]), gpus_per_node=int(r["gpus_per_node"]), capacity_gb=capacity
        )
        basis = plan_mod.benchmark_basis(plan_mod.BENCHMARK_CSV)
        if basis:
            proj = plan_mod.train_time(
                rc,
                nodes=int(r["nodes"]),
                gpus_per_node=int(r["gpus_per_node"]),
                gpu_type=gpu_type,
                basis=basis,
                activation_checkpointing=mem["activation_checkpointing"],
                peak_overrides=config.get("gpu_peak_flops"),
                overheads=overheads,
                time_limit_s=(float(r["time_min"]) * 60 if executor_kind(config) == "slurm" else None),
            )
    else:
        placed = cfg.inference_plan(config, step, run)
        mem = placed["memory"]
        proj = inference_time(step, rc, placed, gpu_type, overheads)
    if workflow.is_main_process:
        print(plan_mod.plan_line(step, run, mem, capacity, gpu_type, proj), file=sys.stderr)
    if step == "train":
        plan_mod.check_fits(step, run, mem, capacity, gpu_type, where)
    else:
        plan_mod.check_inference_fits(step, run, placed, capacity, gpu_type, where)
    _PLANNED.add((step, run))


def inference_time(step, rc, placed, gpu_type, overheads):
    """The projected time of an eval or generate job on its planned GPUs (llmpipe.inference_placement), or None;
    generation adds the per-job costs ``overheads`` (llmpipe.plan.job_overheads)."""
    from llmpipe import inference_placement as ip

    mem, n = placed["memory"], placed["gpus"]
    if step == "eval":
        tasks = eval_tasks.suite_items(config, rc["name"])
        tokens, unknown = ip.eval_tokens(config["eval"], int(rc["data"]["concat_tokens"]), tasks)
        basis = plan_mod.benchmark_basis(plan_mod.BENCHMARK_CSV)
        proj = ip.inference_time(
            rc,
            step,
            gpus=n,
            gpu_type=gpu_type,
            basis=basis,
            eval_tokens=tokens,
            peak_overrides=config.get("gpu_peak_flops"),
        )
        if proj and unknown:
            proj["basis"] += f"; without {len(unknown)} of {len(tasks)} tasks, not fetched yet"
        return proj
    g = generate_steps.generate_settings(config, rc["name"])  # the run's own prompts, when it has them
    new = len(g["prompts"]) * int(g["max_new_tokens"])
    return ip.inference_time(
        rc,
        step,
        gpus=n,
        gpu_type=gpu_type,
        basis=None,
        new_tokens=new,
        weights_gb=mem["weights_gb"] * n,
        overheads=overheads,
    )


def res(step, key, default=0):
    """A resource of a step for Snakemake's `resources:` (shown by the dry run; never rerun triggers)."""

    def get(wildcards):
        run = getattr(wildcards, "run", None)
        preflight(step, run)
        memory_plan(step, run)
        return int(cfg.step_resources(config, step, run).get(key, default) or 0)

    return get


def dispatch_threads(resources, *args):
    """Cores a dispatching rule takes from Snakemake's --cores, namely all the CPUs of its job when the job runs here
    (``resources(*args)``: the step's resources, computed only then), none when the rule only waits on Slurm. With
    none, the Slurm profile's ``jobs`` alone bounds how many rules wait at once; ``cores: all`` of profiles/default
    (which wins over the Slurm profile's keys) would otherwise cap them at the login node's core count."""
    if config["dispatch"]["executor"] != "local":
        return 0
    r = resources(*args)
    return max(1, int(r["cpus_per_task"]) * int(r["tasks_per_node"]))


def step_threads(step):
    """The ``threads`` of a rule that dispatches ``step``, see dispatch_threads."""

    def get(wildcards):
        return dispatch_threads(cfg.step_resources, config, step, getattr(wildcards, "run", None))

    return get


# ------------------------------------------------------------------------------------------- data (rules/data.smk)


def corpus_identity(wildcards):
    cfg.validate_corpus(config, wildcards.corpus)
    return identity_text(data_steps.corpus_identity(config, wildcards.corpus))


def tokenizer_identity(wildcards):
    cfg.validate_tokenizer(config, wildcards.tokenizer)
    return identity_text(data_steps.tokenizer_identity(config, wildcards.tokenizer))


def tokenizer_inputs(wildcards):
    t = cfg.validate_tokenizer(config, wildcards.tokenizer)
    return [f"{RESULTS}/data/{t['corpus']}/raw/manifest.json"] if t["source"] == "train" else []


def mds_identity(wildcards):
    return identity_text(data_steps.mds_identity(config, wildcards.corpus, wildcards.tokenizer, int(wildcards.concat)))


def verify_identity(wildcards):
    return identity_text(
        data_steps.verify_identity(config, wildcards.corpus, wildcards.tokenizer, int(wildcards.concat))
    )


def icl_task_identity(wildcards):
    return identity_text(data_steps.icl_task_identity(config, wildcards.label))


# ------------------------------------------------------------------------------------------- pretraining (rules/train.smk)


def train_identity(wildcards):
    run_cfg(wildcards)
    return identity_text(train_steps.train_identity(config, wildcards.run))


def lost_train_notes():
    """Notes on runs whose train.json a killed changed run left deleted while their training under these settings
    finished and the results after it are up to date: Snakemake plans nothing for eval.json then, so the note names
    the command that restores it without a job (llmpipe.kept_results.lost_train_note)."""
    from llmpipe import kept_results

    for run in cfg.known_runs(config):
        if not kept_results.train_json_lost(RESULTS, run):
            continue
        try:
            note = kept_results.lost_train_note(RESULTS, run, identity_text(train_steps.train_identity(config, run)))
        except Exception:  # a note never stops a run; a broken run is reported when it is asked for
            continue
        if note:
            yield note


if workflow.is_main_process:
    for line in lost_train_notes():
        print(line, file=sys.stderr)


# ------------------------------------------------------------------------------------------- export (rules/convert.smk)


def convert_identity(wildcards):
    return identity_text(convert_steps.convert_identity(config, wildcards.run))


# ------------------------------------------------------------------------------------------- generation (rules/generate.smk)


def generate_identity(wildcards):
    return identity_text(generate_steps.generate_identity(config, wildcards.run))


# ------------------------------------------------------------------------------------------- evaluation (rules/eval.smk)


def eval_identity(wildcards):
    return identity_text(eval_steps.eval_identity(config, wildcards.run))


def eval_task_data_input(wildcards):
    """The manifest of the run's suite's llm-foundry task files (rule eval_task_data); [] when it has none."""
    name, suite = eval_tasks.run_suite(config, wildcards.run)
    files = eval_tasks.foundry_files(suite["icl_tasks"])
    eval_tasks.check_task_data(config, files)
    return [f"{RESULTS}/data/eval-tasks/{name}/manifest.json"] if files else []


def eval_task_data_identity(wildcards):
    return identity_text(eval_steps.eval_task_data_identity(config, wildcards.suite))


def generation_of_run(wildcards):
    """The run's generation: the evaluation target runs every stage. ancient(): a new generation (a prompt
    change) never reruns the evaluation."""
    return ancient(f"{RESULTS}/{wildcards.run}/generate.json")


# ------------------------------------------------------------------------------------------- second harness (rules/lm_eval.smk)
from llmpipe.steps import lm_eval_harness as lm_eval_steps


def lm_eval_data_files(wildcards):
    """Every file of lm_eval.data_dir (task YAMLs and data: a changed one reruns the harness), once the settings
    are checked (a ConfigError names the setting when the harness is off, lm_eval is missing or a task has no YAML)."""
    return lm_eval_steps.lm_eval_inputs(config, wildcards.run)


def lm_eval_identity(wildcards):
    return identity_text(lm_eval_steps.lm_eval_identity(config, wildcards.run))


def lm_eval_res(key):
    def get(wildcards):
        return int(lm_eval_steps.lm_eval_resources(config, wildcards).get(key) or 0)

    return get


def lm_eval_threads(wildcards):
    return dispatch_threads(lm_eval_steps.lm_eval_resources, config, wildcards)


# ------------------------------------------------------------------------------------------- finetuning (rules/finetune.smk)


FINETUNES = sorted(config.get("finetunes") or {})
_FT_RUN = "|".join(re.escape(r) for r in FINETUNES) if FINETUNES else "(?!)"


def finetune_cfg(wildcards):
    """Validated settings of the finetune in the target path (clear ConfigError if wrong, already in a dry run)."""
    return cfg.validate_run(config, wildcards.run)


def instructions_manifest(wildcards):
    """The prepared instruction set the finetune trains and is evaluated on."""
    return f"{RESULTS}/data/instructions/{finetune_cfg(wildcards)['data']['instructions']}/manifest.json"


def finetune_inputs(wildcards):
    """The finetune rule's inputs, i.e. instruction set, tokenizer, the base run's export (own bases) and the
    all-reduce gate."""
    rc = finetune_cfg(wildcards)
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


def finetune_icl_files(wildcards):
    """The ICL task files of the finetune's eval (built ones from its ICL corpus, the base run's by default)."""
    finetune_cfg(wildcards)
    return icl_task_files(wildcards)


def instructions_identity(wildcards):
    cfg.validate_instruction_set(config, wildcards.iset)
    return identity_text(data_steps.instructions_identity(config, wildcards.iset))


def finetune_identity(wildcards):
    finetune_cfg(wildcards)
    return identity_text(train_steps.train_identity(config, wildcards.run))


def finetune_eval_identity(wildcards):
    return identity_text(eval_steps.finetune_eval_identity(config, wildcards.run))


# ------------------------------------------------------------------------------------------- all-reduce bench and gate (rules/bench.smk)


def allreduce_plan(wildcards):
    """No input files; checks the sweep and the executor, and runs the Slurm preflight, while the DAG is built."""
    nodes = int(wildcards.nodes)
    allreduce_mod.settings(config)
    check_executor(config, nodes, f"the all-reduce bench (results/bench/allreduce/nodes{nodes}.csv)")
    if config["dispatch"]["executor"] == "slurm" and ("allreduce", nodes) not in _PREFLIGHT_DONE:
        from llmpipe import slurm

        slurm.preflight(config, allreduce_mod.bench_resources(config, nodes), where="allreduce.resources")
        _PREFLIGHT_DONE.add(("allreduce", nodes))
    return []


def allreduce_res(key):
    def get(wildcards):
        return int(allreduce_mod.bench_resources(config, int(wildcards.nodes)).get(key) or 0)

    return get


def allreduce_threads(wildcards):
    return dispatch_threads(allreduce_mod.bench_resources, config, int(wildcards.nodes))


def allreduce_node_count(wildcards):
    """``nodes`` resource of the bench: the node count in its path."""
    return int(wildcards.nodes)


def allreduce_identity(wildcards):
    return identity_text(allreduce_steps.allreduce_identity(config))


def allreduce_csvs(wildcards):
    """The bench's CSV at every node count of allreduce.nodes."""
    return [f"{RESULTS}/bench/allreduce/nodes{n}.csv" for n in allreduce_mod.settings(config)["nodes"]]


def allreduce_gate_settings(wildcards):
    """``allreduce.gate`` (with ``allreduce.health`` when set) as text: a changed threshold re-checks the gate (it
    never re-measures)."""
    s = allreduce_mod.settings(config)
    return identity_text({**s["gate"], "health": s["health"]} if s.get("health") else s["gate"])


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
        raise cfg.ConfigError(
            f"no all-reduce gate for {wildcards.run}: allreduce.gate is off or the training has a "
            f"single rank. Fix: set allreduce.gate: {{size_bytes: ..., min_busbw_gbps: ...}}."
        )
    inputs = {"csv": f"{RESULTS}/bench/allreduce/nodes{nodes}.csv"}
    if allreduce_mod.settings(config).get("health"):
        inputs["health"] = f"{RESULTS}/bench/allreduce/health/nodes{nodes}.json"
    return inputs


def allreduce_health_identity(wildcards):
    return identity_text(allreduce_steps.health_identity(config))


# ------------------------------------------------------------------------------------------- node-scaling studies (rules/scaling.smk)


def scaling_check(wildcards):
    """Validate the whole study (every node count) while the DAG is built; Slurm preflight for this count."""
    checked = scaling_mod.check_study(config, wildcards.run)
    nodes = int(getattr(wildcards, "nodes", 0) or 0)
    if nodes and nodes not in checked:
        checked.update(scaling_mod.check_study(config, wildcards.run, [nodes]))
    if nodes and config["dispatch"]["executor"] == "slurm" and ("scaling", wildcards.run, nodes) not in _PREFLIGHT_DONE:
        from llmpipe import slurm

        slurm.preflight(config, checked[nodes], where=f"models.{wildcards.run}.resources (scaling at {nodes} nodes)")
        _PREFLIGHT_DONE.add(("scaling", wildcards.run, nodes))
    return checked


def scaling_res(key):
    def get(wildcards):
        sc = scaling_mod.study_config(config, wildcards.run, int(wildcards.nodes))
        return int(cfg.step_resources(sc, "train", wildcards.run).get(key) or 0)

    return get


def scaling_threads(wildcards):
    return dispatch_threads(cfg.step_resources, config, "train", wildcards.run)


def study_identity(wildcards):
    """The study's training identity (the same at every node count), once the whole study is checked."""
    scaling_check(wildcards)
    return identity_text(scaling_steps.study_identity(config, wildcards.run))


def study_trainings(wildcards):
    """The train.json of every node count of the study."""
    return [f"{RESULTS}/scaling/{wildcards.run}/nodes{n}/train.json" for n in scaling_check(wildcards)]


def scaling_tables(wildcards):
    """The table of every study in scaling.runs."""
    return [f"{RESULTS}/scaling/{r}/scaling.csv" for r in scaling_mod.settings(config)["runs"]]


def scaling_gate_input(wildcards):
    """The all-reduce gate at this node count when allreduce.gate is on (see rules/bench.smk)."""
    if allreduce_mod.gate_nodes(config, wildcards.run, int(wildcards.nodes)) is None:
        return []
    return ancient(f"{RESULTS}/bench/allreduce/gate/{wildcards.run}/nodes{wildcards.nodes}.json")


def scaling_inputs(wildcards):
    """A pretraining run's dataset and tokenizer, or a finetune's inputs (rules/finetune.smk), and the gate."""
    if cfg.is_finetune(config, wildcards.run):
        inputs = {k: v for k, v in finetune_inputs(wildcards).items() if k != "gate"}
    else:
        inputs = {"data": dataset_path(wildcards, "verified.json"), "tokenizer": tokenizer_manifest_of_run(wildcards)}
    gate = scaling_gate_input(wildcards)
    if gate:
        inputs["gate"] = gate
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
