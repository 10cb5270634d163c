"""Tokenize + concatenate + write MDS, one restartable unit per input file; lay out, merge and record a dataset.

Layout of a dataset folder ``{out_dir}`` (one per corpus x tokenizer x concat length)::

    {out_dir}/train/unit-00000/{index.json, unit.json, shard.00000.mds.zstd, ...}   one unit per input file
    {out_dir}/train/index.json        merged index of all train units (what llm-foundry / streaming read)
    {out_dir}/val/...                 the same for C4's validation files
    {out_dir}/manifest.json           written last: samples / tokens / documents per split and per unit

Splits: the corpus' ``train`` files become MDS split ``train``, its ``validation`` files MDS split ``val``
(llm-foundry's names: ``train_loader.dataset.split: train``, ``eval_loader.dataset.split: val``).

**Samples.** Each sample is one row ``{"tokens": ndarray:int32 of exactly concat_tokens ids}`` – the column that
llm-foundry's ``convert_dataset_hf/json`` write and its ``text`` dataloader reads (``StreamingTextDataset``
decodes the ``ndarray`` column directly, so ``token_encoding_type`` does not matter). Documents are tokenized with
the tokenizer's defaults (``add_special_tokens=True``, as llm-foundry's ``ConcatTokensDataset`` does), each is
followed by the ids of ``eos_text``, and the stream is cut into samples of exactly ``concat_tokens`` ids, so a
document may run across samples and a sample may hold several documents. Documents whose text is empty or only
whitespace are skipped (they would only add a lone EOS).

**Units.** One unit = one input ``.json.gz`` file; concatenation runs across documents *within* a unit. At the end of
a unit the leftover (< ``concat_tokens`` ids, the tail of its last document(s)) is **dropped**; it is counted in
``dropped_tokens``. So a sample never spans two input files, and the output does not depend on how units are
grouped onto workers: a C4 train file has ~152 M tokens, so the loss is < 2048 tokens per file (0.001 %). For the
same input file, a unit's samples are identical to what llm-foundry's ``ConcatTokensDataset`` (``no_wrap=False``)
yields for that file alone, except for the skipped empty documents.

**Restartable.** A unit is written into ``{split}/.tmp-unit-NNNNN-*`` and becomes ``unit-NNNNN`` by one
``os.rename`` after its shards, ``index.json`` and finally ``unit.json`` (the completion marker, which also records
what the unit was made from) are written and fsync'ed. A unit killed at any point (SIGKILL, Ctrl-C, node failure,
disk full) leaves only a ``.tmp-*`` folder, which the next run deletes; a rerun converts only units that are missing,
incomplete or made from other inputs / settings, and reuses the others. The merged indexes and ``manifest.json``
are written after all units, each atomically, the manifest last.

**Running units.** This module converts one unit (:func:`convert_unit`), lays the units out
(:func:`plan_dataset`) and merges them (:func:`finish_dataset`); it never dispatches. Running the units in parallel
(local processes or a Slurm job array, restarting only the missing ones, a line per finished unit) is the
dispatch layer's: :func:`llmpipe.steps.mds_units.convert_dataset` through :mod:`llmpipe.dispatch.unit_array`. A unit sets
``TOKENIZERS_PARALLELISM=false``: one core per unit. Reading the dataset back: :mod:`llmpipe.data.mds_verify`.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import os
import shutil
import sys
import time
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from llmpipe.data.corpus import check_gzip_magic, load_manifest
from llmpipe.data.errors import DataError, atomic_write_json, remove_if_exists

#: Corpus split (C4's name) -> MDS split (llm-foundry's name).
MDS_SPLITS = {"train": "train", "validation": "val"}
#: The MDS columns: exactly what llm-foundry's convert_dataset_hf/json write and StreamingTextDataset reads.
COLUMNS = {"tokens": "ndarray:int32"}
TOKEN_DTYPE = "int32"
#: Bump when a change here changes what a unit contains (part of each unit's identity in unit.json).
UNIT_FORMAT = 1
#: Documents are tokenized in batches of about this many characters.
BATCH_CHARS = 1 << 20
BATCH_DOCS = 4096


# ------------------------------------------------------------------------------------------------ helpers

def tokenizer_fingerprint(tokenizer_dir: str) -> str:
    """sha1 over the tokenizer folder's files (except our manifest): identifies the tokenizer a unit used."""
    h = hashlib.sha1()
    for fn in sorted(os.listdir(tokenizer_dir)):
        p = os.path.join(tokenizer_dir, fn)
        if fn == "manifest.json" or fn.startswith(".") or not os.path.isfile(p):
            continue
        h.update(fn.encode())
        with open(p, "rb") as fh:
            h.update(hashlib.sha1(fh.read()).digest())
    return h.hexdigest()


_TOKENIZERS: dict[str, Any] = {}


def eos_token_ids(tokenizer_dir: str, eos_text: str) -> list[int]:
    """The ids ``eos_text`` tokenizes to (no added special tokens).

    Taken from the tokenizer folder's ``manifest.json`` when it was written for the same ``eos_text`` (so the
    parent process of a conversion need not import transformers / torch); otherwise computed with the tokenizer.
    """
    try:
        with open(os.path.join(tokenizer_dir, "manifest.json")) as fh:
            man = json.load(fh)
        if man.get("eos_text") == eos_text and man.get("eos_ids"):
            return [int(i) for i in man["eos_ids"]]
    except (OSError, ValueError):
        pass
    return list(cached_tokenizer(os.path.abspath(tokenizer_dir))(eos_text, add_special_tokens=False)["input_ids"])


def cached_tokenizer(tokenizer_dir: str):
    """The tokenizer of a folder, cached per process (keyed by the folder's content, not only its path)."""
    key = f"{tokenizer_dir}:{tokenizer_fingerprint(tokenizer_dir)}"
    if key not in _TOKENIZERS:
        from llmpipe.data.tokenizer import load_tokenizer

        _TOKENIZERS[key] = load_tokenizer(tokenizer_dir)
    return _TOKENIZERS[key]


def _unit_identity(spec: dict) -> dict:
    return {k: spec[k] for k in ("format", "input_name", "input_bytes", "tokenizer_fingerprint", "concat_tokens",
                                 "eos_ids", "compression", "size_limit")}


def read_unit(unit_dir: str) -> dict | None:
    """The unit's completion record, or None when the unit is missing, incomplete or damaged.

    Damaged means: ``index.json`` does not parse, lists another number of samples than ``unit.json``, or a shard
    file it names (the compressed one when the shard is compressed) is missing or has another size, or
    streaming's decompressed copy of a compressed shard (which training reads when present) has another size.
    Such a unit is converted again by the next run (the sample bytes themselves are checked by
    :func:`llmpipe.data.mds_verify.verify_dataset`).
    """
    try:
        with open(os.path.join(unit_dir, "unit.json")) as fh:
            rec = json.load(fh)
        with open(os.path.join(unit_dir, "index.json")) as fh:
            shards = json.load(fh)["shards"]
        if sum(int(sh["samples"]) for sh in shards) != int(rec["samples"]):
            return None
        for sh in shards:
            info = sh.get("zip_data") or sh["raw_data"]
            if os.path.getsize(os.path.join(unit_dir, info["basename"])) != int(info["bytes"]):
                return None
            raw = os.path.join(unit_dir, sh["raw_data"]["basename"])  # streaming's decompressed copy, if any
            if sh.get("zip_data") and os.path.exists(raw) and os.path.getsize(raw) != int(sh["raw_data"]["bytes"]):
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return rec


def unit_complete(spec: dict) -> dict | None:
    """The completion record of ``spec``'s unit if it is complete *and* made from the same inputs/settings."""
    rec = read_unit(spec["unit_dir"])
    if rec is None or rec.get("identity") != _unit_identity(spec):
        return None
    return rec


def _fsync_tree(root: str) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for fn in files:
            fd = os.open(os.path.join(dirpath, fn), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _iter_text_batches(path: str, stats: dict, batch_chars: int = BATCH_CHARS) -> Iterator[list[str]]:
    """Batches of non-blank document texts (about ``batch_chars`` characters, at most ``BATCH_DOCS`` documents)
    from one json.gz; updates ``stats`` (documents, empty, bytes_read).

    Raises:
        DataError: not gzip, truncated / corrupt, or a line that is not a C4 document (names file and line).
    """
    check_gzip_magic(path)
    loads = json.loads
    batch: list[str] = []
    chars = 0
    lineno = 0
    try:
        with open(path, "rb") as raw, gzip.GzipFile(fileobj=raw, mode="rb") as gz:
            for lineno, line in enumerate(gz, 1):
                try:
                    text = loads(line)["text"]
                    if not isinstance(text, str):
                        raise TypeError("text is not a string")
                except (ValueError, KeyError, TypeError) as exc:
                    if not line.strip():
                        continue
                    raise DataError(f"{path}, line {lineno}: not a C4 document ({type(exc).__name__}: {exc}); "
                                    f"each line must be a JSON object with a string 'text'. Fix: replace the "
                                    f"file with a correct copy.") from exc
                stats["documents"] += 1
                if not text or text.isspace():
                    stats["empty_documents"] += 1
                    continue
                batch.append(text)
                chars += len(text)
                if chars >= batch_chars or len(batch) >= BATCH_DOCS:
                    stats["bytes_read"] = raw.tell()
                    yield batch
                    batch, chars = [], 0
            stats["bytes_read"] = raw.tell()
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise DataError(f"{path} is truncated or corrupt (gzip error after line {lineno}: {exc}). "
                        f"Fix: delete it, prepare the corpus again (download / copy the file again).") from exc
    if batch:
        yield batch


def _write_progress(path: str | None, obj: dict) -> None:
    """Replace the unit's progress file ``path`` (none when None) by ``obj``: ``{"bytes_done", "bytes_total",
    "tokens", "done"}``, plus ``"record"`` when done (the format :mod:`llmpipe.dispatch.unit_array` polls); best effort."""
    if not path:
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as fh:
            json.dump(obj, fh)
        os.replace(tmp, path)
    except OSError:
        pass  # progress is best effort


# ------------------------------------------------------------------------------------------------ one unit

def worker_encoder(tokenizer_dir: str):
    """``encode(texts) -> [[ids], ...]`` for a unit, exactly as llm-foundry's ``ConcatTokensDataset`` tokenizes
    (``tokenizer(text, truncation=False, padding=False)``, special tokens added); cached per process.

    Fast path: ``tokenizer.json`` through the Rust ``tokenizers`` library alone, when it reproduces the probes the
    tokenizer step stored (:func:`llmpipe.data.tokenizer.load_backend`; no transformers or torch import).
    Otherwise the transformers tokenizer itself is called (slow tokenizers, Python-side preprocessing,
    ``split_special_tokens``, folders from older runs without probes).
    """
    from llmpipe.data.tokenizer import load_backend

    key = f"encoder:{tokenizer_dir}:{tokenizer_fingerprint(tokenizer_dir)}"
    if key not in _TOKENIZERS:
        backend = load_backend(tokenizer_dir)
        if backend is not None:
            batch = getattr(backend, "encode_batch_fast", None) or backend.encode_batch

            def encode(texts: list[str]) -> list[list[int]]:
                return [e.ids for e in batch(texts, add_special_tokens=True)]
        else:
            tok = cached_tokenizer(tokenizer_dir)

            def encode(texts: list[str]) -> list[list[int]]:
                return tok(texts, add_special_tokens=True, truncation=False, padding=False)["input_ids"]
        _TOKENIZERS[key] = encode
    return _TOKENIZERS[key]


def _encode_or_explain(encode: Any, texts: list[str], path: str, first_doc: int) -> list[list[int]]:
    """``encode(texts)``; a document the tokenizer cannot take (e.g. a lone UTF-16 surrogate from a ``\\ud800``
    JSON escape) becomes a DataError naming the file and the document."""
    try:
        return encode(texts)
    except (TypeError, ValueError, UnicodeError) as exc:
        for i, t in enumerate(texts):
            try:
                t.encode("utf-8")
                encode([t])
            except Exception as exc2:  # noqa: BLE001 - find the culprit, then report it
                raise DataError(f"{path}: document ~{first_doc + i + 1} cannot be tokenized ({type(exc2).__name__}: "
                                f"{exc2}; text starts {t[:60]!r}). Fix: repair or drop that document (invalid "
                                f"Unicode such as a lone surrogate escape) and convert again.") from exc2
        raise DataError(f"{path}: the tokenizer failed on a batch of documents ({type(exc).__name__}: {exc}).") \
            from exc


class _StreamingRowWriter:
    """streaming's own ``MDSWriter`` behind :class:`llmpipe.data.mds_writer.TokenMDSWriter`'s interface; used for
    compressions that writer does not implement (imports mosaicml-streaming, i.e. torch: seconds per process)."""

    def __init__(self, out: str, compression: str | None, size_limit: int | None) -> None:
        from streaming import MDSWriter

        self.writer = MDSWriter(out=out, columns=COLUMNS, compression=compression, size_limit=size_limit,
                                exist_ok=True)

    def write(self, rows: Any) -> None:
        write = self.writer.write
        for row in rows:
            write({"tokens": row})

    def finish(self) -> None:
        self.writer.finish()


def open_writer(out: str, concat_tokens: int, compression: str | None, size_limit: int | None) -> Any:
    """The MDS writer of a unit: our torch-free :class:`~llmpipe.data.mds_writer.TokenMDSWriter` (byte-identical
    output) for no compression / zstd, else mosaicml-streaming's ``MDSWriter``. Both take ``write(rows)`` with
    rows of shape (n, concat_tokens) int32 and ``finish()``."""
    from llmpipe.data import mds_writer

    if mds_writer.supports(compression):
        return mds_writer.TokenMDSWriter(out, concat_tokens, compression, size_limit)
    return _StreamingRowWriter(out, compression, size_limit)


def _process_start_time() -> float | None:
    """This process' start (epoch seconds) from /proc (Linux), for the start-up part of a unit's timings."""
    try:
        with open("/proc/self/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as fh:
            btime = next(int(line.split()[1]) for line in fh if line.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def convert_unit(spec: dict) -> dict:
    """Convert one input file into the MDS folder ``spec['unit_dir']`` (atomically: tmp folder + rename).

    Args:
        spec: built by :func:`plan_dataset`: ``split``, ``name``, ``input``, ``input_name``, ``input_bytes``,
            ``unit_dir``, ``tokenizer_dir``, ``tokenizer_fingerprint``, ``concat_tokens``, ``eos_ids``,
            ``compression``, ``size_limit``, ``progress`` (a JSON file for the parent's progress bars, or None);
            optional ``batch_chars`` (characters per tokenizer call, default ``BATCH_CHARS``; does not change the
            samples).

    Returns:
        The unit record (also stored as ``unit.json``): ``samples``, ``tokens`` (= samples x concat_tokens),
        ``documents``, ``empty_documents``, ``dropped_tokens``, ``seconds`` (this call), ``timings`` (epoch
        seconds: ``process_start``, ``start`` of this call, ``tokenizer_ready``, ``written`` (last shard
        and index), ``end``), ``phase_seconds`` (seconds in the tokenizer (``encode``), packing ids into
        samples (``pack``) and writing shards with their compression (``write``); the rest of ``seconds`` is
        reading, gunzip and JSON), ``rusage`` (this process during the unit, from ``getrusage``: ``user_s``,
        ``sys_s``, ``minflt`` (minor page faults), ``nvcsw`` / ``nivcsw`` (voluntary / involuntary context
        switches)), ``identity``, ...

    Raises:
        DataError: the input is not gzip / truncated / not C4 JSON (message names the file).
    """
    t0 = time.time()
    import resource

    import numpy as np
    from tqdm import tqdm

    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    timings = {"process_start": _process_start_time(), "start": t0}
    concat = int(spec["concat_tokens"])
    encode = worker_encoder(spec["tokenizer_dir"])
    timings["tokenizer_ready"] = time.time()
    eos = [int(i) for i in spec["eos_ids"]]
    neos = len(eos)
    split_dir = os.path.dirname(spec["unit_dir"])
    os.makedirs(split_dir, exist_ok=True)
    tmp_dir = os.path.join(split_dir, f".tmp-{spec['name']}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    stats = {"documents": 0, "empty_documents": 0, "bytes_read": 0}
    samples = 0
    carry = np.empty(0, dtype=np.int32)
    chain = itertools.chain.from_iterable
    tty = sys.stderr.isatty()
    bar = tqdm(total=spec["input_bytes"], unit="B", unit_scale=True, desc=f"{spec['split']}/{spec['name']}",
               mininterval=0.5 if tty else 60, file=sys.stderr, disable=spec.get("quiet", False))
    last_progress = 0.0
    # seconds per phase of this unit (perf_counter): tokenizer calls, packing ids into samples, shard writing
    # (compression included); the rest of the unit's time is reading, gunzip and JSON parsing
    phase = {"encode": 0.0, "pack": 0.0, "write": 0.0}
    clock = time.perf_counter
    try:
        writer = open_writer(tmp_dir, concat, spec["compression"], spec["size_limit"])
        docs_before = 0
        for texts in _iter_text_batches(spec["input"], stats, int(spec.get("batch_chars") or BATCH_CHARS)):
            c0 = clock()
            id_lists = _encode_or_explain(encode, texts, spec["input"], docs_before)
            c1 = clock()
            docs_before = stats["documents"]
            total = sum(map(len, id_lists)) + neos * len(id_lists)
            flat = np.fromiter(chain(x for ids in id_lists for x in (ids, eos)), dtype=np.int32, count=total)
            buf = np.concatenate((carry, flat)) if len(carry) else flat
            n = len(buf) // concat
            c2 = clock()
            if n:
                writer.write(buf[: n * concat].reshape(n, concat))
                samples += n
            carry = buf[n * concat:].copy()
            c3 = clock()
            phase["encode"] += c1 - c0
            phase["pack"] += c2 - c1
            phase["write"] += c3 - c2
            bar.update(stats["bytes_read"] - bar.n)
            now = time.time()
            if now - last_progress > 1.0:
                last_progress = now
                _write_progress(spec.get("progress"), {"bytes_done": stats["bytes_read"],
                                                       "bytes_total": spec["input_bytes"],
                                                       "tokens": samples * concat, "done": False})
        c0 = clock()
        writer.finish()
        phase["write"] += clock() - c0
        timings["written"] = time.time()
        bar.update(spec["input_bytes"] - bar.n)
        bar.close()
        with open(os.path.join(tmp_dir, "index.json")) as fh:
            index_samples = sum(s["samples"] for s in json.load(fh)["shards"])
        if index_samples != samples:
            raise DataError(f"internal error: {spec['name']} wrote {samples} samples but its index lists "
                            f"{index_samples}.")
        timings["end"] = time.time()
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        rec = {
            "split": spec["split"], "name": spec["name"], "input": spec["input"],
            "samples": samples, "tokens": samples * concat, "documents": stats["documents"],
            "empty_documents": stats["empty_documents"], "dropped_tokens": int(len(carry)),
            "seconds": round(timings["end"] - t0, 3), "host": os.uname().nodename, "pid": os.getpid(),
            "timings": {k: (round(v, 3) if v is not None else None) for k, v in timings.items()},
            "phase_seconds": {k: round(v, 6) for k, v in phase.items()},
            "rusage": {"user_s": round(ru1.ru_utime - ru0.ru_utime, 3), "sys_s": round(ru1.ru_stime - ru0.ru_stime, 3),
                       **{k: getattr(ru1, f"ru_{k}") - getattr(ru0, f"ru_{k}") for k in ("minflt", "nvcsw", "nivcsw")}},
            "identity": _unit_identity(spec),
        }
        with open(os.path.join(tmp_dir, "unit.json"), "w") as fh:  # the completion marker: written last
            json.dump(rec, fh, indent=1)
        _fsync_tree(tmp_dir)
        if os.path.exists(spec["unit_dir"]):
            shutil.rmtree(spec["unit_dir"])  # stale / other settings (plan_dataset normally removed it already)
        os.rename(tmp_dir, spec["unit_dir"])
        _fsync_dir(split_dir)
    except BaseException:
        bar.close()
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    _write_progress(spec.get("progress"), {"bytes_done": spec["input_bytes"], "bytes_total": spec["input_bytes"],
                                           "tokens": samples * concat, "done": True, "record": rec})
    return rec




# ------------------------------------------------------------------------------------------------ dataset

def check_concat_tokens(concat_tokens: Any) -> int:
    """``concat_tokens`` as an int.

    Raises:
        DataError: it is not positive.
    """
    concat = int(concat_tokens)
    if concat < 1:
        raise DataError(f"concat_tokens must be positive, got {concat_tokens!r}.")
    return concat


@dataclass(frozen=True, kw_only=True)
class DatasetPlan:
    """The units of one dataset folder and what they share, as :func:`plan_dataset` laid them out.

    Attributes:
        specs: one dict per unit (the argument of :func:`convert_unit` and :func:`unit_complete`), in corpus order,
            train split first.
        splits: the MDS splits that have units (``train``, and ``val`` when the corpus has validation files).
        work_dir: ``{out_dir}/.work``, the run's scratch folder (progress files; removed by
            :func:`finish_dataset`).
    """

    out_dir: str
    corpus_manifest: str
    tokenizer_dir: str
    tokenizer_fingerprint: str
    concat_tokens: int
    eos_text: str
    eos_ids: list[int]
    compression: str | None
    size_limit: int | None
    work_dir: str
    specs: list[dict]
    splits: list[str]


def _merge_split(split_dir: str, unit_names: list[str]) -> int:
    """Merge the units' index.json into ``{split_dir}/index.json`` (as streaming's ``merge_index`` does:
    shard basenames prefixed with the unit folder), written atomically. Returns the number of samples."""
    shards = []
    for name in unit_names:
        with open(os.path.join(split_dir, name, "index.json")) as fh:
            obj = json.load(fh)
        for shard in obj["shards"]:
            for key in ("raw_data", "zip_data", "raw_meta", "zip_meta"):
                if shard.get(key):
                    shard[key]["basename"] = f"{name}/{shard[key]['basename']}"
            shards.append(shard)
    atomic_write_json(os.path.join(split_dir, "index.json"), {"version": 2, "shards": shards})
    return sum(s["samples"] for s in shards)


def _clean_split_dir(split_dir: str, wanted: dict[str, dict]) -> None:
    """Delete leftovers of killed runs (.tmp-* folders), incomplete or stale units, and units not wanted."""
    if not os.path.isdir(split_dir):
        return
    for fn in sorted(os.listdir(split_dir)):
        p = os.path.join(split_dir, fn)
        if fn.startswith(".tmp-"):
            shutil.rmtree(p, ignore_errors=True)
        elif fn.startswith("unit-") and os.path.isdir(p):
            spec = wanted.get(fn)
            if spec is None or unit_complete(spec) is None:
                shutil.rmtree(p, ignore_errors=True)


def plan_dataset(corpus_manifest: str, tokenizer_dir: str, concat_tokens: int, eos_text: str, out_dir: str, *,
                 compression: str | None, size_limit: int | None, batch_chars: int | None = None,
                 progress: bool = True, quiet: bool = False) -> DatasetPlan:
    """Lay out the units of a dataset folder (one per input file) and clean it for a run; converts nothing.

    Removes ``{out_dir}/manifest.json`` (the dataset is incomplete until :func:`finish_dataset` writes it again),
    a previous run's ``.work`` folder and ``.tmp-*`` unit folders, and every unit folder that is incomplete, damaged,
    made from other inputs / settings, or not wanted any more; complete current units stay for reuse.

    Args:
        corpus_manifest: the corpus' ``manifest.json`` (from :func:`llmpipe.data.corpus.prepare_corpus`).
        tokenizer_dir: a tokenizer folder (from :func:`llmpipe.data.tokenizer.prepare_tokenizer`).
        concat_tokens: ids per sample (e.g. 2048).
        eos_text: text put between documents (its ids follow every document); must tokenize to >= 1 id.
        out_dir: the dataset folder (layout in the module docstring).
        compression: the shards' compression as mosaicml-streaming names it (``zstd``, ``zstd:7``, ...) or None.
        size_limit: bytes per shard, None for one shard per unit.
        batch_chars: characters of text per tokenizer call (default ``BATCH_CHARS``); the samples do not depend
            on it.
        progress: each unit writes a progress file under ``{out_dir}/.work/progress`` (for a parent that polls
            them; see :func:`convert_unit`).
        quiet: units draw no tqdm bar of their own.

    Raises:
        DataError: ``concat_tokens`` < 1, a bad corpus manifest, ``eos_text`` that tokenizes to nothing, an input
            file that is missing or not gzip (names it).
    """
    concat = check_concat_tokens(concat_tokens)
    cm = load_manifest(corpus_manifest)
    os.makedirs(out_dir, exist_ok=True)
    out_dir = os.path.abspath(out_dir)
    remove_if_exists(os.path.join(out_dir, "manifest.json"))

    eos_ids = eos_token_ids(tokenizer_dir, eos_text) if eos_text else []
    if not eos_ids:
        raise DataError(f"eos_text {eos_text!r} tokenizes to no tokens with the tokenizer in {tokenizer_dir}: "
                        f"documents could not be separated. Fix: set the tokenizer's eos_text to its end-of-text "
                        f"token (e.g. \"<|endoftext|>\").")
    fp = tokenizer_fingerprint(tokenizer_dir)

    work = os.path.join(out_dir, ".work")
    shutil.rmtree(work, ignore_errors=True)
    progress_dir = os.path.join(work, "progress")
    os.makedirs(progress_dir, exist_ok=True)

    specs: list[dict] = []
    present = []
    for csplit, msplit in MDS_SPLITS.items():
        files = cm["splits"].get(csplit) or []
        split_dir = os.path.join(out_dir, msplit)
        if not files:  # a corpus without validation files (only in benchmarks): no val split
            continue
        present.append(msplit)
        wanted = {}
        for i, f in enumerate(files):
            name = f"unit-{i:05d}"
            check_gzip_magic(f["path"])  # a non-gzip input fails here, before any unit runs
            spec = {
                "format": UNIT_FORMAT, "split": msplit, "name": name, "input": f["path"],
                "input_name": f.get("name") or os.path.basename(f["path"]), "input_bytes": int(f["bytes"]),
                "unit_dir": os.path.join(split_dir, name), "tokenizer_dir": os.path.abspath(tokenizer_dir),
                "tokenizer_fingerprint": fp, "concat_tokens": concat, "eos_ids": list(eos_ids),
                "compression": compression, "size_limit": size_limit,
                "progress": os.path.join(progress_dir, f"{msplit}.{name}.json") if progress else None,
                "quiet": quiet,
                "batch_chars": int(batch_chars or BATCH_CHARS),
            }
            wanted[name] = spec
            specs.append(spec)
        _clean_split_dir(split_dir, wanted)
        os.makedirs(split_dir, exist_ok=True)
    return DatasetPlan(out_dir=out_dir, corpus_manifest=corpus_manifest, tokenizer_dir=tokenizer_dir,
                       tokenizer_fingerprint=fp, concat_tokens=concat, eos_text=eos_text, eos_ids=list(eos_ids),
                       compression=compression, size_limit=size_limit, work_dir=work, specs=specs, splits=present)


def finish_dataset(plan: DatasetPlan, *, converted: list[str], reused: list[str], workers: int, started_at: float,
                   log_dir: str) -> dict:
    """Merge the units of every split into ``{split}/index.json`` and write ``{out_dir}/manifest.json`` (last,
    atomically); remove the run's ``.work`` folder.

    Args:
        plan: from :func:`plan_dataset`; every unit must be complete.
        converted / reused: the units (``split/name``) this run converted / found complete (recorded as
            ``converted_units`` / ``reused_units``).
        workers: processes or array tasks that converted them (``workers``).
        started_at: when the run started (epoch s; ``seconds`` is counted from it).
        log_dir: where the units' logs are (named in the error for an incomplete unit).

    Returns:
        The dataset manifest: ``splits.{train,val}.{samples, tokens, documents, empty_documents, dropped_tokens,
        units: [unit record, ...]}``, ``concat_tokens``, ``eos_ids``, ``columns``, ``converted_units`` /
        ``reused_units`` / ``workers`` (this run), ``started_at`` (epoch s), ``seconds``; each unit record carries
        its ``timings``, ``phase_seconds`` and ``rusage`` (see :func:`convert_unit`).

    Raises:
        DataError: the corpus lists no input files, a unit is not complete, a merged index does not add up, or a
            split has 0 samples (corpus too small for ``concat_tokens``).
    """
    out_dir, specs, concat = plan.out_dir, plan.specs, plan.concat_tokens
    manifest: dict[str, Any] = {
        "version": 1, "corpus_manifest": os.path.abspath(plan.corpus_manifest),
        "tokenizer_dir": os.path.abspath(plan.tokenizer_dir), "tokenizer_fingerprint": plan.tokenizer_fingerprint,
        "concat_tokens": concat, "eos_text": plan.eos_text, "eos_ids": list(plan.eos_ids), "columns": COLUMNS,
        "dtype": TOKEN_DTYPE, "compression": plan.compression, "size_limit": plan.size_limit,
        "splits": {}, "converted_units": list(converted), "reused_units": list(reused), "workers": workers,
    }
    if not specs:
        raise DataError(f"{plan.corpus_manifest} lists no input files. Fix: prepare the corpus again.")
    for msplit in plan.splits:
        split_specs = [s for s in specs if s["split"] == msplit]
        recs = []
        for s in split_specs:
            rec = unit_complete(s)
            if rec is None:
                raise DataError(f"unit {msplit}/{s['name']} ({s['input']}) is not complete after conversion. "
                                f"Fix: rerun; see the logs in {log_dir}.")
            recs.append({**{k: rec[k] for k in ("name", "input", "samples", "tokens", "documents",
                                                "empty_documents", "dropped_tokens", "seconds")},
                         "timings": rec.get("timings"), "phase_seconds": rec.get("phase_seconds"),
                         "rusage": rec.get("rusage")})
        split_dir = os.path.join(out_dir, msplit)
        n = _merge_split(split_dir, [s["name"] for s in split_specs])
        total = {k: sum(r[k] for r in recs) for k in ("samples", "tokens", "documents", "empty_documents",
                                                      "dropped_tokens")}
        if n != total["samples"]:
            raise DataError(f"merged index of {split_dir} lists {n} samples but its units hold "
                            f"{total['samples']}. Fix: delete {split_dir} and rerun.")
        if n == 0:
            raise DataError(f"the {msplit} split of {plan.corpus_manifest} gives 0 samples of concat_tokens={concat} "
                            f"tokens ({total['dropped_tokens']} tokens in all, {total['documents']} documents). "
                            f"Fix: lower concat_tokens or use more files (train_files / val_files).")
        manifest["splits"][msplit] = {**total, "units": recs}
    manifest["started_at"] = round(started_at, 3)
    manifest["seconds"] = round(time.time() - started_at, 3)
    atomic_write_json(os.path.join(out_dir, "manifest.json"), manifest)
    shutil.rmtree(plan.work_dir, ignore_errors=True)
    return manifest
