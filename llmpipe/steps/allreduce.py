"""All-reduce steps: the bandwidth sweep (``allreduce``), its plot (``allreduce_plot``) and the training gate
(``allreduce_gate``, ``scaling_allreduce_gate``). The bench, its files and the gate's check are in
:mod:`llmpipe.allreduce`."""

from __future__ import annotations

import json
import re

from llmpipe import allreduce as bench
from llmpipe.dispatch import check_executor
from llmpipe.steps.context import StepContext

#: Part of the bench's identity: bump when a change in the bench changes what it measures.
VERSION = 1

#: The ``allreduce:`` settings that determine a sweep's result.
IDENTITY_KEYS = ("min_bytes", "max_bytes", "factor", "dtype", "warmup", "iters", "backend", "check")


def allreduce_identity(config: dict) -> dict:
    """What determines a bench result: the sweep, the type, iterations, backend, check and the per-node layout
    (GPUs or tasks per node). Not the gate: changing the threshold re-checks, it does not re-measure.

    Raises:
        ConfigError: an impossible sweep or gate (:func:`llmpipe.allreduce.settings`).
    """
    s = bench.settings(config)
    r = bench.bench_resources(config, 1)
    return {"step": "allreduce", "version": VERSION, **{k: s[k] for k in IDENTITY_KEYS},
            "gpus_per_node": int(r["gpus_per_node"]), "tasks_per_node": int(r["tasks_per_node"])}


def bench_job_resources(config: dict, wildcards) -> dict:
    """The bench's job on ``{nodes}`` nodes (:func:`llmpipe.allreduce.bench_resources`)."""
    return bench.bench_resources(config, int(wildcards.nodes))


def allreduce(ctx: StepContext) -> dict:
    """Rule ``allreduce``: the sweep on ``{nodes}`` nodes through the dispatch layer -> CSV and Markdown table.

    Raises:
        ConfigError: more than one node on an executor that runs on this machine.
        RuntimeError: rank 0 returned no rows.
    """
    nodes = int(ctx.wildcards.nodes)
    s = bench.settings(ctx.config)
    check_executor(ctx.config, nodes, f"the all-reduce bench on {nodes} nodes")
    task = bench.AllReduceTask(bench.sweep_sizes(s["min_bytes"], s["max_bytes"], s["factor"]), s["dtype"],
                               s["warmup"], s["iters"], s["backend"], s["check"], nodes)
    rows = ctx.dispatch(task, step=f"allreduce nodes{nodes}")
    if not rows:
        raise RuntimeError(f"allreduce nodes{nodes}: rank 0 returned no rows")
    bench.write_csv(ctx.output.csv, rows)
    bench.write_markdown(ctx.output.md, rows, s)
    return {"allreduce": s, "resources": ctx.resources}


def allreduce_plot(ctx: StepContext) -> dict:
    """Rule ``allreduce_plot``: busbw versus size, one line per node count of ``allreduce.nodes``."""
    paths = {int(re.search(r"nodes(\d+)\.csv$", p).group(1)): p for p in ctx.input}
    bench.plot_busbw(paths, ctx.output[0])
    return {"nodes": sorted(paths)}


def allreduce_gate(ctx: StepContext) -> dict:
    """Rules ``allreduce_gate`` and ``scaling_allreduce_gate``: pass (write the record) or refuse training.

    Raises:
        RuntimeError: the measured bandwidth is below ``allreduce.gate.min_busbw_gbps`` (the message names the
            NCCL settings to check).
    """
    rec = bench.check_gate(ctx.config, ctx.input.csv, f"allreduce gate for {ctx.wildcards.run}")
    ctx.write_json(rec)
    ctx.log(json.dumps(rec))
    return {"gate": bench.settings(ctx.config)["gate"]}
