"""Node-scaling study steps: the same training at each node count (``scaling_train``) and its table
(``scaling_table``). The study's settings, checks and table are in :mod:`llmpipe.bench.scaling_study`."""

from __future__ import annotations

import re

from llmpipe.bench import scaling_study as scaling
from llmpipe.config.runs import run_settings, step_resources, validate_run, world_size
from llmpipe.steps.context import StepContext, read_json
from llmpipe.steps.registry import register
from llmpipe.steps.training import check_all_steps, finished_training, train_identity, training_task


def study_identity(config: dict, run: str) -> dict:
    """The training identity of every node count of the study (nodes are never part of it; a
    ``scaling.max_duration_batches`` is: it makes a shorter training than ``results/<run>``)."""
    return train_identity(scaling.study_config(config, run, 1), run)


def study_resources(config: dict, wildcards) -> dict:
    """The training job of the study at ``{nodes}`` nodes."""
    return step_resources(scaling.study_config(config, wildcards.run, int(wildcards.nodes)), "train",
                          wildcards.run)


@register("scaling_train", resources=study_resources, where="models.{run}.resources (scaling at {nodes} nodes)")
def scaling_train(ctx: StepContext) -> dict:
    """Rule ``scaling_train``: the run's training task on ``{nodes}`` nodes into the study's folder.

    Raises:
        RuntimeError: the training ended early, or ran on another number of devices than ``{nodes}`` gives.
    """
    run, nodes = ctx.wildcards.run, int(ctx.wildcards.nodes)
    config = scaling.study_config(ctx.config, run, nodes)
    rc, settings = validate_run(config, run), run_settings(config, run)
    task = training_task(ctx, config, run, settings)  # the same task as rule train / finetune builds
    label = f"scaling {run} nodes{nodes}"
    result = finished_training(ctx, settings, label) or ctx.dispatch(task, step=label, config=config)
    check_all_steps(result, settings, label)
    if int(result.get("devices", 0)) != world_size(ctx.resources):
        raise RuntimeError(f"{label}: trained on {result.get('devices')} devices, expected "
                           f"{world_size(ctx.resources)} ({nodes} nodes)")
    ctx.write_json(result)
    return {"run": rc, "resources": ctx.resources}


@register("scaling_table")
def scaling_table(ctx: StepContext) -> dict:
    """Rule ``scaling_table``: scaling.csv, scaling.md and speedup.png of one study."""
    results = {int(re.search(r"nodes(\d+)/train\.json$", p).group(1)): read_json(p) for p in ctx.input}
    scaling.write_study(ctx.wildcards.run, results, ctx.output.csv, ctx.output.md, ctx.output.png)
    return {"nodes": sorted(results)}
