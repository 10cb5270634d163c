"""MDS conversion: exact samples, edge cases, restart after a killed unit, merge counts, verification."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from llmpipe.data.corpus import builtin_documents, prepare_corpus
from llmpipe.data.errors import DataError
from llmpipe.data.mds_verify import verify_dataset
from llmpipe.data.tokenizer import prepare_tokenizer
from llmpipe.steps.mds_units import convert_dataset
from llmpipe.config.schema import fill_defaults
from llmpipe.dispatch.unit_array import resolve_workers
from tests.test_data_corpus import write_c4

EOS = "<|endoftext|>"
C = 32  # concat_tokens in these tests
DEBUG = {"dispatch": {"executor": "debug", "poll_s": 0.05},
         "data_prep": {"compression": "zstd", "size_limit": 1 << 16, "workers": 0}}


def cfg(tmp, **dp) -> dict:
    """The debug config with ``data_prep`` values ``dp``, its other settings the schema's defaults (as a validated
    config has them)."""
    c = json.loads(json.dumps(DEBUG))
    c["dispatch"]["state_dir"] = str(tmp / "state")
    c["data_prep"].update(dp)
    return fill_defaults(c)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A small byte-level BPE (vocab 512) trained on real prose; returns (folder, AutoTokenizer)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("mdstok")
    texts = [d["text"] for d in builtin_documents(max_chars=200_000)]
    write_c4(root / "m", "train", 0, texts)
    write_c4(root / "m", "validation", 0, texts[:3])
    prepare_corpus({"source": "local", "local_dir": str(root / "m"), "train_files": 1, "val_files": 1},
                   str(root / "c"))
    prepare_tokenizer({"source": "train", "vocab_size": 512, "eos_text": EOS}, str(root / "tok"),
                      str(root / "c" / "manifest.json"))
    t = AutoTokenizer.from_pretrained(str(root / "tok"))
    t.model_max_length = int(1e30)
    return str(root / "tok"), t


def ids(t, text: str) -> list[int]:
    return t(text)["input_ids"]  # exactly how llm-foundry's ConcatTokensDataset tokenizes a document


def boundary_doc(t) -> str:
    """A document whose tokens + EOS fill exactly 2 samples."""
    words = "the module returns a value when the function is called with its arguments".split()
    for n in range(1, 400):
        text = " ".join(words[i % len(words)] for i in range(n)).capitalize() + "."
        if len(ids(t, text)) + 1 == 2 * C:
            return text
    raise AssertionError("no boundary document found")


@pytest.fixture(scope="module")
def corpus(tok, tmp_path_factory):
    """Two train files and one val file with edge cases; returns (manifest path, {split: [[texts per file]]})."""
    _, t = tok
    root = tmp_path_factory.mktemp("mdscorpus")
    prose = [d["text"] for d in builtin_documents(max_chars=60_000)]
    long_doc = " ".join(prose[:6])  # many samples long
    assert len(ids(t, long_doc)) > 20 * C
    files = {
        "train": [
            [boundary_doc(t), "First after the boundary: a short sentence.", "", "   \n ", prose[6],
             "Ünïcödé façade naïve café — 日本語のテキスト, emoji 🙂🚀 and Ελληνικά.", long_doc, prose[7]],
            [prose[8], prose[9], "", prose[10], "Tiny."],
        ],
        "validation": [[prose[11], prose[12], prose[13], "Ünïcödé in validation: ½ ∑ ∞."]],
    }
    for split, per_file in files.items():
        for i, texts in enumerate(per_file):
            write_c4(root / "mirror", split, i, texts)
    prepare_corpus({"source": "local", "local_dir": str(root / "mirror"), "train_files": 2, "val_files": 1},
                   str(root / "corpus"))
    return str(root / "corpus" / "manifest.json"), files


def reference(t, texts: list[str]) -> tuple[np.ndarray, int]:
    """Samples one unit must hold: non-blank documents + EOS, cut into C-token rows; and the dropped tail."""
    eos = t(EOS, add_special_tokens=False)["input_ids"]
    flat = [x for text in texts if text.strip() for x in ids(t, text) + eos]
    n = len(flat) // C
    return np.array(flat[: n * C], dtype=np.int32).reshape(n, C), len(flat) - n * C


def read_split(out: str, split: str) -> np.ndarray:
    """All samples of a split, read with streaming's StreamingDataset (what llm-foundry's dataloader uses)."""
    from llmpipe.train.shm_names import open_reader

    with open_reader(out, split) as ds:
        rows = [ds[i]["tokens"] for i in range(len(ds))]
    for r in rows:
        assert isinstance(r, np.ndarray) and r.dtype == np.int32 and r.shape == (C,)
    return np.stack(rows) if rows else np.zeros((0, C), np.int32)


@pytest.fixture(scope="module")
def converted(tok, corpus, tmp_path_factory):
    tok_dir, _ = tok
    man, _ = corpus
    root = tmp_path_factory.mktemp("mdsout")
    out = root / "ds"
    m = convert_dataset(man, tok_dir, C, EOS, str(out), config=cfg(root), log_dir=str(root / "logs"),
                        log_file=str(root / "rule.log"))
    return out, m, root


def test_samples_are_exact_and_edge_cases(tok, corpus, converted):
    _, t = tok
    _, files = corpus
    out, m, root = converted
    eos_id = t.eos_token_id
    for split, msplit in (("train", "train"), ("validation", "val")):
        expected, dropped, docs, empty = [], 0, 0, 0
        for texts in files[split]:
            rows, tail = reference(t, texts)
            expected.append(rows)
            dropped += tail
            docs += len(texts)
            empty += sum(1 for x in texts if not x.strip())
        got = read_split(str(out), msplit)
        np.testing.assert_array_equal(got, np.concatenate(expected))
        sm = m["splits"][msplit]
        assert sm["samples"] == len(got) and sm["tokens"] == len(got) * C
        assert sm["dropped_tokens"] == dropped and sm["documents"] == docs and sm["empty_documents"] == empty
        assert [u["samples"] for u in sm["units"]] == [len(e) for e in expected]
    train = read_split(str(out), "train")
    # the boundary document fills samples 0 and 1 exactly: sample 1 ends with EOS, sample 2 starts the next doc
    assert train[1, -1] == eos_id and eos_id not in train[0]
    nxt = ids(t, files["train"][0][1])
    assert list(train[2, : len(nxt)]) == nxt
    # the long document spans many samples with no EOS inside them
    assert sum(1 for r in train if eos_id not in r) >= 19
    # non-ASCII text survives the round trip
    text = t.decode(train.reshape(-1).tolist())
    assert "日本語のテキスト, emoji 🙂🚀 and Ελληνικά." in text
    # the per-unit lines went to the rule's log
    log = open(root / "rule.log").read()
    assert "unit train/unit-00000 done" in log and "unit val/unit-00000 done" in log


def test_same_samples_as_llm_foundry(tok, corpus, converted):
    """A unit holds what llm-foundry's ConcatTokensDataset yields for that file (blank documents aside)."""
    from llmfoundry.data import ConcatTokensDataset

    _, t = tok
    _, files = corpus
    out, _, _ = converted
    ours = read_split(str(out / "train"), "unit-00000")
    docs = [{"text": x} for x in files["train"][0] if x.strip()]
    theirs = [s["tokens"] for s in ConcatTokensDataset(hf_dataset=docs, tokenizer=t, max_length=C, bos_text="",
                                                       eos_text=EOS, no_wrap=False)]
    np.testing.assert_array_equal(ours, np.stack(theirs))


def test_merge_counts_and_verify(tok, converted, tmp_path):
    tok_dir, t = tok
    out, m, _ = converted
    for split in ("train", "val"):
        index = json.load(open(out / split / "index.json"))
        units = [json.load(open(out / split / u["name"] / "index.json")) for u in m["splits"][split]["units"]]
        assert sum(s["samples"] for s in index["shards"]) == sum(
            s["samples"] for u in units for s in u["shards"]) == m["splits"][split]["samples"]
        assert all(s["zip_data"]["basename"].startswith("unit-") for s in index["shards"])
    rep = verify_dataset(str(out), tok_dir, C, 512, str(tmp_path / "verify.json"))
    assert rep["ok"] and json.load(open(tmp_path / "verify.json")) == rep
    assert rep["splits"]["train"]["samples"] == m["splits"]["train"]["samples"]
    assert rep["splits"]["train"]["max_id"] < 512 and rep["splits"]["val"]["units"] == 1
    ex = rep["splits"]["train"]["examples"]
    assert len(ex) == 3 and all(e["found_in_source"] for e in ex)


def test_unit_records_split_their_seconds_by_phase(converted):
    """Each unit record (manifest and unit.json) carries the seconds spent in the tokenizer, packing and shard
    writing (tools/bench_mds.py sums them per worker count); together they fit inside the unit's own seconds."""
    out, m, _ = converted
    for split in ("train", "val"):
        for u in m["splits"][split]["units"]:
            ph = u["phase_seconds"]
            assert set(ph) == {"encode", "pack", "write"} and all(v >= 0 for v in ph.values())
            assert ph["encode"] > 0 and ph["write"] > 0 and sum(ph.values()) <= u["seconds"] + 1e-3
            assert json.load(open(out / split / u["name"] / "unit.json"))["phase_seconds"] == ph


def test_unit_records_carry_their_process_rusage(converted):
    """Each unit record carries getrusage deltas of its process (tools/bench_mds.py sums them to tell kernel
    time, page faults and preemption apart from the units' own user-mode work)."""
    out, m, _ = converted
    for split in ("train", "val"):
        for u in m["splits"][split]["units"]:
            ru = u["rusage"]
            assert set(ru) == {"user_s", "sys_s", "minflt", "nvcsw", "nivcsw"}
            # the kernel splits CPU time into user and sys by ticks: a tiny unit may show 0.0 in one of them,
            # never in their sum
            assert all(v >= 0 for v in ru.values()) and ru["user_s"] + ru["sys_s"] > 0
            assert ru["user_s"] + ru["sys_s"] <= u["seconds"] + 0.05  # one thread: CPU time fits in the unit's time
            assert json.load(open(out / split / u["name"] / "unit.json"))["rusage"] == ru


def test_tokenizer_batch_size_does_not_change_the_samples(tok, corpus, converted, tmp_path):
    """``batch_chars`` (characters per tokenizer call, a benchmark knob) only regroups documents: tiny batches
    (one document per call, documents split over many batches of the reader) give the same samples."""
    tok_dir, _ = tok
    man, _ = corpus
    src, _, _ = converted
    m = convert_dataset(man, tok_dir, C, EOS, str(tmp_path / "ds"), config=cfg(tmp_path),
                        log_dir=str(tmp_path / "logs"), batch_chars=1)
    for split in ("train", "val"):
        np.testing.assert_array_equal(read_split(str(tmp_path / "ds"), split), read_split(str(src), split))
    assert m["splits"]["train"]["samples"] > 0


def _copy(out, dst):
    shutil.copytree(out, dst)
    return dst


def test_verify_catches_corruption(tok, converted, tmp_path):
    tok_dir, _ = tok
    out, m, _ = converted
    # a damaged shard
    bad = _copy(out, tmp_path / "bad1")
    shard = bad / "train" / "unit-00000" / "shard.00000.mds.zstd"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2: len(data) // 2 + 16] = b"\x00" * 16
    shard.write_bytes(bytes(data))
    for raw in (bad / "train" / "unit-00000").glob("shard.*.mds"):
        raw.unlink()  # the decompressed copies streaming leaves next to the zstd files
    with pytest.raises(DataError, match="shard"):
        verify_dataset(str(bad), tok_dir, C, 512, str(tmp_path / "v1.json"))
    assert not (tmp_path / "v1.json").exists()
    # ids outside the model's vocabulary
    with pytest.raises(DataError, match="vocab_size=100"):
        verify_dataset(str(out), tok_dir, C, 100, str(tmp_path / "v2.json"))
    # a merged index that does not match its units
    bad = _copy(out, tmp_path / "bad3")
    idx = json.load(open(bad / "val" / "index.json"))
    idx["shards"] = idx["shards"][:0]
    json.dump(idx, open(bad / "val" / "index.json", "w"))
    with pytest.raises(DataError, match="index.json lists 0 samples"):
        verify_dataset(str(bad), tok_dir, C, 512, str(tmp_path / "v3.json"))
    # a unit without its completion marker
    bad = _copy(out, tmp_path / "bad4")
    os.unlink(bad / "train" / "unit-00001" / "unit.json")
    with pytest.raises(DataError, match="missing or incomplete"):
        verify_dataset(str(bad), tok_dir, C, 512, str(tmp_path / "v4.json"))
    # wrong concat length
    with pytest.raises(DataError, match="concat_tokens=32"):
        verify_dataset(str(out), tok_dir, 64, 512, str(tmp_path / "v5.json"))


def test_rerun_converts_only_incomplete_units(tok, corpus, converted, tmp_path):
    tok_dir, _ = tok
    man, _ = corpus
    src, m, _ = converted
    out = _copy(src, tmp_path / "ds")

    def marker_mtimes():
        return {f"{s}/{u['name']}": os.stat(out / s / u["name"] / "unit.json").st_mtime_ns
                for s in ("train", "val") for u in m["splits"][s]["units"]}

    before = marker_mtimes()
    # a unit killed before its marker was written, and the tmp folder of another killed attempt
    os.unlink(out / "train" / "unit-00001" / "unit.json")
    os.makedirs(out / "train" / ".tmp-unit-00000-4242-deadbeef")
    (out / "train" / ".tmp-unit-00000-4242-deadbeef" / "shard.00000.mds").write_bytes(b"partial")
    m2 = convert_dataset(man, tok_dir, C, EOS, str(out), config=cfg(tmp_path), log_dir=str(tmp_path / "logs"))
    assert m2["converted_units"] == ["train/unit-00001"]
    assert sorted(m2["reused_units"]) == ["train/unit-00000", "val/unit-00000"]
    after = marker_mtimes()
    assert after["train/unit-00000"] == before["train/unit-00000"]
    assert after["val/unit-00000"] == before["val/unit-00000"]
    assert after["train/unit-00001"] != before["train/unit-00001"]
    assert not any(n.startswith(".tmp-") for n in os.listdir(out / "train"))
    assert {s: v["samples"] for s, v in m2["splits"].items()} == {s: v["samples"] for s, v in m["splits"].items()}
    # a third run has nothing to do
    m3 = convert_dataset(man, tok_dir, C, EOS, str(out), config=cfg(tmp_path), log_dir=str(tmp_path / "logs"))
    assert m3["converted_units"] == [] and marker_mtimes()["train/unit-00001"] == after["train/unit-00001"]
    # changing the settings (here: concat length) redoes every unit
    m4 = convert_dataset(man, tok_dir, C // 2, EOS, str(out), config=cfg(tmp_path), log_dir=str(tmp_path / "logs"))
    assert len(m4["converted_units"]) == 3 and m4["splits"]["train"]["tokens"] >= m["splits"]["train"]["tokens"]


def test_sigkill_during_a_unit_leaves_nothing_complete(tok, corpus, tmp_path):
    tok_dir, _ = tok
    man, _ = corpus
    out = tmp_path / "ds"
    code = f"""
import os, signal, json
from llmpipe.data.mds_writer import TokenMDSWriter
def die(self):  # SIGKILL in the middle of finishing the first unit: shards written, no index yet
    self._flush()
    os.kill(os.getpid(), signal.SIGKILL)
TokenMDSWriter.finish = die
from llmpipe.steps.mds_units import convert_dataset
from llmpipe.config.schema import fill_defaults
convert_dataset({man!r}, {tok_dir!r}, {C}, {EOS!r}, {str(out)!r}, config=json.loads({json.dumps(json.dumps(cfg(tmp_path)))}),
                log_dir={str(tmp_path / 'logs')!r})
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == -9, r.stderr[-2000:]
    assert not (out / "manifest.json").exists()
    names = os.listdir(out / "train")
    assert not any(n.startswith("unit-") for n in names)  # nothing looks complete
    assert any(n.startswith(".tmp-unit-") for n in names)  # the killed unit's partial folder
    m = convert_dataset(man, tok_dir, C, EOS, str(out), config=cfg(tmp_path), log_dir=str(tmp_path / "logs"))
    assert len(m["converted_units"]) == 3
    assert not any(n.startswith(".tmp-") for n in os.listdir(out / "train"))
    assert verify_dataset(str(out), tok_dir, C, 512, str(tmp_path / "v.json"))["ok"]


def test_local_processes_give_the_same_dataset(tok, corpus, converted, tmp_path):
    tok_dir, _ = tok
    man, _ = corpus
    src, _, _ = converted
    c = cfg(tmp_path, workers=2)
    c["dispatch"]["executor"] = "local"
    m = convert_dataset(man, tok_dir, C, EOS, str(tmp_path / "ds"), config=c, log_dir=str(tmp_path / "logs"))
    assert len(m["converted_units"]) == 3
    np.testing.assert_array_equal(read_split(str(tmp_path / "ds"), "train"), read_split(str(src), "train"))
    # the units ran in other processes than this one
    pids = {json.load(open(tmp_path / "ds" / "train" / f"unit-0000{i}" / "unit.json"))["pid"] for i in range(2)}
    assert os.getpid() not in pids


def test_bad_input_files_are_named(tok, corpus, tmp_path, monkeypatch):
    import pdb

    monkeypatch.setattr(pdb, "post_mortem", lambda *a, **k: None)  # submitit's DebugExecutor opens pdb on errors
    tok_dir, _ = tok
    man, _ = corpus
    m = json.load(open(man))
    # not gzip: caught before anything is dispatched
    p = tmp_path / "c4-train.00000-of-01024.json.gz"
    p.write_text('{"text": "plain json, not gzip"}\n')
    m["splits"]["train"][0] = {"name": p.name, "path": str(p), "bytes": p.stat().st_size, "documents": 1}
    json.dump(m, open(tmp_path / "m1.json", "w"))
    with pytest.raises(DataError, match="not a gzip file") as e:
        convert_dataset(str(tmp_path / "m1.json"), tok_dir, C, EOS, str(tmp_path / "o1"), config=cfg(tmp_path),
                        log_dir=str(tmp_path / "logs"))
    assert str(p) in str(e.value)
    # truncated: found by the unit that reads it
    good = m["splits"]["validation"][0]["path"]
    data = open(m["splits"]["train"][1]["path"], "rb").read()
    p2 = tmp_path / "c4-train.00001-of-01024.json.gz"
    p2.write_bytes(data[: len(data) * 2 // 3])
    m = json.load(open(man))
    m["splits"]["train"][1] = {"name": p2.name, "path": str(p2), "bytes": p2.stat().st_size, "documents": 1}
    json.dump(m, open(tmp_path / "m2.json", "w"))
    with pytest.raises(Exception, match="truncated") as e:
        convert_dataset(str(tmp_path / "m2.json"), tok_dir, C, EOS, str(tmp_path / "o2"), config=cfg(tmp_path),
                        log_dir=str(tmp_path / "logs"))
    assert str(p2) in str(e.value) and good
    assert not (tmp_path / "o2" / "manifest.json").exists()
    assert not os.path.exists(tmp_path / "o2" / "train" / "unit-00001")


def test_too_little_text_for_concat(tok, corpus, tmp_path):
    tok_dir, _ = tok
    man, _ = corpus
    with pytest.raises(DataError, match="0 samples of concat_tokens=100000"):
        convert_dataset(man, tok_dir, 100_000, EOS, str(tmp_path / "o"), config=cfg(tmp_path, size_limit=0),
                        log_dir=str(tmp_path / "logs"))


def test_eos_text_must_tokenize(tok, corpus, tmp_path):
    tok_dir, _ = tok
    man, _ = corpus
    with pytest.raises(DataError, match="eos_text"):
        convert_dataset(man, tok_dir, C, "", str(tmp_path / "o"), config=cfg(tmp_path), log_dir=str(tmp_path))


def test_resolve_workers():
    assert resolve_workers(3, 10) == 3
    assert resolve_workers(30, 10) == 10
    assert resolve_workers(0, 1000) == len(os.sched_getaffinity(0))
    assert resolve_workers(0, 1) == 1
    assert resolve_workers(0, 0) == 0


def test_worker_tokenizer_without_transformers_matches_and_falls_back(tok, tmp_path):
    """Units encode with tokenizer.json through `tokenizers` alone only when it reproduces the manifest's probes
    (from the transformers tokenizer); otherwise they fall back to the transformers tokenizer's backend."""
    from llmpipe.data import mds
    from llmpipe.data.tokenizer import load_backend

    tok_dir, t = tok
    texts = [d["text"] for d in builtin_documents(max_chars=60_000)] + ["Ünïcödé 日本語 🙂", "  x\n\n\t", EOS + "a"]
    backend = load_backend(tok_dir)
    assert backend is not None
    assert [e.ids for e in backend.encode_batch(texts, add_special_tokens=True)] == \
        t(texts)["input_ids"]
    # a copy whose probes disagree (as for a tokenizer class that adds behaviour in Python): no fast path
    bad = tmp_path / "tok"
    shutil.copytree(tok_dir, bad)
    man = json.load(open(bad / "manifest.json"))
    man["probes"][0]["ids"] = man["probes"][0]["ids"] + [1]
    json.dump(man, open(bad / "manifest.json", "w"))
    assert load_backend(str(bad)) is None
    del man["probes"]
    json.dump(man, open(bad / "manifest.json", "w"))
    assert load_backend(str(bad)) is None
    assert mds.worker_encoder(str(bad))(texts) == t(texts)["input_ids"]


def test_truncation_in_tokenizer_json_never_cuts_documents(tok, tmp_path):
    """llm-foundry tokenizes with truncation=False: a tokenizer.json that enables truncation must not shorten
    documents in a unit (either loading path)."""
    from llmpipe.data import mds

    tok_dir, t = tok
    trunc = tmp_path / "tok"
    shutil.copytree(tok_dir, trunc)
    tj = json.load(open(trunc / "tokenizer.json"))
    tj["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    json.dump(tj, open(trunc / "tokenizer.json", "w"))
    long_text = " ".join(["the function returns a value"] * 50)
    want = t(long_text)["input_ids"]
    assert len(want) > 8
    assert mds.worker_encoder(str(trunc))([long_text]) == [want]


def test_conversion_never_imports_torch_or_transformers(tok, corpus, tmp_path):
    """A whole conversion (units run in this process with the debug executor) imports neither torch,
    transformers nor mosaicml-streaming: worker start-up stays well under a second."""
    tok_dir, _ = tok
    man, _ = corpus
    code = f"""
import json, sys
from llmpipe.steps.mds_units import convert_dataset
from llmpipe.config.schema import fill_defaults
m = convert_dataset({man!r}, {tok_dir!r}, {C}, {EOS!r}, {str(tmp_path / 'ds')!r},
                    config=json.loads({json.dumps(json.dumps(cfg(tmp_path)))}), log_dir={str(tmp_path / 'logs')!r})
assert m["splits"]["train"]["samples"] > 0
heavy = [k for k in ("torch", "transformers", "streaming") if k in sys.modules]
assert not heavy, heavy
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    from llmpipe.data.mds_verify import verify_dataset

    assert verify_dataset(str(tmp_path / "ds"), tok_dir, C, 512, str(tmp_path / "v.json"))["ok"]


def test_split_special_tokens_tokenizer_takes_the_transformers_path(tok, tmp_path):
    """A tokenizer saved with split_special_tokens=True encodes "<|endoftext|>" in text as ordinary characters;
    tokenizer.json does not record that, so the probes must reject the fast path and units must match
    transformers (= llm-foundry) exactly."""
    from transformers import AutoTokenizer

    from llmpipe.data import mds
    from llmpipe.data.tokenizer import load_backend

    tok_dir, _ = tok
    t = AutoTokenizer.from_pretrained(tok_dir, split_special_tokens=True)
    t.save_pretrained(str(tmp_path / "saved"))
    prepare_tokenizer({"source": "local", "name": str(tmp_path / "saved"), "eos_text": EOS}, str(tmp_path / "tok"))
    t2 = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    text = f"before {EOS} after, and {EOS}{EOS} twice"
    want = t2([text])["input_ids"]
    assert len(want[0]) > 8  # the marker really is split into pieces
    assert load_backend(str(tmp_path / "tok")) is None
    assert mds.worker_encoder(str(tmp_path / "tok"))([text]) == want


def test_damaged_units_are_converted_again(tok, corpus, converted, tmp_path):
    """A unit whose shard file is missing or truncated, whose index.json is cut short, or whose unit.json sample
    count disagrees with its index is converted again by the next run; the other units are reused."""
    tok_dir, _ = tok
    man, _ = corpus
    src, m, _ = converted
    damages = {
        "missing shard": lambda u: os.unlink(next(u.glob("shard.*.zstd"))),
        "truncated shard": lambda u: (lambda p: p.write_bytes(p.read_bytes()[:-7]))(next(u.glob("shard.*.zstd"))),
        # streaming's decompressed copy of a shard (training reads it when present), cut short
        "truncated raw copy": lambda u: (lambda p: p.write_bytes(p.read_bytes()[:-7]))(
            next(u.glob("shard.*.mds.zstd")).with_suffix("")),
        "truncated index": lambda u: (u / "index.json").write_text((u / "index.json").read_text()[:40]),
        "edited record": lambda u: (u / "unit.json").write_text(
            json.dumps({**json.loads((u / "unit.json").read_text()), "samples": 1})),
    }
    for what, damage in damages.items():
        out = _copy(src, tmp_path / what.replace(" ", "-"))
        unit = out / "train" / "unit-00001"
        for z in unit.glob("shard.*.mds.zstd"):  # as after a read by streaming: the decompressed copy exists
            z.with_suffix("").write_bytes(__import__("zstd").decompress(z.read_bytes()))
        damage(out / "train" / "unit-00001")
        m2 = convert_dataset(man, tok_dir, C, EOS, str(out), config=cfg(tmp_path), log_dir=str(tmp_path / "logs"))
        assert m2["converted_units"] == ["train/unit-00001"], what
        assert verify_dataset(str(out), tok_dir, C, 512, str(tmp_path / "v.json"))["ok"], what


def test_verify_checks_the_uncompressed_shard_training_reads(tok, converted, tmp_path):
    """streaming reads shard.NNNNN.mds when it exists next to the .zstd (it writes it when decompressing); a
    corrupted one must fail verification even though the .zstd is intact."""
    import zstd

    tok_dir, _ = tok
    src, _, _ = converted
    out = _copy(src, tmp_path / "ds")
    unit = out / "train" / "unit-00000"
    zpath = next(unit.glob("shard.*.mds.zstd"))
    raw = bytearray(zstd.decompress(zpath.read_bytes()))
    raw[-8:-4] = np.array([42], np.int32).tobytes()  # an in-range id in the last sample
    (unit / zpath.name[: -len(".zstd")]).write_bytes(bytes(raw))
    with pytest.raises(DataError, match="differs from the decompressed"):
        verify_dataset(str(out), tok_dir, C, 512, str(tmp_path / "v.json"))


def test_compression_and_size_limit_settings(tok, corpus, tmp_path):
    """Only spellings streaming can read are accepted (before anything runs); size_limit 0 = one shard per unit."""
    from llmpipe.config.settings import ConfigError

    tok_dir, _ = tok
    man, _ = corpus
    for bad in ("zstd:03", "ZSTD", " zstd", "zstd:0", "gzip"):
        c = cfg(tmp_path, compression=bad)
        with pytest.raises(ConfigError, match="data_prep.compression"):
            convert_dataset(man, tok_dir, C, EOS, str(tmp_path / "bad"), config=c, log_dir=str(tmp_path / "l"))
    for bad in ("64mb", 1 << 32):
        with pytest.raises(ConfigError, match="data_prep.size_limit"):
            convert_dataset(man, tok_dir, C, EOS, str(tmp_path / "bad"), config=cfg(tmp_path, size_limit=bad),
                            log_dir=str(tmp_path / "l"))
    out = tmp_path / "one-shard"
    m = convert_dataset(man, tok_dir, C, EOS, str(out), config=cfg(tmp_path, size_limit=0), log_dir=str(tmp_path))
    assert m["size_limit"] is None
    for u in m["splits"]["train"]["units"]:
        assert len(json.load(open(out / "train" / u["name"] / "index.json"))["shards"]) == 1
    assert verify_dataset(str(out), tok_dir, C, 512, str(tmp_path / "v.json"))["ok"]


def test_invalid_unicode_names_the_file(tok, tmp_path, monkeypatch):
    import gzip
    import pdb

    monkeypatch.setattr(pdb, "post_mortem", lambda *a, **k: None)
    tok_dir, _ = tok
    root = tmp_path / "mirror" / "en"
    root.mkdir(parents=True)
    bad = root / "c4-train.00000-of-01024.json.gz"
    with gzip.open(bad, "wt") as fh:
        fh.write('{"text": "a fine document with enough words in it"}\n')
        fh.write('{"text": "broken \\ud800 surrogate"}\n')
    write_c4(tmp_path / "mirror", "validation", 0, ["a validation document"])
    prepare_corpus({"source": "local", "local_dir": str(tmp_path / "mirror"), "train_files": 1, "val_files": 1},
                   str(tmp_path / "corpus"))
    with pytest.raises(Exception, match="cannot be tokenized") as e:
        convert_dataset(str(tmp_path / "corpus" / "manifest.json"), tok_dir, 8, EOS, str(tmp_path / "o"),
                        config=cfg(tmp_path), log_dir=str(tmp_path / "logs"))
    assert "c4-train.00000-of-01024.json.gz" in str(e.value) and "surrogate" in str(e.value)


def test_verify_accepts_a_lowercasing_tokenizer(corpus, tmp_path):
    """An uncased tokenizer decodes to lower-case text; verification must still find it in the source."""
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast

    from llmpipe.data.tokenizer import train_bpe

    man, files = corpus
    core = train_bpe(iter([t for f in files["train"] for t in f] * 3), 512, EOS)
    core.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS).save_pretrained(str(tmp_path / "saved"))
    prepare_tokenizer({"source": "local", "name": str(tmp_path / "saved"), "eos_text": EOS}, str(tmp_path / "tok"))
    out = tmp_path / "ds"
    convert_dataset(man, str(tmp_path / "tok"), C, EOS, str(out), config=cfg(tmp_path), log_dir=str(tmp_path / "l"))
    rep = verify_dataset(str(out), str(tmp_path / "tok"), C, 512, str(tmp_path / "v.json"))
    assert rep["ok"]
    texts = [ex["text"] for s in rep["splits"].values() for ex in s["examples"]]
    assert all(t == t.lower() for t in texts) and any(ex.get("found_in_source") for s in rep["splits"].values()
                                                      for ex in s["examples"])


def test_mds_benchmark_runs_and_writes_its_columns(tmp_path):
    """tools/bench_mds.py end to end on a tiny generated corpus (ours only, 1 and 2 local workers, two passes):
    the CSV has a row per worker count and pass with the same tokens, each pass's own speedup base, the batch size
    asked and the summed rusage; the summary gives the median speedup per worker count."""
    import csv
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "bench.csv"
    r = subprocess.run([sys.executable, os.path.join(repo, "tools", "bench_mds.py"), "--workers", "1,2",
                        "--files", "2", "--mb-per-file", "0.3", "--vocab", "512", "--concat", "256",
                        "--no-foundry", "--no-same-input", "--batch-chars", "4096", "--variant", "smoke",
                        "--repeat", "2",
                        "--work-dir", str(tmp_path / "work"), "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = list(csv.DictReader(open(out)))
    assert [(int(x["workers"]), int(x["repeat"])) for x in rows] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert len({x["tokens"] for x in rows}) == 1 and int(rows[0]["tokens"]) > 0
    assert float(rows[0]["speedup"]) == float(rows[1]["speedup"]) == 1.0
    for rep in (0, 1):  # each pass divides by its own 1-worker wall time
        one, two = (next(x for x in rows if int(x["workers"]) == w and int(x["repeat"]) == rep) for w in (1, 2))
        assert abs(float(two["speedup"]) - float(one["wall_s"]) / float(two["wall_s"])) < 0.01
    assert "- 2 worker(s): median speedup" in r.stdout
    for x in rows:
        assert x["batch_chars"] == "4096" and x["variant"] == "smoke"
        assert float(x["user_s_sum"]) > 0 and int(x["minflt_sum"]) > 0
        assert float(x["encode_s_sum"]) > 0
    assert "full C4 en train" in r.stdout
