"""Tokenizers: train a byte-level BPE on a corpus, reload it without llmpipe, local and hub sources, EOS checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from llmpipe.config.settings import ConfigError
from llmpipe.data.corpus import builtin_documents, prepare_corpus
from llmpipe.data.errors import DataError
from llmpipe.data.tokenizer import prepare_tokenizer
from tests.test_data_corpus import FakeHub, write_c4

EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small corpus of real prose (the first ~300 kB of the builtin documents) as a local mirror."""
    root = tmp_path_factory.mktemp("tokcorpus")
    texts = [d["text"] for d in builtin_documents(max_chars=300_000)]
    write_c4(root / "mirror", "train", 0, texts[1::2])
    write_c4(root / "mirror", "validation", 0, texts[::2][:20])
    prepare_corpus({"source": "local", "local_dir": str(root / "mirror"), "train_files": 1, "val_files": 1},
                   str(root / "corpus"))
    return str(root / "corpus" / "manifest.json")


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    m = prepare_tokenizer({"source": "train", "vocab_size": 1024, "eos_text": EOS, "key": "bpe"}, str(out), corpus)
    return str(out), m


def test_train_manifest_and_eos(trained):
    out, m = trained
    assert json.load(open(os.path.join(out, "manifest.json"))) == m
    assert m["vocab_size"] == 1024 and m["source"] == "train"
    assert m["eos_text"] == EOS and m["eos_ids"] == [m["eos_token_id"]] and m["eos_token"] == EOS
    assert m["train_documents"] > 10


def test_trained_tokenizer_loads_without_llmpipe(trained):
    out, m = trained
    code = f"""
import sys, json
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained({out!r})
text = "The quick brown fox jumps over the lazy dog. Ünïcödé ✓ 日本語"
ids = tok(text + {EOS!r}, add_special_tokens=False)["input_ids"]
assert ids[-1] == tok.eos_token_id, ids
assert tok.decode(ids[:-1]) == text, tok.decode(ids[:-1])
assert max(ids) < len(tok) == {m['vocab_size']}
assert not any(name.startswith("llmpipe") for name in sys.modules), "llmpipe was imported"
print(json.dumps({{"cls": type(tok).__name__, "eos": tok.eos_token, "n": len(ids)}}))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/",
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["eos"] == EOS and res["cls"] == "PreTrainedTokenizerFast"
    cfg = open(os.path.join(out, "tokenizer_config.json")).read()
    assert "llmpipe" not in cfg and "auto_map" not in cfg


def test_training_is_deterministic(trained, corpus, tmp_path):
    out, _ = trained
    prepare_tokenizer({"source": "train", "vocab_size": 1024, "eos_text": EOS}, str(tmp_path), corpus)
    for fn in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert open(os.path.join(out, fn), "rb").read() == open(tmp_path / fn, "rb").read(), fn


def test_local_source(trained, tmp_path):
    out, m = trained
    m2 = prepare_tokenizer({"source": "local", "name": out, "eos_text": EOS}, str(tmp_path / "copy"))
    assert m2["vocab_size"] == m["vocab_size"] and m2["eos_ids"] == m["eos_ids"] and m2["source"] == "local"
    assert json.load(open(tmp_path / "copy" / "tokenizer.json")) == json.load(open(os.path.join(out, "tokenizer.json")))


def test_local_source_missing_folder(tmp_path):
    with pytest.raises(DataError, match="not a folder"):
        prepare_tokenizer({"source": "local", "name": str(tmp_path / "nope"), "eos_text": EOS, "key": "mine"},
                          str(tmp_path / "out"))


def test_no_eos_is_a_clear_error(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]").save_pretrained(tmp_path / "noeos")
    with pytest.raises(DataError, match="no EOS token and no eos_text") as e:
        prepare_tokenizer({"source": "local", "name": str(tmp_path / "noeos"), "eos_text": "", "key": "weird"},
                          str(tmp_path / "out"))
    assert "tokenizers.weird.eos_text" in str(e.value)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_train_needs_corpus_and_vocab(tmp_path, corpus):
    with pytest.raises(ConfigError, match="corpus manifest"):
        prepare_tokenizer({"source": "train", "vocab_size": 512, "eos_text": EOS}, str(tmp_path))
    with pytest.raises(ConfigError, match="vocab_size"):
        prepare_tokenizer({"source": "train", "vocab_size": 100, "eos_text": EOS}, str(tmp_path), corpus)


def test_train_on_empty_corpus(tmp_path):
    write_c4(tmp_path / "m", "train", 0, ["", "  "])
    write_c4(tmp_path / "m", "validation", 0, ["x"])
    man = tmp_path / "manifest.json"
    man.write_text(json.dumps({"splits": {"train": [{"path": str(tmp_path / "m/en/c4-train.00000-of-01024.json.gz"),
                                                      "name": "x", "bytes": 1, "documents": 2}],
                                          "validation": []}}))
    with pytest.raises(DataError, match="no non-blank text"):
        prepare_tokenizer({"source": "train", "vocab_size": 300, "eos_text": EOS}, str(tmp_path / "t"), str(man))


def test_hub_source_through_local_http_server(trained, tmp_path):
    """source: hub goes through AutoTokenizer.from_pretrained(repo id) -> huggingface_hub -> HF_ENDPOINT."""
    out, m = trained
    files = {fn: open(os.path.join(out, fn), "rb").read()
             for fn in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")}
    hub = FakeHub(files, repo="EleutherAI/gpt-neox-20b", revision="main", repo_type="model")
    try:
        code = f"""
import json
from llmpipe.data.tokenizer import prepare_tokenizer
m = prepare_tokenizer({{"source": "hub", "name": "EleutherAI/gpt-neox-20b", "eos_text": {EOS!r}}}, {str(tmp_path / "hubtok")!r})
print(json.dumps(m))
"""
        env = dict(os.environ, HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        m2 = json.loads(r.stdout.strip().splitlines()[-1])
        assert m2["source"] == "hub" and m2["vocab_size"] == m["vocab_size"] and m2["eos_ids"] == m["eos_ids"]
        assert any(p.endswith("/tokenizer.json") for meth, p, _ in hub.requests if meth == "GET")
        assert (tmp_path / "hubtok" / "tokenizer.json").exists()
    finally:
        hub.close()
