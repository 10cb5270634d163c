"""One training run's page of the Snakemake report (rule ``report_run``): its loss curve, its throughput/MFU over
batches beside the whole-run and steady-state figures of its ``train.json``, and where its tracked run is.

Inputs: ``results/{run}/train.json`` and, beside the run's identity checkpoint folder (the folder of
``train.json``'s ``train_log``, ``results/{run}/checkpoints/<key>/``), its loss log ``train_log.jsonl`` and
``tracking.json`` (:mod:`llmpipe.train.tracking`). Outputs: ``loss.png``, ``mfu.png`` and ``tracking.html`` (a small
table; Snakemake's report shows HTML and images, not CSV). Imports without torch.
"""

from __future__ import annotations

import html
import os

from llmpipe.atomic import read_json
from llmpipe.report.plots import finish_and_save
from llmpipe.report.tables import log_of, pyplot, read_log, throughput_series
from llmpipe.train import tracking


def identity_folder_of(train: dict | None) -> str | None:
    """The identity checkpoint folder a ``train.json`` record came from (its loss log's folder), or None when it
    names no loss log."""
    return os.path.dirname(train["train_log"]) if train and train.get("train_log") else None


def plot_run_loss(run: str, log: list[dict], png: str) -> None:
    """Training loss versus batch of one run (``log``: the loss log's records; batch, loss)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    recs = [r for r in log if r.get("loss") is not None]
    if recs:
        ax.plot([r["batch"] for r in recs], [r["loss"] for r in recs], label=f"{run}: training loss")
    finish_and_save(fig, ax, png, xlabel="batch", ylabel="training loss (nats per token)",
                    title=f"{run}: training loss", has_data=bool(recs), empty_text="no training log")


def plot_run_throughput(run: str, train: dict, log: list[dict], png: str) -> None:
    """MFU (GPU with a known peak) or tokens/s per device (otherwise) per logging interval of one run
    (:func:`llmpipe.report.tables.throughput_series`), with ``train.json``'s whole-run and steady-state figures as
    horizontal lines and the steady window (:mod:`llmpipe.train.throughput`) shaded."""
    plt = pyplot()
    devices = int(train.get("devices") or 1)
    pts = throughput_series(log, devices, train.get("flops_per_token"), train.get("peak_flops_per_device"))
    use_mfu = any(p["mfu"] is not None for p in pts)
    key = "mfu" if use_mfu else "tokens_per_s_per_device"
    pts = [p for p in pts if p[key] is not None]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if pts:
        ax.plot([p["batch"] for p in pts], [p[key] for p in pts], marker=".", label="per logging interval")
    whole = train.get("mfu") if use_mfu else train.get("tokens_per_s_per_device")
    steady = train.get("steady_mfu") if use_mfu else train.get("steady_tokens_per_s_per_device")
    fmt = "{:.2%}" if use_mfu else "{:,.0f} tokens/s"
    if whole:
        ax.axhline(whole, color="tab:gray", linestyle=":", label=f"whole run (train.json): {fmt.format(whole)}")
    if steady:
        ax.axhline(steady, color="tab:green", linestyle="--",
                   label=f"steady state (train.json): {fmt.format(steady)}")
    w = train.get("steady_window") or {}
    if w.get("first_batch") is not None and w.get("last_batch") is not None:
        ax.axvspan(w["first_batch"], w["last_batch"], color="tab:green", alpha=0.08, label="steady window")
    ylabel = "MFU (model FLOPs / peak FLOPs)" if use_mfu else "tokens/s per device"
    title = f"{run}: MFU over batches" if use_mfu else f"{run}: throughput (MFU needs a GPU with a known peak)"
    finish_and_save(fig, ax, png, xlabel="batch", ylabel=ylabel, title=title,
                    has_data=bool(pts or whole or steady), empty_text="no throughput figures")


def tracking_html(run: str, rows: list[dict], folder: str | None) -> str:
    """A small HTML page: one table row per logger of the run's tracked run (:func:`llmpipe.train.tracking.locations`),
    or a line saying the run was not tracked."""
    esc = html.escape
    head = f"<h3>{esc(run)}: tracked run</h3>\n"
    if folder:
        head += f"<p>identity folder: <code>{esc(folder)}</code></p>\n"
    if not rows:
        body = ("<p>Not tracked: no tracking.json in its identity folder (tracking.loggers was empty when it "
                "trained).</p>\n")
    else:
        cells = "".join(f"<tr><td>{esc(r['logger'])}</td><td><code>{esc(r['where'])}</code></td>"
                        f"<td><code>{esc(r['open'])}</code></td></tr>\n" for r in rows)
        body = f"<table border=\"1\">\n<tr><th>logger</th><th>where</th><th>open with</th></tr>\n{cells}</table>\n"
    return f"<!doctype html>\n<html><head><meta charset=\"utf-8\"></head><body>\n{head}{body}</body></html>\n"


def build_run(results_dir: str, run: str, out: dict[str, str], base: str | None = None) -> dict:
    """Write one run's ``out`` files (keys: loss, mfu, tracking) from ``{results_dir}/{run}/train.json``, its
    loss log and its ``tracking.json``; ``base``: the workflow's folder (paths shown relative to it). Returns the
    tracking rows written."""
    train = read_json(os.path.join(results_dir, run, "train.json")) or {}
    log = read_log(log_of(results_dir, run, train))
    for p in out.values():
        os.makedirs(os.path.dirname(p) or ".", exist_ok=True)
    plot_run_loss(run, log, out["loss"])
    plot_run_throughput(run, train, log, out["mfu"])
    folder = identity_folder_of(train)
    rows = tracking.locations(tracking.read_state(folder), base) if folder else []
    tmp = out["tracking"] + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(tracking_html(run, rows, folder))
    os.replace(tmp, out["tracking"])
    return {"tracking": rows}
