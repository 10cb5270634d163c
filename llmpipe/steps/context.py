"""The step context: what a rule's step function gets, built once from Snakemake's ``snakemake`` object.

:func:`llmpipe.steps.run_rule` builds one :class:`StepContext` per rule execution (:meth:`StepContext.build`) and
hands it to the rule's step function. The context holds everything a step reads from the workflow (config,
wildcards, input and output paths, params) and everything the dispatch layer needs (log file, submitit folder,
resources, submission key, executor), so a step function reads like its stage: build the task, :meth:`dispatch`
it, :meth:`write_json` the result.

Imports nothing heavy (no torch): the rule files import the step modules to plan the DAG.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

from llmpipe.atomic import atomic_write_json
from llmpipe.dispatch import jobs as dispatch


def read_json(path: str) -> Any:
    """The JSON document in ``path``."""
    with open(path) as fh:
        return json.load(fh)


def wildcard_values(wildcards: Any) -> dict[str, str]:
    """A rule's wildcards (Snakemake's named list, or any object with attributes) as a dict."""
    return dict(wildcards.items()) if hasattr(wildcards, "items") else dict(vars(wildcards))


def parse_params(params: Any) -> dict:
    """A rule's ``params`` as a dict: name -> value, with JSON text (the identity) parsed back to its structure."""
    out = {}
    items = params.items() if hasattr(params, "items") else []
    for name, value in items:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                pass
        out[name] = value
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepContext:
    """One execution of one rule, as its step function sees it.

    Attributes:
        rule: the rule's name (``train``).
        config: the workflow config (Snakemake's ``config``).
        wildcards: the rule's wildcards (attribute access: ``ctx.wildcards.run``).
        input, output, params: Snakemake's named lists (``ctx.input.tokenizer``, ``ctx.output[0]``,
            ``ctx.params.identity``).
        log_file: the rule's log (``results/logs/<rule>/<name>.log``); emptied when the step starts, the dispatch
            layer appends its lines and a failing step its error.
        log_dir: the folder of submitit's per-job files (``results/logs/<step>/<name>.submitit``); None for
            steps that dispatch nothing.
        resources: the resources of the job the step dispatches (:func:`llmpipe.config.runs.step_resources`: nodes,
            tasks_per_node, gpus_per_node, cpus_per_task, mem_gb, time_min, slurm); empty for steps that
            dispatch nothing.
        key: the submission key (:func:`llmpipe.dispatch.jobs.job_key` of the rule, its outputs and params): a later
            execution with the same key re-attaches to a job still running instead of submitting a second one.
        executor: ``dispatch.executor`` of the config (local | slurm | debug).
    """

    rule: str
    config: dict
    wildcards: Any
    input: Any
    output: Any
    params: Any
    log_file: str
    log_dir: str | None
    resources: dict
    key: str
    executor: str

    @classmethod
    def build(cls, smk: Any, *, log_dir: str | None, resources: dict) -> StepContext:
        """The context of Snakemake's ``smk`` (a rule script's ``snakemake`` object).

        Args:
            log_dir: the step's submitit folder relative to ``results/logs/`` without ``.submitit``
                (``train/mpt-tiny``), or None.
            resources: the job's resources (see :attr:`resources`).
        """
        config = smk.config
        return cls(rule=smk.rule, config=config, wildcards=smk.wildcards, input=smk.input, output=smk.output,
                   params=smk.params, log_file=smk.log[0],
                   log_dir=None if log_dir is None else os.path.join(config["results_dir"], "logs",
                                                                     f"{log_dir}.submitit"),
                   resources=dict(resources), key=dispatch.job_key(smk.rule, list(smk.output), list(smk.params)),
                   executor=dispatch.executor_kind(config))

    def dispatch(self, fn: Callable, *args: Any, step: str, config: dict | None = None,
                 progress: Callable[[], str | None] | None = None,
                 resume_batch: Callable[[], int] | None = None, on_job: Callable[[str, str], None] | None = None,
                 **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` as this step's job (:func:`llmpipe.dispatch.jobs.run_step` on :attr:`resources`,
        logging to :attr:`log_file`, submitit files in :attr:`log_dir`) and return rank 0's result.

        Args:
            step: a short name for the log lines and the job name (``train mpt-tiny``).
            config: the config that decides where the job runs, when not :attr:`config` (e.g. one whose executor
                is ``local``: :func:`llmpipe.dispatch.jobs.with_executor`).
            progress: the step's progress as a short text, logged when Slurm requeues the job.
            resume_batch: the batch of the step's newest complete checkpoint: a Slurm job that ends TIMEOUT after
                checkpointing is submitted again (:func:`llmpipe.dispatch.requeue.resubmit_after_timeout`).
            on_job: called with ``(executor, job id)`` once the step's job is submitted or re-attached to.

        Raises:
            llmpipe.dispatch.jobs.StepFailed: the job failed, was cancelled or timed out.
        """
        return dispatch.run_step(fn, *args, step=step, resources=self.resources,
                                 config=self.config if config is None else config, log_dir=self.log_dir,
                                 key=self.key, log_file=self.log_file, progress=progress,
                                 resume_batch=resume_batch, on_job=on_job, **kwargs)

    def on_submitting_machine(self) -> dict:
        """The config with ``dispatch.executor: local`` (``debug`` stays): for steps that must run where
        Snakemake runs, e.g. downloads (compute nodes are often offline)."""
        return dispatch.with_executor(self.config, "local" if self.executor != "debug" else None)

    def write_json(self, obj: Any, path: str | None = None) -> None:
        """Write ``obj`` as JSON to ``path`` (default: the first output) atomically: a killed step never leaves a
        half-written output that looks complete."""
        atomic_write_json(self.output[0] if path is None else path, obj)

    def log(self, line: str) -> None:
        """Append one line to the rule's log."""
        with open(self.log_file, "a") as fh:
            fh.write(line.rstrip("\n") + "\n")
