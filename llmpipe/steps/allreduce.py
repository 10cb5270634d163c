"""All-reduce steps: the bandwidth sweep (``allreduce``), its plot (``allreduce_plot``), the GPU health check
(``allreduce_health``) and the training gate (``allreduce_gate``, ``scaling_allreduce_gate``). The bench, its files
and the gate's check are in :mod:`llmpipe.bench.allreduce_bw`, the health check in :mod:`llmpipe.bench.health`."""

from __future__ import annotations

import json
import re

from llmpipe.bench import allreduce_bw as bench
from llmpipe.bench import health
from llmpipe.config.settings import ConfigError
from llmpipe.dispatch.jobs import check_executor
from llmpipe.steps.context import StepContext, read_json
from llmpipe.steps.registry import register

#: Part of the bench's identity: bump when a change in the bench changes what it measures.
VERSION = 1

#: The ``allreduce:`` settings that determine a sweep's result.
IDENTITY_KEYS = ("min_bytes", "max_bytes", "factor", "dtype", "warmup", "iters", "backend", "check")


def allreduce_identity(config: dict) -> dict:
    """What determines a bench result: the sweep, the type, iterations, backend, check and the per-node layout
    (GPUs or tasks per node). Not the gate: changing the threshold re-checks, it does not re-measure.

    Raises:
        ConfigError: an impossible sweep or gate (:func:`llmpipe.bench.allreduce_bw.settings`).
    """
    s = bench.settings(config)
    r = bench.bench_resources(config, 1)
    return {"step": "allreduce", "version": VERSION, **{k: s[k] for k in IDENTITY_KEYS},
            "gpus_per_node": int(r["gpus_per_node"]), "tasks_per_node": int(r["tasks_per_node"])}


#: Part of the health check's identity: bump when a change in the check changes what it measures.
HEALTH_VERSION = 1

#: The ``allreduce.health`` settings that determine a health check's result (not the thresholds).
HEALTH_IDENTITY_KEYS = ("matmul_size", "matmul_dtype", "warmup", "iters")


def health_identity(config: dict) -> dict:
    """What determines a health-check result: matmul size and type, iterations, the all-reduce size
    (``allreduce.gate.size_bytes``), backend and per-node layout. Not the thresholds: they re-judge, not re-measure.

    Raises:
        ConfigError: the health check is off or impossible (:func:`llmpipe.bench.allreduce_bw.settings`).
    """
    s = bench.settings(config)
    if not s.get("health"):
        raise ConfigError("allreduce.health is null: there is no health check to run. Fix: set "
                                "allreduce.health: {on_slow: fail} (with allreduce.gate) or leave out this target.")
    r = bench.bench_resources(config, 1)
    return {"step": "allreduce_health", "version": HEALTH_VERSION,
            **{k: s["health"][k] for k in HEALTH_IDENTITY_KEYS}, "size_bytes": int(s["gate"]["size_bytes"]),
            "backend": s["backend"], "gpus_per_node": int(r["gpus_per_node"]),
            "tasks_per_node": int(r["tasks_per_node"])}


def gate_identity(config: dict) -> dict | None:
    """The gate's settings as the gate rules' ``params: gate`` (``allreduce.gate``, with ``allreduce.health`` when
    set; None when the gate is off): a changed threshold re-checks the gate, it never re-measures."""
    s = bench.settings(config)
    return {**s["gate"], "health": s["health"]} if s.get("health") else s["gate"]


def bench_job_resources(config: dict, wildcards) -> dict:
    """The bench's job on ``{nodes}`` nodes (:func:`llmpipe.bench.allreduce_bw.bench_resources`)."""
    return bench.bench_resources(config, int(wildcards.nodes))


@register("allreduce", resources=bench_job_resources, where="allreduce.resources")
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


@register("allreduce_health", resources=bench_job_resources, where="allreduce.resources")
def allreduce_health(ctx: StepContext) -> dict:
    """Rule ``allreduce_health``: the GPU health check on ``{nodes}`` nodes -> one line per GPU (JSON list).

    Raises:
        ConfigError: more than one node on an executor that runs on this machine; the check is off.
        RuntimeError: rank 0 returned no lines.
    """
    nodes = int(ctx.wildcards.nodes)
    s = bench.settings(ctx.config)
    health_identity(ctx.config)
    check_executor(ctx.config, nodes, f"the GPU health check on {nodes} nodes")
    h = s["health"]
    task = health.HealthTask(s["gate"]["size_bytes"], h["matmul_size"], h["matmul_dtype"], h["warmup"], h["iters"],
                             s["backend"])
    lines = ctx.dispatch(task, step=f"allreduce_health nodes{nodes}")
    if not lines:
        raise RuntimeError(f"allreduce_health nodes{nodes}: rank 0 returned no lines")
    health.write_json(ctx.output[0], lines)
    return {"health": h, "resources": ctx.resources}


@register("allreduce_plot")
def allreduce_plot(ctx: StepContext) -> dict:
    """Rule ``allreduce_plot``: busbw versus size, one line per node count of ``allreduce.nodes``."""
    paths = {int(re.search(r"nodes(\d+)\.csv$", p).group(1)): p for p in ctx.input}
    bench.plot_busbw(paths, ctx.output[0])
    return {"nodes": sorted(paths)}


@register("allreduce_gate")
@register("scaling_allreduce_gate")
def allreduce_gate(ctx: StepContext) -> dict:
    """Rules ``allreduce_gate`` and ``scaling_allreduce_gate``: pass (write the record) or refuse training.

    With ``allreduce.health`` on, the record also holds ``gpus``: one line per GPU of the health check
    (:func:`llmpipe.bench.health.judge`; ``slow`` lists why a GPU fails), and ``on_slow: warn`` logs slow GPUs instead of
    failing.

    Raises:
        RuntimeError: the measured bandwidth is below ``allreduce.gate.min_busbw_gbps`` (the message names the
            NCCL settings to check), or a GPU failed the health check with ``on_slow: fail`` (named by host).
    """
    s = bench.settings(ctx.config)
    where = f"allreduce gate for {ctx.wildcards.run}"
    rec = bench.check_gate(ctx.config, ctx.input.csv, where)
    if s.get("health"):
        lines, warnings = health.check(read_json(ctx.input.health), s["health"], s["gate"]["min_busbw_gbps"], where)
        rec.update({"health": ctx.input.health, "gpus": lines, "slow_gpus": len(warnings)})
        for w in warnings:
            ctx.log(f"WARNING: {w} (allreduce.health.on_slow: warn)")
            print(f"llmpipe: WARNING: {w}", flush=True)
        for d in lines:  # one line per GPU in the gate's log, as in its record
            ctx.log(json.dumps(d))
    ctx.write_json(rec)
    ctx.log(json.dumps({k: v for k, v in rec.items() if k != "gpus"}))
    return {"gate": s["gate"], "health": s.get("health")}
