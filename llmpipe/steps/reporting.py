"""Report steps: the tables and plots of ``results/report/`` (rule ``report``, built by :mod:`llmpipe.report.tables`) and
one training run's plots and tracking location (rule ``report_run``, :mod:`llmpipe.report.run_page`)."""

from __future__ import annotations

import os

from llmpipe.report import run_page as run_report
from llmpipe.report import tables
from llmpipe.steps.context import StepContext
from llmpipe.steps.registry import register


@register("report")
def report(ctx: StepContext) -> dict:
    """Rule ``report``: every file of ``results/report/`` from the inputs Snakemake resolved."""
    runs, scaling, allreduce = list(ctx.params.runs), list(ctx.params.scaling), list(ctx.params.allreduce)
    tables.build(ctx.config, ctx.config["results_dir"], dict(ctx.output.items()), runs, scaling, allreduce)
    return {"report": tables.settings(ctx.config), "runs": runs, "scaling": scaling, "allreduce": allreduce}


@register("report_run")
def report_run(ctx: StepContext) -> dict:
    """Rule ``report_run``: ``results/report/runs/{run}/`` (loss.png, mfu.png, tracking.html) from the run's
    ``train.json``, loss log and ``tracking.json``."""
    run = ctx.wildcards.run
    got = run_report.build_run(ctx.config["results_dir"], run, dict(ctx.output.items()), base=os.getcwd())
    return {"run": run, **got}
