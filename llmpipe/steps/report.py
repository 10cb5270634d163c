"""Report step (rule ``report``): the tables and plots of ``results/report/`` (built by :mod:`llmpipe.report`)."""

from __future__ import annotations

from llmpipe import report as tables
from llmpipe.steps.context import StepContext


def report(ctx: StepContext) -> dict:
    """Rule ``report``: every file of ``results/report/`` from the inputs Snakemake resolved."""
    runs, scaling, allreduce = list(ctx.params.runs), list(ctx.params.scaling), list(ctx.params.allreduce)
    tables.build(ctx.config, ctx.config["results_dir"], dict(ctx.output.items()), runs, scaling, allreduce)
    return {"report": tables.settings(ctx.config), "runs": runs, "scaling": scaling, "allreduce": allreduce}
