"""Fit the evaluation time plan's constants (``llmpipe.plan.eval_time``) to committed rows, and check the plan on them.

Usage (from the repository root; any machine, no GPU; the task files and tokenizer the rows were measured with):

    python3 tools/calibrate_eval_plan.py fit --tokenizer results/tokenizers/bpe-builtin-docs --task-data DIR \\
        --out benchmarks/eval-plan-basis.json
    python3 tools/calibrate_eval_plan.py record-step --results DIR --run mpt-tiny --task-data DIR [--drop piqa]
        [--icl-batches padded] [--batch-size 4] --out benchmarks/eval-step-cpu-mpt-tiny-icl-bench.json

``fit`` reads the rows :data:`ROWS` names per device class. Every row's batches are rebuilt with the project's
counting (:func:`llmpipe.evaluation.icl_tokens.item_tokens` with the few-shot examples llm-foundry draws,
:func:`llmpipe.plan.eval_time.icl_work`), and a row whose recorded ``tokens_run`` differs from the rebuilt batches'
tokens is refused (another tokenizer, suite or file). Then:

* ``batch_s``, ``forward_s_per_flop`` and ``decode_s_per_layer`` are the non-negative least-squares fit, in relative
  error, of every ICL evaluator's seconds in the ``rates`` rows (``tools/bench_icl_eval.py`` records: both paths,
  every repeat; step records whose ``eval.json`` has ``timing``);
* ``start_s`` (and ``load_s_per_param`` when the ``start`` rows have models of several sizes: a least-squares line
  in the parameters) from the ``start`` rows (whole eval steps): each step's seconds minus its planned batches;
* ``checks``: the plan against every row of the device class, ``(planned - measured) / measured``: the first-to-last
  batch time of a benchmark run; the whole step of a step record, and its first-to-last batch time when its
  ``eval.json`` has ``timing``; the step against the dry run's own ``plan eval`` line when the record holds one
  (made with the constants committed when the row ran: few-shot preambles estimated, the line's rounding);
  ``in_sample`` says whether the row took part in the fit.

``record-step`` times one eval step through Snakemake (``<results>/<run>/eval.json`` with the benchmark suite and
``--task-data``'s files; a first, untimed Snakemake call makes its inputs;
the timed one runs the eval step alone: it deletes that run's ``eval.json`` and kept evaluations, so ``--results``
must be a scratch folder) and writes the step record ``fit`` reads: the command,
the step's seconds, the dry run's ``plan eval`` line just before it (``phases.plan.lines.eval``), its ``eval.json``
and the suite.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from llmpipe.atomic import atomic_write_json  # noqa: E402
from llmpipe.plan import eval_time  # noqa: E402

BENCH = os.path.join(REPO, "benchmarks")
#: Which committed rows fit which constants of which device class, and which only check the plan.
ROWS = {
    "h200": {"rates": ["icl-eval-h200-mpt-1b-random-acceptance-suite.json"],
             "start": ["acceptance-h200-mpt-1b-nokill.json", "acceptance-h200-mpt-3b.json"],
             "checks": ["acceptance-h200-mpt-1b.json", "icl-eval-h100-mpt-1b-random-partial.json",
                        "icl-eval-h100-mpt-1b-random-winogrande-control.json"],
             "why": "the rates: the only GPU benchmark with per-evaluator times of both paths (MPT-1B's shape, one "
                    "H200, bf16, 2,048 context, batch 32); the start and the model's load: the eval steps of the "
                    "older 1B acceptance record and of the 3B record (padded, batch 8), so that the newer 1B record "
                    "checks them; the nine-task benchmark on an H100 (the same bf16 peak, so the same constants) "
                    "checks all three paths, and its winogrande control padded and shared_prefix at batch 32 and 16"},
    "cpu": {"rates": ["eval-step-cpu-mpt-tiny-icl-bench.json", "eval-step-cpu-mpt-tiny-icl-bench-padded-b4.json"],
            "start": ["eval-step-cpu-mpt-tiny-icl-bench.json", "eval-step-cpu-mpt-tiny-icl-bench-padded-b4.json"],
            "checks": ["eval-step-cpu-mpt-tiny-icl-bench-b16.json", "icl-eval-cpu-mpt-tiny.json",
                       "eval-step-cpu-mpt-tiny-icl-bench-shared-prefix.json",
                       "eval-step-cpu-mpt-tiny-icl-bench-trimmed-beside-shared-prefix.json"],
            "why": "two eval steps of the tiny chain (the 2-core VM, 128 context) with the benchmark suite less "
                   "piqa: trimmed at batch 8 (the shipped eval settings) and padded at batch 4, so that the batch "
                   "count and the tokens vary apart; checked on a third step (trimmed, batch 16), on the CPU "
                   "benchmark's in-process runs and on a shared_prefix step with a trimmed step run beside it, "
                   "on another day"},
}


def run_arch(run: str) -> dict:
    """The ``arch`` of ``run`` in the shipped config."""
    from llmpipe.config.runs import run_config
    from llmpipe.config.schema import load_config

    return dict(run_config(load_config(os.path.join(REPO, "config", "config.yaml")), run)["arch"])


def suite_tasks(suite_cfg: dict) -> list[dict]:
    """The tasks of a record's suite (``{"eval": {"suites": {name: {"icl_tasks": [...]}}}}``)."""
    return list(next(iter(suite_cfg["eval"]["suites"].values()))["icl_tasks"])


def works_of(tasks: list[dict], task_data: str, encoder, seq: int, batch_size: int, icl_batches: str,
             val_batches: int) -> list[eval_time.EvaluatorWork]:
    """The evaluators of one evaluation: the held-out split's ``val_batches`` batches, then each task at each shot
    count (its first ``subset_items`` items of the file under ``task_data``) that can be scored in the context."""
    from llmpipe.evaluation import icl_tokens
    from llmpipe.evaluation.suites import foundry_task

    works = [eval_time.heldout_work(val_batches, batch_size, seq)]
    for t in tasks:
        items = icl_tokens.read_items(os.path.join(task_data, t["dataset_uri"]))
        if t.get("subset_items") is not None:
            items = items[: int(t["subset_items"])]
        works.extend(eval_time.task_works(t["label"], foundry_task(t), items, encoder, t.get("num_fewshot", [0]),
                                          int(t.get("max_seq_len") or seq), batch_size, icl_batches) or [])
    return works


def observations(path: str, task_data: str, encoder) -> list[dict]:
    """One observation per evaluation in a committed row (every path; ``shared_prefix``'s forwards are the plan's
    :func:`llmpipe.evaluation.icl_tokens.forward_shapes`): ``{"row", "kind": bench | step, "path", "arch", "works",
    "measured_s", "evaluators_s"}`` (bench: first-to-last batch seconds and per-evaluator seconds; step: the whole
    step's seconds).

    Raises:
        SystemExit: a benchmark run's recorded tokens differ from the rebuilt batches'.
    """
    with open(path, encoding="utf-8") as fh:
        rec = json.load(fh)
    tasks = suite_tasks(rec["suite"])
    out = []
    if "runs" in rec:   # tools/bench_icl_eval.py
        arch = run_arch(rec["run"])
        for r in rec["runs"]:
            # a run's own icl_batches and batch size where it records them (``PATH@N`` runs), else the record's
            works = works_of(tasks, task_data, encoder, int(rec["seq"]), int(r.get("batch_size", rec["batch_size"])),
                             r.get("icl_batches", r["path"]), 1)
            for w in works[1:]:
                if r["tokens_run"].get(w.label) != w.tokens:
                    raise SystemExit(f"{os.path.basename(path)} {r['path']} #{r['repeat']} {w.label}: recorded "
                                     f"{r['tokens_run'].get(w.label)} tokens, the rebuilt batches {w.tokens}: another "
                                     f"tokenizer, suite or task file than the row's")
            out.append({"row": os.path.basename(path), "kind": "bench", "path": r["path"], "repeat": r["repeat"],
                        "arch": arch, "works": works, "measured_s": float(r["batches_s"]),
                        "evaluators_s": r["evaluators_s"]})
        return out
    ev = rec["eval"]   # a step record: tools/gpu_acceptance.py or record-step
    run = ev["run"]
    val = ev["val"]
    works = works_of(tasks, task_data, encoder, int(val["seq_len"]), int(val["batch_size"]),
                     ev.get("icl_batches", "padded"), int(val["batches"]))
    out.append({"row": os.path.basename(path), "kind": "step", "path": ev.get("icl_batches", "padded"), "repeat": 1,
                "arch": run_arch(run), "works": works, "measured_s": float(rec["phases"]["eval"]["seconds"]),
                "evaluators_s": (ev.get("timing") or {}).get("evaluators_s") or {},
                "batches_s": (ev.get("timing") or {}).get("batches_s"),
                "line_s": plan_line_seconds(((rec["phases"].get("plan") or {}).get("lines") or {}).get("eval"))})
    return out


def plan_line_seconds(line: str | None) -> float | None:
    """The time of a dry run's ``plan eval`` line (``time 46 s``, ``time 1.2 minutes``, ``time 2.0 hours``:
    :func:`llmpipe.plan.memory_time.human_time`) in seconds; None without a line, a time, or for a line of an
    earlier planner (one that does not name ``eval-plan-basis.json``)."""
    m = re.search(r"; time ([0-9.]+) (s|minutes|hours|days) \(", line or "")
    if not m or os.path.basename(eval_time.EVAL_PLAN_BASIS_JSON) not in line:   # an earlier planner's line
        return None
        return None
    return float(m.group(1)) * {"s": 1, "minutes": 60, "hours": 3600, "days": 86400}[m.group(2)]


def nnls(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Non-negative least squares in relative error: every subset of the columns solved by ``numpy.linalg.lstsq``
    on the rows divided by their ``y``; the best fit whose coefficients are all non-negative."""
    import numpy as np

    a = np.array(rows) / np.array(ys)[:, None]
    b = np.ones(len(ys))
    best, best_err = [0.0] * a.shape[1], float("inf")
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            coef, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if (coef < 0).any():
                continue
            err = float(((a[:, cols] @ coef - b) ** 2).sum())
            if err < best_err:
                best_err, best = err, [0.0] * a.shape[1]
                for c, v in zip(cols, coef):
                    best[c] = float(v)
    return best


def fit(args: argparse.Namespace) -> int:
    """The ``fit`` subcommand (module docstring)."""
    from llmpipe.evaluation.icl_tokens import Encoder
    from llmpipe.model.mfu import mpt_param_count, peak_flops_for_name

    encoder = Encoder.from_folder(args.tokenizer)
    devices, checks = {}, []
    for device, chosen in ROWS.items():
        peak = None if device == "cpu" else peak_flops_for_name(device, "bf16")
        names = list(dict.fromkeys(chosen["rates"] + chosen["start"] + chosen["checks"]))
        obs = {name: observations(os.path.join(BENCH, name), args.task_data, encoder) for name in names}
        rate_obs = [o for name in chosen["rates"] for o in obs[name]]
        xs, ys = [], []
        for o in rate_obs:
            for w in o["works"][1:]:
                if o["evaluators_s"].get(w.label):
                    xs.append(list(eval_time.features(o["arch"], w)))
                    ys.append(float(o["evaluators_s"][w.label]))
        coef = dict(zip(eval_time.RATE_KEYS, nnls(xs, ys)))
        basis = eval_time.DeviceBasis(device, 0.0, *(coef[k] for k in eval_time.RATE_KEYS), peak_flops=peak)
        start_obs = [o for name in chosen["start"] for o in obs[name]]
        starts = [o["measured_s"] - eval_time.plan_seconds(o["arch"], o["works"], basis)["batches_s"]
                  for o in start_obs]
        params = [float(mpt_param_count(o["arch"])["total"]) for o in start_obs]
        if len(set(params)) > 1:   # models of several sizes: start = a + b x parameters (least squares)
            import numpy as np

            (start, load), *_ = np.linalg.lstsq(np.array([[1.0, p] for p in params]), np.array(starts), rcond=None)
            start, load = float(start), max(0.0, float(load))
        else:
            start, load = sum(starts) / len(starts), 0.0
        basis = eval_time.DeviceBasis(device, start, *(coef[k] for k in eval_time.RATE_KEYS), peak_flops=peak,
                                      load_s_per_param=load)
        rate_rows = ", ".join(chosen["rates"])
        devices[device] = {
            "rows": chosen["rates"] + chosen["start"], "why": chosen["why"], "peak_flops": peak,
            "start_s": {"value": round(start, 2), "unit": "s per eval step",
                        "derivation": f"over {', '.join(chosen['start'])}: the step's seconds minus its planned "
                                      f"batches ({', '.join(f'{s:.1f}' for s in starts)} s), "
                                      + ("least squares in the model's parameters ("
                                         + ", ".join(f"{p:.3g}" for p in params) + ")" if load else "their mean")},
            "load_s_per_param": {"value": load, "unit": "s per model parameter (added to the start)",
                                 "derivation": "the same fit" if load else "0: the start rows have one model size"},
            "batch_s": {"value": coef["batch_s"], "unit": "s per batch",
                        "derivation": f"non-negative least squares (relative error) over {len(ys)} evaluator times "
                                      f"of {rate_rows}"},
            "forward_s_per_flop": {"value": coef["forward_s_per_flop"], "unit": "s per forward FLOP",
                                   "derivation": "the same fit"
                                   + (f"; forward MFU {basis.forward_mfu:.3f} of the {device} bf16 peak"
                                      if basis.forward_mfu else
                                      f"; {1 / coef['forward_s_per_flop'] / 1e9:.1f} GFLOP/s"
                                      if coef["forward_s_per_flop"] else "")},
            "decode_s_per_layer": {"value": coef["decode_s_per_layer"], "unit": "s per decoding step and block",
                                   "derivation": "the same fit"},
        }
        in_sample = set(chosen["rates"]) | set(chosen["start"])
        for name in names:
            for o in obs[name]:
                p = eval_time.plan_seconds(o["arch"], o["works"], basis)
                pairs = [("first to last eval batch", o["measured_s"], p["batches_s"])] if o["kind"] == "bench" else [
                    ("eval step", o["measured_s"], p["seconds"])] + (
                    [("first to last eval batch", o["batches_s"], p["batches_s"])] if o.get("batches_s") else []) + (
                    [("eval step, the dry run's line", o["measured_s"], o["line_s"])] if o.get("line_s") else [])
                for what, measured, planned in pairs:
                    checks.append({"device": device, "row": name, "path": o["path"], "repeat": o["repeat"],
                                   "measured": what, "measured_s": round(measured, 2), "planned_s": round(planned, 2),
                                   "error": round((planned - measured) / measured, 3), "in_sample": name in in_sample})
    record = {
        "what": "The evaluation time plan's constants per device class (llmpipe.plan.eval_time), fitted to the "
                "committed rows each names, and the plan checked on those rows and on others (checks: error = "
                "(planned - measured) / measured).",
        "command": " ".join(["python3", "tools/calibrate_eval_plan.py", *sys.argv[1:]]),
        "tokenizer": os.path.basename(os.path.normpath(args.tokenizer)),
        "devices": devices, "checks": checks,
    }
    atomic_write_json(args.out, record)
    for c in checks:
        print(f"{c['device']:5} {c['row']:52} {c['path']:8} #{c['repeat']} {c['measured']:25} measured "
              f"{c['measured_s']:8.2f} s planned {c['planned_s']:8.2f} s {c['error']:+.0%}"
              f"{'' if c['in_sample'] else '  (not in the fit)'}")
    return 0


def record_step(args: argparse.Namespace) -> int:
    """The ``record-step`` subcommand (module docstring)."""
    results = os.path.abspath(args.results)
    target = os.path.join(results, args.run, "eval.json")
    overlay: dict = {"results_dir": results, "eval": {"icl_batches": args.icl_batches}}
    if args.batch_size:
        overlay["eval"]["batch_size"] = args.batch_size
    with open(args.suite, encoding="utf-8") as fh:
        suite_cfg = yaml.safe_load(fh)
    name = next(iter(suite_cfg["eval"]["suites"]))
    suite_cfg["eval"]["suites"][name]["icl_tasks"] = [t for t in suite_cfg["eval"]["suites"][name]["icl_tasks"]
                                                      if t["label"] not in set(args.drop)]
    overlay["eval"].update(suite_cfg["eval"], task_data={"source": "local", "local_dir": os.path.abspath(args.task_data)})
    overlay["models"] = {args.run: {"eval_suite": name}}
    extra = os.path.join(results, f"record-step-{args.run}.yaml")
    with open(extra, "w", encoding="utf-8") as fh:
        yaml.safe_dump(overlay, fh)
    if os.path.exists(target):
        os.remove(target)
    cmd = [sys.executable, "-m", "snakemake", "--cores", "all", target, "--configfile", extra,
           "--config", f"dispatch={{state_dir: {os.path.join(results, '.jobs')}}}"]
    subprocess.run(cmd, cwd=REPO, check=True)   # its inputs (and a first evaluation), untimed
    os.remove(target)
    shutil.rmtree(os.path.join(results, args.run, "kept", "eval"), ignore_errors=True)  # or it is restored, not run
    dry = subprocess.run(cmd + ["-n"], cwd=REPO, check=True, capture_output=True, text=True)
    line = next((ln for ln in (dry.stdout + dry.stderr).splitlines() if ln.startswith(f"plan eval {args.run}:")), None)
    t0 = time.time()
    subprocess.run(cmd, cwd=REPO, check=True)
    seconds = time.time() - t0
    with open(target, encoding="utf-8") as fh:
        ev = json.load(fh)
    atomic_write_json(args.out, {
        "command": " ".join(["python3", "tools/calibrate_eval_plan.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": os.environ.get("LLMPIPE_COMMIT"),
        "phases": {"plan": {"lines": {"eval": line}}, "eval": {"seconds": round(seconds, 1)}}, "suite": suite_cfg,
        "eval": ev})
    print(f"record-step: eval step of {args.run} {seconds:.1f} s; record {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse the subcommand and run it; return its exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit")
    f.add_argument("--tokenizer", required=True, help="the prepared tokenizer folder the rows were measured with")
    f.add_argument("--task-data", required=True, help="the folder the rows' dataset_uri paths are relative to")
    f.add_argument("--out", default=os.path.join(BENCH, "eval-plan-basis.json"))
    r = sub.add_parser("record-step")
    r.add_argument("--results", required=True, help="a scratch results_dir (its run's evaluations are deleted)")
    r.add_argument("--run", default="mpt-tiny")
    r.add_argument("--suite", default=os.path.join(REPO, "tools", "icl-bench-suite.yaml"))
    r.add_argument("--task-data", required=True, help="llm-foundry's scripts/ layout the suite's files are under")
    r.add_argument("--drop", action="append", default=[], help="a task label to leave out of the suite (e.g. one "
                   "whose answers do not fit the run's context); repeatable")
    r.add_argument("--icl-batches", default="trimmed", choices=("trimmed", "padded", "shared_prefix"))
    r.add_argument("--batch-size", type=int, default=None, help="eval.batch_size (default: the config's)")
    r.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    return fit(args) if args.cmd == "fit" else record_step(args)


if __name__ == "__main__":
    sys.exit(main())
