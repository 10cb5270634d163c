"""Tokenize + concatenate + write MDS, in parallel, restartably; and verify the result.

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

**Parallel.** Units run through :func:`llmpipe.dispatch.map_steps`: locally as ``workers`` processes (submitit's
local executor) that each claim units from a shared queue (largest file first), on Slurm as a job array of one
task per unit (``array_parallelism = workers``). ``TOKENIZERS_PARALLELISM=false`` in every worker: one core per
worker. Progress: a tqdm bar per running unit on a terminal and a line per finished unit (tokens written).
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import os
import shutil
import sys
import threading
import time
import unicodedata
import uuid
import zlib
from typing import Any, Iterator

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
    return list(_tokenizer(os.path.abspath(tokenizer_dir))(eos_text, add_special_tokens=False)["input_ids"])


def _tokenizer(tokenizer_dir: str):
    """The tokenizer of a folder, cached per process (keyed by the folder's content, not only its path)."""
    key = f"{tokenizer_dir}:{tokenizer_fingerprint(tokenizer_dir)}"
    if key not in _TOKENIZERS:
        from llmpipe.data.tokenizer import load_tokenizer

        _TOKENIZERS[key] = load_tokenizer(tokenizer_dir)
    return _TOKENIZERS[key]


def _unit_identity(spec: dict) -> dict:
    return {k: spec[k] for k in ("format", "input_name", "input_bytes", "tokenizer_fingerprint", "concat_tokens",
                                 "eos_ids", "compression", "size_limit")}


def _read_unit(unit_dir: str) -> dict | None:
    """The unit's completion record, or None when the unit is missing, incomplete or damaged.

    Damaged means: ``index.json`` does not parse, lists another number of samples than ``unit.json``, or a shard
    file it names (the compressed one when the shard is compressed) is missing or has another size, or
    streaming's decompressed copy of a compressed shard (which training reads when present) has another size.
    Such a unit is converted again by the next run (the sample bytes themselves are checked by
    :func:`verify_dataset`).
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
    rec = _read_unit(spec["unit_dir"])
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
    from llmpipe.data.corpus import _check_gzip_magic

    _check_gzip_magic(path)
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

def _worker_encoder(tokenizer_dir: str):
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
            tok = _tokenizer(tokenizer_dir)

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
        spec: built by :func:`convert_dataset`: ``split``, ``name``, ``input``, ``input_name``, ``input_bytes``,
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
    encode = _worker_encoder(spec["tokenizer_dir"])
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
            shutil.rmtree(spec["unit_dir"])  # stale / other settings (the parent normally removed it already)
        os.rename(tmp_dir, spec["unit_dir"])
        _fsync_dir(split_dir)
    except BaseException:
        bar.close()
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    _write_progress(spec.get("progress"), {"bytes_done": spec["input_bytes"], "bytes_total": spec["input_bytes"],
                                           "tokens": samples * concat, "done": True, "record": rec})
    return rec


def run_units(job: dict) -> list[dict]:
    """Worker entry point (one submitit job): convert units from ``job['units']``.

    With ``job['claim_dir']`` set, several jobs share one list and each unit is claimed by exactly one job
    (an ``O_EXCL`` file per unit), so ``workers`` local processes balance the load dynamically.
    Returns the records of the units this job converted.
    """
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    done = []
    claim_dir = job.get("claim_dir")
    for spec in job["units"]:
        if claim_dir:
            try:
                fd = os.open(os.path.join(claim_dir, f"{spec['split']}.{spec['name']}"),
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                os.close(fd)
            except FileExistsError:
                continue
        if unit_complete(spec):
            continue
        done.append(convert_unit(spec))
    return done


# ------------------------------------------------------------------------------------------------ progress

class _Monitor(threading.Thread):
    """Parent-side progress: a tqdm bar per running unit (on a terminal) and one line per finished unit."""

    def __init__(self, specs: list[dict], log_file: str | None, bars: bool):
        super().__init__(daemon=True)
        self.specs = specs
        self.log_file = log_file
        self.bars_on = bars and sys.stderr.isatty()
        self.bars: dict[str, Any] = {}
        self.announced: set[str] = set()
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.total = len(specs)

    def announce(self, rec: dict) -> None:
        from llmpipe.dispatch import _say

        key = f"{rec['split']}/{rec['name']}"
        with self.lock:
            if key in self.announced:
                return
            self.announced.add(key)
            bar = self.bars.pop(key, None)
            if bar is not None:
                bar.close()
            rate = rec["tokens"] / rec["seconds"] if rec.get("seconds") else 0.0
            msg = (f"mds: unit {key} done ({len(self.announced)}/{self.total}): {rec['tokens']:,} tokens in "
                   f"{rec['samples']:,} samples from {rec['documents']:,} documents, {rec['seconds']:.1f} s, "
                   f"{rate / 1e6:.2f} M tokens/s")
            if self.bars_on:
                from tqdm import tqdm

                with tqdm.external_write_mode(file=sys.stderr):
                    _say(msg, self.log_file)
            else:
                _say(msg, self.log_file)

    def poll(self) -> None:
        for spec in self.specs:
            key = f"{spec['split']}/{spec['name']}"
            if key in self.announced or not spec.get("progress"):
                continue
            try:
                with open(spec["progress"]) as fh:
                    prog = json.load(fh)
            except (OSError, ValueError):
                continue
            if prog.get("done") and prog.get("record"):
                self.announce(prog["record"])
                continue
            if self.bars_on:
                from tqdm import tqdm

                with self.lock:
                    bar = self.bars.get(key)
                    if bar is None:
                        bar = self.bars[key] = tqdm(total=prog["bytes_total"], unit="B", unit_scale=True,
                                                    desc=key, leave=False, file=sys.stderr)
                    bar.update(prog["bytes_done"] - bar.n)

    def run(self) -> None:
        while not self.stop_event.wait(0.5):
            self.poll()

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=5)
        self.poll()
        with self.lock:
            for bar in self.bars.values():
                bar.close()
            self.bars.clear()


# ------------------------------------------------------------------------------------------------ dataset

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


def resolve_workers(config: dict, n_units: int) -> int:
    """``data_prep.workers``, with 0 meaning min(units, CPUs available to this process)."""
    w = int((config.get("data_prep") or {}).get("workers", 0) or 0)
    if w <= 0:
        try:
            cpus = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cpus = os.cpu_count() or 1
        w = cpus
    return max(1, min(w, n_units)) if n_units else 0


def convert_dataset(corpus_manifest: str, tokenizer_dir: str, concat_tokens: int, eos_text: str, out_dir: str, *,
                    config: dict, log_dir: str, log_file: str | None = None, batch_chars: int | None = None) -> dict:
    """Tokenize, concatenate and write a corpus as MDS train/val datasets, one parallel unit per input file.

    Args:
        corpus_manifest: the corpus' ``manifest.json`` (from :func:`llmpipe.data.corpus.prepare_corpus`).
        tokenizer_dir: a tokenizer folder (from :func:`llmpipe.data.tokenizer.prepare_tokenizer`).
        concat_tokens: ids per sample (e.g. 2048).
        eos_text: text put between documents (its ids follow every document); must tokenize to >= 1 id.
        out_dir: the dataset folder (layout in the module docstring).
        config: the workflow config: ``data_prep`` (``compression``, ``size_limit`` in bytes per shard,
            ``workers``: 0 = min(units, CPUs); optional ``cpus_per_unit`` (1), ``mem_gb_per_unit`` (4)),
            ``dispatch`` (executor: local | slurm | debug) and ``data_resources`` (time limit).
        log_dir: folder for submitit's per-job logs.
        log_file: the rule's log file; the per-unit lines are appended to it too.
        batch_chars: characters of text per tokenizer call (default ``BATCH_CHARS``); for benchmarks, the samples
            do not depend on it.

    Returns:
        The dataset manifest (also ``{out_dir}/manifest.json``): ``splits.{train,val}.{samples, tokens,
        documents, empty_documents, dropped_tokens, units: [unit record, ...]}``, ``concat_tokens``, ``eos_ids``,
        ``columns``, ``converted_units`` / ``reused_units`` / ``workers`` (this run), ``started_at`` (epoch s), ``seconds``;
        each unit record carries its ``timings`` (see :func:`convert_unit`).

    Raises:
        DataError: bad input file (names it), ``eos_text`` that tokenizes to nothing, a split with 0 samples
            (corpus too small for ``concat_tokens``).
        llmpipe.dispatch.StepFailed: a unit's job failed (message: the job's error and log tail, which name
            the file for bad input).
    """
    from llmpipe.config import step_resources, validate_data_prep
    from llmpipe.data.corpus import _check_gzip_magic, load_manifest
    from llmpipe.dispatch import _executor_kind, _say, map_steps

    t0 = time.time()
    concat = int(concat_tokens)
    if concat < 1:
        raise DataError(f"concat_tokens must be positive, got {concat_tokens!r}.")
    shards = validate_data_prep(config, concat)
    compression, size_limit = shards["compression"], shards["size_limit"]  # size_limit None: one shard per unit
    cm = load_manifest(corpus_manifest)
    dp = config.get("data_prep") or {}
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
    kind = _executor_kind(config)

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
            _check_gzip_magic(f["path"])  # a non-gzip input fails here, before anything is dispatched
            spec = {
                "format": UNIT_FORMAT, "split": msplit, "name": name, "input": f["path"],
                "input_name": f.get("name") or os.path.basename(f["path"]), "input_bytes": int(f["bytes"]),
                "unit_dir": os.path.join(split_dir, name), "tokenizer_dir": os.path.abspath(tokenizer_dir),
                "tokenizer_fingerprint": fp, "concat_tokens": concat, "eos_ids": list(eos_ids),
                "compression": compression, "size_limit": size_limit,
                "progress": os.path.join(progress_dir, f"{msplit}.{name}.json") if kind != "slurm" else None,
                # local workers log to files and the parent draws their bars; on Slurm the bar goes to the
                # job's log (a line a minute); in debug mode the unit runs here and draws its own bar
                "quiet": kind == "local",
                "batch_chars": int(batch_chars or BATCH_CHARS),
            }
            wanted[name] = spec
            specs.append(spec)
        _clean_split_dir(split_dir, wanted)
        os.makedirs(split_dir, exist_ok=True)

    todo = [s for s in specs if unit_complete(s) is None]
    reused = [f"{s['split']}/{s['name']}" for s in specs if s not in todo]
    todo.sort(key=lambda s: -s["input_bytes"])  # largest first: better balance over the workers
    n_workers = resolve_workers(config, len(todo))
    if reused:
        _say(f"mds: {len(reused)} unit(s) already complete, reused: {', '.join(reused[:8])}"
             f"{' ...' if len(reused) > 8 else ''}", log_file)
    if todo:
        res = dict(step_resources(config, "data"))
        res.update(nodes=1, gpus_per_node=0, tasks_per_node=1, cpus_per_task=int(dp.get("cpus_per_unit", 1)),
                   mem_gb=int(dp.get("mem_gb_per_unit", 4)))
        if kind == "slurm":
            jobs = [{"units": [s], "claim_dir": None} for s in todo]
            max_parallel = n_workers if int(dp.get("workers", 0) or 0) > 0 else 0
        else:
            claim_dir = os.path.join(work, "claims")
            os.makedirs(claim_dir, exist_ok=True)
            jobs = [{"units": todo, "claim_dir": claim_dir} for _ in range(n_workers)]
            max_parallel = 0
        how = (f"as a Slurm job array of {len(jobs)} task(s)" + (f", at most {max_parallel} at once" if max_parallel
                                                                  else "")) if kind == "slurm" else \
            f"with {len(jobs)} worker process(es) ({kind})"
        _say(f"mds: converting {len(todo)} unit(s) of {len(specs)} {how}; concat_tokens={concat}, "
             f"eos ids {list(eos_ids)}", log_file)
        # progress files are polled for local runs only: on Slurm (hundreds of units on a shared file system)
        # the line per finished unit comes from map_steps' on_result
        mon = _Monitor(todo if kind != "slurm" else [], log_file, bars=kind == "local")
        mon.total = len(todo)
        mon.start()
        try:
            map_steps(run_units, jobs, step="mds " + "/".join(out_dir.split(os.sep)[-4:]), resources=res, config=config,
                      log_dir=log_dir, log_file=log_file, max_parallel=max_parallel,
                      on_result=lambda i, recs: [mon.announce(r) for r in recs or []])
        finally:
            mon.stop()

    manifest: dict[str, Any] = {
        "version": 1, "corpus_manifest": os.path.abspath(corpus_manifest),
        "tokenizer_dir": os.path.abspath(tokenizer_dir), "tokenizer_fingerprint": fp,
        "concat_tokens": concat, "eos_text": eos_text, "eos_ids": list(eos_ids), "columns": COLUMNS,
        "dtype": TOKEN_DTYPE, "compression": compression, "size_limit": size_limit,
        "splits": {}, "converted_units": [f"{s['split']}/{s['name']}" for s in todo], "reused_units": reused,
        "workers": n_workers if todo else 0,
    }
    if not specs:
        raise DataError(f"{corpus_manifest} lists no input files. Fix: prepare the corpus again.")
    for msplit in present:
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
            raise DataError(f"the {msplit} split of {corpus_manifest} gives 0 samples of concat_tokens={concat} "
                            f"tokens ({total['dropped_tokens']} tokens in all, {total['documents']} documents). "
                            f"Fix: lower concat_tokens or use more files (train_files / val_files).")
        manifest["splits"][msplit] = {**total, "units": recs}
    manifest["started_at"] = round(t0, 3)
    manifest["seconds"] = round(time.time() - t0, 3)
    atomic_write_json(os.path.join(out_dir, "manifest.json"), manifest)
    shutil.rmtree(work, ignore_errors=True)
    _say(f"mds: {out_dir}: " + ", ".join(f"{k} {v['samples']:,} samples ({v['tokens']:,} tokens)"
                                         for k, v in manifest["splits"].items())
         + f" in {manifest['seconds']:.1f} s", log_file)
    return manifest


# ------------------------------------------------------------------------------------------------ verify

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
    """Open the split with streaming's StreamingDataset (as training does); return its length and samples."""
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    ds = StreamingDataset(local=out_dir, split=split, shuffle=False, batch_size=1)
    try:
        n = len(ds)
        return n, [ds[i]["tokens"] for i in indices if 0 <= i < n]
    finally:
        del ds
        clean_stale_shared_memory()


def verify_dataset(out_dir: str, tokenizer_dir: str, concat_tokens: int, vocab_size: int, out_json: str) -> dict:
    """Read a converted dataset back and check it; write the report ``out_json`` (atomically) and return it.

    Checks, per split: the merged index' sample count equals the sum of the units' (index and unit.json) and the
    manifest's; every sample of every shard holds exactly ``concat_tokens`` ids of dtype int32, all in
    ``[0, vocab_size)`` (vectorized scan of each decompressed shard); streaming's ``StreamingDataset`` (the reader
    training uses) sees the same number of samples and returns int32 arrays of shape (concat_tokens,); three
    samples (first, middle, last) decode to text found in the source file of their unit (compared after NFC, the
    tokenizer's own normalizer and whitespace collapsing).

    Args:
        out_dir: the dataset folder written by :func:`convert_dataset`.
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
    tok = _tokenizer(os.path.abspath(tokenizer_dir))
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
            rec = _read_unit(os.path.join(split_dir, u["name"]))
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
