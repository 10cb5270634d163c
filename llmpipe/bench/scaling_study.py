"""Node-scaling study: the same training (pretraining or finetune) at several node counts, and its table.

``results/scaling/{run}/nodes{N}/train.json`` is run ``run`` trained on ``N`` nodes (per-node layout, batch, data,
everything else from the run's config) by the same :class:`llmpipe.train.pretrain.TrainTask` as ``results/{run}/``; only the
resources (nodes) and the run folder differ. Nodes are not part of a training's identity
(:func:`llmpipe.steps.training.train_identity`), so every node count trains the same model;
``scaling.max_duration_batches`` can shorten a study (that does change the identity: it is a different, shorter
training than ``results/{run}``).

``results/scaling/{run}/scaling.csv`` and ``.md`` compare them: nodes, devices, wall clock, tokens/s, tokens/s per
device, MFU, peak memory per device, speedup versus the smallest node count (wall clock of the smallest / wall clock
of N, as the seed's "speedup versus one node") and scaling efficiency (speedup / (N / N_smallest); 1 = linear).

Imports without torch (the Snakefile uses it to plan).
"""

from __future__ import annotations

import os
from typing import Any

from llmpipe.config.runs import deep_merge, gpu_memory, is_finetune, run_config, step_resources, validate_run
from llmpipe.config.schema import section_defaults
from llmpipe.config.settings import ConfigError
from llmpipe.plan import memory_time as plan
from llmpipe.report.plots import finish_and_save

#: Settings of the studies the config does not set: the schema's defaults of ``scaling:``.
DEFAULTS: dict[str, Any] = section_defaults("scaling")


#: Columns of scaling.csv, in order.
COLUMNS = ["run", "nodes", "devices", "wall_clock_s", "wall_clock", "tokens", "tokens_per_s",
           "tokens_per_s_per_device", "mfu", "peak_memory_per_device_gib", "speedup", "scaling_efficiency",
           "device"]


def settings(config: dict) -> dict:
    """The ``scaling:`` section over :data:`DEFAULTS`; node counts sorted, unique, positive.

    Raises:
        ConfigError: empty or non-positive node counts.
    """
    s = {**DEFAULTS, **(config.get("scaling") or {})}
    try:
        nodes = sorted({int(n) for n in s["nodes"]})
    except (TypeError, ValueError):
        raise ConfigError(f"scaling.nodes must be a list of node counts, got {s['nodes']!r}.") from None
    if not nodes or nodes[0] < 1:
        raise ConfigError(f"scaling.nodes must list node counts >= 1, got {s['nodes']!r}.")
    s["nodes"] = nodes
    s["runs"] = list(s.get("runs") or [])
    return s


def study_config(config: dict, run: str, nodes: int) -> dict:
    """The workflow config as the study's training at ``nodes`` nodes sees it: ``models.<run>.resources.nodes``
    (``finetunes.<run>.resources.nodes`` for a finetune) set to ``nodes``; when ``scaling.max_duration_batches`` is
    set, the training shortened to it; ``train.fsdp.activation_checkpointing: auto`` decided once for the whole
    study, at its smallest node count (:func:`llmpipe.plan.memory_time.resolve_activation_checkpointing`), so every node count
    computes the same FLOPs per token and the speedups compare like with like (a config without ``gpu_type``, not
    checked against the schema, leaves it to each job)."""
    section = "finetunes" if is_finetune(config, run) else "models"
    study = settings(config)
    over: dict = {"resources": {"nodes": int(nodes)}}
    if study.get("max_duration_batches"):
        over["train"] = {"max_duration_batches": int(study["max_duration_batches"])}
    fewest = deep_merge(config, {section: {run: {"resources": {"nodes": min(study["nodes"])}}}})
    rc = run_config(fewest, run)
    fsdp = rc["train"].get("fsdp")
    if isinstance(fsdp, dict) and fsdp.get("activation_checkpointing") == "auto" and "gpu_type" in config:
        r = step_resources(fewest, "train", run)
        decided = plan.resolve_activation_checkpointing(
            rc, nodes=int(r["nodes"]), gpus_per_node=int(r["gpus_per_node"]),
            capacity_gb=gpu_memory(config))
        over.setdefault("train", {})["fsdp"] = {
            "activation_checkpointing": decided["train"]["fsdp"]["activation_checkpointing"]}
    return deep_merge(config, {section: {run: over}})


def check_study(config: dict, run: str, nodes: list[int] | None = None) -> dict[int, dict]:
    """Validate the study's training at every node count while the DAG is built (the dry run says it).

    One check of the run's settings (:func:`llmpipe.config.runs.validate_run`, the same as its own training's) with the
    study's node counts added to those the batch must split at (:meth:`llmpipe.config.settings.RunSettings.check_batch`).

    Returns node count -> resources. Raises:
        ConfigError: the run's settings fail, listing every node count where the batch does not split (e.g.
            ``global_batch_size`` not divisible by the devices), or a multi-node count on an executor that runs
            one machine.
    """
    nodes = nodes or settings(config)["nodes"]
    try:  # at the smallest count: the run's own node count is replaced by the study's
        validate_run(study_config(config, run, min(nodes)), run, node_counts=nodes, counts_where="scaling.nodes")
    except ConfigError as exc:
        raise ConfigError(f"the node-scaling study of {run} (scaling.nodes = {nodes}) cannot run: {exc}") from None
    out = {n: step_resources(study_config(config, run, n), "train", run) for n in nodes}
    from llmpipe.dispatch.jobs import check_executor
    for n in nodes:
        check_executor(config, n, f"the node-scaling study of {run} at {n} nodes")
    return out


def _hms(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    s = float(seconds)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{int(h)}h{int(m):02d}m{sec:06.3f}s" if h else f"{int(m)}m{sec:06.3f}s"


def table(results: dict[int, dict]):
    """The study's table from node count -> train.json record (a pandas DataFrame, columns :data:`COLUMNS`).

    ``speedup = wall_clock_s(smallest N) / wall_clock_s(N)``; ``scaling_efficiency = speedup / (N / smallest N)``.
    Every row trains the same tokens, so the wall-clock ratio is also the throughput ratio up to start-up time.
    """
    import pandas as pd

    rows = []
    base_n = min(results)
    base = results[base_n]
    for n in sorted(results):
        r = results[n]
        wall = r.get("wall_clock_s")
        speedup = base["wall_clock_s"] / wall if wall and base.get("wall_clock_s") else None
        rows.append({
            "run": r.get("run"), "nodes": int(r.get("nodes", n)), "devices": int(r["devices"]),
            "wall_clock_s": wall, "wall_clock": _hms(wall), "tokens": r.get("tokens"),
            "tokens_per_s": r.get("tokens_per_s"), "tokens_per_s_per_device": r.get("tokens_per_s_per_device"),
            "mfu": r.get("mfu"), "peak_memory_per_device_gib": r.get("peak_memory_per_device_gib"),
            "speedup": round(speedup, 3) if speedup else None,
            "scaling_efficiency": round(speedup / (n / base_n), 3) if speedup else None,
            "device": r.get("device"),
        })
    return pd.DataFrame(rows, columns=COLUMNS)


def markdown(df, title: str = "") -> str:
    """A DataFrame as a Markdown table (no extra dependency: pandas' to_markdown needs tabulate)."""
    def fmt(v):
        if v is None or (isinstance(v, float) and v != v):
            return "–"
        if isinstance(v, float):
            return f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.0f}"
        if isinstance(v, int) and not isinstance(v, bool):
            return f"{v:,}" if abs(v) >= 10000 else str(v)
        return str(v)

    cols = list(df.columns)
    lines = [f"{title}\n" if title else "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for rec in df.to_dict("records"):
        lines.append("| " + " | ".join(fmt(rec[c]) for c in cols) + " |")
    return "\n".join(line for line in lines if line is not None).lstrip("\n") + "\n"


def plot_speedup(studies: dict[str, Any], png: str) -> None:
    """Speedup versus nodes (one line per study, from :func:`table` DataFrames) with the ideal (linear) line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    top = 1
    for run, df in studies.items():
        if df is None or df.empty:
            continue
        ax.plot(df["nodes"], df["speedup"], marker="o", label=f"{run}")
        n0 = int(df["nodes"].min())
        top = max(top, int(df["nodes"].max()))
        ax.plot(df["nodes"], df["nodes"] / n0, ls=":", color="grey")
    finish_and_save(fig, ax, png, xlabel="nodes", ylabel="speedup versus the smallest node count",
                    title="Node scaling (dotted: linear)", has_data=bool(studies),
                    empty_text="no scaling study results")


# ------------------------------------------------------------------------------------------- files

def write_study(run: str, results: dict[int, dict], csv_path: str, md_path: str, png_path: str) -> None:
    """Write a study's table (:func:`table`) as CSV and Markdown, and its speedup plot, from node count ->
    train.json record. The CSV and Markdown files are written aside and renamed into place."""
    df = table(results)
    tmp = csv_path + ".tmp"
    df.to_csv(tmp, index=False)
    os.replace(tmp, csv_path)
    r0 = results[min(results)]
    title = (f"Node scaling of {run}: {r0.get('steps')} batches of {r0.get('global_batch_size')} x "
             f"{r0.get('concat_tokens')} tokens at every node count. speedup = wall clock of {min(results)} node(s) / "
             f"wall clock of N; scaling efficiency = speedup / (N / {min(results)}).")
    with open(md_path + ".tmp", "w") as fh:
        fh.write(markdown(df, title))
    os.replace(md_path + ".tmp", md_path)
    plot_speedup({run: df}, png_path)
