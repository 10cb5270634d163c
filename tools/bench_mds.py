#!/usr/bin/env python
"""Benchmark: our parallel MDS conversion vs llm-foundry's ``convert_dataset_json``, and our worker scaling.

One run, one input: a generated corpus in C4's layout (``--files`` train files of English text recombined from the
paragraphs of the builtin Python-documentation corpus, deterministic from ``--seed``), one tokenizer (a byte-level
BPE trained on the builtin corpus, ``--vocab`` tokens), ``--concat`` tokens per sample, zstd shards,
``TOKENIZERS_PARALLELISM=false`` on both sides. Every measurement runs in a fresh Python process:

* ``llm-foundry``: ``from llmfoundry.command_utils import convert_dataset_json`` called as a user would (a folder of
  json.gz files, ``split='train'``, ``concat_tokens``, the tokenizer folder, ``eos_text``), with a fresh
  ``HF_DATASETS_CACHE``. Wall time is the ``convert_dataset_json`` call only (the library import is excluded).
  It converts the first ``--foundry-files`` files (default 1: it is single-process and slow); ours converts the
  same files with 1 worker (row ``ours-same-input``), and its per-core rate is also compared with every ``ours``
  row (columns ``per_core_vs_foundry``: wall-clock based; ``conversion_vs_foundry``: without process start-up).
* ``ours``: :func:`llmpipe.steps.mds_units.convert_dataset` with ``data_prep.workers = N`` through the local (submitit)
  executor, for each N of ``--workers``, on all ``--files`` files (1 worker first, then the largest N first; the
  CSV is rewritten after every run, so a run cut short by a time limit keeps what it measured). Wall time is the
  whole call: spawning the worker processes (which import neither torch nor mosaicml-streaming), converting, merging the
  indexes and writing the manifest.

Columns of the CSV: ``impl, workers, files, documents, text_mb`` (UTF-8 text converted), ``tokens, samples,
wall_s, cpu_s`` (user+sys of the process and its children), ``tokens_per_s``, ``tokens_per_s_per_core``
(= tokens / (wall_s x workers)), ``text_mb_per_s_per_core``, ``tokens_per_cpu_s`` (= tokens / cpu_s: counts any
threads a side uses), ``unit_s_sum`` (ours: the sum of the units' own conversion seconds, i.e. without process
start-up, merge and polling; llm-foundry: its wall time), ``tokens_per_unit_s`` (= tokens / unit_s_sum),
``spawn_s`` (ours: from the call until the first unit starts in a worker process), ``tokenizer_s`` (mean time a
unit takes to load its tokenizer), ``tail_s`` (from the end of the last
unit until the call returns: worker exit, index merge, manifest), ``encode_s_sum, pack_s_sum, write_s_sum,
read_s_sum`` (ours: the units' own seconds split by phase and summed over units: tokenizer calls, packing ids into
samples, shard writing with compression, and the rest: reading, gunzip, JSON; compare them across worker counts
to see which phase slows down side by side), ``user_s_sum, sys_s_sum, minflt_sum, nivcsw_sum`` (ours: the
units' processes by ``getrusage``, summed: user / kernel CPU seconds, minor page faults, involuntary context
switches), ``batch_chars`` (ours: characters per tokenizer call, ``--batch-chars``), ``variant`` (``--variant``), ``repeat``
(ours: the pass of ``--repeat``, from 0; each pass has its own 1-worker base),
``speedup`` (ours: wall at 1 worker / wall at N), ``efficiency`` (= speedup / N), ``per_core_vs_foundry``,
``conversion_vs_foundry`` (ours / llm-foundry, per core and per conversion second), ``cpus`` (CPUs available),
``host``. At the end a markdown table and the full-C4 estimate are printed.

Usage::

    python tools/bench_mds.py --workers 1,2,4,8,16 --files 128 --mb-per-file 2.5 --foundry-files 8 --out mds.csv
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import multiprocessing
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

EOS = "<|endoftext|>"


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- inputs

def make_inputs(work: str, files: int, mb_per_file: float, vocab: int, seed: int) -> tuple[str, str]:
    """Builtin corpus -> tokenizer; then ``files`` generated train files. Returns (corpus manifest, tok dir)."""
    from llmpipe.data.corpus import builtin_documents, scan_all
    from llmpipe.data.errors import atomic_write_json
    from llmpipe.data.tokenizer import prepare_tokenizer

    tag = f"f{files}-mb{mb_per_file:g}-v{vocab}-s{seed}"
    base = os.path.join(work, "builtin")
    tok_dir = os.path.join(work, f"tok-v{vocab}")
    corpus = os.path.join(work, f"corpus-{tag}")
    man = os.path.join(corpus, "manifest.json")
    if all(os.path.exists(p) for p in (man, os.path.join(corpus, "text-bytes.json"),
                                        os.path.join(tok_dir, "manifest.json"))):
        log(f"reusing inputs in {corpus}")
        return man, tok_dir
    from llmpipe.data.corpus import prepare_corpus

    log("building the builtin corpus and training the tokenizer")
    prepare_corpus({"source": "builtin", "subset": "en", "train_files": 4, "val_files": 1}, base)
    prepare_tokenizer({"source": "train", "vocab_size": vocab, "eos_text": EOS}, tok_dir,
                      os.path.join(base, "manifest.json"))
    global _PARS
    _PARS = [p for d in builtin_documents() for p in d["text"].split("\n\n")]
    en = os.path.join(corpus, "en")
    os.makedirs(en, exist_ok=True)
    t0 = time.time()
    jobs = [(os.path.join(en, f"c4-train.{i:05d}-of-01024.json.gz"), int(mb_per_file * 1e6), seed * 100003 + i)
            for i in range(files)]
    with multiprocessing.get_context("fork").Pool(min(files, len(os.sched_getaffinity(0)))) as pool:
        made = pool.map(_gen_file, jobs)
    paths = [p for p, _ in made]
    with open(os.path.join(corpus, "text-bytes.json"), "w") as fh:
        json.dump({os.path.basename(p): b for p, b in made}, fh)
    log(f"generated {files} files x {mb_per_file:g} MB of text in {time.time() - t0:.0f} s")
    info = scan_all({"train": paths, "validation": []})
    atomic_write_json(man, {"version": 1, "source": "bench", "subset": "en", "root": corpus,
                            "splits": {"train": [{k: f[k] for k in ("name", "path", "bytes", "documents")}
                                                 for f in info["train"]], "validation": []},
                            "documents": {"train": sum(f["documents"] for f in info["train"])}})
    return man, tok_dir


_PARS: list[str] = []


def _gen_file(job: tuple[str, int, int]) -> tuple[str, int]:
    """Write one C4-layout file of about ``target`` characters of text; deterministic from its seed."""
    path, target, seed = job
    rng = random.Random(seed)
    n = j = nbytes = 0
    with gzip.open(path + ".tmp", "wt", compresslevel=1, encoding="utf-8") as fh:
        while n < target:
            # a C4-sized document (~2 kB): a few paragraphs drawn at random, in random order
            text = "\n".join(rng.choice(_PARS) for _ in range(rng.randint(1, 6)))
            fh.write(json.dumps({"text": text, "timestamp": "2019-04-25T12:57:54Z",
                                 "url": f"https://example.org/bench/{j}"}) + "\n")
            n += len(text)
            nbytes += len(text.encode("utf-8"))
            j += 1
    os.replace(path + ".tmp", path)
    return path, nbytes


def subset_manifest(man: str, k: int, out: str) -> str:
    with open(man) as fh:
        m = json.load(fh)
    m["splits"]["train"] = m["splits"]["train"][:k]
    m["documents"] = {"train": sum(f["documents"] for f in m["splits"]["train"])}
    with open(out, "w") as fh:
        json.dump(m, fh)
    return out


# ---------------------------------------------------------------------------------------------- runners

def _cpu_s() -> float:
    a = resource.getrusage(resource.RUSAGE_SELF)
    b = resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def run_ours(args: argparse.Namespace) -> dict:
    """(child) our convert_dataset with N workers; prints a JSON result line."""
    from llmpipe.config.schema import fill_defaults
    from llmpipe.steps.mds_units import convert_dataset

    out = args.out_dir
    shutil.rmtree(out, ignore_errors=True)
    # the settings asked, the rest the schema's defaults (as a validated workflow config has them)
    cfg = fill_defaults({"dispatch": {"executor": "local", "state_dir": os.path.join(out + "-state"), "poll_s": 0.2},
                         "data_prep": {"compression": "zstd", "size_limit": 1 << 26, "workers": args.n},
                         "data_resources": {"time_min": 600}})
    c0 = _cpu_s()
    e0 = time.time()
    t0 = time.perf_counter()
    m = convert_dataset(args.manifest, args.tok, args.concat, EOS, out, config=cfg, log_dir=out + "-logs",
                        batch_chars=args.batch_chars)
    wall = time.perf_counter() - t0
    e1 = time.time()
    tr = m["splits"]["train"]
    tm = [u["timings"] for u in tr["units"]]
    tokenizer_load_sum = sum(t["tokenizer_ready"] - t["start"] for t in tm)
    # where the time outside the units' own conversion goes (epoch timestamps from each unit's record)
    phases = {
        "spawn_s": min(t["start"] for t in tm) - e0,  # call start -> first unit starts (worker process up)
        "tokenizer_s": tokenizer_load_sum / len(tm),
        "tail_s": e1 - max(t["end"] for t in tm),  # last unit ends -> call returns (exit, merge, manifest)
    }
    # the units' own seconds by phase (summed over units): which part slows down when workers run side by side
    for ph in ("encode", "pack", "write"):
        phases[f"{ph}_s_sum"] = sum((u.get("phase_seconds") or {}).get(ph, 0.0) for u in tr["units"])
    unit_s_sum = sum(u["seconds"] for u in tr["units"])
    phases["read_s_sum"] = (unit_s_sum - sum(phases[f"{ph}_s_sum"] for ph in ("encode", "pack", "write"))
                            - tokenizer_load_sum)
    # the units' processes by getrusage: CPU seconds in user / kernel mode, minor page faults, preemptions
    for k in ("user_s", "sys_s", "minflt", "nivcsw"):
        phases[f"{k}_sum"] = sum((u.get("rusage") or {}).get(k, 0) for u in tr["units"])
    return {"wall_s": wall, "cpu_s": _cpu_s() - c0, "tokens": tr["tokens"], "samples": tr["samples"],
            "documents": tr["documents"], "files": len(tr["units"]),
            "unit_s_sum": unit_s_sum, "workers_used": m["workers"], **phases}


def run_foundry(args: argparse.Namespace) -> dict:
    """(child) llm-foundry's convert_dataset_json on the same files, as a user would call it."""
    with open(args.manifest) as fh:
        files = [f["path"] for f in json.load(fh)["splits"]["train"]]
    src = args.out_dir + "-input"
    shutil.rmtree(src, ignore_errors=True)
    os.makedirs(src)
    for p in files:  # the folder the user points --path at
        os.symlink(p, os.path.join(src, os.path.basename(p)))
    out = args.out_dir
    shutil.rmtree(out, ignore_errors=True)
    from llmfoundry.command_utils import convert_dataset_json

    c0 = _cpu_s()
    t0 = time.perf_counter()
    convert_dataset_json(path=src, out_root=out, compression="zstd", concat_tokens=args.concat, split="train",
                         tokenizer=args.tok, bos_text="", eos_text=EOS, no_wrap=False, num_workers=None)
    wall = time.perf_counter() - t0
    with open(os.path.join(out, "index.json")) as fh:
        samples = sum(s["samples"] for s in json.load(fh)["shards"])
    with open(args.manifest) as fh:
        docs = sum(f["documents"] for f in json.load(fh)["splits"]["train"])
    return {"wall_s": wall, "cpu_s": _cpu_s() - c0, "tokens": samples * args.concat, "samples": samples,
            "documents": docs, "files": len(files), "unit_s_sum": wall}


def text_bytes(manifest: str) -> int:
    """UTF-8 bytes of document text in the files of a bench manifest."""
    with open(manifest) as fh:
        m = json.load(fh)
    with open(os.path.join(m["root"], "text-bytes.json")) as fh:
        sizes = json.load(fh)
    return sum(sizes[f["name"]] for f in m["splits"]["train"])


def child(kind: str, manifest: str, tok: str, concat: int, n: int, out_dir: str, env_extra: dict,
          batch_chars: int = 0) -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT + os.pathsep +
               os.environ.get("PYTHONPATH", ""), **env_extra)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--manifest", manifest, "--tok", tok,
           "--concat", str(concat), "--n", str(n), "--out-dir", out_dir, "--batch-chars", str(batch_chars)]
    r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    if r.returncode:
        raise SystemExit(f"{kind} run failed (rc {r.returncode})")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    res["text_bytes"] = text_bytes(manifest)
    return res


# ---------------------------------------------------------------------------------------------- main

FIELDS = ["impl", "workers", "files", "documents", "text_mb", "tokens", "samples", "wall_s", "cpu_s",
          "tokens_per_s", "tokens_per_s_per_core", "text_mb_per_s_per_core", "tokens_per_cpu_s", "unit_s_sum", "tokens_per_unit_s", "spawn_s", "tokenizer_s", "tail_s", "encode_s_sum", "pack_s_sum", "write_s_sum", "read_s_sum", "user_s_sum", "sys_s_sum", "minflt_sum", "nivcsw_sum", "batch_chars", "variant", "repeat", "speedup", "efficiency", "per_core_vs_foundry", "conversion_vs_foundry", "cpus", "host"]


def sorted_rows(rows: list[dict]) -> list[dict]:
    order = {"llm-foundry": 0, "ours-same-input": 1, "ours": 2}
    return sorted(rows, key=lambda r: (order.get(r["impl"], 3), int(r["workers"]), int(r.get("repeat") or 0)))


def write_csv(path: str, rows: list[dict]) -> None:
    rows = sorted_rows(rows)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    os.replace(path + ".tmp", path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="1,2,4,8,16", help="comma-separated worker counts for our converter")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "mds-throughput.csv"))
    ap.add_argument("--files", type=int, default=16, help="generated train files (units)")
    ap.add_argument("--mb-per-file", type=float, default=48.0, help="MB of text per generated file")
    ap.add_argument("--foundry-files", type=int, default=1, help="files llm-foundry converts (0 = all)")
    ap.add_argument("--no-foundry", action="store_true", help="skip the llm-foundry run")
    ap.add_argument("--no-same-input", dest="same_input", action="store_false",
                    help="skip running ours (1 worker) on exactly the files llm-foundry converted")
    ap.add_argument("--append", action="store_true",
                    help="keep the rows already in --out (e.g. a sweep split over two commands); speedups use "
                         "the 1-worker row found there when this run has none")
    ap.add_argument("--concat", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch-chars", type=int, default=0,
                    help="characters per tokenizer call in our converter (0: llmpipe.data.mds.BATCH_CHARS)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run our worker sweep this many times; each pass divides by its own 1-worker wall time and "
                         "the summary gives the median speedup per worker count (for machines whose per-core speed "
                         "drifts between minutes, see benchmarks/README.md)")
    ap.add_argument("--variant", default="", help="a label for the CSV's variant column (e.g. an environment tried)")
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--work-dir", default=os.environ.get("BENCH_WORK", "/tmp/llmpipe-bench"))
    ap.add_argument("--child", choices=["ours", "foundry"], help=argparse.SUPPRESS)
    ap.add_argument("--manifest", help=argparse.SUPPRESS)
    ap.add_argument("--tok", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        res = run_ours(args) if args.child == "ours" else run_foundry(args)
        print(json.dumps(res))
        return

    if args.repeat < 1 or (args.repeat > 1 and "1" not in [w.strip() for w in args.workers.split(",")]):
        ap.error("--repeat must be >= 1, and with --repeat > 1 --workers must include 1 (each pass's base)")
    if not args.batch_chars:
        from llmpipe.data.mds import BATCH_CHARS

        args.batch_chars = BATCH_CHARS  # resolved once: the children and the CSV get the same number
    t_start = time.time()
    os.makedirs(args.work_dir, exist_ok=True)
    man, tok = make_inputs(args.work_dir, args.files, args.mb_per_file, args.vocab, args.seed)
    cpus = len(os.sched_getaffinity(0))
    host = os.uname().nodename
    workers = [int(w) for w in args.workers.split(",") if w.strip()]
    rows: list[dict] = []
    if args.append and os.path.exists(args.out):
        with open(args.out) as fh:
            rows = [r for r in csv.DictReader(fh)]
        ran = set(workers)
        rows = [r for r in rows if not (r["impl"] == "ours" and int(r["workers"]) in ran)
                and not (r["impl"] == "llm-foundry" and not args.no_foundry)]
    foundry = next((r for r in rows if r["impl"] == "llm-foundry"), None)
    base = next((r for r in rows if r["impl"] == "ours" and int(r["workers"]) == 1), None)

    def make_row(impl: str, n: int, r: dict) -> dict:
        if r.get("workers_used") and int(r["workers_used"]) != n:  # convert_dataset caps workers at the units
            log(f"note: {n} workers asked, {r['workers_used']} ran (one per unit at most); the row says "
                f"{r['workers_used']}")
            n = int(r["workers_used"])
        return {"impl": impl, "workers": n, "files": r["files"], "documents": r["documents"],
                "text_mb": round(r["text_bytes"] / 1e6, 3), "tokens": r["tokens"], "samples": r["samples"], "wall_s": round(r["wall_s"], 3),
                "cpu_s": round(r["cpu_s"], 3), "tokens_per_s": round(r["tokens"] / r["wall_s"]),
                "tokens_per_s_per_core": round(r["tokens"] / (r["wall_s"] * n)),
                "text_mb_per_s_per_core": round(r["text_bytes"] / 1e6 / (r["wall_s"] * n), 3),
                "tokens_per_cpu_s": round(r["tokens"] / r["cpu_s"]) if r["cpu_s"] else "",
                "unit_s_sum": round(r["unit_s_sum"], 3), "tokens_per_unit_s": round(r["tokens"] / r["unit_s_sum"]),
                **{k_: round(r[k_], 3) if k_ in r else "" for k_ in ("spawn_s", "tokenizer_s", "tail_s", "encode_s_sum",
                                                                   "pack_s_sum", "write_s_sum", "read_s_sum",
                                                                   "user_s_sum", "sys_s_sum", "minflt_sum",
                                                                   "nivcsw_sum")},
                "batch_chars": args.batch_chars if impl != "llm-foundry" else "",
                "variant": args.variant,
                "speedup": "", "efficiency": "", "per_core_vs_foundry": "", "conversion_vs_foundry": "",
                "cpus": cpus, "host": host}

    def vs_foundry(d: dict) -> None:
        if foundry and d["impl"] != "llm-foundry":
            d["per_core_vs_foundry"] = round(float(d["tokens_per_s_per_core"]) /
                                             float(foundry["tokens_per_s_per_core"]), 3)
            d["conversion_vs_foundry"] = round(float(d["tokens_per_unit_s"]) / float(foundry["tokens_per_unit_s"]), 3)

    scratch = os.path.join(args.work_dir, "out")
    k = min(args.foundry_files or args.files, args.files)
    fman = man if k >= args.files else subset_manifest(man, k, os.path.join(args.work_dir, f"manifest-first{k}.json"))
    if not args.no_foundry:
        log(f"llm-foundry convert_dataset_json on {k} file(s)")
        rf = child("foundry", fman, tok, args.concat, 1, os.path.join(scratch, "foundry"),
                   {"HF_DATASETS_CACHE": os.path.join(scratch, "hf-datasets-cache")})
        shutil.rmtree(os.path.join(scratch, "hf-datasets-cache"), ignore_errors=True)
        shutil.rmtree(os.path.join(scratch, "foundry"), ignore_errors=True)
        foundry = make_row("llm-foundry", 1, rf)
        rows.append(foundry)
        log(", ".join(f"{k_}={v}" for k_, v in foundry.items()))
        write_csv(args.out, rows)
        for d in rows:
            vs_foundry(d)
    if args.same_input and k < args.files:
        log(f"ours, 1 worker, on the same {k} file(s) as llm-foundry")
        d = make_row("ours-same-input", 1, child("ours", fman, tok, args.concat, 1,
                                                 os.path.join(scratch, "ours-same"), {}, args.batch_chars))
        vs_foundry(d)
        rows.append(d)
        write_csv(args.out, rows)
        shutil.rmtree(os.path.join(scratch, "ours-same"), ignore_errors=True)
    # 1 worker first (the base of the speedups), then the largest counts: if a time limit cuts the run short,
    # the rows that matter most are already in the CSV. With --repeat, each pass has its own 1-worker base.
    for rep in range(args.repeat):
        for n in sorted(workers, key=lambda w: (w != 1, -w)):
            log(f"ours, {n} worker(s), {args.files} files" + (f", pass {rep + 1}/{args.repeat}" if args.repeat > 1
                                                               else ""))
            d = make_row("ours", n, child("ours", man, tok, args.concat, n, os.path.join(scratch, f"ours-{n}"), {},
                                          args.batch_chars))
            shutil.rmtree(os.path.join(scratch, f"ours-{n}"), ignore_errors=True)
            d["repeat"] = rep
            n = int(d["workers"])
            if n == 1:
                base = d
            if base:
                d["speedup"] = round(float(base["wall_s"]) / d["wall_s"], 3)
                d["efficiency"] = round(d["speedup"] / n, 3)
            vs_foundry(d)
            rows.append(d)
            log(", ".join(f"{k_}={v}" for k_, v in d.items()))
            write_csv(args.out, rows)  # after every row: a run cut short still leaves its results
    log(f"wrote {args.out} ({time.time() - t_start:.0f} s in all)")
    print(summary(rows))


#: C4 en train: 1024 files, ~365 M documents, ~156 B tokens (C4 paper, T5 tokenizer); used for the estimate.
C4_TRAIN_TOKENS = 156e9


def summary(rows: list[dict]) -> str:
    """A markdown table of the rows and the full-C4 estimate from the measured per-core rates."""
    cols = ["impl", "workers", "files", "tokens", "wall_s", "tokens_per_s_per_core", "text_mb_per_s_per_core",
            "speedup", "efficiency", "per_core_vs_foundry"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in sorted_rows(rows):
        out.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    ours = [r for r in rows if r["impl"] == "ours"]
    passes = {int(r.get("repeat") or 0) for r in ours}
    if len(passes) > 1:
        out.append("")
        for n in sorted({int(r["workers"]) for r in ours}):
            sp = sorted(float(r["speedup"]) for r in ours
                        if int(r["workers"]) == n and r.get("speedup") not in ("", None))
            if sp:
                med = statistics.median(sp)
                out.append(f"- {n} worker(s): median speedup {med:.3f} (efficiency {med / n:.3f}) over {len(sp)} "
                           f"pass(es); range {sp[0]:.3f}-{sp[-1]:.3f}")
    if ours:
        worst = min(float(r["tokens_per_s_per_core"]) for r in ours)
        best = max(float(r["tokens_per_s_per_core"]) for r in ours)
        out.append("")
        for cores in (16, 64, 256, 1024):
            out.append(f"- full C4 en train (~{C4_TRAIN_TOKENS / 1e9:.0f} B tokens) on {cores} cores: "
                       f"{C4_TRAIN_TOKENS / (best * cores) / 3600:.1f} h at {best:,.0f} tokens/s/core "
                       f"({C4_TRAIN_TOKENS / (worst * cores) / 3600:.1f} h at the lowest measured "
                       f"{worst:,.0f})")
    return "\n".join(out)


if __name__ == "__main__":
    main()
