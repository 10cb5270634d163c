#!/usr/bin/env python3
"""Probe: how fast is each vCPU, how much does a busy neighbour slow it, and how do N copies scale?

Two kernels, each in forked processes (``os.sched_setaffinity`` when pinned), started together:
``tok`` encodes the same ~200 kB of text with a ``tokenizers`` BPE (``encode_batch_fast``, TOKENIZERS_PARALLELISM
false; the MDS conversion's inner loop, 90% of a unit's time), ``sha`` hashes one 64 KiB buffer with sha256 (pure
ALU in L1/L2). Prints, per kernel: each CPU's rate alone (relative to the fastest), for ``tok`` the rate of CPU 0
and CPU 1 next to each other CPU (pairs, relative to each CPU alone), N = 1, 8, 1, 16, 1, 8 unpinned processes
(sum, mean and min/max per process) and 8 or 16 processes pinned to CPUs 0-7, the even, the odd and all CPUs.
Writes the per-CPU and pair figures to ``$OUT/topo.json`` (``/tmp`` without ``OUT``).
Used to explain the MDS worker-scaling runs (benchmarks/README.md, sixth session).

Usage: python scripts/probe_cpu_interference.py TOKENIZER_JSON DOCS_JSON   (DOCS_JSON: a JSON list of texts)
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import sys
import time

os.environ["TOKENIZERS_PARALLELISM"] = "false"
TOK, TEXTS = (sys.argv[1], sys.argv[2]) if len(sys.argv) > 2 else ("", "")


def work(args: tuple) -> float:
    """(pool process) run one kernel on ``cpu`` (None: not pinned) for ``secs`` from ``start_at``; units/s."""
    cpu, kind, secs, start_at = args
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    if kind == "tok":
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(TOK)
        with open(TEXTS) as fh:
            docs = json.load(fh)

        def step() -> int:
            return sum(len(e.ids) for e in tok.encode_batch_fast(docs))
    else:
        buf = os.urandom(1 << 16)

        def step() -> int:
            for _ in range(64):
                hashlib.sha256(buf).digest()
            return 64
    step()  # warm up before the clock starts
    while time.time() < start_at:
        time.sleep(0.0005)
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < secs:
        n += step()
    return n / (time.perf_counter() - t0)


def run(cpus: list, kind: str, secs: float) -> list[float]:
    """One process per entry of ``cpus`` (a CPU number or None), started together; their rates."""
    with mp.get_context("fork").Pool(len(cpus)) as pool:
        return pool.map(work, [(c, kind, secs, time.time() + 0.5) for c in cpus])


def main() -> int:
    if not TEXTS:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    out: dict = {}
    n = os.cpu_count() or 1
    for kind in ("tok", "sha"):
        alone = [run([c], kind, 1.0)[0] for c in range(n)]
        out[f"{kind}_alone"] = alone
        print(kind, "alone per cpu", [round(a / max(alone), 2) for a in alone], flush=True)
        if kind == "tok":
            for a in (0, 1):
                rel = {}
                for k in range(n):
                    if k == a:
                        continue
                    r = run([a, k], kind, 1.2)
                    rel[k] = (round(r[0] / alone[a], 2), round(r[1] / alone[k], 2))
                out[f"pair{a}"] = rel
                print(f"pairs with cpu{a}:", rel, flush=True)
        for procs in (1, 8, 1, 16, 1, 8):
            r = run([None] * procs, kind, 3.0)
            print(f"{kind} N={procs:2d} unpinned: sum {sum(r):,.0f} mean {sum(r) / procs:,.0f} per-proc min/max "
                  f"{min(r):,.0f}/{max(r):,.0f}", flush=True)
        for name, cpus in (("0-7", list(range(8))), ("even", list(range(0, n, 2))), ("odd", list(range(1, n, 2))),
                           ("all", list(range(n)))):
            if max(cpus) >= n:
                continue
            r = run(cpus, kind, 3.0)
            print(f"{kind} pinned {name}: mean {sum(r) / len(r):,.0f} min/max {min(r):,.0f}/{max(r):,.0f}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "topo.json"), "w") as fh:
        json.dump(out, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
