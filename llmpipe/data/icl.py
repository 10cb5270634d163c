"""In-context-learning tasks the project makes itself from held-out text.

:func:`build_cloze_task` cuts cloze items (LAMBADA-style "predict the last word") from the corpus' *validation*
split, which the model never trains on, in llm-foundry's ``language_modeling`` ICL format: a jsonl file with one
``{"context": ..., "continuation": ...}`` object per line. ``context`` is a passage (the sentence, preceded by the
sentences before it in the same document while the passage stays under :data:`MAX_CONTEXT_CHARS`) minus its last
word; ``continuation`` is ``" " + last word`` (without the closing period). llm-foundry's defaults handle it as is
(``icl_task_type: language_modeling``, ``continuation_delimiter: ' '``, ``strip_dataset: true``: the leading
space is stripped and added back for GPT-2-style tokenizers, so the answer is tokenized as " word").
"""

from __future__ import annotations

import json
import os
import random
import re

from llmpipe.data.errors import DataError, atomic_write_bytes

#: A passage (context + last word) is at most this many characters: it fits small models' max_seq_len.
MAX_CONTEXT_CHARS = 320
MIN_WORDS = 8

_SENT_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
_LAST_WORD = re.compile(r"^(?P<ctx>.*\S)\s+(?P<word>[A-Za-z][a-z]{2,})\.$", re.S)
_BAD = re.compile(r"[{}\[\]=<>|\\`#@$_*]|\.\.\.|https?:|\be\.g\.|\bi\.e\.|\betc\.")


def _items_from_text(text: str) -> list[tuple[str, str]]:
    out = []
    for para in text.split("\n"):
        sents = [s.strip() for s in _SENT_SPLIT.split(para.strip()) if s.strip()]
        for i, sent in enumerate(sents):
            if _BAD.search(sent) or len(sent.split()) < MIN_WORDS or len(sent) > MAX_CONTEXT_CHARS:
                continue
            m = _LAST_WORD.match(sent)
            if not m:
                continue
            passage = sent
            j = i - 1
            while j >= 0 and len(sents[j]) + 1 + len(passage) <= MAX_CONTEXT_CHARS and not _BAD.search(sents[j]):
                passage = sents[j] + " " + passage
                j -= 1
            ctx = passage[: len(passage) - len(m.group("word")) - 1].rstrip()
            out.append((ctx, " " + m.group("word")))
    return out


def build_cloze_task(corpus_manifest: str, out_path: str, num_items: int, seed: int) -> dict:
    """Write a cloze ICL task (jsonl, llm-foundry ``language_modeling`` format) cut from held-out text.

    Candidates are the sentences of the corpus' validation split (in manifest order) that are prose (no code
    characters, at least 8 words, at most 320 characters) and end with an alphabetic word of 3+ letters and a
    period; ``num_items`` of them are drawn with ``random.Random(seed)`` and written in corpus order. The same
    inputs give a byte-identical file.

    Args:
        corpus_manifest: the corpus ``manifest.json`` (file or folder).
        out_path: the ``.jsonl`` to write (atomically).
        num_items: how many items (all candidates when fewer exist; a note is printed).
        seed: sampling seed.

    Returns:
        ``{"path", "items", "candidates", "seed", "source_files", "examples" (the first 3 items)}``.

    Raises:
        DataError: the validation split yields no candidate sentence, or ``num_items`` < 1.
    """
    from llmpipe.data.corpus import iter_documents, load_manifest

    if int(num_items) < 1:
        raise DataError(f"num_items must be at least 1 for a cloze task, got {num_items!r}.")
    m = load_manifest(corpus_manifest)
    files = [f["path"] for f in m["splits"].get("validation") or []]
    if not files:
        raise DataError(f"{corpus_manifest} has no validation files: a cloze task must come from held-out text. "
                        f"Fix: set val_files >= 1 for the corpus.")
    cands: list[tuple[str, str]] = []
    for path in files:
        for doc in iter_documents(path):
            cands.extend(_items_from_text(doc["text"]))
    if not cands:
        raise DataError(f"no cloze items could be cut from the validation text of {corpus_manifest} (no prose "
                        f"sentence ending in a word and a period). Fix: use a corpus with English prose.")
    n = min(int(num_items), len(cands))
    if n < int(num_items):
        print(f"[llmpipe] note: the validation split has only {len(cands)} cloze candidates; the task has {n} "
              f"items, not {num_items}.", flush=True)
    picks = sorted(random.Random(int(seed)).sample(range(len(cands)), n))
    items = [{"context": cands[i][0], "continuation": cands[i][1]} for i in picks]
    data = "".join(json.dumps(it, ensure_ascii=False) + "\n" for it in items).encode("utf-8")
    atomic_write_bytes(out_path, data)
    return {"path": os.path.abspath(out_path), "items": n, "candidates": len(cands), "seed": int(seed),
            "source_files": files, "examples": items[:3]}


def build_cloze_choice_task(corpus_manifest: str, out_path: str, num_items: int, seed: int,
                            num_choices: int = 4) -> dict:
    """Write a multiple-choice cloze task (llm-foundry ``multiple_choice`` format) cut from held-out text.

    The same items as :func:`build_cloze_task`, but the model ranks ``num_choices`` candidate last words instead of
    generating the word exactly: ``{"query": context, "choices": [" word", ...], "gold": index}``. Distractors are
    other items' answers drawn with ``random.Random(seed)``; chance accuracy is ``1 / num_choices``. A small model
    that learned anything about the domain beats chance here long before it can produce the exact word.

    Raises:
        DataError: as :func:`build_cloze_task`, or fewer distinct answers than ``num_choices``.
    """
    tmp = out_path + ".lm.tmp"
    info = build_cloze_task(corpus_manifest, tmp, num_items, seed)
    with open(tmp, encoding="utf-8") as fh:
        items = [json.loads(line) for line in fh]
    os.remove(tmp)
    answers = sorted({it["continuation"] for it in items})
    if len(answers) < num_choices:
        raise DataError(f"only {len(answers)} distinct answers in the held-out items of {corpus_manifest}; a "
                        f"{num_choices}-way cloze task needs more. Fix: raise num_items or lower num_choices.")
    rng = random.Random(int(seed) + 1)
    out = []
    for it in items:
        distract = rng.sample([a for a in answers if a != it["continuation"]], num_choices - 1)
        gold = rng.randrange(num_choices)
        choices = distract[:gold] + [it["continuation"]] + distract[gold:]
        out.append({"query": it["context"], "choices": choices, "gold": gold})
    data = "".join(json.dumps(it, ensure_ascii=False) + "\n" for it in out).encode("utf-8")
    atomic_write_bytes(out_path, data)
    return {**info, "path": os.path.abspath(out_path), "num_choices": num_choices, "examples": out[:3]}
