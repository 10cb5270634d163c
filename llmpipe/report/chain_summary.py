"""The short summary Snakemake prints when a chain ends: what each run that changed now scores and where its files are.

Read from the runs' own records (``results/{run}/train.json``, ``eval.json``, ``generate.json``), never recomputed;
a run is listed when one of them was written at or after the start of this Snakemake invocation. Imports without
torch (it runs in Snakemake's ``onsuccess`` handler).
"""

from __future__ import annotations

import glob
import os

from llmpipe.atomic import read_json

#: The records a run's line is read from, in the order its parts are printed.
RECORDS = ("train.json", "eval.json", "generate.json")


def run_line(run_dir: str) -> str | None:
    """One line for the run in ``run_dir``: final training loss and batches (train.json), held-out loss and gauntlet
    average (eval.json; ``partial`` when tasks were left out), prompts answered (generate.json), and the folder;
    None when the run has none of the records."""
    train, ev, gen = (read_json(os.path.join(run_dir, name)) for name in RECORDS)
    if not (train or ev or gen):
        return None
    parts = []
    if train and train.get("final_train_loss") is not None:
        parts.append(f"train loss {train['final_train_loss']:.4f} after {train.get('steps', '?')} batches")
    if ev and (ev.get("val") or {}).get("loss") is not None:
        parts.append(f"held-out loss {ev['val']['loss']:.4f}")
    gauntlet = (ev or {}).get("gauntlet") or {}
    if gauntlet.get("average") is not None:
        partial = " (partial: " + ", ".join(gauntlet["missing"]) + " not scored)" if gauntlet.get("missing") else ""
        parts.append(f"gauntlet average {gauntlet['average']:.4f}{partial}")
    if gen and isinstance(gen.get("outputs"), list):
        parts.append(f"{len(gen['outputs'])} prompt(s) answered")
    return f"{os.path.basename(run_dir.rstrip('/'))}: {', '.join(parts) or 'no scores yet'}; files: {run_dir}/"


def summary(results_dir: str, since: float) -> list[str]:
    """The summary's lines for the runs under ``results_dir`` with a record written at or after ``since`` (Unix
    seconds); empty when no run changed."""
    lines = []
    for run_dir in sorted(glob.glob(os.path.join(results_dir, "*", ""))):
        run_dir = run_dir.rstrip("/")
        stamps = [os.path.getmtime(p) for p in (os.path.join(run_dir, n) for n in RECORDS) if os.path.exists(p)]
        if stamps and max(stamps) >= since:
            line = run_line(run_dir)
            if line:
                lines.append(line)
    return lines


def print_summary(results_dir: str, since: float) -> None:
    """Print :func:`summary` under a heading (nothing when no run changed)."""
    lines = summary(results_dir, since)
    if lines:
        print("llmpipe: summary of the runs this chain changed:\n" + "\n".join(f"  {line}" for line in lines),
              flush=True)
