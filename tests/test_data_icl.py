"""The cloze ICL task cut from held-out text."""

from __future__ import annotations

import json
import os

import pytest

from llmpipe.data.corpus import prepare_corpus
from llmpipe.data.errors import DataError
from llmpipe.data.icl import build_cloze_task
from tests.test_data_corpus import write_c4

VAL = [
    "The river flows slowly through the old town at night. Children play near the water every summer afternoon. "
    "Nobody remembers when the bridge was first built.",
    "def f(x): return x == 1. This sentence has an e.g. in it, so it is skipped by the filter today.",
    "A short one.\nEvery morning the baker opens the shop before the sun rises over the hills. "
    "Fresh bread smells wonderful to everyone walking past the small window.",
    "",
]
TRAIN = ["Training text must never appear in the task because the model has seen it already during pretraining."]


@pytest.fixture
def corpus(tmp_path):
    write_c4(tmp_path / "m", "train", 0, TRAIN)
    write_c4(tmp_path / "m", "validation", 0, VAL)
    prepare_corpus({"source": "local", "local_dir": str(tmp_path / "m"), "train_files": 1, "val_files": 1},
                   str(tmp_path / "c"))
    return str(tmp_path / "c" / "manifest.json")


def read(path):
    return [json.loads(line) for line in open(path)]


def test_items_format_and_content(corpus, tmp_path):
    r = build_cloze_task(corpus, str(tmp_path / "cloze.jsonl"), num_items=100, seed=17)
    items = read(tmp_path / "cloze.jsonl")
    assert r["items"] == len(items) == r["candidates"] == 5  # fewer candidates than asked: all of them
    val_text = " ".join(VAL)
    for it in items:
        assert set(it) == {"context", "continuation"}
        cont = it["continuation"]
        assert cont.startswith(" ") and cont[1:].isalpha() and " " not in cont[1:]
        assert not it["context"].endswith(" ")
        assert (it["context"] + cont + ".") in val_text  # a held-out sentence minus its last word
        assert "Training" not in it["context"]
        assert "==" not in it["context"] and "e.g." not in it["context"]
    assert {it["continuation"] for it in items} == {" night", " afternoon", " built", " hills", " window"}
    # passages keep the sentences before them in the same document
    assert any(it["context"].startswith("The river flows") and it["continuation"] == " built" for it in items)


def test_sampling_is_deterministic_and_seeded(corpus, tmp_path):
    a = build_cloze_task(corpus, str(tmp_path / "a.jsonl"), num_items=3, seed=1)
    b = build_cloze_task(corpus, str(tmp_path / "b.jsonl"), num_items=3, seed=1)
    assert open(tmp_path / "a.jsonl", "rb").read() == open(tmp_path / "b.jsonl", "rb").read()
    assert a["items"] == b["items"] == 3
    seen = {tuple(it["continuation"] for it in read(tmp_path / "a.jsonl"))}
    for seed in range(2, 12):
        build_cloze_task(corpus, str(tmp_path / "c.jsonl"), num_items=3, seed=seed)
        seen.add(tuple(it["continuation"] for it in read(tmp_path / "c.jsonl")))
    assert len(seen) > 1


def test_no_candidates_is_an_error(tmp_path):
    write_c4(tmp_path / "m", "train", 0, TRAIN)
    write_c4(tmp_path / "m", "validation", 0, ["x = 1", "no period here"])
    prepare_corpus({"source": "local", "local_dir": str(tmp_path / "m"), "train_files": 1, "val_files": 1},
                   str(tmp_path / "c"))
    with pytest.raises(DataError, match="no cloze items"):
        build_cloze_task(str(tmp_path / "c"), str(tmp_path / "x.jsonl"), 10, 0)
    assert not os.path.exists(tmp_path / "x.jsonl")


def test_builtin_corpus_gives_enough_items(tmp_path):
    """The embedded default (builtin corpus, 200 items) has enough held-out sentences."""
    prepare_corpus({"source": "builtin", "train_files": 1, "val_files": 1, "max_chars": 1_500_000},
                   str(tmp_path / "c"))
    r = build_cloze_task(str(tmp_path / "c"), str(tmp_path / "cloze.jsonl"), 200, 17)
    assert r["items"] == 200 and r["candidates"] > 300


def test_llm_foundry_reads_the_task(corpus, tmp_path, monkeypatch):
    """llm-foundry's language_modeling ICL dataset loads the file and finds each answer as " word"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    from llmfoundry.eval.datasets.in_context_learning_evaluation import InContextLearningLMTaskDataset

    build_cloze_task(corpus, str(tmp_path / "cloze.jsonl"), 100, 17)
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(VAL * 20, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>")
    ds = InContextLearningLMTaskDataset(dataset_uri=str(tmp_path / "cloze.jsonl"), tokenizer=tok, max_seq_len=128,
                                        pad_tok_id=tok.eos_token_id, num_fewshot=0, fewshot_random_seed=1,
                                        prompt_string="", example_delimiter="\n", continuation_delimiter=" ",
                                        destination_path=str(tmp_path / "dest.jsonl"))
    assert len(ds) == 5
    for i in range(len(ds)):
        ex = ds[i]
        cont = tok.decode([ex["context"][j] for j in ex["continuation_indices"]])
        assert cont.startswith(" ") and cont.strip().isalpha()
