"""The rule table: every Snakemake rule that has a script, registered by its step function.

A stage module registers each step function under its rule's name with :func:`register`, declaring what
:func:`llmpipe.steps.run_rule` and the DAG-time checks (:mod:`llmpipe.plan.dag_checks`) need beside the rule file::

    @register("mds", resources=data_resources, where="data_resources")
    def mds(ctx: StepContext) -> dict: ...

The rule itself (inputs, outputs, log, params) is in ``rules/<stage>.smk``, and its script is ``scripts/run_rule.py``
for every rule; the step's submitit folder is derived from the rule's ``log:`` (:func:`submitit_folder`).
``tests/test_steps.py`` checks that the rules with a script and the registered names are the same set.

Imports nothing heavy (no torch): the rule files import the step modules to plan the DAG.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

#: ``(config, wildcards) -> resources`` of the job a step dispatches (:func:`llmpipe.config.runs.step_resources`'s keys).
Resources = Callable[[dict, Any], dict]


@dataclasses.dataclass(frozen=True)
class Kept:
    """A rule whose finished result is kept per identity and restored instead of recomputed
    (:mod:`llmpipe.steps.kept_results`).

    Attributes:
        section: the config section whose ``earlier_identities_to_keep`` says how many results of other identities
            stay kept (``convert``, ``generate``, ``eval``).
        whole_folder: keep the folder of the first output (an export: every file of ``hf/``), not the outputs.
        ignore_inputs: names of inputs that do not decide the result (the evaluation's ``generation``, an
            ``ancient`` ordering input); the other inputs' contents are part of the result's key.
    """

    section: str
    whole_folder: bool = False
    ignore_inputs: tuple[str, ...] = ()


#: The kept results of the steps after training (rules ``convert``, ``generate``, ``eval``, ``finetune_eval``).
KEPT_EXPORT = Kept("convert", whole_folder=True)
KEPT_GENERATION = Kept("generate")
KEPT_EVAL = Kept("eval", ignore_inputs=("generation",))


@dataclasses.dataclass(frozen=True)
class Rule:
    """One registered rule (:data:`RULES` names it): how :func:`llmpipe.steps.run_rule` runs it and what the
    DAG-time checks check.

    Attributes:
        step: the step function; takes the :class:`~llmpipe.steps.context.StepContext`, returns the resolved
            settings it used.
        resources: ``(config, wildcards) -> resources`` of the job the step dispatches (also the rule's Snakemake
            ``resources:`` and ``threads:``, see ``rules/common.smk``); None for steps that dispatch nothing.
        where: the config path of those resources for the Slurm preflight's messages, a pattern of the rule's
            wildcards (``models.{run}.resources``); None: the rule is not preflighted.
        plan: the GPU step whose memory plan (and time projection) the dry run prints for the rule's run
            (``train``, ``convert``, ``generate``, ``eval``; :mod:`llmpipe.plan.dag_checks`); None: no plan.
        kept: how the rule's finished result is kept per identity; None: never kept.
    """

    step: Callable[..., Any]
    resources: Resources | None = None
    where: str | None = None
    plan: str | None = None
    kept: Kept | None = None

    def where_of(self, wildcards: Any) -> str:
        """:attr:`where` with the rule's wildcards filled in."""
        values = dict(wildcards.items()) if hasattr(wildcards, "items") else dict(vars(wildcards))
        return (self.where or "resources").format(**values)


#: Every registered rule: rule name -> :class:`Rule`. Filled by the stage modules' :func:`register` decorators,
#: i.e. complete once :mod:`llmpipe.steps` is imported.
RULES: dict[str, Rule] = {}


def register(name: str, *, resources: Resources | None = None, where: str | None = None, plan: str | None = None,
             kept: Kept | None = None) -> Callable[[Callable], Callable]:
    """Decorator: register the decorated step function as rule ``name``'s step (see :class:`Rule` for the rest).
    One function may be registered under several names (stack the decorators).

    Raises:
        ValueError: ``name`` is registered already.
    """
    def add(step: Callable) -> Callable:
        if name in RULES:
            raise ValueError(f"rule {name!r} is registered twice: {RULES[name].step.__module__}."
                             f"{RULES[name].step.__name__} and {step.__module__}.{step.__name__}")
        RULES[name] = Rule(step, resources, where, plan, kept)
        return step
    return add


def submitit_folder(log_file: str, results_dir: str) -> str:
    """The step's submitit folder as :meth:`~llmpipe.steps.context.StepContext.build` takes it: the rule's log
    path relative to ``<results_dir>/logs`` without ``.log`` (``results/logs/train/mpt-tiny.log`` ->
    ``train/mpt-tiny``; the folder is then ``results/logs/train/mpt-tiny.submitit``)."""
    return os.path.relpath(os.path.splitext(log_file)[0], os.path.join(results_dir, "logs"))
