"""Write MDS shards of fixed-length token rows without importing mosaicml-streaming.

Why this exists: ``import streaming`` runs the package's ``__init__``, which imports torch, transformers, scipy,
sympy and torchvision (its dataset, vision and text modules). Measured with ``python -X importtime`` that is 5.5 s
on this project's 2-core CI machine; timed in fresh processes it took 8.5-19 s per process on the 16-core H200
host of the device tool (benchmarks/README.md, "MDS conversion"), which is more than converting a 24 MB input
file, and every conversion worker paid it. A conversion worker only needs to write one column, so it writes the shards itself:

* the bytes are exactly those of ``streaming.MDSWriter(columns={"tokens": "ndarray:int32"}, compression=...,
  size_limit=..., hashes=None)`` fed the same rows one by one (``tests/test_data_mds_writer.py`` compares the
  files byte for byte, index included, for several compressions, shard splits and row lengths);
* the format facts used (MDS "version 2", read from streaming 0.12's ``format/mds/writer.py``,
  ``format/base/writer.py`` and ``format/mds/encodings.py``): a shard is ``uint32 n``, ``uint32 offsets[n+1]``
  (absolute byte offsets of the samples), the writer's JSON config (sorted keys), then the samples; a sample with
  one variable-size column is ``uint32 size`` + the column's bytes; an ``ndarray:int32`` value without a fixed
  shape is ``byte(ndim << 2 | shape-dtype code)`` + its shape in the smallest unsigned dtype that holds it
  (codes 0..3 = uint8/16/32/64) + the int32 values; a shard is closed before a sample would make
  ``8 + len(config) + sum(sample size + 4)`` exceed ``size_limit``; ``zstd`` compresses a shard with the ``zstd``
  package at level 3 (``zstd:N`` = level N) into ``shard.NNNNN.mds.zstd`` and only that file is kept;
  ``index.json`` is ``{"shards": [...], "version": 2}`` with sorted keys.

Only compression ``None``, ``zstd`` and ``zstd:N`` are supported here (:func:`supports`); the converter uses
streaming's own ``MDSWriter`` for anything else. Reading is always done by streaming (training's
``StreamingDataset`` and :func:`llmpipe.data.mds_verify.verify_dataset`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

#: Every ``compression`` value mosaicml-streaming 0.12 accepts (``streaming.base.compression.get_compressions()``,
#: checked against it in tests/test_data_mds_writer.py), so a bad ``data_prep.compression`` fails at plan time.
STREAMING_COMPRESSIONS = frozenset(
    [None, "br", "bz2", "gz", "snappy", "zstd"] + [f"br:{i}" for i in range(12)] + [f"bz2:{i}" for i in range(1, 10)]
    + [f"gz:{i}" for i in range(10)] + [f"zstd:{i}" for i in range(1, 23)])
#: Shards hold uint32 byte offsets: a shard (and so ``size_limit``) must stay below 4 GiB.
MAX_SHARD_BYTES = (1 << 32) - 1

#: The column this writer writes (what llm-foundry's text dataloader reads).
COLUMN_NAME = "tokens"
COLUMN_ENCODING = "ndarray:int32"


def _zstd_level(compression: str | None) -> int | None:
    """0 for no compression, the zstd level for ``zstd`` / ``zstd:N``, None when unsupported here."""
    if not compression:
        return 0
    if compression not in STREAMING_COMPRESSIONS or not str(compression).startswith("zstd"):
        return None  # exactly streaming's spellings: "zstd:03" or "ZSTD" would give an index it cannot read
    _, _, level = str(compression).partition(":")
    return int(level) if level else 3


def supports(compression: str | None) -> bool:
    """True when :class:`TokenMDSWriter` can write shards with this ``data_prep.compression`` value."""
    return _zstd_level(compression) is not None


def _shape_code(n: int) -> tuple[int, str]:
    for code, dtype in enumerate(("uint8", "uint16", "uint32", "uint64")):
        if n < 1 << (8 << code):
            return code, dtype
    raise ValueError(f"row length {n} is too large")


class TokenMDSWriter:
    """MDS writer for rows of exactly ``seq_len`` int32 token ids (column ``tokens``, ``ndarray:int32``).

    Args:
        out: the folder to write (created; must not hold another dataset's files).
        seq_len: ids per row (``concat_tokens``), >= 1.
        compression: None, ``"zstd"`` or ``"zstd:N"`` (N in 1..22).
        size_limit: shard size limit in bytes (as streaming's ``size_limit``: int, 0/None = one shard).

    Raises:
        ValueError: unsupported compression or ``seq_len`` < 1.
    """

    def __init__(self, out: str, seq_len: int, compression: str | None = None,
                 size_limit: int | None = 1 << 26) -> None:
        level = _zstd_level(compression)
        if level is None:
            raise ValueError(f"compression {compression!r} is not supported by TokenMDSWriter (use None, 'zstd' "
                             f"or 'zstd:N'); mosaicml-streaming's MDSWriter writes the others.")
        if int(seq_len) < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.out = out
        self.seq_len = int(seq_len)
        self.compression = compression or None
        self.level = level
        self.size_limit = int(size_limit) if size_limit else None
        if self.size_limit is not None and not 0 < self.size_limit <= MAX_SHARD_BYTES:
            raise ValueError(f"size_limit must be in 1..{MAX_SHARD_BYTES} bytes (uint32 offsets), got {size_limit}")
        config = {"version": 2, "format": "mds", "compression": self.compression, "hashes": [],
                  "size_limit": self.size_limit, "column_names": [COLUMN_NAME],
                  "column_encodings": [COLUMN_ENCODING], "column_sizes": [None]}
        self.config = config
        self.config_data = json.dumps(config, sort_keys=True).encode("utf-8")
        code, shape_dtype = _shape_code(self.seq_len)
        datum_len = 1 + np.dtype(shape_dtype).itemsize + 4 * self.seq_len
        # every sample: uint32 size of the column + [ndim<<2 | code] + shape + values
        self.prefix = np.frombuffer(np.array([datum_len], np.uint32).tobytes() + bytes([(1 << 2) | code])
                                    + np.array([self.seq_len], shape_dtype).tobytes(), np.uint8)
        self.sample_bytes = 4 + datum_len
        if self.size_limit:
            room = self.size_limit - (8 + len(self.config_data))
            self.rows_per_shard = room // (self.sample_bytes + 4)
        else:
            self.rows_per_shard = None
        os.makedirs(out, exist_ok=True)
        self.shards: list[dict[str, Any]] = []
        self._pending: list[np.ndarray] = []
        self._pending_rows = 0

    def write(self, rows: np.ndarray) -> None:
        """Append rows (shape ``(n, seq_len)``, dtype int32); full shards are written as they fill.

        Raises:
            ValueError: wrong dtype or row length; a ``size_limit`` too small for one row (streaming's writer
                would write an empty shard and then exceed the limit).
        """
        rows = np.asarray(rows)
        if rows.dtype != np.int32 or rows.ndim != 2 or rows.shape[1] != self.seq_len:
            raise ValueError(f"rows must be int32 of shape (n, {self.seq_len}), got {rows.dtype} {rows.shape}")
        if self.rows_per_shard is not None and self.rows_per_shard < 1 and len(rows):
            raise ValueError(f"size_limit {self.size_limit} bytes cannot hold one row of {self.seq_len} ids "
                             f"({self.sample_bytes + 4 + 8 + len(self.config_data)} bytes). Fix: raise "
                             f"data_prep.size_limit.")
        while len(rows):
            take = len(rows) if self.rows_per_shard is None else \
                min(len(rows), self.rows_per_shard - self._pending_rows)
            self._pending.append(rows[:take])
            self._pending_rows += take
            rows = rows[take:]
            if self.rows_per_shard is not None and self._pending_rows == self.rows_per_shard:
                self._flush()

    def _flush(self) -> None:
        rows = np.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
        n = len(rows)
        if 4 + 4 * (n + 1) + len(self.config_data) + n * self.sample_bytes > MAX_SHARD_BYTES:
            raise ValueError(f"a shard of {n} rows would exceed 4 GiB (MDS offsets are uint32). Fix: set "
                             f"data_prep.size_limit (e.g. 67108864) instead of 0.")
        self._pending, self._pending_rows = [], 0
        body = np.empty((n, self.sample_bytes), np.uint8)
        body[:, : len(self.prefix)] = self.prefix
        body[:, len(self.prefix):] = np.ascontiguousarray(rows).view(np.uint8).reshape(n, 4 * self.seq_len)
        head_len = 4 + 4 * (n + 1) + len(self.config_data)
        offsets = (np.arange(n + 1, dtype=np.int64) * self.sample_bytes + head_len).astype(np.uint32)
        raw = b"".join((np.array([n], np.uint32).tobytes(), offsets.tobytes(), self.config_data, body.tobytes()))
        raw_name = f"shard.{len(self.shards):05d}.mds"
        raw_info = {"basename": raw_name, "bytes": len(raw), "hashes": {}}
        zip_info = None
        data, name = raw, raw_name
        if self.level:
            import zstd  # the package mosaicml-streaming compresses with

            data, name = zstd.compress(raw, self.level), raw_name + ".zstd"
            zip_info = {"basename": name, "bytes": len(data), "hashes": {}}
        with open(os.path.join(self.out, name), "wb") as fh:
            fh.write(data)
        self.shards.append({"samples": n, "raw_data": raw_info, "zip_data": zip_info, **self.config})

    def finish(self) -> dict:
        """Write the last shard and then ``index.json``; return the index (``{"shards": [...], "version": 2}``)."""
        if self._pending_rows:
            self._flush()
        index = {"version": 2, "shards": self.shards}
        with open(os.path.join(self.out, "index.json"), "w") as fh:
            json.dump(index, fh, sort_keys=True)
        return index
