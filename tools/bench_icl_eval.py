"""ICL evaluation speed and agreement: padded against trimmed (and shared-prefix) batches (``eval.icl_batches``), one
process, one record.

Usage (from the repository root; on the GPU machine with the environment of ../shared/tools/gpu-setup.sh sourced):

    python3 tools/bench_icl_eval.py --model results/mpt-1b/hf --run mpt-1b --task-data DIR \\
        --out benchmarks/icl-eval-h200-mpt-1b.json

``DIR`` holds llm-foundry's ``scripts/`` layout at the pinned commit (as for ``tools/gpu_acceptance.py``); the suite
is ``tools/icl-bench-suite.yaml`` (nine tasks: 0-, 3-, 10- and 25-shot multiple choice, schema, language modelling,
generation; the first 300 items of each file). The evaluation is the project's own
(:func:`llmpipe.evaluation.icl_eval.evaluate` with the run's sequence length and ``--batch-size``), run
``--repeats`` times per path, the paths (``--paths``: padded, trimmed, shared_prefix; ``PATH@N`` runs a path at
batch size N, :func:`parse_variants`) alternating, padded first, in this one process (``--tasks``: a subset of the
suite; ``--attention sdpa``: every path on SDPA, :func:`register_sdpa`, restricted to one SDPA kernel by
``--sdpa-backend``); the record is rewritten after every run,
``complete: false`` until the last. Each run's record holds eval.json's ``timing`` (``to_first_batch_s``: model load
and dataset build; ``batches_s``: first to last eval batch; per evaluator seconds and tokens run; ``planned``: the
evaluation time plan's first-to-last batch seconds from the committed constants, ``llmpipe.plan.eval_time``) and
accuracies. The per-item record (a composer callback at every forward) compares the first padded run with the first
run of each other path item by item: multiple choice and schema by the choice with the best mean answer
log-likelihood (llm-foundry's rule; with the padded run's margins of the items decided differently, beside the
median margin), language modelling by every answer token being the top-1, generation by the generated text.
``by_path``: for each path but padded, ``speedup`` (mean padded ``batches_s`` / its mean ``batches_s``),
``accuracy_delta_points`` and ``agreement`` against padded; the record's top-level ``speedup``,
``accuracy_delta_points`` and ``agreement`` are trimmed's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from llmpipe.atomic import atomic_write_json  # noqa: E402

SUITE = os.path.join(REPO, "tools", "icl-bench-suite.yaml")
PER_ITEM = "llmpipe_bench_per_item"
#: per-item decisions of the current run: evaluator label -> item key -> decision
ITEMS: dict[str, dict] = {}


def register_per_item() -> str:
    """Register the composer callback that records each item's decision into this module's :data:`ITEMS`; return its
    registry name."""
    from composer.core import Callback
    from llmfoundry.registry import callbacks

    class PerItem(Callback):
        def eval_after_forward(self, state, logger) -> None:  # noqa: ARG002 - composer's callback signature
            if state.dataloader_label != "eval":   # llm-foundry's label of the held-out loader
                ITEMS.setdefault(state.dataloader_label, {}).update(item_decisions(state.batch, state.outputs))

    callbacks.register(PER_ITEM, func=PerItem)   # replaces an earlier registration, which fills another ITEMS
    return PER_ITEM


SDPA = "llmpipe_bench_sdpa"
#: attention modules the SDPA callback switched in the current run
SWITCHED: list[int] = []


def register_sdpa() -> str:
    """Register the composer callback that, at the start of each evaluation, switches the loaded model's attention
    from MPT's ``attn_impl: torch`` function to SDPA (:func:`llmpipe.model.attention.use_sdpa`) and appends the number
    of modules switched to :data:`SWITCHED`; return its registry name.

    Raises (in the run): RuntimeError when nothing was switched (not an MPT on ``attn_impl: torch``), so that a run
    asked for SDPA never measures the torch path under SDPA's name."""
    from composer.core import Callback
    from llmfoundry.registry import callbacks

    from llmpipe.model.attention import use_sdpa

    class Sdpa(Callback):
        def eval_start(self, state, logger) -> None:  # noqa: ARG002 - composer's callback signature
            n = use_sdpa(state.model)
            if not n:
                raise RuntimeError("--attention sdpa: the model has no MPT attention module on attn_impl: torch to "
                                   "switch. Fix: pass an MPT export (llmpipe's convert step), or --attention torch.")
            SWITCHED.append(n)

    callbacks.register(SDPA, func=Sdpa)
    return SDPA


def item_decisions(batch: dict, outputs) -> dict:
    """Item key (its token ids without padding) -> decision, for one (micro)batch of an ICL evaluator.

    ``outputs``: logits [rows, length, vocabulary] (right-padded task types) or the generated strings (generation).
    Decisions: the chosen choice and its margin (multiple choice, schema: ``{"choice": index, "margin": best minus
    second-best mean answer log-likelihood, nats per token, "means": every choice's mean answer log-likelihood}``,
    margin None for one choice), whether every answer token is the top-1 (language modelling), the generated text
    (generation)."""
    import torch

    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    if batch.get("mode") == "generate":
        return {tuple(ids[r][mask[r]].tolist()): outputs[r] for r in range(ids.shape[0])}
    rows = []
    for r, idx in enumerate(batch["continuation_indices"]):
        idx = torch.as_tensor(idx, device=outputs.device)
        lp = torch.log_softmax(outputs[r, idx - 1].float(), dim=-1)
        target = ids[r, idx].to(outputs.device)
        key = tuple(ids[r, : int(idx.max()) + 1].tolist())
        rows.append((key, float(lp.gather(1, target.unsqueeze(1)).mean()), bool((lp.argmax(-1) == target).all())))
    if "choice_groupings" in batch:
        out = {}
        for a, b in batch["choice_groupings"]:
            means = [row[1] for row in rows[a:b]]
            ranked = sorted(means, reverse=True)
            out[tuple(row[0] for row in rows[a:b])] = {
                "choice": means.index(ranked[0]), "margin": ranked[0] - ranked[1] if len(ranked) > 1 else None,
                "means": means}
        return out
    return {key: top1 for key, _, top1 in rows}


def heldout_split(folder: str, files: list[str]) -> str:
    """An MDS ``val`` split of 16 text samples from the task files' first items (the held-out metrics need one;
    ``val_batches`` is 1 here); return ``folder``."""
    from streaming import MDSWriter

    texts = []
    for path in files:
        with open(path) as fh:
            for line in fh:
                texts.append(json.dumps(json.loads(line)))
                if len(texts) % 4 == 0:
                    break
    with MDSWriter(out=os.path.join(folder, "val"), columns={"text": "str"}) as w:
        for i in range(16):
            w.write({"text": " ".join(texts[i % len(texts):] + texts[: i % len(texts)])})
    return folder


def parse_variants(spec: str, batch_size: int) -> list[tuple[str, str, int]]:
    """``--paths`` as (label, ``eval.icl_batches`` value, batch size) per run of a round: an entry ``PATH`` runs at
    ``batch_size``, ``PATH@N`` at N sequences per device (e.g. ``padded@16``: the reference at another batch size, a
    control of how many decisions bf16 alone changes when only the batch's shapes change).

    Raises ValueError (naming the entry) for an unknown path, a batch size that is not a positive integer, an entry
    given twice, or a first entry other than ``padded`` at ``batch_size`` (every comparison is against it)."""
    from llmpipe.evaluation.icl_batches import ICL_BATCHES

    variants = []
    for entry in (e for e in spec.split(",") if e):
        path, _, size = entry.partition("@")
        if path not in ICL_BATCHES:
            raise ValueError(f"--paths: {entry!r}: the path must be one of {', '.join(ICL_BATCHES)}")
        if size and not (size.isdigit() and int(size) > 0):
            raise ValueError(f"--paths: {entry!r}: the batch size after @ must be a positive integer")
        size_n = int(size) if size else batch_size
        label = path if size_n == batch_size else f"{path}@{size_n}"
        if any(v[0] == label for v in variants):
            raise ValueError(f"--paths: {entry!r} is given twice")
        variants.append((label, path, size_n))
    if not variants or variants[0][:2] != ("padded", "padded"):
        raise ValueError(f"--paths: the first entry must be padded at --batch-size {batch_size} (the reference)")
    return variants


def decision_of(value):
    """The comparable decision of an :func:`item_decisions` value (a choice's index without its margin)."""
    return value["choice"] if isinstance(value, dict) else value


def agreement(padded: dict, trimmed: dict) -> dict:
    """Per evaluator: items in both runs, items decided alike, and their fraction. Multiple choice and schema also
    give the padded run's margins (nats per answer token, :func:`item_decisions`): their median over the compared
    items and, sorted, those of the items decided differently, so that a difference can be told from a near-tie, and
    ``loglik_max_abs_diff``: the largest difference of one choice's mean answer log-likelihood between the two runs
    over the compared items (nats per token), the size of the numerical difference that the margins are set against."""
    out = {}
    for label in sorted(padded):
        p, t = padded[label], trimmed.get(label, {})
        common = set(p) & set(t)
        differ = [k for k in common if decision_of(p[k]) != decision_of(t[k])]
        same = len(common) - len(differ)
        row = {"items_padded": len(p), "items_trimmed": len(t), "items_compared": len(common),
               "same_decision": same, "fraction": round(same / len(common), 4) if common else None}
        margins = [p[k]["margin"] for k in common if isinstance(p[k], dict) and p[k]["margin"] is not None]
        if margins:
            row["margin_median"] = round(statistics.median(margins), 5)
            row["differing_margins"] = sorted(round(p[k]["margin"], 5) for k in differ
                                              if p[k]["margin"] is not None)
            diffs = [abs(x - y) for k in common if "means" in p[k] and "means" in t[k]
                     for x, y in zip(p[k]["means"], t[k]["means"], strict=True)]
            if diffs:
                row["loglik_max_abs_diff"] = round(max(diffs), 6)
        out[label] = row
    return out


def build_record(args, argv, settings, suite_cfg, paths: list[str], runs: list[dict], items: dict,
                 complete: bool) -> dict:
    """The benchmark's record from the runs so far. ``complete`` is False while runs are still to come (the record is
    rewritten after every run, so a run cut short keeps what finished); ``by_path`` then covers the paths that ran."""
    import torch

    from tools.gpu_acceptance import stack

    ran = [p for p in paths if any(r["path"] == p for r in runs)]
    mean = {p: statistics.mean(r["batches_s"] for r in runs if r["path"] == p) for p in ran}
    acc = {p: next(r["accuracy"] for r in runs if r["path"] == p) for p in ran}
    by_path = {p: {"speedup": round(mean["padded"] / mean[p], 3),
                   "accuracy_delta_points": {k: round(100 * (acc[p][k] - acc["padded"][k]), 3) for k in acc["padded"]},
                   "agreement": agreement(items["padded"], items[p])} for p in ran[1:]}
    record = {
        "command": " ".join(["python3", "tools/bench_icl_eval.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        "commit": os.environ.get("LLMPIPE_COMMIT"),
        "stack": stack(),
        "model": os.path.abspath(args.model), "run": args.run, "seq": int(settings.data.concat_tokens),
        "batch_size": args.batch_size, "precision": "amp_bf16" if torch.cuda.is_available() else "fp32",
        "attention": args.attention,
        "sdpa_backend": args.sdpa_backend if args.attention == "sdpa" else None,
        "complete": complete,
        "runs_planned": len(paths) * args.repeats,
        "suite": suite_cfg,
        "runs": runs,
        "by_path": by_path,
    }
    if "trimmed" in by_path:   # the record's headline keys: trimmed against padded
        record.update(by_path["trimmed"])
    return record


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write the record (module docstring); return 0."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a Hugging Face export (its tokenizer beside it)")
    ap.add_argument("--run", default="mpt-1b", help="the run whose sequence length the evaluation uses")
    ap.add_argument("--seq", type=int, default=None, help="the sequence length instead of the run's")
    ap.add_argument("--task-data", required=True, help="llm-foundry's scripts/ layout at the pinned commit")
    ap.add_argument("--suite", default=SUITE)
    ap.add_argument("--batch-size", type=int, default=32, help="eval.batch_size (sequences per device)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--paths", default="padded,trimmed,shared_prefix",
                    help="eval.icl_batches values to run, comma-separated, padded first (the reference); PATH@N runs "
                         "PATH at batch size N")
    ap.add_argument("--out", required=True)
    ap.add_argument("--attention", choices=("torch", "sdpa"), default="torch",
                    help="the export's own attention (torch: MPT's attn_impl torch) or SDPA switched in after the "
                         "model loads, for every path")
    ap.add_argument("--sdpa-backend", choices=("auto", "cudnn", "flash", "efficient", "math"),
                    default=os.environ.get("LLMPIPE_SDPA_BACKEND", "auto"),
                    help="with --attention sdpa: the SDPA kernels allowed (llmpipe.model.attention.set_sdpa_backend; "
                         "auto: PyTorch chooses); default $LLMPIPE_SDPA_BACKEND or auto")
    ap.add_argument("--tasks", default=None,
                    help="only these task labels of the suite, comma-separated (default: every task)")
    args = ap.parse_args(argv)
    try:
        variants = parse_variants(args.paths, args.batch_size)
    except ValueError as exc:
        ap.error(str(exc))
    paths = [label for label, _, _ in variants]

    from llmpipe.config.runs import run_settings
    from llmpipe.config.schema import load_config
    from llmpipe.config.stage_settings import EvalSettings
    from llmpipe.evaluation.icl_eval import evaluate

    with open(args.suite) as fh:
        suite_cfg = yaml.safe_load(fh)
    name, suite = next(iter(suite_cfg["eval"]["suites"].items()))
    if args.tasks:
        wanted = args.tasks.split(",")
        unknown = sorted(set(wanted) - {t["label"] for t in suite["icl_tasks"]})
        if unknown:
            ap.error(f"--tasks: {', '.join(unknown)} not in {args.suite} (its labels: "
                     f"{', '.join(t['label'] for t in suite['icl_tasks'])})")
        suite = dict(suite, icl_tasks=[t for t in suite["icl_tasks"] if t["label"] in wanted])
        suite_cfg = {"eval": {"suites": {name: suite}}}
    tasks = [dict(t, dataset_uri=os.path.join(os.path.abspath(args.task_data), t["dataset_uri"]))
             for t in suite["icl_tasks"]]
    settings = run_settings(load_config(os.path.join(REPO, "config", "config.yaml")), args.run)
    if args.seq:
        settings = dataclasses.replace(settings, data=dataclasses.replace(settings.data, concat_tokens=args.seq))
    extra = {register_per_item(): {}, **({register_sdpa(): {}} if args.attention == "sdpa" else {})}
    if args.attention == "sdpa":
        from llmpipe.model.attention import set_sdpa_backend

        set_sdpa_backend(args.sdpa_backend)
    runs, items = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-icl-") as scratch:
        data = heldout_split(os.path.join(scratch, "mds"), sorted({t["dataset_uri"] for t in tasks}))
        for repeat in range(args.repeats):
            for path, icl_batches, batch_size in variants:
                ITEMS.clear()
                SWITCHED.clear()
                ev = evaluate(settings, os.path.abspath(args.model), data, {t["label"]: t["dataset_uri"] for t in tasks},
                              eval_settings=EvalSettings(batch_size=batch_size, val_batches=1, icl_batches=icl_batches),
                              suite={"name": name, "icl_tasks": tasks, "eval_gauntlet": None},
                              callbacks=extra)
                items.setdefault(path, {k: dict(v) for k, v in ITEMS.items()})
                timing = ev["timing"]
                runs.append({"path": path, "icl_batches": icl_batches, "batch_size": batch_size,
                             "sdpa_modules": max(SWITCHED, default=0),
                             "repeat": repeat + 1, "seconds": ev["seconds"], **timing,
                             "tokens_run_total": sum(timing["tokens_run"].values()),
                             "accuracy": {f"{t}/{s}": r["accuracy"] for t, by in ev["tasks"].items()
                                          for s, r in by.items()},
                             "items": {f"{t}/{s}": r["items"] for t, by in ev["tasks"].items() for s, r in by.items()},
                             "items_cut": {f"{t}/{s}": r["items_cut"] for t, by in ev["tasks"].items()
                                           for s, r in by.items()}})
                planned = (timing.get("planned") or {}).get("batches_s")
                print(f"bench_icl_eval: {path} #{repeat + 1}: first to last batch {timing['batches_s']} s "
                      f"(planned {planned} s), to first batch {timing['to_first_batch_s']} s, "
                      f"{runs[-1]['tokens_run_total']} tokens", flush=True)
                atomic_write_json(args.out, build_record(args, argv, settings, suite_cfg, paths, runs, items,
                                                         complete=False))
    record = build_record(args, argv, settings, suite_cfg, paths, runs, items, complete=True)
    atomic_write_json(args.out, record)
    by_path = record["by_path"]
    for p, r in by_path.items():
        print(f"bench_icl_eval: {p}: speedup {r['speedup']}x (first to last eval batch)", flush=True)
    print(f"bench_icl_eval: record {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
