"""Token counts of ICL task items as llm-foundry 0.22's ICL datasets build them, and how each item fits the context.

llm-foundry turns every item of a task into one sequence (language modelling, generation) or one per choice
(multiple choice, schema): the preamble (``prompt_string`` and the few-shot examples, tokenized with the
tokenizer's special tokens), the item's context and its answer
(``llmfoundry/eval/datasets/in_context_learning_evaluation.py``, ``tokenize_example`` of each dataset class).
When context and answer do not fit ``max_seq_len`` it cuts the context from the left (``trim_context`` in
``llmfoundry/eval/datasets/utils.py``), silently; an answer longer than ``max_seq_len`` stops the whole
evaluation ("Dataset included continuation longer than the max seq len") without naming the task.

:func:`item_tokens` counts those tokens per item, exactly as the dataset will (same texts, same tokenizer calls,
same few-shot draw); :func:`context_fit` turns the counts into the items cut to fit and the items that cannot be
scored at all. The dry run checks answers with the run's prepared tokenizer (:meth:`Encoder.from_folder`, the Rust
``tokenizers`` library, no torch); the evaluation job counts contexts too, with the export's tokenizer. Few-shot
counts import llm-foundry (and torch) for its sampler, so they run in the job only.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

#: Constructor defaults of llm-foundry 0.22's ICL dataset classes that change the texts tokenized
#: (``InContextLearningDataset`` and its four subclasses); a task's own keys override them. The language-modelling
#: dataset always reads its answer from ``continuation``, the schema dataset from ``continuation`` and its
#: contexts from ``choices_key``.
COMMON_DEFAULTS = {"prompt_string": "", "example_delimiter": "\n", "continuation_delimiter": " ", "prelimiter": "",
                   "strip_dataset": True, "fewshot_random_seed": 1234}
TYPE_DEFAULTS = {
    "language_modeling": {"context_key": "context", "answer_key": "continuation"},
    "multiple_choice": {"context_key": "query", "choices_key": "choices"},
    "schema": {"choices_key": "context_options"},
    "generation_task_with_answers": {"context_key": "context", "answer_key": "answer", "cot_delimiter": ""},
}
#: Tokens llm-foundry adds to a generation task's longest answer when ``cot_delimiter`` is set
#: (``_MAX_ANSWER_BUFFER_LENGTH``).
COT_ANSWER_BUFFER = 10


class Encoder:
    """A tokenizer as the counts need it: ``encode(texts, special)`` -> the ids of each text (with or without
    the tokenizer's special tokens) and ``eos_token_id`` (llm-foundry drops a trailing EOS from the preamble)."""

    def __init__(self, encode: Callable[[list[str], bool], list[list[int]]], eos_token_id: int | None):
        self.encode = encode
        self.eos_token_id = eos_token_id

    @classmethod
    def from_transformers(cls, tokenizer) -> Encoder:
        """A transformers tokenizer, called as llm-foundry calls it (no truncation, no padding)."""
        def encode(texts: list[str], special: bool) -> list[list[int]]:
            if not texts:
                return []
            return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=special)["input_ids"]]
        return cls(encode, tokenizer.eos_token_id)

    @classmethod
    def from_folder(cls, tokenizer_dir: str) -> Encoder:
        """A prepared tokenizer folder (``results/tokenizers/<name>``): its ``tokenizer.json`` through the Rust
        library when the folder's probes prove it tokenizes as transformers does
        (:func:`llmpipe.data.tokenizer.load_backend`), else transformers' ``AutoTokenizer``.

        Raises:
            llmpipe.data.errors.DataError: the folder holds no loadable tokenizer.
        """
        from llmpipe.data.tokenizer import load_backend, load_tokenizer

        backend = load_backend(tokenizer_dir)
        if backend is None:
            return cls.from_transformers(load_tokenizer(tokenizer_dir))
        with open(os.path.join(tokenizer_dir, "manifest.json"), encoding="utf-8") as fh:
            eos = json.load(fh).get("eos_token_id")

        def encode(texts: list[str], special: bool) -> list[list[int]]:
            return [list(e.ids) for e in backend.encode_batch(list(texts), add_special_tokens=special)]
        return cls(encode, eos)


@dataclass(frozen=True)
class ItemTokens:
    """One item's tokens as llm-foundry builds its sequences, before any cut.

    ``context``: per sequence, the tokens before the answer (preamble + the item's context; None when not
    counted); ``answer``: per sequence, the answer's tokens (multiple choice: each choice; schema: the
    continuation after each context option; generation: the longest of the item's answer and aliases, with
    special tokens, plus :data:`COT_ANSWER_BUFFER` when ``cot_delimiter`` is set: what llm-foundry reserves for
    generating); ``category``: the item's category for ``has_categories`` tasks (each category is its own
    dataset), else None; ``shared``: the tokens every sequence of the item starts with alike, what
    ``eval.icl_batches: shared_prefix`` forwards once (multiple choice: the context; schema: the preamble; 0 for one
    sequence or when contexts are not counted).
    """

    context: tuple[int, ...] | None
    answer: tuple[int, ...]
    category: str | None = None
    shared: int = 0


def read_items(path: str) -> list[dict]:
    """The items of a jsonl task file (one JSON object per non-blank line), in file order."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def settings(task: Mapping) -> dict:
    """The dataset settings of a task that shape its texts: :data:`COMMON_DEFAULTS` and its type's
    :data:`TYPE_DEFAULTS`, overridden by the task's keys (``question_prelimiter`` is ``prelimiter``, as
    llm-foundry's ``build_icl_evaluators`` maps it)."""
    ttype = task["icl_task_type"]
    s = {**COMMON_DEFAULTS, **TYPE_DEFAULTS[ttype]}
    fixed = ("answer_key",) if ttype == "language_modeling" else ()  # the LM dataset sets it itself
    s.update({k: task[k] for k in s if k in task and k not in fixed})
    if "question_prelimiter" in task:
        s["prelimiter"] = task["question_prelimiter"]
    return s


def item_tokens(task: Mapping, items: Sequence[Mapping], encoder: Encoder, *, num_fewshot: int = 0,
                context: bool = True, fewshot: str = "drawn") -> list[ItemTokens]:
    """Tokens of each item of a task as llm-foundry 0.22's dataset for its ``icl_task_type`` builds them.

    The same texts and tokenizer calls as the dataset's ``_prep_example`` / ``tokenize_example``: fields
    stripped (``strip_dataset``), the preamble (``prompt_string`` and ``num_fewshot`` examples drawn by
    llm-foundry's own sampler with the task's ``fewshot_random_seed``, one generator per dataset, items in file
    order) with special tokens and without a trailing EOS, the context without special tokens (right-stripped,
    except schema options), the answer with a leading space when the tokenizer needs one
    (``tokenizer_needs_prefix_space``). ``has_categories`` tasks are split by ``category`` as llm-foundry
    partitions them (sorted categories, each its own few-shot pool and generator). Used for the items cut to fit
    and the items that cannot be scored (:func:`context_fit`), and for the tokens an evaluation runs.

    Args:
        task: the task as handed to llm-foundry (``icl_task_type`` and its keys).
        items: the task's items in file order (:func:`read_items` of the file llm-foundry reads).
        encoder: the tokenizer the evaluation uses (:class:`Encoder`).
        num_fewshot: shot count; above 0 imports llm-foundry (and torch) for its few-shot sampler.
        context: False counts answers only (``ItemTokens.context`` is None): what the dry run checks.
        fewshot: ``drawn`` (the examples llm-foundry's sampler draws: exact, imports llm-foundry when
            ``num_fewshot`` > 0) or ``mean`` (every preamble counted as ``prompt_string`` plus ``num_fewshot`` times
            the mean tokens of one in-context example of the dataset: an estimate without llm-foundry or torch, what
            the dry run's time plan uses).

    Returns:
        One :class:`ItemTokens` per item, in file order; counts are tokens.

    Raises:
        ValueError: an unknown task type, a ``has_categories`` item without ``category``, or an item without a
            field its task type reads (or a ``gold`` index out of its choices), naming the task and the field; or
            ``fewshot`` is neither ``drawn`` nor ``mean``.
    """
    ttype = task["icl_task_type"]
    if ttype not in TYPE_DEFAULTS:
        raise ValueError(f"ICL task {task.get('label')}: unknown icl_task_type {ttype!r}")
    if fewshot not in ("drawn", "mean"):
        raise ValueError(f"fewshot must be drawn or mean, got {fewshot!r}")
    try:
        return _item_tokens(task, ttype, settings(task), items, encoder, num_fewshot, context, fewshot)
    except (KeyError, IndexError) as exc:
        what = f"has no {exc}" if isinstance(exc, KeyError) else "has a gold index outside its choices"
        raise ValueError(f"ICL task {task.get('label')}: an item {what} (a {ttype} task reads it; llm-foundry would "
                         f"fail on it too). Fix: check the task's file and its *_key settings.") from exc


def _item_tokens(task: Mapping, ttype: str, s: dict, items: Sequence[Mapping], encoder: Encoder, num_fewshot: int,
                 context: bool, fewshot: str) -> list[ItemTokens]:
    """:func:`item_tokens` once the settings are known: the file as one dataset, or one per category."""
    if not task.get("has_categories"):
        return _dataset_tokens(ttype, s, list(items), encoder, num_fewshot, context, None, fewshot)
    groups: dict[str, list[int]] = {}
    for i, it in enumerate(items):
        if "category" not in it:
            raise ValueError(f"ICL task {task.get('label')}: has_categories is set but item {i + 1} has no "
                             f"'category'")
        groups.setdefault(it["category"], []).append(i)
    out: list[ItemTokens | None] = [None] * len(items)
    for cat in sorted(groups):
        part = _dataset_tokens(ttype, s, [items[i] for i in groups[cat]], encoder, num_fewshot, context, cat,
                               fewshot)
        for i, rec in zip(groups[cat], part):
            out[i] = rec
    return out  # type: ignore[return-value]


def _encode_unique(encoder: Encoder, texts: list[str], special: bool) -> list[list[int]]:
    uniq = list(dict.fromkeys(texts))
    ids = dict(zip(uniq, encoder.encode(uniq, special)))
    return [ids[t] for t in texts]


def _dataset_tokens(ttype: str, s: dict, items: list[Mapping], encoder: Encoder, num_fewshot: int,
                    context: bool, category: str | None, fewshot: str = "drawn") -> list[ItemTokens]:
    """:func:`item_tokens` of one llm-foundry dataset (one file, or one category of it)."""
    prefix_space = len(encoder.encode([" a"], False)[0]) == 1
    has_cot = False
    gen_answers: list[int] = []
    if ttype == "generation_task_with_answers":
        # read_dataset: the longest answer or alias, tokenized with special tokens, before the fields are stripped
        has_cot = any("chain_of_thought" in it for it in items)
        responses, owner = [], []
        for i, it in enumerate(items):
            for ans in dict.fromkeys([it[s["answer_key"]]] + list(it.get("aliases") or [])):
                responses.append(f"{it.get('chain_of_thought') or ''}{s['cot_delimiter']}{ans}" if has_cot else ans)
                owner.append(i)
        longest = [0] * len(items)
        for i, ids in zip(owner, _encode_unique(encoder, responses, True)):
            longest[i] = max(longest[i], len(ids))
        buffer = COT_ANSWER_BUFFER if s["cot_delimiter"] else 0
        gen_answers = [n + buffer for n in longest]
    if s["strip_dataset"]:
        items = [{k: v.strip() if isinstance(v, str) else v for k, v in it.items()} for it in items]

    def spaced(text: str) -> str:
        return f" {text}" if prefix_space and not text.startswith(" ") else text

    # answers: one text list per item (one per sequence)
    if ttype == "language_modeling":
        ans_texts = [[spaced(it[s["answer_key"]])] for it in items]
    elif ttype == "multiple_choice":
        ans_texts = [[spaced(c) for c in it[s["choices_key"]]] for it in items]
    elif ttype == "schema":
        ans_texts = [[spaced(it["continuation"])] * len(it[s["choices_key"]]) for it in items]
    else:
        ans_texts = []
    if ans_texts:
        flat = _encode_unique(encoder, [t for texts in ans_texts for t in texts], False)
        answers, k = [], 0
        for texts in ans_texts:
            answers.append(tuple(len(ids) for ids in flat[k:k + len(texts)]))
            k += len(texts)
    else:
        answers = [(n,) for n in gen_answers]
    if not context:
        return [ItemTokens(None, a, category) for a in answers]

    def in_context_answer(it: Mapping) -> str:
        if ttype == "multiple_choice":
            return it[s["choices_key"]][it["gold"]]
        if ttype == "generation_task_with_answers" and has_cot:
            return f"{it.get('chain_of_thought') or ''}{s['cot_delimiter']}{it[s['answer_key']]}"
        return it[s["answer_key"]]

    def construct(it: Mapping, preceding: str, add_answer: bool) -> str:
        if ttype == "schema":  # InContextLearningSchemaTaskDataset.construct_context (always with the answer)
            ctx = it[s["choices_key"]][it["gold"]]
            if preceding:
                ctx = f"{s['example_delimiter']}{ctx}"
            return f"{s['prelimiter']}{ctx}{s['continuation_delimiter']}{it['continuation']}"
        ctx = f"{s['prelimiter']}{it[s['context_key']]}"
        if preceding:
            ctx = f"{s['example_delimiter']}{ctx}"
        ctx = f"{ctx}{s['continuation_delimiter']}"
        return f"{ctx}{in_context_answer(it)}" if add_answer else ctx

    rng = random.Random(s["fewshot_random_seed"])
    mean = num_fewshot > 0 and fewshot == "mean"
    if num_fewshot > 0 and not mean:
        from llmfoundry.eval.datasets.utils import get_fewshot_sample_idxs
    preambles, ctx_texts = [], []
    for i, it in enumerate(items):
        pre = s["prompt_string"]
        if mean:
            pre += "\n"  # a stand-in for the examples: the item's context is built as after a preamble
        elif num_fewshot > 0:
            for j in get_fewshot_sample_idxs(len(items), num_fewshot, i, rng):
                pre += construct(items[j], pre, True)
        preambles.append(pre)
        if ttype == "schema":  # _construct_multiple_contexts
            if pre:
                cont_del = s["continuation_delimiter"].rstrip() if s["strip_dataset"] else s["continuation_delimiter"]
                ctx_texts.append([f"{s['prelimiter']}{s['example_delimiter']}{c}{cont_del}"
                                  for c in it[s["choices_key"]]])
            else:
                ctx_texts.append([f"{s['prelimiter']}{c}" for c in it[s["choices_key"]]])
        else:
            ctx = construct(it, pre, False)
            ctx_texts.append([ctx.rstrip() if s["strip_dataset"] else ctx])
    eos = encoder.eos_token_id

    def preamble_len(ids: list[int]) -> int:
        return len(ids) - 1 if eos is not None and len(ids) > 1 and ids[-1] == eos else len(ids)  # _fix_eos_on_preamble

    if mean:
        examples = _encode_unique(encoder, [construct(it, "\n", True) for it in items], False)
        shots = min(num_fewshot, len(items) - 1)
        estimate = preamble_len(encoder.encode([s["prompt_string"]], True)[0]) + round(
            shots * sum(map(len, examples)) / len(examples))
        pre_lens = [estimate] * len(items)
    else:
        pre_lens = [preamble_len(ids) for ids in _encode_unique(encoder, preambles, True)]
    flat = _encode_unique(encoder, [t for texts in ctx_texts for t in texts], False)
    out, k = [], 0
    for i, texts in enumerate(ctx_texts):
        ctx = tuple(pre_lens[i] + len(ids) for ids in flat[k:k + len(texts)])
        k += len(texts)
        # a multiple-choice item is one context per choice, all alike; a schema item's options share the preamble
        shared = 0
        if ttype == "multiple_choice":
            ctx = ctx * len(answers[i])
            shared = ctx[0] if len(ctx) > 1 else 0
        elif ttype == "schema" and len(ctx) > 1:
            shared = pre_lens[i]
        out.append(ItemTokens(ctx, answers[i], category, shared))
    return out


def context_fit(task_type: str, tokens: Sequence[ItemTokens], max_seq_len: int) -> dict:
    """How a task's items fit a context of ``max_seq_len`` tokens in llm-foundry 0.22.

    Language modelling, multiple choice, schema: a sequence is context + answer; when longer than
    ``max_seq_len``, llm-foundry keeps the answer and the last ``max_seq_len - answer`` context tokens
    (``trim_context``). Generation: every context of a dataset (a file, or one category) is cut to
    ``max_seq_len - A`` tokens, ``A`` its longest answer (what llm-foundry reserves for generating). An item cannot
    be scored when an answer of it leaves no context token (answer >= ``max_seq_len``): llm-foundry stops the whole
    evaluation for an answer longer than ``max_seq_len`` and builds an over-long sequence for one equal to it.

    Args:
        task_type: the task's ``icl_task_type``.
        tokens: :func:`item_tokens` of its items (with or without contexts).
        max_seq_len: the evaluation's context in tokens (the task's ``max_seq_len``, else the run's).

    Returns:
        ``{"items", "items_cut" (items with a context cut from the left; -1 when contexts were not counted),
        "items_too_long" (items that cannot be scored), "first_too_long" (1-based item number, 0 for none),
        "longest_answer_tokens", "max_seq_len"}``, all integers.
    """
    seq = int(max_seq_len)
    too_long = [i for i, t in enumerate(tokens) if max(t.answer, default=0) >= seq]
    counted = all(t.context is not None for t in tokens)
    cut = 0
    if counted and task_type == "generation_task_with_answers":
        reserved: dict[str | None, int] = {}
        for t in tokens:
            reserved[t.category] = max(reserved.get(t.category, 0), t.answer[0])
        cut = sum(1 for t in tokens if t.context[0] > seq - reserved[t.category])  # type: ignore[index]
    elif counted:
        cut = sum(1 for t in tokens if any(c + a > seq for c, a in zip(t.context, t.answer)))  # type: ignore[arg-type]
    return {"items": len(tokens), "items_cut": cut if counted else -1, "items_too_long": len(too_long),
            "first_too_long": too_long[0] + 1 if too_long else 0,
            "longest_answer_tokens": max((max(t.answer, default=0) for t in tokens), default=0), "max_seq_len": seq}


def _batches(task_type: str, tokens: Sequence[ItemTokens], max_seq_len: int, batch_size: int, icl_batches: str,
             world_size: int):
    """Yield each batch of :func:`batch_shapes` as ``(items, rows, width)``: its items, their sequences' lengths
    (one list per item) and the batch's width."""
    from llmpipe.evaluation.icl_batches import ICL_BATCHES

    if icl_batches not in ICL_BATCHES:
        raise ValueError(f"icl_batches must be one of {ICL_BATCHES}, got {icl_batches!r}")
    if any(t.context is None for t in tokens):
        raise ValueError("batch_shapes needs the items' contexts counted (item_tokens(..., context=True))")
    seq, world = int(max_seq_len), max(1, int(world_size))
    for category in sorted({t.category for t in tokens}, key=lambda c: (c is not None, c or "")):
        part = [t for t in tokens if t.category == category]
        if not part:
            continue
        if task_type == "generation_task_with_answers":
            width = seq - max(t.answer[0] for t in part)
            rows = [[min(t.context[0], width)] for t in part]  # type: ignore[index]
        else:
            width = seq
            rows = [[min(c + a, seq) for c, a in zip(t.context, t.answer)] for t in part]  # type: ignore[arg-type]
        per_batch = batch_size
        if task_type in ("multiple_choice", "schema"):
            choices = len(part[0].answer)
            per_batch = max(batch_size, choices) // choices
        order = list(range(len(rows)))
        if icl_batches != "padded":   # trimmed and shared_prefix batch alike
            order.sort(key=lambda i: (-max(rows[i]), i))
        dealt = order + order[: (-len(order)) % world]
        for rank in range(world):
            mine = dealt[rank::world]
            for b in range(0, len(mine), per_batch):
                idx = mine[b:b + per_batch]
                batch = [rows[i] for i in idx]
                yield ([part[i] for i in idx], batch,
                       width if icl_batches == "padded" else max(max(r) for r in batch))


def batch_shapes(task_type: str, tokens: Sequence[ItemTokens], max_seq_len: int, batch_size: int,
                 icl_batches: str, world_size: int = 1) -> list[tuple[int, int]]:
    """The batches an evaluation of one task at one shot count runs, over all its ``world_size`` processes, as
    ``(rows, width)`` pairs: sequences in the batch and its width in tokens (padding included).

    Each dataset (the file, or one category) is batched on its own. Sequence lengths: context + answer, at most
    ``max_seq_len`` (right-padded types; :func:`context_fit`'s cut), or the context cut to ``max_seq_len - A``
    (generation, ``A`` its longest answer). ``padded``: every row is ``max_seq_len`` (generation: ``max_seq_len -
    A``) wide. ``trimmed`` and ``shared_prefix`` (:mod:`llmpipe.evaluation.icl_batches`): items sorted by their
    longest sequence, longest first, and each batch as wide as its longest sequence. Items go to the processes as llm-foundry's
    ``DistributedSampler`` (no shuffle) deals them: item ``i`` to rank ``i mod world_size``, the list padded with its
    first items to a multiple of ``world_size``. A batch holds ``batch_size`` items (multiple choice and schema:
    ``max(batch_size, C) // C`` items of ``C`` rows, ``C`` the first item's choice count, llm-foundry's
    ``get_effective_batch_size``).

    Args:
        tokens: :func:`item_tokens` of the task's items with contexts counted, at that shot count.

    Raises:
        ValueError: contexts were not counted, or ``icl_batches`` is not one of
            :data:`llmpipe.evaluation.icl_batches.ICL_BATCHES`.
    """
    return [(sum(len(r) for r in rows), width)
            for _, rows, width in _batches(task_type, tokens, max_seq_len, batch_size, icl_batches, world_size)]


def forward_shapes(task_type: str, tokens: Sequence[ItemTokens], max_seq_len: int, batch_size: int,
                   icl_batches: str, world_size: int = 1) -> list[tuple[int, int, int]]:
    """The model forwards of those batches as ``(rows, width, attended)``: sequences, tokens forwarded per
    sequence (padding included) and the columns each attends to at most.

    One forward ``(rows, width, width)`` per batch of :func:`batch_shapes`, except with ``shared_prefix`` on one
    process for a multiple-choice or schema batch (:func:`llmpipe.evaluation.shared_prefix.prefix_logits`): the
    items' shared prefixes (``ItemTokens.shared``, each at most its item's shortest sequence less one token)
    ``(items, P, P)``, then every sequence's rest ``(rows, R, P + R)`` on their cache, ``P`` the longest prefix and
    ``R`` the longest rest; where ``P + R`` exceeds ``max_seq_len`` every item shares the batch's shortest prefix,
    and a batch with an item that shares nothing is one whole forward. Same arguments and errors as
    :func:`batch_shapes`.
    """
    prefixes = (icl_batches == "shared_prefix" and max(1, int(world_size)) == 1
                and task_type in ("multiple_choice", "schema"))
    out: list[tuple[int, int, int]] = []
    for items, rows, width in _batches(task_type, tokens, max_seq_len, batch_size, icl_batches, world_size):
        n_rows = sum(len(r) for r in rows)
        shared = [min(t.shared, min(r) - 1) for t, r in zip(items, rows)]
        if not prefixes or min(shared) <= 0:
            out.append((n_rows, width, width))
            continue
        def longest_rest(shared: list[int]) -> int:
            return max(n - p for p, r in zip(shared, rows) for n in r)

        if max(shared) + longest_rest(shared) > int(max_seq_len):
            shared = [min(shared)] * len(shared)
        top, rest = max(shared), longest_rest(shared)
        out += [(len(items), top, top), (n_rows, rest, top + rest)]
    return out


def batch_tokens(task_type: str, tokens: Sequence[ItemTokens], max_seq_len: int, batch_size: int, icl_batches: str,
                 world_size: int = 1) -> int:
    """Input tokens (padding included) of the batches an evaluation of one task at one shot count runs, summed over
    its ``world_size`` processes: what ``eval.json``'s ``timing.tokens_run`` counts for that evaluator. The sum of
    rows x width over :func:`batch_shapes` (same arguments, same errors)."""
    return sum(rows * width for rows, width in
               batch_shapes(task_type, tokens, max_seq_len, batch_size, icl_batches, world_size))


def too_long_reason(label: str, fit: Mapping, setting: str) -> str:
    """The message for a task that cannot be scored (:func:`context_fit` with ``items_too_long`` > 0):
    the task, the counts, the context's setting (``setting``) and the fix."""
    return (f"ICL task {label}: {fit['items_too_long']} of {fit['items']} items have an answer of "
            f"{fit['max_seq_len']} tokens or more (e.g. item {fit['first_too_long']}; the longest "
            f"{fit['longest_answer_tokens']} tokens), which leaves no context token in the evaluation's "
            f"{fit['max_seq_len']}-token context ({setting}); llm-foundry cannot score them (it stops with "
            f"'continuation longer than the max seq len'). Fix: drop {label} from the run's suite, or evaluate it "
            f"with a model whose context is longer than {fit['longest_answer_tokens']} tokens.")


def task_fits(tasks: Sequence[Mapping], encoder: Encoder, max_seq_len: int, setting: str, *,
              batching: tuple[int, str, int] | None = None) -> tuple[dict, dict]:
    """How each task of an llm-foundry task list fits the evaluation's context, before any model is loaded.

    Args:
        tasks: llm-foundry's ``icl_tasks`` (each with ``label``, ``icl_task_type``, ``dataset_uri`` of the file it
            reads, ``num_fewshot``).
        encoder: the evaluation's tokenizer.
        max_seq_len: the evaluation's context in tokens (a task's own ``max_seq_len`` wins).
        setting: the setting that gives ``max_seq_len``, for messages (e.g. ``data.concat_tokens of mpt-tiny``).
        batching: ``(batch_size, icl_batches, world_size)``: each fit also holds ``batch_shapes``
            (:func:`batch_shapes`), ``tokens_planned``, their tokens (:func:`batch_tokens`), and
            ``forward_shapes``, the model's forwards of those batches (:func:`forward_shapes`).

    Returns:
        (``{label: {"<k>-shot": context_fit}}`` of the tasks that can be scored, ``{label: {"reason", "items",
        "items_too_long", "longest_answer_tokens", "max_seq_len", "icl_task_type"}}`` of those that cannot: an
        item's answer leaves no context token, see :func:`context_fit`).
    """
    fits, refused = {}, {}
    for task in tasks:
        label, ttype = task["label"], task["icl_task_type"]
        seq = int(task.get("max_seq_len") or max_seq_len)
        items = read_items(task["dataset_uri"])
        answers = context_fit(ttype, item_tokens(task, items, encoder, context=False), seq)
        if answers["items_too_long"]:
            where = "the task's max_seq_len" if task.get("max_seq_len") else setting
            refused[label] = {"reason": too_long_reason(label, answers, where), "icl_task_type": ttype,
                              **{k: answers[k] for k in ("items", "items_too_long", "longest_answer_tokens",
                                                         "max_seq_len")}}
            continue
        fits[label] = {}
        for k in task.get("num_fewshot", [0]):
            counted = item_tokens(task, items, encoder, num_fewshot=int(k))
            fit = fits[label][f"{int(k)}-shot"] = context_fit(ttype, counted, seq)
            if batching is not None:
                fit["batch_shapes"] = batch_shapes(ttype, counted, seq, *batching)
                fit["tokens_planned"] = sum(rows * width for rows, width in fit["batch_shapes"])
                fit["forward_shapes"] = forward_shapes(ttype, counted, seq, *batching)
    return fits, refused
