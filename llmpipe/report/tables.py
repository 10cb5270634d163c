"""The seed's report tables and plots, built with pandas from the results files (``results/report/``).

* **Table 1** (pretraining, ``table1_pretraining.csv/.md``): one row per pretraining run with a ``train.json``: model,
  data, max duration, ratios to MPT-125M (parameters from :func:`llmpipe.model.mfu.mpt_param_count`, batches from the
  config), eval interval, nodes, devices, wall clock, throughput (tokens/s) and MFU each over the whole run and in
  the steady state (:mod:`llmpipe.train.throughput`), peak memory per device, checkpoint
  size, whether conversion, inference and evaluation worked, and evaluation accuracy (held-out token accuracy and
  the in-context-learning task's accuracy from ``eval.json``).
* **Table 2** (finetuning, ``table2_finetuning.csv/.md``): one row per finetune run (``finetunes:`` in the config)
  with a ``train.json``, plus the node counts of its scaling study if any; speedup versus its fewest nodes.
* **Projection** (``projection.csv/.md``): how long each configured model's full token budget would take on N nodes,
  from a measured throughput. Labelled as a projection; see :func:`projection` for what it assumes.
* Plots (PNG): loss curves, throughput/MFU over batches, all-reduce busbw versus size, speedup versus nodes.

Only runs whose results exist, or that ``report.runs`` requests, are included (rules/report.smk).
Imports without torch.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
from typing import Any

from llmpipe.atomic import read_json
from llmpipe.bench.scaling_study import markdown
from llmpipe.config.runs import run_config, tokens_per_run
from llmpipe.config.schema import section_defaults
from llmpipe.config.settings import ConfigError
from llmpipe.model.mfu import flops_per_token, mpt_param_count
from llmpipe.report.plots import finish_and_save

#: Settings of the report the config does not set: the schema's defaults of ``report:``.
DEFAULTS: dict[str, Any] = section_defaults("report")


BASE_MODEL = "mpt-125m"  # the seed's ratios are to MPT-125M


def settings(config: dict) -> dict:
    """The ``report:`` section over :data:`DEFAULTS`."""
    s = {**DEFAULTS, **(config.get("report") or {})}
    s["projection"] = {**DEFAULTS["projection"], **(s.get("projection") or {})}
    s["runs"] = list(s.get("runs") or [])
    return s


def _finetunes(config: dict) -> set[str]:
    return set((config.get("finetunes") or {}).keys())


def report_runs(config: dict, results_dir: str) -> list[str]:
    """Runs in the report: ``report.runs`` (requested: built if missing), then, with ``report.include_existing``,
    every other configured run whose ``train.json`` already exists."""
    s = settings(config)
    runs = list(dict.fromkeys(s["runs"]))
    if s["include_existing"]:
        known = set(config.get("models") or {}) | _finetunes(config)
        for run in sorted(known):
            if run not in runs and os.path.exists(os.path.join(results_dir, run, "train.json")):
                runs.append(run)
    return runs


def scaling_runs(config: dict, results_dir: str) -> list[str]:
    """Scaling studies in the report: ``report.scaling_runs`` and (include_existing) every existing scaling.csv."""
    s = settings(config)
    runs = list(dict.fromkeys(s["scaling_runs"]))
    if s["include_existing"]:
        for p in sorted(glob.glob(os.path.join(results_dir, "scaling", "*", "scaling.csv"))):
            r = os.path.basename(os.path.dirname(p))
            if r not in runs:
                runs.append(r)
    return runs


def allreduce_nodes(config: dict, results_dir: str) -> list[int]:
    """All-reduce node counts in the report: ``report.allreduce_nodes`` and every existing nodes{N}.csv."""
    s = settings(config)
    nodes = [int(n) for n in s["allreduce_nodes"]]
    if s["include_existing"]:
        for p in glob.glob(os.path.join(results_dir, "bench", "allreduce", "nodes*.csv")):
            m = re.search(r"nodes(\d+)\.csv$", p)
            if m and int(m.group(1)) not in nodes:
                nodes.append(int(m.group(1)))
    return sorted(set(nodes))


def run_inputs(config: dict, results_dir: str, run: str) -> list[str]:
    """Files of one run the report reads: train.json always; eval.json, hf/manifest.json and generate.json for a
    requested run (built if missing) or when they exist."""
    s = settings(config)
    files = [os.path.join(results_dir, run, "train.json")]
    for leaf in ("eval.json", "hf/manifest.json", "generate.json"):
        p = os.path.join(results_dir, run, leaf)
        if run in s["runs"] or os.path.exists(p):
            files.append(p)
    return files


# ------------------------------------------------------------------------------------------- helpers

def hms(seconds: float | None) -> str | None:
    """Seconds as the seed's wall-clock notation (``9m7.873s``, ``3h28m24.319s``)."""
    if seconds is None:
        return None
    h, rem = divmod(float(seconds), 3600)
    m, s = divmod(rem, 60)
    return f"{int(h)}h{int(m)}m{s:.3f}s" if h else f"{int(m)}m{s:.3f}s"


def human_duration(seconds: float) -> str:
    """A rough duration for the projection: ``about 2.1 months`` (1 month = 30 days)."""
    if seconds is None or not math.isfinite(seconds):
        return "–"
    for unit, size in (("years", 365 * 86400), ("months", 30 * 86400), ("weeks", 7 * 86400), ("days", 86400),
                       ("hours", 3600), ("minutes", 60)):
        if seconds >= size:
            return f"about {seconds / size:.1f} {unit}"
    return f"about {seconds:.0f} seconds"


def _params(config: dict, run: str) -> int | None:
    try:
        return mpt_param_count(run_config(config, run)["arch"])["total"]
    except (ConfigError, KeyError):
        return None


def eval_accuracy(ev: dict | None) -> tuple[float | None, dict[str, float]]:
    """(held-out token accuracy, ICL accuracy columns) from an eval.json.

    Each column names its benchmark, shot count and the harness that scored it (``ICL hellaswag (10-shot)
    [llm-foundry 0.22.0]``), so results of two harnesses are never mixed in one column; an eval.json with a
    gauntlet adds ``ICL gauntlet average (<suite>) [<harness>]``. An eval.json without a harness (written before
    it was recorded) gives the bare ``ICL <task> (<setting>)``.
    """
    if not ev:
        return None, {}
    tok = (ev.get("val") or {}).get("token_accuracy")
    tag = f" [{ev['harness']}]" if ev.get("harness") else ""
    icl = {}
    for task, val in (ev.get("icl") or {}).items():
        if isinstance(val, dict):
            for setting, acc in val.items():
                if isinstance(acc, (int, float)):
                    icl[f"ICL {task} ({setting}){tag}"] = round(float(acc), 4)
        elif isinstance(val, (int, float)):
            icl[f"ICL {task}{tag}"] = round(float(val), 4)
    avg = (ev.get("gauntlet") or {}).get("average")
    if isinstance(avg, (int, float)):
        icl[f"ICL gauntlet average ({ev.get('suite')}){tag}"] = round(float(avg), 4)
    return tok, icl


def _ok(run_dir: str) -> str:
    """``Y`` when the export, generation and evaluation of a run all worked, ``N`` when one failed, ``–`` when one
    is missing."""
    man = read_json(os.path.join(run_dir, "hf", "manifest.json"))
    gen = read_json(os.path.join(run_dir, "generate.json"))
    ev = read_json(os.path.join(run_dir, "eval.json"))
    if man is None or gen is None or ev is None:
        return "–"
    conv = bool(man.get("bytes"))
    inf = bool(gen.get("outputs")) and all(o.get("new_tokens", 0) > 0 for o in gen["outputs"])
    loss = (ev.get("val") or {}).get("loss")
    evl = loss is not None and math.isfinite(float(loss))
    return "Y" if conv and inf and evl else "N"


# ------------------------------------------------------------------------------------------- tables

def table1(config: dict, results_dir: str, runs: list[str]):
    """Table 1 (pretraining) as a DataFrame; one row per run in ``runs`` that is not a finetune and has train.json.

    Ratios are to MPT-125M's configured parameters and ``max_duration_batches`` (the seed's columns); the runtime
    ratio is to the MPT-125M row when the table has one.
    """
    import pandas as pd

    fts = _finetunes(config)
    base_params = _params(config, BASE_MODEL)
    try:
        base_batches = int(run_config(config, BASE_MODEL)["train"]["max_duration_batches"])
    except ConfigError:
        base_batches = None
    rows = []
    for run in runs:
        if run in fts:
            continue
        tr = read_json(os.path.join(results_dir, run, "train.json"))
        if not tr:
            continue
        rc = run_config(config, run)
        params = _params(config, run)
        ev = read_json(os.path.join(results_dir, run, "eval.json"))
        tok_acc, icl_acc = eval_accuracy(ev)
        ck = tr.get("checkpoint_size_bytes")
        rows.append({
            "model": run,
            "training data": rc["data"]["corpus"],
            "max duration (batches)": int(tr.get("steps") or rc["train"]["max_duration_batches"]),
            "params": params,
            "ratio params / 125M params": round(params / base_params, 2) if params and base_params else None,
            "ratio batches / 125M batches": round(int(tr["steps"]) / base_batches, 2) if base_batches else None,
            "eval interval (batches)": int(rc["train"]["eval_interval_batches"]),
            "nodes": tr.get("nodes"),
            "devices": tr.get("devices"),
            "wall clock": hms(tr.get("wall_clock_s")),
            "wall clock (s)": tr.get("wall_clock_s"),
            "ratio runtime / 125M runtime": None,
            "throughput, whole run (tokens/s)": tr.get("tokens_per_s"),
            "MFU, whole run": tr.get("mfu"),
            "throughput, steady state (tokens/s)": tr.get("steady_tokens_per_s"),
            "MFU, steady state": tr.get("steady_mfu"),
            "memory per device (GiB)": tr.get("peak_memory_per_device_gib"),
            "checkpoint size (GiB)": round(ck / 2**30, 3) if ck else None,
            "conversion, inference & eval ok": _ok(os.path.join(results_dir, run)),
            "eval accuracy (held-out tokens)": round(tok_acc, 4) if tok_acc is not None else None,
            **icl_acc,
            "peak host RSS (GiB)": tr.get("peak_host_rss_gib"),
            "device": tr.get("device"),
        })
    df = pd.DataFrame(rows)
    if not df.empty and BASE_MODEL in set(df["model"]):
        base_wall = float(df.loc[df["model"] == BASE_MODEL, "wall clock (s)"].iloc[0])
        df["ratio runtime / 125M runtime"] = (df["wall clock (s)"] / base_wall).round(2)
    return df


def table2(config: dict, results_dir: str, runs: list[str]):
    """Table 2 (finetuning) as a DataFrame: every finetune run in ``runs`` with a train.json, and the node counts
    of its scaling study (``results/scaling/{run}/nodes*/train.json``) when one exists.

    Speedup = wall clock at the fewest nodes of that run / wall clock at this row's nodes (the seed's "speedup
    versus one node"); eval accuracy only where an eval.json belongs to the row (the run's own training).
    """
    import pandas as pd

    fts = config.get("finetunes") or {}
    rows = []
    for run in runs:
        if run not in fts:
            continue
        records = []
        tr = read_json(os.path.join(results_dir, run, "train.json"))
        if tr:
            records.append((tr, os.path.join(results_dir, run)))
        for p in sorted(glob.glob(os.path.join(results_dir, "scaling", run, "nodes*", "train.json"))):
            t = read_json(p)
            if t and not (tr and int(t.get("nodes", 0)) == int(tr.get("nodes", -1))):
                records.append((t, None))
        if not records:
            continue
        base = min(records, key=lambda r: int(r[0].get("nodes", 1)))[0]
        fcfg = fts.get(run) or {}
        data = fcfg.get("dataset") or fcfg.get("data") or fcfg.get("hf_name")
        if isinstance(data, dict):  # finetunes.<run>.data.instructions names the instruction set
            iset = data.get("instructions")
            src = ((config.get("instruction_sets") or {}).get(iset) or {}) if iset else {}
            data = (src.get("hf_name") or src.get("repo_id") or src.get("name") or iset or data.get("hf_name")
                    or data.get("name") or json.dumps(data, sort_keys=True))
        for t, run_dir in sorted(records, key=lambda r: int(r[0].get("nodes", 1))):
            ev = read_json(os.path.join(run_dir, "eval.json")) if run_dir else None
            tok_acc, icl_acc = eval_accuracy(ev)
            wall = t.get("wall_clock_s")
            speed = base.get("wall_clock_s") / wall if wall and base.get("wall_clock_s") else None
            rows.append({
                "model": run,
                "finetuning data": data,
                "nodes": t.get("nodes"),
                "devices": t.get("devices"),
                "wall clock": hms(wall),
                "wall clock (s)": wall,
                "speedup versus fewest nodes": "–" if t is base else (f"{speed:.2f}x" if speed else None),
                "throughput, whole run (tokens/s)": t.get("tokens_per_s"),
                "throughput, steady state (tokens/s)": t.get("steady_tokens_per_s"),
                "memory per device (GiB)": t.get("peak_memory_per_device_gib"),
                "inference & eval ok": _ok(run_dir) if run_dir else "–",
                "eval accuracy (held-out tokens)": round(tok_acc, 4) if tok_acc is not None else None,
                **icl_acc,
            })
    cols = ["model", "finetuning data", "nodes", "devices", "wall clock", "wall clock (s)",
            "speedup versus fewest nodes", "throughput, whole run (tokens/s)", "throughput, steady state (tokens/s)",
            "memory per device (GiB)", "inference & eval ok",
            "eval accuracy (held-out tokens)"]
    extra = [c for r in rows for c in r if c not in cols]
    return pd.DataFrame(rows, columns=cols + list(dict.fromkeys(extra)))


def pick_reference(config: dict, results_dir: str, runs: list[str]) -> str | None:
    """The measured run the projection scales from: ``report.projection.reference``, else the run with an MFU
    (a GPU run) and the most FLOPs per token, else the run with the most FLOPs per token."""
    ref = settings(config)["projection"]["reference"]
    if ref:
        return ref
    best = None
    for run in runs:
        tr = read_json(os.path.join(results_dir, run, "train.json"))
        if not tr or not tr.get("tokens_per_s_per_device") or not tr.get("flops_per_token"):
            continue
        key = (tr.get("mfu") is not None, float(tr["flops_per_token"]))
        if best is None or key > best[0]:
            best = (key, run)
    return best[1] if best else None


def projection(config: dict, results_dir: str, reference: str | None, basis: dict | None = None):
    """Projected pretraining time of each configured model on each node count of ``report.projection.nodes``.

    Without a measured GPU reference (none, or a CPU run without MFU) and with ``basis`` (the committed GPU
    benchmark, :func:`llmpipe.plan.memory_time.benchmark_basis`), the time plan of the dry run is used instead
    (:func:`llmpipe.plan.memory_time.train_time`: the benchmark's MFU x the bf16 peak of ``gpu_type``, each model's GPUs per node;
    where ``gpu_type`` finds no card, that of the card the basis rows were measured on, which the basis text names).

    From the reference run's measured ``tokens_per_s_per_device`` (train.json):

        tokens/s per device (model) = measured tokens/s per device x FLOPs/token (reference) / FLOPs/token (model)
        time (model, N nodes)       = tokens_per_run(model) / (tokens/s per device x N x devices per node)

    FLOPs per token by :func:`llmpipe.model.mfu.flops_per_token` (llm-foundry's count), the token budget by
    :func:`llmpipe.config.runs.tokens_per_run` (max_duration_batches x global_batch_size x concat_tokens), devices per node
    as in the reference run. With ``report.projection.assume_mfu`` set and the reference's peak FLOP/s known, the
    per-device rate is ``assume_mfu x peak / FLOPs per token`` instead.

    Assumes: the reference's device type; the same MFU for every model size (or the assumed one); linear scaling
    with nodes (no communication or input slow-down); no time for evaluation, checkpoints or restarts. Returns an
    empty DataFrame without a usable reference.
    """
    import pandas as pd

    cols = ["model", "params", "token budget", "FLOPs per token", "nodes", "devices",
            "projected tokens/s", "projected time (s)", "projected time", "reference", "basis"]
    tr = read_json(os.path.join(results_dir, reference, "train.json")) if reference else None
    s = settings(config)["projection"]
    if basis and (not tr or tr.get("mfu") is None):
        return pd.DataFrame(_benchmark_projection(config, s, basis), columns=cols)
    if not tr or not tr.get("tokens_per_s_per_device"):
        return pd.DataFrame(columns=cols)
    per_node = max(1, int(tr["devices"]) // max(1, int(tr.get("nodes") or 1)))
    ref_fpt = float(tr.get("flops_per_token") or flops_per_token(run_config(config, reference)["arch"],
                                                                   int(tr["concat_tokens"])))
    models = s.get("models") or sorted(config.get("models") or {}, key=lambda m: _params(config, m) or 0)
    assume = s.get("assume_mfu")
    peak = tr.get("peak_flops_per_device")
    rows = []
    for m in models:
        rc = run_config(config, m)
        fpt = flops_per_token(rc["arch"], int(rc["data"]["concat_tokens"]))
        if assume and peak:
            tpsd = float(assume) * float(peak) / fpt
            basis = f"assumed MFU {assume} x peak {float(peak) / 1e12:.1f} TFLOP/s of {tr.get('device')}"
        else:
            tpsd = float(tr["tokens_per_s_per_device"]) * ref_fpt / fpt
            mfu_txt = f" = {tr['mfu']}" if tr.get("mfu") is not None else ""
            basis = (f"{reference}'s {float(tr['tokens_per_s_per_device']):,.0f} tokens/s per {tr.get('device')} "
                     f"device, scaled by FLOPs per token (same MFU{mfu_txt})")
        for n in s["nodes"]:
            devices = int(n) * per_node
            tps = tpsd * devices
            t = tokens_per_run(config, m) / tps
            rows.append({"model": m, "params": _params(config, m), "token budget": tokens_per_run(config, m),
                         "FLOPs per token": fpt, "nodes": int(n), "devices": devices,
                         "projected tokens/s": round(tps, 1), "projected time (s)": round(t, 1),
                         "projected time": human_duration(t), "reference": reference, "basis": basis})
    return pd.DataFrame(rows, columns=cols)


def _benchmark_projection(config: dict, s: dict, basis: dict) -> list[dict]:
    from llmpipe.config.runs import gpu_memory, gpu_type, step_resources
    from llmpipe.plan import memory_time as plan

    rows = []
    # gpu_type auto: this machine's card; without one (a login node), the card the basis rows were measured on
    capacity, card = gpu_memory(config), gpu_type(config)
    if card is None and basis.get("card"):
        card = basis["card"]
        capacity = (config.get("gpu_memory_gb") or {}).get(card) or plan.GPU_MEMORY_GB.get(card)
    models = s.get("models") or sorted(config.get("models") or {}, key=lambda m: _params(config, m) or 0)
    for m in models:
        rc = run_config(config, m)
        per_node = int(step_resources(config, "train", m)["gpus_per_node"]) or 1
        for n in s["nodes"]:
            ac = plan.train_memory(rc, nodes=int(n), gpus_per_node=per_node,
                                   capacity_gb=capacity)["activation_checkpointing"]
            t = plan.train_time(rc, nodes=int(n), gpus_per_node=per_node, gpu_type=card, basis=basis,
                                activation_checkpointing=ac, peak_overrides=config.get("gpu_peak_flops"))
            if t is None:
                continue
            rows.append({"model": m, "params": _params(config, m), "token budget": t["tokens"],
                         "FLOPs per token": t["flops_per_token"], "nodes": int(n), "devices": int(n) * per_node,
                         "projected tokens/s": round(t["tokens_per_s"], 1), "projected time (s)": round(t["seconds"], 1),
                         "projected time": human_duration(t["seconds"]), "reference": "benchmark",
                         "basis": t["basis"]})
    return rows


PROJECTION_NOTE = (
    "**PROJECTION, not a measurement.** Each model's configured token budget (max_duration_batches x "
    "global_batch_size x concat_tokens) divided by a projected throughput: the reference run's measured tokens/s "
    "per device, scaled by the ratio of FLOPs per token (llm-foundry's count, llmpipe.model.mfu.flops_per_token), times "
    "the devices of N nodes (devices per node as in the reference run). Assumes the reference's device type, the "
    "same MFU at every model size, linear scaling with nodes, and no time for evaluation, checkpoints or "
    "restarts; real multi-node runs are slower. Without a measured GPU run, the committed GPU benchmark's MFU "
    "(the rows benchmarks/plan-basis.json names for the card gpu_type plans for) times that card's bf16 peak is "
    "the basis, as in the dry run's plans.")


# ------------------------------------------------------------------------------------------- plots

def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def read_log(path: str) -> list[dict]:
    """The records of a loss log (``train_log.jsonl``: one JSON object a line); empty when it cannot be read."""
    out = []
    try:
        with open(path) as fh:
            for line in fh:
                line = line.strip()
                if line:
                    out.append(json.loads(line))
    except OSError:
        pass
    return out


def log_of(results_dir: str, run: str, tr: dict | None) -> str:
    """A run's loss log: the ``train_log`` its ``train.json`` record ``tr`` names (in the identity checkpoint
    folder) when it exists, else ``{results_dir}/{run}/train_log.jsonl``."""
    if tr and tr.get("train_log") and os.path.exists(tr["train_log"]):
        return tr["train_log"]
    return os.path.join(results_dir, run, "train_log.jsonl")


def plot_loss(results_dir: str, runs: list[str], png: str) -> None:
    """Training loss versus batch, one line per run (``results/{run}/train_log.jsonl``: batch, loss)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = 0
    for run in runs:
        recs = [r for r in read_log(log_of(results_dir, run, read_json(os.path.join(results_dir, run, "train.json"))))
                if r.get("loss") is not None]
        if recs:
            ax.plot([r["batch"] for r in recs], [r["loss"] for r in recs], label=run)
            drawn += 1
    finish_and_save(fig, ax, png, xlabel="batch", ylabel="training loss (nats per token)", title="Training loss",
                    has_data=bool(drawn), empty_text="no training logs")


def throughput_series(log: list[dict], devices: int, flops_per_token_: float | None,
                      peak: float | None) -> list[dict]:
    """Per logging interval: ``tokens/s per device = (tokens_i - tokens_{i-1}) / (elapsed_i - elapsed_{i-1}) /
    devices`` and, with a known peak, ``MFU = tokens/s per device x FLOPs per token / peak`` (as llmpipe.model.mfu)."""
    out = []
    for a, b in zip(log, log[1:]):
        dt = float(b["elapsed_s"]) - float(a["elapsed_s"])
        if dt <= 0 or b["batch"] <= a["batch"]:
            continue
        tpsd = (int(b["tokens"]) - int(a["tokens"])) / dt / max(1, devices)
        mfu = tpsd * flops_per_token_ / peak if (peak and flops_per_token_) else None
        out.append({"batch": b["batch"], "tokens_per_s_per_device": tpsd, "mfu": mfu})
    return out


def plot_mfu(results_dir: str, runs: list[str], png: str) -> None:
    """MFU over batches where the device's peak is known (GPU runs); otherwise tokens/s per device over batches."""
    plt = pyplot()
    series = {}
    for run in runs:
        tr = read_json(os.path.join(results_dir, run, "train.json"))
        if not tr:
            continue
        series[run] = throughput_series(read_log(log_of(results_dir, run, tr)), int(tr.get("devices") or 1),
                                        tr.get("flops_per_token"), tr.get("peak_flops_per_device"))
    use_mfu = any(p["mfu"] is not None for s in series.values() for p in s)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run, pts in series.items():
        pts = [p for p in pts if (p["mfu"] is not None) == use_mfu]
        if pts:
            ax.plot([p["batch"] for p in pts], [p["mfu" if use_mfu else "tokens_per_s_per_device"] for p in pts],
                    marker=".", label=run)
    ax.set_xlabel("batch")
    if use_mfu:
        ax.set_ylabel("MFU (model FLOPs / peak FLOPs)")
        ax.set_title("Model FLOPs utilization over batches")
    else:
        ax.set_ylabel("tokens/s per device")
        ax.set_title("Throughput over batches (MFU needs a GPU with a known peak)")
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------- files

def _write_table(df, csv_path: str, md_path: str, title: str) -> None:
    tmp = csv_path + ".tmp"
    df.to_csv(tmp, index=False)
    os.replace(tmp, csv_path)
    with open(md_path + ".tmp", "w") as fh:
        fh.write(markdown(df, title) if not df.empty else f"{title}\n\n(no results)\n")
    os.replace(md_path + ".tmp", md_path)


def build(config: dict, results_dir: str, out: dict[str, str], runs: list[str], scaling: list[str],
          allreduce: list[int]) -> None:
    """Write every report file named in ``out`` (keys: table1_csv, table1_md, table2_csv, table2_md,
    projection_csv, projection_md, loss, mfu, busbw, speedup)."""
    import pandas as pd

    from llmpipe.bench.allreduce_bw import plot_busbw
    from llmpipe.bench.scaling_study import plot_speedup

    for p in out.values():
        os.makedirs(os.path.dirname(p) or ".", exist_ok=True)
    t1 = table1(config, results_dir, runs)
    _write_table(t1, out["table1_csv"], out["table1_md"],
                 "Table 1: pretraining runs (throughput in tokens/s over all devices; memory = peak allocated per "
                 "device; MFU only on GPUs with a known peak).")
    t2 = table2(config, results_dir, runs)
    _write_table(t2, out["table2_csv"], out["table2_md"],
                 "Table 2: finetuning runs (speedup = wall clock at the fewest nodes / wall clock at N).")
    ref = pick_reference(config, results_dir, runs)
    from llmpipe.config.runs import gpu_type
    from llmpipe.plan import memory_time as plan

    proj = projection(config, results_dir, ref, plan.benchmark_basis(card=gpu_type(config)))
    _write_table(proj, out["projection_csv"], out["projection_md"], PROJECTION_NOTE)
    plot_loss(results_dir, runs, out["loss"])
    plot_mfu(results_dir, runs, out["mfu"])
    plot_busbw({n: os.path.join(results_dir, "bench", "allreduce", f"nodes{n}.csv") for n in allreduce},
               out["busbw"])
    studies = {}
    for r in scaling:
        p = os.path.join(results_dir, "scaling", r, "scaling.csv")
        if os.path.exists(p):
            studies[r] = pd.read_csv(p)
    plot_speedup(studies, out["speedup"])
