"""The evaluation's time plan, from the batches it will run.

An evaluation is a start (job start, imports, model load, the datasets' build) and then, evaluator after evaluator
(an ICL task at one shot count, or the held-out split), its batches. Each batch costs

    batch_s + forward FLOPs / forward rate                       (+ new tokens x n_layers x decode_s_per_layer)

* ``forward FLOPs``: rows x width x a third of :func:`llmpipe.model.mfu.flops_per_token` at that width (llm-foundry's
  count, attention at the batch's own width), with the batch shapes of
  :func:`llmpipe.evaluation.icl_tokens.batch_shapes`: the same function whose token sum ``eval.json`` records as
  ``tokens_planned`` and checks against the tokens run.
* ``forward rate``: on a GPU, ``forward_mfu`` x the GPU's dense bf16 peak (:func:`llmpipe.model.mfu.peak_flops_for_name`);
  on the CPU, the basis's measured ``forward_flops_per_s``.
* ``batch_s``: what a batch costs besides its FLOPs (the dataloader, collation, metric updates, kernel launches).
* the last term for generation tasks only: llm-foundry generates up to its dataset's longest answer
  (``max_new_tokens``) for every batch; ``decode_s_per_layer`` is one decoding step of one transformer block. A
  model that stops early (EOS or the task's stop sequences on every row) takes less: the plan is the bound.

With several processes the batches are dealt to the ranks, which run at once: the sum divides by the world size.

The start is ``start_s + load_s_per_param x parameters`` (the model's load grows with it). The constants are per
device class (``h200``, ``cpu``) in ``benchmarks/eval-plan-basis.json``, fitted by ``tools/calibrate_eval_plan.py``
to committed benchmark rows (each constant's rows are named there). Another GPU type gets the ``h200`` constants
with its own bf16 peak, and the plan's text names the row that served it (``eval-plan-basis.json: its h200 row at the
h100 bf16 peak``).

This module imports without torch and takes explicit arguments, never the workflow config.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from llmpipe.model.mfu import flops_per_token, mpt_param_count, peak_flops_for_name

#: The committed constants of the plan (module docstring), written by ``tools/calibrate_eval_plan.py``.
EVAL_PLAN_BASIS_JSON = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                    "benchmarks", "eval-plan-basis.json")
#: The constants' names, in the order of the fit's columns.
RATE_KEYS = ("batch_s", "forward_s_per_flop", "decode_s_per_layer")


@dataclass(frozen=True)
class EvaluatorWork:
    """What one evaluator runs: ``batches`` as ``(rows, width)`` pairs over all ranks (width in tokens, padding
    included) and, for a generation task, ``new_tokens``: the tokens generated per batch (llm-foundry's
    ``max_new_tokens``, the dataset's longest answer); 0 otherwise. ``forwards``: the model's forwards as
    ``(rows, width, attended columns)`` (:func:`llmpipe.evaluation.icl_tokens.forward_shapes`); empty (the held-out
    split): one ``(rows, width, width)`` per batch."""

    label: str
    batches: tuple[tuple[int, int], ...]
    new_tokens: int = 0
    world_size: int = 1
    forwards: tuple[tuple[int, int, int], ...] = ()

    @property
    def runs(self) -> tuple[tuple[int, int, int], ...]:
        """The forwards the model runs, ``(rows, width, attended)`` each (:attr:`forwards`, else the batches)."""
        return self.forwards or tuple((r, w, w) for r, w in self.batches)

    @property
    def tokens(self) -> int:
        """Input tokens of all batches (rows x width summed): ``eval.json``'s ``tokens_planned``."""
        return sum(r * w for r, w in self.batches)


def icl_work(label: str, task_type: str, tokens: Sequence, max_seq_len: int, batch_size: int, icl_batches: str,
             world_size: int = 1) -> EvaluatorWork:
    """The :class:`EvaluatorWork` of one ICL task at one shot count.

    Args:
        tokens: :func:`llmpipe.evaluation.icl_tokens.item_tokens` of its items, contexts counted.
        max_seq_len, batch_size, icl_batches, world_size: as :func:`llmpipe.evaluation.icl_tokens.batch_shapes`.

    Raises:
        ValueError: as :func:`llmpipe.evaluation.icl_tokens.batch_shapes`.
    """
    from llmpipe.evaluation.icl_tokens import batch_shapes, forward_shapes

    shapes = batch_shapes(task_type, tokens, max_seq_len, batch_size, icl_batches, world_size)
    new = max((t.answer[0] for t in tokens), default=0) if task_type == "generation_task_with_answers" else 0
    forwards = forward_shapes(task_type, tokens, max_seq_len, batch_size, icl_batches, world_size)
    return EvaluatorWork(label, tuple(shapes), int(new), max(1, int(world_size)), tuple(forwards))


def task_works(label: str, task: Mapping, items: Sequence[Mapping], encoder, shots: Sequence[int], max_seq_len: int,
               batch_size: int, icl_batches: str, world_size: int = 1,
               fewshot: str = "drawn") -> list[EvaluatorWork] | None:
    """The :class:`EvaluatorWork` of one ICL task at each of its ``shots`` (labels ``<label>/<k>-shot``), or None when
    an answer leaves no context token (the evaluation leaves the task out:
    :func:`llmpipe.evaluation.icl_tokens.task_fits`).

    Args:
        task: the task as handed to llm-foundry (``icl_task_type`` and its keys).
        items: the items it is scored on, in file order.
        encoder: the evaluation's tokenizer (:class:`llmpipe.evaluation.icl_tokens.Encoder`).
        fewshot: as :func:`llmpipe.evaluation.icl_tokens.item_tokens` (``mean`` in the dry run).
        max_seq_len, batch_size, icl_batches, world_size: as :func:`icl_work`.

    Raises:
        ValueError: as :func:`llmpipe.evaluation.icl_tokens.item_tokens` and :func:`icl_work`.
    """
    from llmpipe.evaluation.icl_tokens import context_fit, item_tokens

    ttype = task["icl_task_type"]
    out = []
    for k in shots:
        tokens = item_tokens(task, items, encoder, num_fewshot=int(k), fewshot=fewshot)
        if context_fit(ttype, tokens, max_seq_len)["items_too_long"]:
            return None
        out.append(icl_work(f"{label}/{int(k)}-shot", ttype, tokens, max_seq_len, batch_size, icl_batches,
                            world_size))
    return out


def heldout_work(batches: int, batch_size: int, seq_len: int, world_size: int = 1) -> EvaluatorWork:
    """The held-out split's evaluator: ``batches`` full batches of ``batch_size`` sequences of ``seq_len`` tokens
    (none for ``batches`` <= 0: the split's size is unknown before it is built)."""
    return EvaluatorWork("eval", ((int(batch_size), int(seq_len)),) * max(0, int(batches)), 0,
                         max(1, int(world_size)))


def forward_flops(arch: Mapping, work: EvaluatorWork, prefixes: bool = True) -> float:
    """Forward FLOPs of ``work``'s forwards (:attr:`EvaluatorWork.runs`; with ``prefixes`` False one per batch):
    rows x width x ``flops_per_token(arch, attended) / 3`` summed (llm-foundry's training count,
    ``llmpipe.model.mfu``, of which the forward is a third; its attention term at the columns a token attends to)."""
    runs = work.runs if prefixes else tuple((r, w, w) for r, w in work.batches)
    return sum(r * w * flops_per_token(arch, a) / 3 for r, w, a in runs)


def features(arch: Mapping, work: EvaluatorWork, prefixes: bool = True) -> tuple[float, float, float]:
    """The three quantities the constants multiply (:data:`RATE_KEYS`): forwards, forward FLOPs, and decoding
    steps x blocks (``len(batches) x new_tokens x n_layers``); all over every rank. ``prefixes`` False counts one
    forward per batch (the shared prefixes' forwards ignored)."""
    n = len(work.batches)
    forwards = len(work.runs) if prefixes else n
    return float(forwards), forward_flops(arch, work, prefixes), float(n * work.new_tokens * int(arch["n_layers"]))


@dataclass(frozen=True)
class DeviceBasis:
    """One device class's constants: ``start_s`` (s per job), ``batch_s`` (s per batch), ``forward_s_per_flop``
    (s per forward FLOP on the basis device: 1 / (forward MFU x its bf16 peak), or 1 / measured FLOP/s on the CPU),
    ``decode_s_per_layer`` (s per decoding step and block), the ``device`` class and its bf16 peak in FLOP/s (None
    for the CPU), ``source`` (the file's base name) and ``load_s_per_param`` (s per model parameter added to the
    start)."""

    device: str
    start_s: float
    batch_s: float
    forward_s_per_flop: float
    decode_s_per_layer: float
    peak_flops: float | None = None
    source: str = ""
    load_s_per_param: float = 0.0

    def for_gpu(self, gpu_type: str, peak_overrides: Mapping[str, float] | None = None) -> DeviceBasis | None:
        """The constants on ``gpu_type``: the forward rate scaled by its bf16 peak over the basis device's (the same
        forward MFU), ``source`` naming the row that serves it; None without a known peak."""
        if self.peak_flops is None:
            return self
        peak = peak_flops_for_name(str(gpu_type).replace("-", " "), "bf16", peak_overrides)
        if not peak:
            return None
        return DeviceBasis(str(gpu_type), self.start_s, self.batch_s, self.forward_s_per_flop * self.peak_flops / peak,
                           self.decode_s_per_layer, peak, f"{self.source}: its {self.device} row at the {gpu_type} "
                           f"bf16 peak", self.load_s_per_param)

    @property
    def forward_mfu(self) -> float | None:
        """The forward MFU the constants stand for (None on the CPU)."""
        return None if self.peak_flops is None else 1.0 / (self.forward_s_per_flop * self.peak_flops)


@functools.lru_cache(maxsize=4)
def _read_basis(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        return None


def load_basis(device: str, path: str = EVAL_PLAN_BASIS_JSON,
               peak_overrides: Mapping[str, float] | None = None) -> DeviceBasis | None:
    """The constants of device class ``device`` (``cpu``, or a GPU type: its own entry, else the ``h200`` entry
    scaled by :meth:`DeviceBasis.for_gpu` with ``peak_overrides``, the config's ``gpu_peak_flops``) from ``path``;
    None when the file or a usable entry is missing (or the GPU type's peak is unknown)."""
    raw = _read_basis(path)
    if not raw:
        return None
    devices = raw["devices"]
    key = "cpu" if device == "cpu" else (str(device) if str(device) in devices else "h200")
    if key not in devices:
        return None
    d = devices[key]
    basis = DeviceBasis(key, *(float(d[k]["value"]) for k in ("start_s",) + RATE_KEYS),
                        peak_flops=d.get("peak_flops"), source=os.path.basename(path),
                        load_s_per_param=float((d.get("load_s_per_param") or {}).get("value", 0.0)))
    return basis if key == device or device == "cpu" else basis.for_gpu(device, peak_overrides)


def plan_seconds(arch: Mapping, works: Sequence[EvaluatorWork], basis: DeviceBasis) -> dict:
    """The planned duration of an evaluation that runs ``works`` with the constants ``basis``.

    Returns:
        ``{"seconds": start + batches, "start_s" (with the model's load), "batches_s" (first to last eval batch, what ``eval.json``'s
        ``timing.batches_s`` measures), "evaluators_s": {label: s}, "tokens": input tokens, "batches": count,
        "basis": one line naming the constants and their file}``. Seconds of several ranks are divided by the world
        size (they run at once). On a GPU shared prefixes count as their forwards (:attr:`EvaluatorWork.runs`); on
        the CPU as the trimmed batches they are (measured no faster there).
    """
    per: dict[str, float] = {}
    # on the CPU the prefix path's second forward, cache copies and logits assembly cost about what the shared
    # prefix saves (benchmarks/icl-eval-cpu-mpt-tiny.json: 0.89x of trimmed), so its batches count as trimmed ones
    prefixes = basis.forward_mfu is not None
    for w in works:
        n, flops, steps = features(arch, w, prefixes)
        per[w.label] = (n * basis.batch_s + flops * basis.forward_s_per_flop + steps * basis.decode_s_per_layer
                        ) / w.world_size
    batches_s = sum(per.values())
    start = basis.start_s + basis.load_s_per_param * mpt_param_count(arch)["total"]
    rate = (f"forward at MFU {basis.forward_mfu:.3f} of {basis.device} bf16 peak" if basis.forward_mfu is not None
            else f"forward at {1 / basis.forward_s_per_flop / 1e9:.1f} GFLOP/s (CPU)")
    n_batches = sum(len(w.batches) for w in works)
    tokens = sum(w.tokens for w in works)
    text = (f"start {start:.0f} s + {len(works)} evaluator(s), {n_batches} batches, {tokens:.3g} tokens: "
            f"{rate}, {basis.batch_s * 1e3:.0f} ms per batch"
            + (f", {basis.decode_s_per_layer * 1e3:.2f} ms per decoding step and block" if any(
                w.new_tokens for w in works) else "") + f" ({basis.source})")
    return {"seconds": start + batches_s, "start_s": start, "batches_s": batches_s,
            "evaluators_s": per, "tokens": tokens, "batches": n_batches, "basis": text}


def uncounted_note(arch: Mapping, tasks: Sequence[Mapping], batch_size: int, basis: DeviceBasis,
                   world_size: int = 1) -> str:
    """What a time plan leaves out: the tasks the dry run could not count yet
    (:func:`llmpipe.evaluation.suites.uncounted_tasks`), their item scorings (items x shot counts) and a bound on
    their batches' time: each scoring as one row of the full context (the most a language-modelling or
    question-answering item runs), batched ``batch_size`` rows a batch, timed by :func:`plan_seconds` with
    ``basis``. A multiple-choice or schema item runs one such row per choice, a generation item adds its decoding:
    the text says so. Tasks with unknown items (a standard file not fetched yet) are named, without a figure.

    Returns:
        one clause for the plan line, e.g. ``"this time leaves out 2 task(s) not counted yet (task file or
        tokenizer not on disk yet): cloze_heldout 0-shot 200 items, ...: at most +12 s at one full 128-token row per
        item scoring (x its choices for multiple_choice); counted once the files exist"``.
    """
    known = [t for t in tasks if t.get("items") is not None]
    unknown = [t for t in tasks if t.get("items") is None]

    def shots(t: Mapping) -> str:
        return "/".join(str(k) for k in t["shots"]) + "-shot"

    parts = [f"{t['label']} {shots(t)} {t['items']} items" for t in known]
    parts += [f"{t['label']} {shots(t)} items unknown until its file exists" for t in unknown]
    text = (f"this time leaves out {len(tasks)} task(s) not counted yet (task file or tokenizer not on disk yet): "
            + ", ".join(parts))
    if known:
        bound = 0.0
        for seq in sorted({int(t["max_seq_len"]) for t in known}):
            rows = sum(int(t["items"]) * len(t["shots"]) for t in known if int(t["max_seq_len"]) == seq)
            full, last = divmod(rows, max(1, int(batch_size)))
            batches = ((int(batch_size), seq),) * full + (((last, seq),) if last else ())
            bound += plan_seconds(arch, [EvaluatorWork("uncounted", batches, 0, max(1, int(world_size)))],
                                  basis)["batches_s"]
        seqs = sorted({int(t["max_seq_len"]) for t in known})
        times = {"multiple_choice": "x its choices", "schema": "x its contexts",
                 "generation_task_with_answers": "+ its decoding"}
        extra = sorted({f"{times[t['icl_task_type']]} for {t['icl_task_type']}" for t in known
                        if t["icl_task_type"] in times})
        text += (f": {sum(int(t['items']) * len(t['shots']) for t in known)} item scorings, at most "
                 f"+{bound:.1f} s at one full {'/'.join(map(str, seqs))}-token row each"
                 + (f" ({'; '.join(extra)})" if extra else ""))
    if unknown:
        text += f"; +? s for {len(unknown)} task(s) of unknown size"
    return text + "; the dry run counts them once their files exist"
