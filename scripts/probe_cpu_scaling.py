#!/usr/bin/env python3
"""Probe: does a CPU-bound tokenizer loop slow down when N copies run side by side, and does CPU placement matter?

Each worker process (optionally pinned to one CPU with ``os.sched_setaffinity``) encodes the same text with a
byte-level BPE (``tokenizers``, trained here on that text, TOKENIZERS_PARALLELISM=false) for ``--seconds`` and
reports tokens/s. Prints one CSV row per (placement, worker) and a summary per placement: mean per-worker rate
relative to one worker alone. Used to explain the MDS worker-scaling efficiency (benchmarks/README.md).

Usage: python scripts/probe_cpu_scaling.py --out probe.csv
"""
from __future__ import annotations

import argparse
import csv
import multiprocessing as mp
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _text() -> str:
    from llmpipe.data.corpus import builtin_documents
    return "\n\n".join(d["text"] for d in builtin_documents())


def _worker(args):
    cpu, tok_json, seconds, start_at = args
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    from tokenizers import Tokenizer
    tok = Tokenizer.from_str(tok_json)
    text = _text()
    docs = [text[i:i + 2000] for i in range(0, len(text), 2000)]
    while time.time() < start_at:
        time.sleep(0.001)
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < seconds:
        n += sum(len(e.ids) for e in tok.encode_batch(docs[:200]))
    return cpu, n / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--out", default="probe-cpu-scaling.csv")
    a = ap.parse_args()
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator([_text()], trainers.BpeTrainer(vocab_size=8192, show_progress=False))
    tj = tok.to_str()
    n = os.cpu_count() or 1
    placements = {
        "1 pinned cpu0": [0],
        "8 unpinned": [None] * 8,
        "8 pinned 0-7": list(range(8)),
        "8 pinned even": list(range(0, n, 2))[:8],
        "8 pinned odd": list(range(1, n, 2))[:8],
        f"{n} pinned all": list(range(n)),
    }
    rows, base = [], None
    ctx = mp.get_context("spawn")
    for name, cpus in placements.items():
        if len(cpus) > n or any(c is not None and c >= n for c in cpus):
            continue  # not enough CPUs here
        with ctx.Pool(len(cpus)) as pool:
            start = time.time() + 3.0
            res = pool.map(_worker, [(c, tj, a.seconds, start) for c in cpus])
        rates = [r for _, r in res]
        mean = sum(rates) / len(rates)
        base = base or mean
        for c, r in res:
            rows.append({"placement": name, "workers": len(cpus), "cpu": c, "tokens_per_s": round(r),
                         "relative_to_alone": round(r / base, 3)})
        print(f"{name:16s} workers={len(cpus):2d} mean {mean:,.0f} tok/s per worker = {mean / base:.3f} of alone; "
              f"min {min(rates) / base:.3f}", flush=True)
    with open(a.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
