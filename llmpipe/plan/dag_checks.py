"""What the workflow checks and says while Snakemake builds the DAG, the dry run (``snakemake -n``) included.

``rules/common.smk`` validates the config, then creates one :class:`DagChecks` and calls it:

* :meth:`DagChecks.check_settings` and :meth:`DagChecks.print_notes` once, when the workflow is read: the results
  folder, the GPU type the plans assume, the tracking loggers' packages; jobs another Snakemake left live
  (:mod:`llmpipe.dispatch.live_jobs`) and trainings whose ``train.json`` a killed run left deleted (:mod:`llmpipe.steps.kept_results`);
* :meth:`DagChecks.resources` for every rule's ``resources:``: the registered step's request
  (:data:`llmpipe.steps.registry.RULES`), checked against the Slurm cluster (:func:`llmpipe.dispatch.slurm.preflight`, on the
  Slurm profile) and, for a GPU step, its memory plan and time projection printed and checked against the GPU
  (:mod:`llmpipe.plan.memory_time`), each once per request or run: the object remembers what it has checked;
* :meth:`DagChecks.check_jobs` and :meth:`DagChecks.refuse_local_multi_node` from ``onstart`` (real executions only):
  a real run evaluates a job's resources only when the job is about to run, so without them a request the cluster
  cannot run, or a plan that cannot fit, would stop the run after the steps before it had run or been queued.

A request the cluster can never run raises :class:`PreflightRefused` (``rules/common.smk`` shows it as Snakemake's
resource error, the message alone); a plan that cannot fit raises :class:`~llmpipe.config.settings.ConfigError`.

Never imports Snakemake or torch: it is library code the rule files call.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from typing import Any

from llmpipe.config import runs as cfg
from llmpipe.config.identity import identity_text
from llmpipe.config.settings import ConfigError
from llmpipe.dispatch.jobs import check_executor, executor_kind
from llmpipe.evaluation import suites as eval_tasks
from llmpipe.plan import memory_time as plan_mod
from llmpipe.steps import RULES
from llmpipe.steps import training as train_steps
from llmpipe.steps.generate import run_generate_settings


class PreflightRefused(ConfigError):
    """A step's request that the Slurm cluster can never run (:func:`llmpipe.dispatch.slurm.preflight`'s message)."""


class DagChecks:
    """The DAG-time checks of one workflow run, each done once.

    Attributes:
        config: the validated workflow config.
        main_process: whether this is Snakemake's main process; only it prints (a process Snakemake starts for a
            job reads the workflow again and checks, silently).
        preflighted: ``(where, request)`` pairs the Slurm preflight has passed.
        planned: ``(step, run)`` pairs whose plan was printed and passed.
    """

    def __init__(self, config: dict, *, main_process: bool = True) -> None:
        self.config = config
        self.main_process = main_process
        self.preflighted: set[tuple[str, str]] = set()
        self.planned: set[tuple[str, str]] = set()

    def say(self, line: str) -> None:
        """Print ``line`` on stderr in the main process."""
        if self.main_process:
            print(line, file=sys.stderr)

    # ------------------------------------------------------------------------------------------- once, at start

    def check_settings(self) -> None:
        """The checks of settings no rule owns: the results folder (:func:`llmpipe.config.results_dir.check_results_dir`), an
        unknown ``gpu_type`` (naming the known ones) or ``auto`` on Slurm (:func:`llmpipe.config.runs.gpu_card`), a tracking logger whose package is missing
        (:func:`llmpipe.train.tracking.settings` names the fix) and an eval suite that no run's choice finds
        (:func:`llmpipe.evaluation.suites.run_suite`, for every run: the rest of a suite's checks need its files and
        come with the eval rule's inputs, :func:`llmpipe.evaluation.suites.check_suite`).

        Raises:
            ConfigError: naming the setting and the fix.
        """
        from llmpipe.config.results_dir import check_results_dir
        from llmpipe.train.tracking import settings as tracking_settings

        check_results_dir(self.config["results_dir"])
        cfg.gpu_memory(self.config)
        tracking_settings(self.config)
        for run in cfg.known_runs(self.config):
            eval_tasks.run_suite(self.config, run)

    def print_notes(self) -> None:
        """Say, in the main process, which jobs another (or a killed) Snakemake submitted are still live (a run
        re-attaches to them: :mod:`llmpipe.dispatch.jobs`; a dry run, which a locked folder does not stop, says so too),
        and which runs lost their ``train.json`` while their training under these settings finished
        (:meth:`lost_train_notes`)."""
        if not self.main_process:
            return
        from llmpipe.dispatch import live_jobs

        for line in live_jobs.notes(self.config["dispatch"]["state_dir"]):
            self.say(line)
        for line in self.lost_train_notes():
            self.say(line)

    def lost_train_notes(self) -> Iterable[str]:
        """Notes on runs whose train.json a killed changed run left deleted while their training under these
        settings finished and the results after it are up to date: Snakemake plans nothing for eval.json then, so
        the note names the command that restores it without a job (:func:`llmpipe.steps.kept_results.lost_train_note`)."""
        from llmpipe.steps import kept_results

        results = self.config["results_dir"]
        for run in cfg.known_runs(self.config):
            if not kept_results.train_json_lost(results, run):
                continue
            try:
                identity = identity_text(train_steps.train_identity(self.config, run))
                note = kept_results.lost_train_note(results, run, identity)
            except Exception:  # a note never stops a run; a broken run is reported when it is asked for
                continue
            if note:
                yield note

    # ------------------------------------------------------------------------------------------- per rule

    def request(self, rule: str, wildcards: Any) -> dict:
        """The resources of the job rule ``rule``'s step dispatches for ``wildcards`` (its registration's
        ``resources``), unchecked.

        Raises:
            KeyError: no step with resources is registered under ``rule``.
        """
        resources = RULES[rule].resources
        if resources is None:
            raise KeyError(f"rule {rule!r} registers no resources (llmpipe.steps.registry.register)")
        return resources(self.config, wildcards)

    def resources(self, rule: str, wildcards: Any) -> dict:
        """:meth:`request`, once checked: on the Slurm profile against the cluster (:meth:`preflight`), and for a
        rule whose registration names a ``plan``, the plan of its run (:meth:`plan`).

        Raises:
            PreflightRefused: the cluster can never run the request.
            ConfigError: the run's plan cannot fit the GPUs of ``gpu_type``.
        """
        registered = RULES[rule]
        got = self.request(rule, wildcards)
        if self.config["dispatch"]["executor"] == "slurm":
            self.preflight(got, registered.where_of(wildcards))
        run = getattr(wildcards, "run", None)
        if registered.plan and run is not None:
            self.plan(registered.plan, run)
        return got

    def dispatch_threads(self, rule: str, wildcards: Any) -> int:
        """The ``threads`` of a rule whose step dispatches a job: all the CPUs of its job when the job runs here
        (local executor), none when the rule only waits on Slurm. With none, the Slurm profile's ``jobs`` alone
        bounds how many rules wait at once; ``cores: all`` of profiles/default (which wins over the Slurm profile's
        keys) would otherwise cap them at the login node's core count."""
        if self.config["dispatch"]["executor"] != "local":
            return 0
        r = self.request(rule, wildcards)
        return max(1, int(r["cpus_per_task"]) * int(r["tasks_per_node"]))

    def preflight(self, resources: dict, where: str) -> None:
        """Check a request against the Slurm cluster while the DAG is built (dry run too), once per request and
        config path, so a request that can never run fails now instead of waiting in the queue forever.

        Raises:
            PreflightRefused: :func:`llmpipe.dispatch.slurm.preflight`'s ConfigError, naming ``where`` and the fix.
        """
        key = (where, json.dumps(resources, sort_keys=True, default=str))
        if key in self.preflighted:
            return
        from llmpipe.dispatch import slurm

        try:
            slurm.preflight(self.config, resources, where=where)
        except ConfigError as exc:
            raise PreflightRefused(str(exc)) from None
        self.preflighted.add(key)

    def check_jobs(self, jobs: Iterable[Any]) -> None:
        """Make every check of :meth:`resources` for ``jobs`` before the first of them starts, as the dry run does.

        A dry run evaluates the resources of every job it lists; a real run evaluates a job's resources only when
        the job is ready (Snakemake's scheduler), so the preflight and the plans of a training would stop the run
        after its data steps had downloaded and queued. Called from ``onstart`` with the jobs that will run, this
        evaluates each job's ``resources`` (Snakemake's, which calls the rule's resource functions, i.e.
        :meth:`resources`, wrapped as in the dry run): the error is the dry run's, and the run stops with nothing
        started. Each check is still made once (:attr:`preflighted`, :attr:`planned`): the scheduler's later
        evaluations print nothing again.

        Args:
            jobs: the jobs that will run, in the order the dry run lists them (Snakemake's, topologically sorted);
                each with ``resources`` (evaluated on first access).

        Raises:
            Exception: the first job's resource error, as Snakemake raises it (``WorkflowError`` around a
                :class:`PreflightRefused`, ``InputFunctionException`` around a plan's ConfigError).
        """
        for job in jobs:
            _ = job.resources  # evaluated for its checks

    def refuse_local_multi_node(self, jobs: Iterable[Any]) -> None:
        """Without the Slurm profile, stop before any job runs when a training or finetune that has to run asks for
        more than one node: the local executor uses this one machine (:func:`llmpipe.dispatch.jobs.check_executor`).

        Args:
            jobs: the jobs that will run (Snakemake's, from ``onstart``: real executions only, so dry runs still
                show the multi-node plan, and reports or evaluations of runs trained elsewhere are not affected);
                each with ``rule.name``, ``wildcards.run`` and ``resources``.

        Raises:
            ConfigError: naming the run's resources and the fix.
        """
        if self.config["dispatch"]["executor"] == "slurm":
            return
        for job in jobs:
            if job.rule.name in ("train", "finetune"):
                run = job.wildcards.run
                where = f"{'finetunes' if job.rule.name == 'finetune' else 'models'}.{run}.resources"
                check_executor(self.config, int(job.resources.get("nodes", 1) or 1), f"{where} (rule {job.rule.name})")

    # ------------------------------------------------------------------------------------------- plans

    def plan(self, step: str, run: str) -> None:
        """The per-GPU memory plan (and a training's projected time) of a GPU step of ``run``, printed once while
        the DAG is built (dry run too); a step that clearly cannot fit the GPUs of ``gpu_type`` stops here, naming
        what to change (:mod:`llmpipe.plan.memory_time`). ``step``: train, convert (host memory and time), generate or eval.

        Raises:
            ConfigError: the step cannot fit.
        """
        if (step, run) in self.planned:
            return
        config = self.config
        r = cfg.step_resources(config, step, run)
        rc = cfg.run_config(config, run)
        if "d_model" not in (rc.get("arch") or {}):  # a hub base without its architecture: nothing to plan from
            return
        overheads = plan_mod.job_overheads()
        if step == "convert":  # host memory and time: the export runs on the host (llmpipe.hf.export)
            if overheads:
                t = plan_mod.convert_time(rc, overheads)
                m = plan_mod.convert_memory(rc, overheads)
                self.say(f"plan convert {run}: host memory {m['total_gb']:.1f} GiB (bf16 export {m['export_gb']:.1f}, "
                         f"verification reload {m['verify_gb']:.1f}; requested: mem_gb {r['mem_gb']}); "
                         f"time {plan_mod.human_time(t['seconds'])} ({t['basis']})")
            self.planned.add((step, run))
            return
        if int(r["gpus_per_node"]) <= 0:
            if step == "eval":  # time only: a CPU has no memory plan here
                proj = self.eval_projection(rc, "cpu", 1)
                if proj:
                    self.say(f"plan eval {run}: on the CPU; time {plan_mod.human_time(proj['seconds'])} "
                             f"({proj['basis']})")
                self.planned.add((step, run))
            return
        where = cfg.section_path(config, run)
        card = cfg.gpu_card(config)  # gpu_type, or auto: this machine's card (llmpipe.plan.card)
        gpu_type, capacity = card.gpu_type, card.memory_gb
        if gpu_type is None:  # auto and no GPU here: nothing to plan the GPUs against
            self.say(self.no_card_line(step, run, rc, r))
        elif step == "train":
            mem = plan_mod.train_memory(rc, nodes=int(r["nodes"]), gpus_per_node=int(r["gpus_per_node"]),
                                        capacity_gb=capacity)
            proj = self.train_projection(rc, r, mem, overheads)
            self.say(plan_mod.plan_line(step, run, mem, capacity, card.label, proj, card.unknown_note()))
            plan_mod.check_fits(step, run, mem, capacity, gpu_type, where, rc)
        else:
            placed = cfg.inference_plan(config, step, run)
            mem = placed["memory"]
            proj = self.inference_projection(step, rc, placed, overheads)
            self.say(plan_mod.plan_line(step, run, mem, capacity, card.label, proj, card.unknown_note()))
            plan_mod.check_inference_fits(step, run, placed, capacity, gpu_type, where)
        self.planned.add((step, run))

    def no_card_line(self, step: str, run: str, rc: dict, r: dict) -> str:
        """The plan line of a GPU step where ``gpu_type: auto`` finds no GPU (nvidia-smi): a training's memory per
        GPU without a card to compare it with, an evaluation's time on the CPU, which the jobs here run on."""
        why = "no GPU: gpu_type is auto and nvidia-smi finds none on this machine"
        if step == "train":
            mem = plan_mod.train_memory(rc, nodes=int(r["nodes"]), gpus_per_node=int(r["gpus_per_node"]),
                                        capacity_gb=None)
            return plan_mod.plan_line(step, run, mem, None, why)
        proj = self.eval_projection(rc, "cpu", 1) if step == "eval" else None
        time = f"; time {plan_mod.human_time(proj['seconds'])} ({proj['basis']})" if proj else ""
        return f"plan {step} {run}: planned for the CPU ({why}){time}"

    def train_projection(self, rc: dict, r: dict, mem: dict, overheads: dict | None) -> dict | None:
        """The projected time of a training with resources ``r`` and memory plan ``mem`` on ``gpu_type``
        (:func:`llmpipe.plan.memory_time.train_time`), or None without a benchmark basis."""
        gpu_type = cfg.gpu_type(self.config)
        basis = plan_mod.benchmark_basis(card=gpu_type)   # the rows benchmarks/plan-basis.json names for the card
        if not basis:
            return None
        return plan_mod.train_time(
            rc, nodes=int(r["nodes"]), gpus_per_node=int(r["gpus_per_node"]), gpu_type=gpu_type,
            basis=basis, activation_checkpointing=mem["activation_checkpointing"],
            peak_overrides=self.config.get("gpu_peak_flops"), overheads=overheads,
            time_limit_s=(float(r["time_min"]) * 60 if executor_kind(self.config) == "slurm" else None))

    def eval_projection(self, rc: dict, device: str, processes: int) -> dict | None:
        """The planned time of the eval job of run ``rc`` on ``device`` (a ``gpu_type``, or ``cpu``) with
        ``processes`` ranks (:mod:`llmpipe.plan.eval_time`, the batches of
        :func:`llmpipe.evaluation.suites.planned_works`), or None without the committed constants for it."""
        from llmpipe.plan import eval_time

        basis = eval_time.load_basis(device, peak_overrides=self.config.get("gpu_peak_flops"))
        if basis is None:
            return None
        works, missing = eval_tasks.planned_works(self.config, rc["name"], world_size=processes)
        proj = eval_time.plan_seconds(rc["arch"], works, basis)
        if missing:  # the figure is the counted part's: the note says what it leaves out and bounds it
            proj["basis"] += "; " + eval_time.uncounted_note(
                rc["arch"], eval_tasks.uncounted_tasks(self.config, rc["name"], missing),
                int(self.config["eval"]["batch_size"]), basis, processes)
        return proj

    def inference_projection(self, step: str, rc: dict, placed: dict, overheads: dict | None) -> dict | None:
        """The projected time of an eval or generate job on its planned GPUs (``placed``:
        :func:`llmpipe.config.runs.inference_plan`; :func:`llmpipe.plan.inference_placement.inference_time`), or None;
        generation adds the per-job costs ``overheads`` (:func:`llmpipe.plan.memory_time.job_overheads`)."""
        from llmpipe.plan import inference_placement as ip

        config = self.config
        mem, n = placed["memory"], placed["gpus"]
        if step == "eval":
            return self.eval_projection(rc, str(cfg.gpu_type(config)), n)
        g = run_generate_settings(config, rc["name"])  # the run's own prompts, when it has them
        new = len(g.prompts) * g.max_new_tokens
        return ip.inference_time(rc, step, gpus=n, gpu_type=cfg.gpu_type(config), basis=None, new_tokens=new,
                                 weights_gb=mem["weights_gb"] * n, overheads=overheads)
