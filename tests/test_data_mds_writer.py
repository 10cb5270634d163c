"""Our torch-free MDS shard writer writes exactly the bytes mosaicml-streaming's MDSWriter writes."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys

import numpy as np
import pytest

from llmpipe.data.mds_writer import TokenMDSWriter, supports


def _streaming_write(out, rows, compression, size_limit):
    from streaming import MDSWriter

    with MDSWriter(out=str(out), columns={"tokens": "ndarray:int32"}, compression=compression,
                   size_limit=size_limit) as w:
        for r in rows:
            w.write({"tokens": r})


@pytest.mark.parametrize("seq_len,n,compression,size_limit,blocks", [
    (2048, 37, "zstd", 1 << 16, [5, 1, 20, 11]),      # several shards, uint16 shape, blocks across shard ends
    (2048, 8, "zstd", 1 << 26, [8]),                  # one shard (the default size limit)
    (100, 300, None, 1 << 14, [299, 1]),              # uncompressed, uint8 shape
    (300, 50, "zstd:7", 20_000, [1] * 50),            # a zstd level, one row at a time
    (70_000, 3, "zstd", None, [2, 1]),                # uint32 shape, no size limit: one shard
    (16, 1, None, 1 << 26, [1]),                      # a single row
])
def test_same_bytes_as_streaming(tmp_path, seq_len, n, compression, size_limit, blocks):
    rng = np.random.default_rng(seq_len + n)
    rows = rng.integers(0, 50_000, size=(n, seq_len), dtype=np.int32)
    _streaming_write(tmp_path / "ref", rows, compression, size_limit)
    w = TokenMDSWriter(str(tmp_path / "ours"), seq_len, compression, size_limit)
    i = 0
    for b in blocks:
        w.write(rows[i:i + b])
        i += b
    assert i == n
    w.finish()
    ref, ours = sorted(os.listdir(tmp_path / "ref")), sorted(os.listdir(tmp_path / "ours"))
    assert ours == ref
    assert len(ref) > 1
    for fn in ref:
        assert filecmp.cmp(tmp_path / "ref" / fn, tmp_path / "ours" / fn, shallow=False), fn
    if size_limit == 1 << 16:
        assert len(ref) > 3  # the case really splits shards


def test_streaming_reads_it_back(tmp_path):
    from llmpipe.train.shm_names import open_reader

    rows = np.arange(40 * 64, dtype=np.int32).reshape(40, 64)
    w = TokenMDSWriter(str(tmp_path / "ds"), 64, "zstd", 4000)
    w.write(rows)
    idx = w.finish()
    assert len(idx["shards"]) > 2 and sum(s["samples"] for s in idx["shards"]) == 40
    with open_reader(str(tmp_path / "ds")) as ds:
        got = np.stack([ds[i]["tokens"] for i in range(len(ds))])
    np.testing.assert_array_equal(got, rows)


def test_bad_input_and_settings(tmp_path):
    assert supports(None) and supports("zstd") and supports("zstd:22")
    assert not supports("gz") and not supports("zstd:0") and not supports("zstd:x")
    assert not supports("zstd:03") and not supports("ZSTD") and not supports(" zstd") and not supports("zstd:+3")
    with pytest.raises(ValueError, match="not supported"):
        TokenMDSWriter(str(tmp_path / "a"), 8, "gz")
    small = TokenMDSWriter(str(tmp_path / "b"), 2048, None, 1000)
    with pytest.raises(ValueError, match="size_limit"):
        small.write(np.zeros((1, 2048), np.int32))
    w = TokenMDSWriter(str(tmp_path / "c"), 8)
    with pytest.raises(ValueError, match="int32"):
        w.write(np.zeros((2, 8), np.int64))
    with pytest.raises(ValueError, match="shape"):
        w.write(np.zeros((2, 9), np.int32))


def test_accepted_compressions_are_streamings():
    from streaming.base.compression import get_compressions

    from llmpipe.data.mds_writer import STREAMING_COMPRESSIONS

    assert STREAMING_COMPRESSIONS == set(get_compressions()) | {None}


def test_writer_does_not_import_torch():
    """The point of the writer: a conversion worker never imports torch / transformers / streaming."""
    code = ("import sys, numpy as np\n"
            "from llmpipe.data.mds_writer import TokenMDSWriter\n"
            "import tempfile\n"
            "w = TokenMDSWriter(tempfile.mkdtemp(), 8, 'zstd'); w.write(np.zeros((3, 8), np.int32)); w.finish()\n"
            "from llmpipe.data import mds\n"
            "import llmpipe.dispatch.unit_array\n"
            "heavy = [m for m in ('torch', 'transformers', 'streaming') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
