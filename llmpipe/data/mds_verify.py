"""Read a converted MDS dataset back and check it (:func:`verify_dataset`), as training will read it.

The dataset layout and the sample format are described in :mod:`llmpipe.data.mds`.
"""

from __future__ import annotations

import json
import os
import time
import unicodedata
from typing import Any

from llmpipe.data.errors import DataError, atomic_write_json, remove_if_exists
from llmpipe.data.mds import COLUMNS, TOKEN_DTYPE, cached_tokenizer, read_unit


def _load_mds_manifest(out_dir: str) -> dict:
    p = os.path.join(out_dir, "manifest.json")
    try:
        with open(p) as fh:
            return json.load(fh)
    except FileNotFoundError as exc:
        raise DataError(f"{p} does not exist: the MDS conversion did not finish. Fix: run it (convert_dataset)."
                        ) from exc


def _scan_shards(split_dir: str, index: dict, concat: int, vocab_size: int) -> dict:
    """Read every shard of a split: exact sample sizes, the ndarray header, dtype int32, ids in [0, vocab)."""
    import numpy as np
    from streaming.base.compression import decompress
    from streaming.base.format.mds.encodings import mds_encode

    datum = mds_encode(COLUMNS["tokens"], np.zeros(concat, dtype=np.int32))
    header = np.frombuffer(np.array([len(datum)], np.uint32).tobytes() + datum[: len(datum) - 4 * concat],
                           np.uint8)
    sample_bytes = 4 + len(datum)
    lo, hi, total = None, None, 0
    for si, shard in enumerate(index["shards"]):
        where = f"{split_dir}: shard {si}"
        if shard.get("column_names") != ["tokens"] or shard.get("column_encodings") != [COLUMNS["tokens"]]:
            raise DataError(f"{where} has columns {shard.get('column_names')} / {shard.get('column_encodings')}, "
                            f"not tokens / {COLUMNS['tokens']}. Fix: convert the dataset again.")
        zip_info, raw_info = shard.get("zip_data"), shard["raw_data"]
        unit = raw_info["basename"].split("/")[0]
        fix = (f"Fix: delete {os.path.join(split_dir, unit)} and run the conversion again (only that unit is "
               f"converted again)." if unit.startswith("unit-") else "Fix: convert the dataset again.")
        raw_path = os.path.join(split_dir, raw_info["basename"])
        zip_path = os.path.join(split_dir, zip_info["basename"]) if zip_info else None
        data = None
        if zip_path and os.path.exists(zip_path):
            try:
                with open(zip_path, "rb") as fh:
                    data = decompress(shard["compression"], fh.read())
            except Exception as exc:  # noqa: BLE001 - zstd / other codec errors
                raise DataError(f"{where} ({zip_info['basename']}) cannot be decompressed: {exc}. {fix}") from exc
        if os.path.exists(raw_path):
            # streaming reads the uncompressed file when it exists (it writes one when it decompresses a shard):
            # that is what training sees, so it is checked too, and must be the compressed shard's content
            with open(raw_path, "rb") as fh:
                raw = fh.read()
            if data is not None and raw != data:
                raise DataError(f"{where}: {raw_info['basename']} (read by training) differs from the "
                                f"decompressed {zip_info['basename']}. Fix: delete {raw_path}; streaming "
                                f"decompresses the shard again.")
            data = raw
        if data is None:
            raise DataError(f"{where}: file missing ({zip_path or raw_path}). {fix}")
        if len(data) != raw_info["bytes"]:
            raise DataError(f"{where} ({raw_info['basename']}) has {len(data)} bytes, its index says "
                            f"{raw_info['bytes']}. {fix}")
        n = int(np.frombuffer(data[:4], np.uint32)[0])
        if n != shard["samples"]:
            raise DataError(f"{where} holds {n} samples, its index says {shard['samples']}.")
        offsets = np.frombuffer(data[4: 4 + 4 * (n + 1)], np.uint32).astype(np.int64)
        sizes = np.diff(offsets)
        bad = np.nonzero(sizes != sample_bytes)[0]
        if len(bad):
            raise DataError(f"{where}: sample {int(bad[0])} has {int(sizes[bad[0]])} bytes; every sample must "
                            f"hold exactly concat_tokens={concat} int32 ids ({sample_bytes} bytes). Fix: "
                            f"convert the dataset again with this concat_tokens.")
        if n == 0:
            continue
        rows = np.frombuffer(data, np.uint8, count=n * sample_bytes, offset=int(offsets[0])).reshape(n, sample_bytes)
        if not (rows[:, : len(header)] == header).all():
            raise DataError(f"{where}: a sample's ndarray header is not int32[{concat}]. Fix: convert again.")
        toks = np.ascontiguousarray(rows[:, len(header):]).view(np.int32)
        smin, smax = int(toks.min()), int(toks.max())
        if smin < 0 or smax >= vocab_size:
            bad_row = int(np.nonzero((toks < 0).any(1) | (toks >= vocab_size).any(1))[0][0])
            raise DataError(f"{where}: sample {bad_row} has token id {smax if smax >= vocab_size else smin}, "
                            f"outside [0, vocab_size={vocab_size}). Fix: use a model vocab_size >= the "
                            f"tokenizer's, or convert again with the right tokenizer.")
        lo = smin if lo is None else min(lo, smin)
        hi = smax if hi is None else max(hi, smax)
        total += n
    return {"samples": total, "min_id": lo, "max_id": hi, "shards": len(index["shards"])}


def _fragment(text: str, eos_text: str) -> str:
    """A piece of decoded text that must occur verbatim in one source document."""
    pieces = [p for p in text.split(eos_text)] if eos_text else [text]
    best = ""
    for p in pieces:
        p = p[4:-4]  # sample edges may cut a multi-byte character / token
        for part in p.split("\ufffd"):
            if len(part) > len(best):
                best = part
    if len(best) > 240:
        mid = len(best) // 2
        best = best[mid - 120: mid + 120]
    return best.strip()


def _text_canon(tok: Any) -> Any:
    """How source text and decoded text are compared: NFC, the tokenizer's own normalizer (lower-casing, NFKC,
    ... for tokenizers that have one: their decoded text is normalized text) and runs of whitespace collapsed."""
    normalizer = getattr(getattr(tok, "backend_tokenizer", None), "normalizer", None)

    def canon(text: str) -> str:
        text = unicodedata.normalize("NFC", text)
        if normalizer is not None:
            text = normalizer.normalize_str(text)
        return " ".join(text.split())

    return canon


def _find_in_source(path: str, fragments: list[str], canon: Any) -> set[int]:
    from llmpipe.data.corpus import iter_documents

    want = {i: canon(f) for i, f in enumerate(fragments)}
    found: set[int] = set()
    for doc in iter_documents(path):
        text = canon(doc["text"])
        for i, frag in want.items():
            if i not in found and frag in text:
                found.add(i)
        if len(found) == len(want):
            break
    return found


def _streaming_read(out_dir: str, split: str, indices: list[int]) -> tuple[int, list]:
    """Open the split with streaming's StreamingDataset (as training does); return its length and samples. Its
    shared memory lives in this job's slot and goes when it is read (:func:`llmpipe.train.shm_names.open_reader`);
    other jobs' segments on the node are left alone."""
    from llmpipe.train.shm_names import open_reader

    with open_reader(out_dir, split) as ds:
        n = len(ds)
        return n, [ds[i]["tokens"] for i in indices if 0 <= i < n]


def verify_dataset(out_dir: str, tokenizer_dir: str, concat_tokens: int, vocab_size: int, out_json: str) -> dict:
    """Read a converted dataset back and check it; write the report ``out_json`` (atomically) and return it.

    Checks, per split: the merged index' sample count equals the sum of the units' (index and unit.json) and the
    manifest's; every sample of every shard holds exactly ``concat_tokens`` ids of dtype int32, all in
    ``[0, vocab_size)`` (vectorized scan of each decompressed shard); streaming's ``StreamingDataset`` (the reader
    training uses) sees the same number of samples and returns int32 arrays of shape (concat_tokens,); three
    samples (first, middle, last) decode to text found in the source file of their unit (compared after NFC, the
    tokenizer's own normalizer and whitespace collapsing).

    Args:
        out_dir: the dataset folder written by :func:`llmpipe.steps.mds_units.convert_dataset`.
        tokenizer_dir: the tokenizer folder used for the conversion (for decoding).
        concat_tokens: expected ids per sample.
        vocab_size: ids must be below this (the model's ``vocab_size``).
        out_json: where the report goes: ``{"ok": true, "splits": {split: {"samples", "tokens", "shards",
            "units", "min_id", "max_id", "examples": [{"index", "unit", "source", "fragment", "text"}]}}, ...}``.

    Raises:
        DataError: any check fails (message: split, shard / sample, what is wrong and the fix).
    """
    import numpy as np

    t0 = time.time()
    remove_if_exists(out_json)
    concat = int(concat_tokens)
    m = _load_mds_manifest(out_dir)
    if int(m["concat_tokens"]) != concat:
        raise DataError(f"{out_dir} was converted with concat_tokens={m['concat_tokens']}, expected {concat}. "
                        f"Fix: convert again with concat_tokens={concat}.")
    tok = cached_tokenizer(os.path.abspath(tokenizer_dir))
    eos_text = m.get("eos_text") or ""
    report: dict[str, Any] = {"ok": False, "out_dir": os.path.abspath(out_dir), "concat_tokens": concat,
                              "vocab_size": int(vocab_size), "dtype": TOKEN_DTYPE, "splits": {}}
    for split, sm in m["splits"].items():
        split_dir = os.path.join(out_dir, split)
        try:
            with open(os.path.join(split_dir, "index.json")) as fh:
                index = json.load(fh)
        except FileNotFoundError as exc:
            raise DataError(f"{split_dir}/index.json is missing. Fix: convert the dataset again.") from exc
        unit_counts = []
        for u in sm["units"]:
            rec = read_unit(os.path.join(split_dir, u["name"]))
            if rec is None:
                raise DataError(f"unit {split}/{u['name']} is missing or incomplete. Fix: convert again (a rerun "
                                f"converts only the missing units).")
            with open(os.path.join(split_dir, u["name"], "index.json")) as fh:
                n_idx = sum(s["samples"] for s in json.load(fh)["shards"])
            if n_idx != rec["samples"] or n_idx != u["samples"]:
                raise DataError(f"unit {split}/{u['name']}: its index lists {n_idx} samples, its record "
                                f"{rec['samples']}, the manifest {u['samples']}. Fix: delete the unit and rerun.")
            unit_counts.append(n_idx)
        n_merged = sum(s["samples"] for s in index["shards"])
        if n_merged != sum(unit_counts) or n_merged != sm["samples"]:
            raise DataError(f"{split_dir}/index.json lists {n_merged} samples but the units hold "
                            f"{sum(unit_counts)} (manifest: {sm['samples']}). Fix: convert again.")
        scan = _scan_shards(split_dir, index, concat, int(vocab_size))
        if scan["samples"] != n_merged:
            raise DataError(f"{split_dir}: shards hold {scan['samples']} samples, index says {n_merged}.")

        # read back through streaming, the reader llm-foundry's text dataloader uses
        picks = sorted({0, n_merged // 2, n_merged - 1})
        n_stream, rows = _streaming_read(out_dir, split, picks)
        if n_stream != n_merged:
            raise DataError(f"streaming's StreamingDataset sees {n_stream} samples in {split_dir}, the index "
                            f"{n_merged}. Fix: convert again.")
        bounds = np.cumsum([0] + unit_counts)
        examples = []
        by_source: dict[str, list[int]] = {}
        for idx, row in zip(picks, rows):
            if not isinstance(row, np.ndarray) or row.dtype != np.int32 or row.shape != (concat,):
                raise DataError(f"{split} sample {idx} reads back as {type(row).__name__} "
                                f"{getattr(row, 'dtype', '?')} {getattr(row, 'shape', '?')}, expected int32 "
                                f"({concat},). Fix: convert again.")
            u = int(np.searchsorted(bounds, idx, side="right") - 1)
            unit = sm["units"][u]
            text = tok.decode(row.tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False)
            frag = _fragment(text, eos_text)
            examples.append({"index": idx, "unit": unit["name"], "source": unit["input"], "fragment": frag,
                             "text": text[:600]})
            if len(frag) >= 8:
                by_source.setdefault(unit["input"], []).append(len(examples) - 1)
        for src, ex_ids in by_source.items():
            found = _find_in_source(src, [examples[i]["fragment"] for i in ex_ids], _text_canon(tok))
            for j, ei in enumerate(ex_ids):
                examples[ei]["found_in_source"] = j in found
                if j not in found:
                    raise DataError(f"{split} sample {examples[ei]['index']} decodes to text that is not in its "
                                    f"source {src}: {examples[ei]['fragment'][:120]!r}. The dataset does not match "
                                    f"its tokenizer or corpus. Fix: convert again with this tokenizer.")
        report["splits"][split] = {"samples": n_merged, "tokens": n_merged * concat, "shards": scan["shards"],
                                   "units": len(unit_counts), "min_id": scan["min_id"], "max_id": scan["max_id"],
                                   "examples": examples}
    report["ok"] = True
    report["seconds"] = round(time.time() - t0, 3)
    atomic_write_json(out_json, report)
    return report
