"""Instruction sets for supervised finetuning: prompt/response pairs as local JSON-lines files.

A prepared instruction set is a folder ``{out_dir}`` with

* ``data/train.jsonl`` and ``data/test.jsonl``: one ``{"prompt": ..., "response": ...}`` object per line, exactly
  these two columns (llm-foundry's finetuning dataloader reads such a folder with ``hf_name: {out_dir}/data`` and
  ``split: train`` / ``split: test``; ``datasets`` takes the split from the file name). ``test`` is always the
  held-out split, whatever the source calls it.
* ``manifest.json``, written last and atomically: rows per split, prompt/response length statistics, sha256 of
  each file.

Sources (``iset_cfg['source']``):

* ``builtin`` – written by the project, offline and deterministic for a Python version: for public functions
  and classes of the pure-Python standard library (read with :mod:`ast`, never imported), the question is
  ``"What does json.dumps do?"``, the prompt that question in :data:`BUILTIN_TEMPLATE`
  (``"Question: What does json.dumps do?\nAnswer:"``), and the response the first sentence of its docstring. A
  hash of the name puts ``eval_percent`` % of the items into the held-out split.
* ``hub`` – ``datasets.load_dataset(hf_name, revision=...)`` (``mosaicml/dolly_hhrlhf``, ``kowndinya23/instruct-v3``)
  on the submitting machine (compute nodes need no hub access: training reads the local files).
* ``local`` – the same from a folder ``local_dir`` in the hub dataset's layout (``data/train-00000-of-00001.parquet``
  or ``.jsonl`` ...), e.g. a mirror, or a few rows standing in for the hub dataset in tests.

For hub and local sources, ``columns: {prompt: <column>, response: <column>}`` names the columns (other columns,
such as instruct-v3's ``source``, are dropped), ``train_split`` / ``eval_split`` the source's split names, and
``max_rows`` (optional) keeps only the first rows of each split. Their prompt column is written as it is: any
instruction format (dolly_hhrlhf's ``### Instruction:`` ... ``### Response:``) is already in its text.

The instruction format (:func:`instruction_template`) is what a model finetuned on the set saw around each
question; generation applies the same template to its prompts (:func:`apply_template`).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import sysconfig
from collections.abc import Iterator

from llmpipe.data.errors import DataError, atomic_write_bytes, atomic_write_json, remove_if_exists

#: File names of the prepared splits (``split`` values of the finetuning dataloader).
SPLIT_FILES = {"train": "train.jsonl", "test": "test.jsonl"}
#: Where the question goes in an instruction template (literal text: other braces are not fields).
PROMPT_FIELD = "{prompt}"
#: The instruction format of the builtin set: its training prompts and its finetunes' generation prompts.
BUILTIN_TEMPLATE = "Question: " + PROMPT_FIELD + "\nAnswer:"
#: The question of the builtin set; ``{name}`` is ``module.attribute``.
BUILTIN_QUESTION = "What does {name} do?"
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "turtledemo",
              "ensurepip", "pydoc_data", "lib2to3", "idlelib", "tkinter", "distutils"}
_SENTENCE_END = re.compile(r"(?<=[a-z0-9)\]`'\"])\.(?:\s|$)")


def _where(iset_cfg: dict) -> str:
    return f"instruction_sets.{iset_cfg['key']}" if iset_cfg.get("key") else "the instruction set"


def apply_template(template: str, prompt: str) -> str:
    """``template`` with its :data:`PROMPT_FIELD` (``{prompt}``) replaced by ``prompt``; other text, braces included,
    is kept as it is.

    Raises:
        ValueError: ``template`` has no ``{prompt}``.
    """
    if PROMPT_FIELD not in template:
        raise ValueError(f"the template {template!r} has no {PROMPT_FIELD}, so the prompt would be lost")
    return template.replace(PROMPT_FIELD, prompt)


def instruction_template(iset_cfg: dict) -> str:
    """The instruction format a model finetuned on this instruction set saw, ``{prompt}`` standing for the question.

    ``builtin``: :data:`BUILTIN_TEMPLATE` (its prepared prompts are this template applied to each question).
    ``hub`` / ``local``: ``{prompt}``, the source's prompt column as written (a format it has is in its text).

    Args:
        iset_cfg: one entry of ``instruction_sets:`` (``source``).
    """
    return BUILTIN_TEMPLATE if iset_cfg.get("source") == "builtin" else PROMPT_FIELD


def first_sentence(doc: str, max_words: int = 30) -> str | None:
    """The first sentence of a docstring as one line, or None when it is not a short plain-English sentence."""
    par = re.split(r"\n\s*\n", doc.strip(), maxsplit=1)[0]
    text = re.sub(r"\s+", " ", par).strip()
    m = _SENTENCE_END.search(text)
    if not m:
        return None
    sent = text[: m.start() + 1]
    words = sent.split(" ")
    if not 4 <= len(words) <= max_words or not sent[0].isupper():
        return None
    if re.search(r"[{}\[\]=<>|\\#@$]|>>>|::", sent):
        return None
    return sent


def _is_heldout(key: str, percent: int) -> bool:
    return int(hashlib.sha1(key.encode()).hexdigest()[:8], 16) % 100 < percent


def builtin_items() -> Iterator[tuple[str, str, str]]:
    """``(name, prompt, response)`` for each documented public function or class of the standard library.

    Sorted by module path, then by definition order; the first definition of a name wins.
    """
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(("config-", "_")))
        for fn in sorted(filenames):
            if fn.endswith(".py") and not fn.startswith(("_", "test")):
                files.append(os.path.join(dirpath, fn))
    seen: set[str] = set()
    for path in sorted(files):
        mod = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
        try:
            with open(path, "rb") as fh:
                source = fh.read()
            try:
                tree = ast.parse(source)
            except SystemError:  # CPython 3.11 "AST constructor recursion depth mismatch" (seen once in CI): retry
                tree = ast.parse(source)
        except (SyntaxError, ValueError, OSError):
            continue
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
                continue
            name = f"{mod}.{node.name}"
            doc = ast.get_docstring(node, clean=True)
            if name in seen or not doc:
                continue
            sent = first_sentence(doc)
            if sent:
                seen.add(name)
                yield name, apply_template(BUILTIN_TEMPLATE, BUILTIN_QUESTION.format(name=name)), " " + sent


def builtin_instructions(max_items: int = 2000, eval_percent: int = 10) -> dict[str, list[dict]]:
    """The builtin instruction set: ``{"train": [{"prompt", "response"}, ...], "test": [...]}``.

    Deterministic for a Python version. When there are more than ``max_items`` items, a hash-ordered subset is
    kept (spread over the whole library rather than its first modules), then restored to library order.
    """
    items = list(builtin_items())
    if len(items) > max_items:
        keep = set(sorted(range(len(items)), key=lambda i: hashlib.sha1(items[i][0].encode()).hexdigest())[:max_items])
        items = [it for i, it in enumerate(items) if i in keep]
    out: dict[str, list[dict]] = {"train": [], "test": []}
    for name, prompt, response in items:
        out["test" if _is_heldout(name, eval_percent) else "train"].append({"prompt": prompt, "response": response})
    return out


def _load_rows(iset_cfg: dict, split: str) -> list[dict]:
    """Rows of one split of a hub or local dataset, with its prompt/response columns renamed."""
    import datasets

    where = _where(iset_cfg)
    src = iset_cfg["source"]
    name = iset_cfg.get("local_dir") if src == "local" else iset_cfg["hf_name"]
    kwargs = {} if src == "local" else {"revision": iset_cfg.get("revision") or None}
    try:
        ds = datasets.load_dataset(name, split=split, **kwargs)
    except ValueError as exc:  # unknown split
        raise DataError(f"{where}: split {split!r} of {name} cannot be read ({exc}). Fix: set train_split / "
                        f"eval_split to the dataset's split names.") from exc
    cols = iset_cfg.get("columns") or {"prompt": "prompt", "response": "response"}
    missing = [c for c in (cols["prompt"], cols["response"]) if c not in ds.column_names]
    if missing:
        raise DataError(f"{where}: {name} (split {split}) has no column(s) {missing}; its columns are "
                        f"{ds.column_names}. Fix: set {where}.columns to {{prompt: <column>, response: <column>}}.")
    n = len(ds) if iset_cfg.get("max_rows") in (None, 0) else min(len(ds), int(iset_cfg["max_rows"]))
    rows = []
    for i in range(n):
        r = ds[i]
        p, a = r[cols["prompt"]], r[cols["response"]]
        if not isinstance(p, str) or not isinstance(a, str):
            raise DataError(f"{where}: row {i} of split {split} has a non-text prompt or response "
                            f"({type(p).__name__}, {type(a).__name__}).")
        if p.strip() and a.strip():  # an empty prompt or response has nothing to learn; llm-foundry drops it too
            rows.append({"prompt": p, "response": a})
    return rows


def _stats(rows: list[dict]) -> dict:
    if not rows:
        return {"rows": 0}
    plen = sorted(len(r["prompt"]) for r in rows)
    rlen = sorted(len(r["response"]) for r in rows)
    return {"rows": len(rows), "prompt_chars_median": plen[len(plen) // 2], "prompt_chars_max": plen[-1],
            "response_chars_median": rlen[len(rlen) // 2], "response_chars_max": rlen[-1]}


def prepare_instructions(iset_cfg: dict, out_dir: str) -> dict:
    """Write an instruction set as ``{out_dir}/data/{train,test}.jsonl`` and ``{out_dir}/manifest.json`` (last).

    Args:
        iset_cfg: one entry of ``instruction_sets:`` (see the module docstring); an optional ``key`` makes error
            messages name the setting.
        out_dir: the instruction set's folder (created).

    Returns:
        The manifest: ``{"source", "data_dir" (absolute), "splits": {"train": {"rows", ...}, "test": {...}},
        "sha256": {split: hex}}``.

    Raises:
        DataError: a split is empty, a column is missing, a row is not text (message names the setting).
    """
    os.makedirs(out_dir, exist_ok=True)
    remove_if_exists(os.path.join(out_dir, "manifest.json"))
    where = _where(iset_cfg)
    src = iset_cfg.get("source")
    if src == "builtin":
        splits = builtin_instructions(int(iset_cfg.get("max_items", 2000)), int(iset_cfg.get("eval_percent", 10)))
    elif src in ("hub", "local"):
        splits = {"train": _load_rows(iset_cfg, iset_cfg.get("train_split", "train")),
                  "test": _load_rows(iset_cfg, iset_cfg.get("eval_split", "test"))}
    else:
        raise DataError(f"{where}.source is {src!r}; it must be builtin, hub or local.")
    data_dir = os.path.join(out_dir, "data")
    manifest = {"source": src, "key": iset_cfg.get("key"), "data_dir": os.path.abspath(data_dir),
                "columns": ["prompt", "response"], "splits": {}, "sha256": {}}
    for split, rows in splits.items():
        if not rows:
            raise DataError(f"{where}: the {split} split has no usable rows (non-empty prompt and response). "
                            f"Fix: check the source's split names and columns.")
        raw = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
        atomic_write_bytes(os.path.join(data_dir, SPLIT_FILES[split]), raw)
        manifest["splits"][split] = _stats(rows)
        manifest["sha256"][split] = hashlib.sha256(raw).hexdigest()
    atomic_write_json(os.path.join(out_dir, "manifest.json"), manifest)
    return manifest


def write_standin(out_dir: str, rows: dict[str, list[dict]], fmt: str = "jsonl") -> str:
    """Write a few rows in a hub dataset's layout (``data/{split}-00000-of-00001.{fmt}``); return ``out_dir``.

    A stand-in for a hub dataset when the hub cannot be reached (``source: local``, ``local_dir: out_dir``).
    ``rows`` maps the source's split names to rows with the source's own columns. ``fmt``: jsonl or parquet.
    """
    d = os.path.join(out_dir, "data")
    os.makedirs(d, exist_ok=True)
    for split, split_rows in rows.items():
        path = os.path.join(d, f"{split}-00000-of-00001.{fmt}")
        if fmt == "parquet":
            import datasets
            datasets.Dataset.from_list(split_rows).to_parquet(path)
        else:
            with open(path, "w") as fh:
                for r in split_rows:
                    fh.write(json.dumps(r) + "\n")
    return out_dir
