"""ICL suites: stand-in tasks of every llm-foundry type scored as hand-computed, every item counted, the gauntlet
average, the task-data download (against a local HTTP server) and the dry-run checks."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import http.server
import inspect
import json
import math
import threading
from types import SimpleNamespace

import pytest

from llmpipe.evaluation import suites as eval_tasks
from llmpipe.evaluation.task_data import TaskDataError, fetch_task_files
from llmpipe.config.settings import ConfigError
from tests.conftest import project_config, snakemake
from tests.helpers.repeat_model import DIM, SCALE, SPECIAL, WORDS, write_repeat_model


def write_jsonl(path, items):
    path.write_text("".join(json.dumps(it) + "\n" for it in items))
    return str(path)


# ------------------------------------------------------------------------------------------- scoring, real model

def standin_tasks(d):
    """Stand-in tasks, one per llm-foundry type, for the repeat model (tests/helpers/repeat_model.py: the next
    word is the last word). ``right`` items have the repeated word as their gold answer, the others another word,
    so the expected accuracy of each is right / items."""
    a, b = WORDS[0], WORDS[1]
    mc = [{"query": f"{a} {WORDS[i + 2]}", "choices": [WORDS[i + 10], WORDS[i + 2]], "gold": 1 if i < 5 else 0}
          for i in range(7)]  # 5 of 7 right
    lm = [{"context": f"{a} {WORDS[i + 2]}", "continuation": WORDS[i + 2] if i < 3 else WORDS[i + 10]}
          for i in range(5)]  # 3 of 5 right
    schema = [{"context_options": [f"{a} {WORDS[i + 2]}", f"{a} {WORDS[i + 10]}"],
               "continuation": f"{WORDS[i + 2]} {b}", "gold": 0 if i < 4 else 1} for i in range(6)]  # 4 of 6
    gen = [{"context": f"{a} {WORDS[i + 2]}", "answer": WORDS[i + 2] if i < 2 else WORDS[i + 10], "aliases": []}
           for i in range(4)]  # 2 of 4
    return [
        {"label": "mc", "dataset_uri": write_jsonl(d / "mc.jsonl", mc), "icl_task_type": "multiple_choice",
         "num_fewshot": [0]},
        {"label": "mc_first3", "dataset_uri": str(d / "mc.jsonl"), "icl_task_type": "multiple_choice",
         "num_fewshot": [0], "subset_items": 3},
        {"label": "lm", "dataset_uri": write_jsonl(d / "lm.jsonl", lm), "icl_task_type": "language_modeling",
         "num_fewshot": [0, 2]},
        {"label": "schema", "dataset_uri": write_jsonl(d / "schema.jsonl", schema), "icl_task_type": "schema",
         "num_fewshot": [0]},
        {"label": "gen", "dataset_uri": write_jsonl(d / "gen.jsonl", gen),
         "icl_task_type": "generation_task_with_answers", "num_fewshot": [0]},
    ]


def context_tasks(d):
    """Tasks for the repeat model's 64-token context (one token per word, no BOS): ``cut`` has contexts of 10, 62,
    63, 64 and 100 words before a one-word answer (its context's last word, so every item is right); ``long`` is
    a 3-item multiple-choice task whose second item has a 70-word choice (PIQA's case: an answer longer than the
    context)."""
    cut = [{"context": " ".join(WORDS[(i + j) % 20] for j in range(n)), "continuation": WORDS[(i + n - 1) % 20]}
           for i, n in enumerate([10, 62, 63, 64, 100])]
    long = [{"query": f"{WORDS[0]} {WORDS[i]}", "choices": [WORDS[i], " ".join([WORDS[1]] * (70 if i == 1 else 2))],
             "gold": 0} for i in range(3)]
    return [{"label": "cut", "dataset_uri": write_jsonl(d / "cut.jsonl", cut), "icl_task_type": "language_modeling",
             "num_fewshot": [0, 1]},
            {"label": "long", "dataset_uri": write_jsonl(d / "long.jsonl", long), "icl_task_type": "multiple_choice",
             "num_fewshot": [0]}]


@pytest.mark.slow
@pytest.mark.parametrize("icl_batches", ["trimmed", "padded", "shared_prefix"])
def test_standin_suite_is_scored_as_hand_computed(tmp_path, monkeypatch, icl_batches):
    """With trimmed and with padded ICL batches, every task type scores its hand-computed accuracy over every item (7 multiple-choice items need 7 batches of
    one question: more than val_batches, which caps the held-out loader only), the subset is recorded, and the
    held-out loss is the model's exact -log p(w | w). A task whose answer is longer than the context is recorded
    as not scored while the others are scored, the gauntlet average says it is partial, and each task counts the
    items whose context was cut to fit."""
    from streaming import MDSWriter

    # evaluate() runs in this process here: the single-process torch.distributed variables it sets must not reach
    # the jobs later tests start (they would inherit WORLD_SIZE=1)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)

    from llmpipe.config.runs import run_settings
    from llmpipe.evaluation.icl_eval import evaluate
    from llmpipe.config.stage_settings import EvalSettings

    model = write_repeat_model(str(tmp_path / "model"))
    with MDSWriter(out=str(tmp_path / "mds" / "val"), columns={"text": "str"}) as w:
        for i in range(5):
            w.write({"text": " ".join([WORDS[i]] * 40)})
    tasks = standin_tasks(tmp_path) + context_tasks(tmp_path)
    gauntlet = {"categories": [
        {"name": "choice", "benchmarks": [{"name": "mc", "num_fewshot": 0, "random_baseline": 0.5},
                                          {"name": "schema", "num_fewshot": 0, "random_baseline": 0.5}]},
        {"name": "free", "benchmarks": [{"name": "lm", "num_fewshot": 0, "random_baseline": 0.0},
                                        {"name": "gen", "num_fewshot": 0, "random_baseline": 0.0}]},
        {"name": "long_answers", "benchmarks": [{"name": "long", "num_fewshot": 0, "random_baseline": 0.5}]}]}
    tiny = run_settings(project_config(), "mpt-tiny")  # a run named repeat, of 64-token sequences
    repeat = dataclasses.replace(tiny, name="repeat", data=dataclasses.replace(tiny.data, concat_tokens=64))
    ev = evaluate(repeat, model, str(tmp_path / "mds"), {t["label"]: t["dataset_uri"] for t in tasks},
                  eval_settings=EvalSettings(batch_size=2, val_batches=1, icl_batches=icl_batches),
                  suite={"name": "stand-in", "icl_tasks": tasks, "eval_gauntlet": gauntlet})
    want = {("mc", "0-shot"): (5, 7), ("mc_first3", "0-shot"): (3, 3), ("lm", "0-shot"): (3, 5),
            ("lm", "2-shot"): (3, 5), ("schema", "0-shot"): (4, 6), ("gen", "0-shot"): (2, 4),
            ("cut", "0-shot"): (5, 5), ("cut", "1-shot"): (5, 5)}
    got = {(t, s): (r["correct"], r["items"]) for t, by in ev["tasks"].items() for s, r in by.items()}
    assert got == want
    # cut to fit: 0-shot, context + 1-word answer > 64 for the 64- and 100-word contexts; 1-shot, another item
    # (10 words or more) and its answer come first, so every item is cut (10 + 1 + 62 + 1 > 64 at the least)
    cuts = {(t, s): r["items_cut"] for t, by in ev["tasks"].items() for s, r in by.items()}
    assert cuts == {**{k: 0 for k in want}, ("cut", "0-shot"): 2, ("cut", "1-shot"): 5}
    assert ev["not_scored"] == {"long": {
        "reason": ev["not_scored"]["long"]["reason"], "icl_task_type": "multiple_choice", "items": 3,
        "items_too_long": 1, "longest_answer_tokens": 70, "max_seq_len": 64, "items_in_file": 3}}
    assert ev["not_scored"]["long"]["reason"].startswith("ICL task long: 1 of 3 items have an answer of 64 tokens "
                                                         "or more (e.g. item 2; the longest 70 tokens)")
    assert "data.concat_tokens of repeat" in ev["not_scored"]["long"]["reason"]
    assert "Fix: drop long from the run's suite" in ev["not_scored"]["long"]["reason"]
    assert "long" not in ev["icl"] and "long" not in ev["tasks"]
    for (task, shots), (right, n) in want.items():
        assert ev["icl"][task][shots] == pytest.approx(right / n)
    assert ev["tasks"]["mc_first3"]["0-shot"]["subset"] is True
    assert ev["tasks"]["mc_first3"]["0-shot"]["items_in_file"] == 7
    assert ev["tasks"]["mc"]["0-shot"]["subset"] is False
    # gauntlet: ((5/7 - .5)/.5 + (4/6 - .5)/.5) / 2 and (3/5 + 2/4) / 2, then their mean
    choice, free = ((5 / 7 - 0.5) / 0.5 + (4 / 6 - 0.5) / 0.5) / 2, (3 / 5 + 2 / 4) / 2
    assert ev["gauntlet"]["categories"] == pytest.approx({"choice": choice, "free": free})
    assert ev["gauntlet"]["average"] == pytest.approx((choice + free) / 2)
    assert ev["gauntlet"]["partial"] is True and ev["gauntlet"]["missing"] == ["long/0-shot"]
    assert ev["gauntlet"]["categories_left_out"] == ["long_answers"]
    # held-out: one batch of 2 samples of 40 words, 39 predicted tokens each; loss log(e^(s*d) + V - 1) - s*d
    vocab = len(SPECIAL) + len(WORDS)
    assert ev["val"]["tokens"] == 2 * 39
    assert ev["val"]["loss"] == pytest.approx(math.log(math.exp(SCALE * DIM) + vocab - 1) - SCALE * DIM, rel=0.05)
    assert ev["val"]["token_accuracy"] == 1.0
    assert ev["val"]["split"] == "val" and ev["val"]["token_scope"] == "all" and ev["kind"] == "pretrain"
    assert ev["harness"].startswith("llm-foundry 0.22") and ev["icl_batches"] == icl_batches
    # the tokens each evaluator ran are the ones counted from the items before the model loaded, on both paths
    run = ev["timing"]["tokens_run"]
    assert {label: run[label] for label in run if label != "eval"} == {
        f"{t}/{s}": r["tokens_planned"] for t, by in ev["tasks"].items() for s, r in by.items()}
    padded_mc = 7 * 2 * 64  # 7 items of 2 choices, each row the full 64-token context
    assert (run["mc/0-shot"] == padded_mc) is (icl_batches == "padded")
    # the time plan of these very batches (the committed CPU constants) sits beside the measured time
    planned = ev["timing"]["planned"]
    assert set(planned["evaluators_s"]) == set(run) | {"eval"} and all(v > 0 for v in planned["evaluators_s"].values())
    assert planned["batches_s"] == pytest.approx(sum(planned["evaluators_s"].values()), abs=0.01)
    assert "eval-plan-basis.json" in planned["basis"] and "GFLOP/s (CPU)" in planned["basis"]
    # where the time went: called in a running process, the clock starts at the call and nothing is handed back yet
    phases = ev["timing"]["phases"]
    assert phases["hand_back_s"] is None and ev["timing"]["wall_s"] is None and phases["batches_s"] > 0
    assert sum(v for v in phases.values() if v is not None) == pytest.approx(ev["timing"]["job_s"], abs=0.01)
    json.dumps(ev, allow_nan=False)  # nothing NaN or infinite


# ------------------------------------------------------------------------------------------- scores and average

def metric(correct, total):
    return {"InContextLearningMultipleChoiceAccuracy": SimpleNamespace(correct=correct, total=total)}


def test_task_scores_count_items_and_refuse_missing_or_empty_ones():
    info = {"mmlu": {"items": 5, "file": "m.jsonl"}, "piqa": {"items": 4, "file": "p.jsonl"}}
    scores = eval_tasks.task_scores({"mmlu/5-shot/astronomy": metric(3, 3), "mmlu/5-shot/law": metric(0, 2),
                                     "piqa/0-shot": metric(1, 4), "eval": {}}, info)
    assert scores["mmlu"]["5-shot"]["items"] == 5 and scores["mmlu"]["5-shot"]["correct"] == 3
    assert scores["mmlu"]["5-shot"]["accuracy"] == pytest.approx((1.0 + 0.0) / 2)  # mean of the categories
    assert scores["piqa"]["0-shot"]["accuracy"] == 0.25
    with pytest.raises(ValueError, match=r"piqa \(0-shot\) scored 3 items but its data has 4"):
        eval_tasks.task_scores({"mmlu/5-shot": metric(1, 5), "piqa/0-shot": metric(1, 3)}, info)
    with pytest.raises(ValueError, match=r"piqa \(0-shot\) scored no item"):
        eval_tasks.task_scores({"mmlu/5-shot": metric(1, 5), "piqa/0-shot": metric(0, 0)}, info)
    with pytest.raises(ValueError, match="piqa have no score"):
        eval_tasks.task_scores({"mmlu/5-shot": metric(1, 5)}, info)


def test_gauntlet_average_arithmetic():
    scores = {"copa": {"0-shot": {"accuracy": 0.75}}, "piqa": {"0-shot": {"accuracy": 0.5}},
              "lambada": {"0-shot": {"accuracy": 0.4}}, "arc": {"3-shot": {"accuracy": 0.25}}}
    g = {"categories": [
        {"name": "commonsense", "benchmarks": [{"name": "copa", "num_fewshot": 0, "random_baseline": 0.5},
                                               {"name": "piqa", "num_fewshot": 0, "random_baseline": 0.5}]},
        {"name": "language", "benchmarks": [{"name": "lambada", "num_fewshot": 0, "random_baseline": 0.0}]},
        {"name": "knowledge", "benchmarks": [{"name": "arc", "num_fewshot": 3, "random_baseline": 0.25},
                                             {"name": "mmlu", "num_fewshot": 5, "random_baseline": 0.25}]}]}
    out = eval_tasks.gauntlet_average(scores, g)
    assert out["benchmarks"] == pytest.approx({"copa/0-shot": 0.5, "piqa/0-shot": 0.0, "lambada/0-shot": 0.4,
                                              "arc/3-shot": 0.0})
    assert out["categories"] == pytest.approx({"commonsense": 0.25, "language": 0.4})
    assert out["categories_left_out"] == ["knowledge"]  # mmlu has no score
    assert out["average"] == pytest.approx((0.25 + 0.4) / 2)
    g["averages"] = {"core_average": ["language"]}
    assert eval_tasks.gauntlet_average(scores, g)["average"] == pytest.approx(0.4)
    assert eval_tasks.gauntlet_average(scores, None) is None


def test_subset_file_and_fewshot_checks(tmp_path):
    f = write_jsonl(tmp_path / "t.jsonl", [{"context": f"c{i}", "continuation": "x"} for i in range(4)])
    tasks, info = eval_tasks.foundry_tasks(
        [{"label": "t", "dataset_uri": f, "icl_task_type": "language_modeling", "num_fewshot": [0, 1],
          "subset_items": 2}], {"t": f}, str(tmp_path / "scratch"))
    assert info["t"] == {"items": 2, "items_in_file": 4, "subset": True, "file": f,
                         "icl_task_type": "language_modeling"}
    assert len(open(tasks[0]["dataset_uri"]).readlines()) == 2 and tasks[0]["num_fewshot"] == [0, 1]
    with pytest.raises(ValueError, match="2 shots need 3 items, the file has 2"):
        eval_tasks.foundry_tasks([{"label": "t", "dataset_uri": f, "icl_task_type": "language_modeling",
                                   "num_fewshot": [2], "subset_items": 2}], {"t": f}, str(tmp_path / "s2"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="has 0 items"):
        eval_tasks.foundry_tasks([{"label": "e", "dataset_uri": str(empty), "icl_task_type": "schema"}],
                                 {"e": str(empty)}, str(tmp_path / "s3"))


# ------------------------------------------------------------------------------------------- tokens per item

def word_tokenizer():
    """The repeat model's word-level tokenizer as a Rust ``tokenizers.Tokenizer``: one token per word, no special
    tokens added (so no BOS), ``<|endoftext|>`` = 0."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(SPECIAL + WORDS)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return core


def words(n, start=0):
    return " ".join(WORDS[(start + j) % len(WORDS)] for j in range(n))


def test_item_tokens_and_cuts_as_hand_counted():
    """Token counts per item and the items cut to fit an 8-token context, for each task type, counted by hand
    (one token per word; llm-foundry adds a leading space to answers, which the tokenizer ignores)."""
    from llmpipe.evaluation.icl_tokens import Encoder, context_fit, item_tokens

    core = word_tokenizer()
    enc = Encoder(lambda texts, special: [e.ids for e in core.encode_batch(texts, add_special_tokens=special)], 0)

    def fit(task, items):
        toks = item_tokens(task, items, enc)
        return toks, context_fit(task["icl_task_type"], toks, 8)

    # language modelling: the 2-word prompt comes first; context + 1-word answer > 8 for 9, 10 and 14
    lm = {"icl_task_type": "language_modeling", "prompt_string": words(2)}
    toks, f = fit(lm, [{"context": words(n), "continuation": "alpha"} for n in (3, 7, 8, 12)])
    assert [(t.context, t.answer) for t in toks] == [((5,), (1,)), ((9,), (1,)), ((10,), (1,)), ((14,), (1,))]
    assert f == {"items": 4, "items_cut": 3, "items_too_long": 0, "first_too_long": 0, "longest_answer_tokens": 1,
                 "max_seq_len": 8}
    # multiple choice: one sequence per choice; 7 + 2 > 8 cuts the second item (at its longer choice)
    mc = {"icl_task_type": "multiple_choice"}
    toks, f = fit(mc, [{"query": words(q), "choices": ["alpha", "bravo charlie"], "gold": 0} for q in (2, 7)])
    assert [(t.context, t.answer) for t in toks] == [((2, 2), (1, 2)), ((7, 7), (1, 2))]
    assert (f["items_cut"], f["items_too_long"]) == (1, 0)
    # schema: one sequence per context option, each followed by the 2-word continuation; 7 + 2 > 8
    sc = {"icl_task_type": "schema"}
    toks, f = fit(sc, [{"context_options": [words(2), words(o)], "continuation": "alpha bravo", "gold": 0}
                       for o in (3, 7)])
    assert [(t.context, t.answer) for t in toks] == [((2, 3), (2, 2)), ((2, 7), (2, 2))]
    assert (f["items_cut"], f["items_too_long"]) == (1, 0)
    # generation: llm-foundry keeps room for the longest answer or alias of the task (4 words), so contexts over
    # 8 - 4 tokens are cut
    gen = {"icl_task_type": "generation_task_with_answers"}
    items = [{"context": words(4), "answer": "alpha", "aliases": []},
             {"context": words(5), "answer": words(3), "aliases": [words(4)]}]
    toks, f = fit(gen, items)
    assert [(t.context, t.answer) for t in toks] == [((4,), (1,)), ((5,), (4,))]
    assert (f["items_cut"], f["items_too_long"], f["longest_answer_tokens"]) == (1, 0, 4)
    # with a chain-of-thought delimiter llm-foundry reserves 10 more tokens: no item can be scored in 8 tokens
    _, f = fit(dict(gen, cot_delimiter=" ## "), items)
    assert (f["items_too_long"], f["first_too_long"], f["longest_answer_tokens"]) == (2, 1, 14)
    # an answer as long as the context leaves no context token: that item cannot be scored
    toks, f = fit(lm, [{"context": words(2), "continuation": "alpha"}, {"context": words(2), "continuation": words(8)}])
    assert (f["items_too_long"], f["first_too_long"], f["longest_answer_tokens"]) == (1, 2, 8)
    # the dry run counts answers only
    toks = item_tokens(lm, [{"context": words(2), "continuation": words(3)}], enc, context=False)
    assert toks[0].context is None and context_fit("language_modeling", toks, 8)["items_cut"] == -1


def test_item_tokens_match_llm_foundry_datasets(tmp_path):
    """For every task type, with few-shot examples, delimiters, a prompt, categories and a chain of thought, with a
    word-level tokenizer and a byte-level BPE that adds a BOS token: the context llm-foundry's own dataset keeps
    for each sequence is min(counted context, room left by the answer), and its answer tokens are the counted
    ones."""
    import random

    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    import llmfoundry.eval.datasets  # noqa: F401 - registers the task types
    from llmfoundry.eval.datasets import get_icl_task_dataloader
    from llmpipe.data.tokenizer import train_bpe
    from llmpipe.evaluation.icl_tokens import Encoder, context_fit, item_tokens, read_items

    rnd = random.Random(3)

    def sent(lo, hi):
        return " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(lo, hi)))

    bpe = train_bpe(iter([sent(30, 30) for _ in range(200)]), 300, "<|endoftext|>")
    bpe.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                       special_tokens=[("<|endoftext|>", 0)])
    eos = {"eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
    tokenizers = [PreTrainedTokenizerFast(tokenizer_object=word_tokenizer(), pad_token="<|endoftext|>", **eos),
                  PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>", **eos)]
    n = 24
    lm = [{"context": sent(1, 30) + " ", "continuation": " " + sent(1, 4), "category": rnd.choice("ab")}
          for _ in range(n)]
    mc = [{"query": sent(1, 30), "choices": [sent(1, 8) for _ in range(3)], "gold": rnd.randint(0, 2)}
          for _ in range(n)]
    sc = [{"context_options": [sent(1, 20) for _ in range(2)], "continuation": sent(1, 5), "gold": rnd.randint(0, 1)}
          for _ in range(n)]
    gen = [{"context": sent(1, 30), "answer": sent(1, 3), "aliases": [sent(1, 4)], "chain_of_thought": sent(1, 3),
            "category": rnd.choice("ab")} for _ in range(n)]
    tasks = [
        {"icl_task_type": "language_modeling", "dataset_uri": write_jsonl(tmp_path / "lm.jsonl", lm),
         "has_categories": True, "prompt_string": "Read:", "continuation_delimiter": ""},
        {"icl_task_type": "multiple_choice", "dataset_uri": write_jsonl(tmp_path / "mc.jsonl", mc),
         "prelimiter": "Q: ", "continuation_delimiter": " A:", "fewshot_random_seed": 7},
        {"icl_task_type": "schema", "dataset_uri": write_jsonl(tmp_path / "sc.jsonl", sc)},
        {"icl_task_type": "generation_task_with_answers", "dataset_uri": write_jsonl(tmp_path / "gen.jsonl", gen),
         "has_categories": True, "cot_delimiter": " ## ", "continuation_delimiter": "\nA:"},
    ]
    # the defaults the counts assume are those of llm-foundry's dataset classes
    from llmfoundry.registry import icl_datasets
    from llmpipe.evaluation.icl_tokens import COMMON_DEFAULTS, TYPE_DEFAULTS
    for ttype, own in TYPE_DEFAULTS.items():
        params = inspect.signature(icl_datasets.get(ttype)).parameters
        for key, value in {**COMMON_DEFAULTS, **own}.items():
            assert key not in params or params[key].default == value, (ttype, key)
    seen_cut = seen_whole = 0
    for ti, tok in enumerate(tokenizers):
        enc = Encoder.from_transformers(tok)
        for task in tasks:
            items = read_items(task["dataset_uri"])
            ttype = task["icl_task_type"]
            for seq, shots in ((64, 0), (64, 2), (400, 3)):
                mine = item_tokens(task, items, enc, num_fewshot=shots)
                assert context_fit(ttype, mine, seq)["items_too_long"] == 0
                kwargs = {k: v for k, v in task.items() if k not in ("icl_task_type", "dataset_uri", "has_categories")}
                kwargs.update(max_seq_len=seq, pad_tok_id=-1, num_fewshot=shots)
                dls = get_icl_task_dataloader(ttype, task["dataset_uri"], tok, 4,
                                              has_categories=task.get("has_categories", False),
                                              destination_path=str(tmp_path / f"{ti}-{ttype}-{seq}-{shots}.jsonl"),
                                              kwargs=kwargs)
                parts = {c: dl.dataloader.dataset for c, dl in dls.items()} if isinstance(dls, dict) \
                    else {None: dls.dataloader.dataset}
                for cat, ds in parts.items():
                    idx = [i for i, it in enumerate(items) if cat is None or it["category"] == cat]
                    reserved = max(mine[i].answer[0] for i in idx)
                    for j, i in enumerate(idx):
                        got, t = ds[j], mine[i]
                        # the tokens an item's sequences share (shared_prefix's plan): a choice's context, a
                        # schema item's preamble (its few-shot examples)
                        if ttype == "multiple_choice":
                            assert t.shared == t.context[0]
                        elif ttype == "schema":
                            assert 0 <= t.shared < min(t.context) and (shots == 0 or t.shared > 0)
                        else:
                            assert t.shared == 0
                        if ttype == "generation_task_with_answers":
                            assert ds.padding_size == seq - reserved
                            kept = (sum(1 for x in got["context"] if x != -1),)
                            want = (min(t.context[0], seq - reserved),)
                        else:
                            spans = got["continuation_indices"]
                            spans = [spans] if ttype == "language_modeling" else spans
                            kept = tuple(int(sp[0]) for sp in spans)
                            answers = got["continuation"] if ttype == "language_modeling" else got["answer"]
                            answers = [answers] if ttype == "language_modeling" else answers
                            assert tuple(len(a) for a in answers) == t.answer
                            want = tuple(min(c, seq - a) for c, a in zip(t.context, t.answer))
                        assert kept == want, (ti, ttype, seq, shots, i)
                        seen_cut += kept != t.context
                        seen_whole += kept == t.context
    assert seen_cut > 50 and seen_whole > 50  # both cut and whole contexts were compared


# ------------------------------------------------------------------------------------------- task data download

class FlakyFiles(http.server.BaseHTTPRequestHandler):
    """Serves ``files`` (URL path -> bytes) with Range support; ``fail_first`` paths answer 503 once."""

    files: dict[str, bytes] = {}
    fail_first: set[str] = set()
    requests: list[tuple[str, str | None]] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        type(self).requests.append((self.path, self.headers.get("Range")))
        if self.path in self.fail_first:
            self.fail_first.discard(self.path)
            self.send_error(503)
            return
        data = self.files.get(self.path)
        if data is None:
            self.send_error(404)
            return
        start = int(self.headers["Range"].split("=")[1].split("-")[0]) if self.headers.get("Range") else 0
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        self.wfile.write(data[start:])

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FlakyFiles)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def test_download_retries_resumes_checksums_and_skips_finished_files(server, tmp_path):
    rev = "0123abcd"
    piqa = b"".join(json.dumps({"query": f"q{i}", "choices": ["a", "b"], "gold": i % 2}).encode() + b"\n"
                    for i in range(50))
    copa = b'{"query": "q", "choices": ["a", "b"], "gold": 0}\n' * 3
    FlakyFiles.files = {f"/{rev}/scripts/eval/local_data/commonsense_reasoning/piqa.jsonl": piqa,
                        f"/{rev}/scripts/eval/local_data/commonsense_reasoning/copa.jsonl": copa}
    FlakyFiles.fail_first = {f"/{rev}/scripts/eval/local_data/commonsense_reasoning/copa.jsonl"}
    FlakyFiles.requests = []
    files = ["eval/local_data/commonsense_reasoning/copa.jsonl", "eval/local_data/commonsense_reasoning/piqa.jsonl"]
    dest = tmp_path / "eval-tasks" / "standard"
    (dest / "eval/local_data/commonsense_reasoning").mkdir(parents=True)
    (dest / "eval/local_data/commonsense_reasoning/piqa.jsonl.part").write_bytes(piqa[:100])  # an interrupted one
    settings = {"source": "github", "base_url": f"http://127.0.0.1:{server.server_address[1]}", "revision": rev,
                "retries": 3}
    m = fetch_task_files(files, str(dest), settings, wait_s=0.01)
    assert (dest / files[1]).read_bytes() == piqa and (dest / files[0]).read_bytes() == copa
    assert m["files"][files[1]] == {"bytes": len(piqa), "items": 50, "sha256": hashlib.sha256(piqa).hexdigest(),
                                    "url": f"{settings['base_url']}/{rev}/scripts/{files[1]}"}
    assert m["files"][files[0]]["items"] == 3 and m["revision"] == rev
    assert json.loads((dest / "manifest.json").read_text()) == m
    paths = [p for p, _ in FlakyFiles.requests]
    assert paths.count(f"/{rev}/scripts/{files[0]}") == 2  # 503, then the retry
    assert (f"/{rev}/scripts/{files[1]}", "bytes=100-") in FlakyFiles.requests  # resumed
    assert not list(dest.rglob("*.part"))
    FlakyFiles.requests = []
    fetch_task_files(files, str(dest), settings, wait_s=0.01)
    assert FlakyFiles.requests == []  # complete files (size and checksum as recorded) are not fetched again
    (dest / files[0]).write_bytes(b"changed\n")
    with pytest.raises(TaskDataError, match="not a JSON object"):  # a damaged file is fetched again, then read
        FlakyFiles.files[f"/{rev}/scripts/{files[0]}"] = b"not json\n"
        fetch_task_files(files, str(dest), settings, wait_s=0.01)
    with pytest.raises(TaskDataError, match="does not exist \\(404\\)"):
        fetch_task_files(["eval/local_data/x/missing.jsonl"], str(dest), settings, wait_s=0.01)
    FlakyFiles.fail_first = {f"/{rev}/scripts/{files[1]}"}
    (dest / "manifest.json").unlink()
    with pytest.raises(TaskDataError, match="after 1 attempt"):
        fetch_task_files(files[1:], str(dest), dict(settings, retries=1), wait_s=0.01)


def test_local_mirror_copy_and_missing_file(tmp_path):
    mirror = tmp_path / "llm-foundry-scripts"
    (mirror / "eval/local_data/language_understanding").mkdir(parents=True)
    data = b'{"context": "a b", "continuation": "c"}\n' * 2
    (mirror / "eval/local_data/language_understanding/lambada_openai.jsonl").write_bytes(data)
    files = ["eval/local_data/language_understanding/lambada_openai.jsonl"]
    m = fetch_task_files(files, str(tmp_path / "out"), {"source": "local", "local_dir": str(mirror),
                                                         "revision": "r"})
    assert m["files"][files[0]]["sha256"] == hashlib.sha256(data).hexdigest() and m["files"][files[0]]["items"] == 2
    assert (tmp_path / "out" / files[0]).read_bytes() == data
    with pytest.raises(TaskDataError, match="local_dir must hold llm-foundry's layout"):
        fetch_task_files(["eval/local_data/x/y.jsonl"], str(tmp_path / "out"), {"source": "local",
                                                                                 "local_dir": str(mirror)})


# ------------------------------------------------------------------------------------------- dry-run checks

def config_with(tasks=None, gauntlet=None, **task_over):
    cfg = copy.deepcopy(project_config())
    if tasks is not None:
        cfg["eval"]["icl_tasks"] = tasks
        cfg["eval"]["eval_gauntlet"] = gauntlet
    return cfg


@pytest.mark.parametrize("task,message", [
    ({"label": "x", "kind": "cloze", "num_items": 3, "num_fewshot": [3]},
     r"eval\.icl_tasks\[0\]\.num_fewshot has 3 shots but the task has 3 items"),
    ({"label": "x", "dataset_uri": "hf://datasets/piqa", "icl_task_type": "multiple_choice"},
     r"eval\.icl_tasks\[0\]\.dataset_uri is 'hf://datasets/piqa': evaluation reads local files only"),
    ({"label": "x", "dataset_uri": "eval/local_data/a/b.jsonl", "icl_task_type": "multiple_choice",
      "cot_delimiter": "A:"}, r"eval\.icl_tasks\[0\]\.cot_delimiter is not taken by a multiple_choice task"),
    ({"label": "x", "dataset_uri": "eval/local_data/a/b.jsonl"}, r"icl_task_type is None; it must be one of"),
    ({"label": "x"}, r"eval\.icl_tasks\[0\] \(x\) has no data"),
    ({"label": "eval", "kind": "cloze"}, r"eval\.icl_tasks\[0\]\.label is 'eval', llm-foundry's name for the held"),
    ({"label": "x", "dataset_uri": "/nonexistent/t.jsonl", "icl_task_type": "schema"}, r"is not a file"),
    ({"label": "x", "dataset_uri": "eval/local_data/a/b.jsonl", "icl_task_type": "schema", "num_items": 5},
     r"num_items and seed are settings of a task the project builds"),
])
def test_suite_checks(task, message):
    with pytest.raises(ConfigError, match=message):
        eval_tasks.check_suite(config_with([task]), "mpt-tiny")


def test_suite_checks_on_files_and_gauntlet(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="has no items"):
        eval_tasks.check_suite(config_with([{"label": "e", "dataset_uri": str(empty), "icl_task_type": "schema"}]),
                               "mpt-tiny")
    two = write_jsonl(tmp_path / "two.jsonl", [{"context": "a", "continuation": "b"}] * 2)
    with pytest.raises(ConfigError, match="subset_items is 3 but the task has 2 items"):
        eval_tasks.check_suite(config_with([{"label": "t", "dataset_uri": two, "icl_task_type": "language_modeling",
                                             "subset_items": 3}]), "mpt-tiny")
    task = {"label": "t", "dataset_uri": two, "icl_task_type": "language_modeling", "num_fewshot": [0]}
    bad = {"categories": [{"name": "c", "benchmarks": [{"name": "t", "num_fewshot": 5, "random_baseline": 0}]}]}
    with pytest.raises(ConfigError, match=r"eval\.eval_gauntlet\.categories\[0\]\.benchmarks\[0\] is t at 5 shots"):
        eval_tasks.check_suite(config_with([task], bad), "mpt-tiny")
    good = {"categories": [{"name": "c", "benchmarks": [{"name": "t", "num_fewshot": 0, "random_baseline": 0}]}]}
    eval_tasks.check_suite(config_with([task], good), "mpt-tiny")
    with pytest.raises(ConfigError, match=r"eval\.eval_gauntlet\.averages\.core_average names \['d'\]"):
        eval_tasks.check_suite(config_with([task], {**good, "averages": {"core_average": ["c", "d"]}}), "mpt-tiny")
    cfg = config_with()
    cfg["models"]["mpt-tiny"]["eval_suite"] = "nope"
    with pytest.raises(ConfigError, match="^models.mpt-tiny.eval_suite is 'nope': eval suite 'nope' is not defined"):
        eval_tasks.check_suite(cfg, "mpt-tiny")


def test_local_task_data_folder_is_checked(tmp_path):
    files = ["eval/local_data/commonsense_reasoning/copa.jsonl"]
    cfg = {"eval": {"task_data": {"source": "local", "local_dir": str(tmp_path / "nowhere")}}}
    with pytest.raises(ConfigError, match=r"eval\.task_data\.local_dir is .*nowhere', not a folder"):
        eval_tasks.check_task_data(cfg, files)
    cfg["eval"]["task_data"]["local_dir"] = str(tmp_path)
    with pytest.raises(ConfigError, match="lacks 1 of the suite's files, e.g. eval/local_data/commonsense_reas"):
        eval_tasks.check_task_data(cfg, files)
    (tmp_path / files[0]).parent.mkdir(parents=True)
    (tmp_path / files[0]).write_text("{}\n")
    eval_tasks.check_task_data(cfg, files)
    cfg["eval"]["task_data"]["source"] = "github"  # a mirror named but not used: refused, not silently ignored
    with pytest.raises(ConfigError, match=r"eval\.task_data\.local_dir is set but eval\.task_data\.source is "
                                          r"'github'.*Fix: set eval\.task_data\.source: local"):
        eval_tasks.check_task_data(cfg, files)


def test_standard_files_are_counted_from_the_mirror_and_planned_as_the_job_batches_them(tmp_path):
    """A standard file's items are known in the dry run when it is in the local mirror: subsets and shot counts are
    checked against them, and the time plan counts its batches (with the run's prepared tokenizer) exactly as the
    job will batch them; a task whose file or tokenizer is not on disk yet is named as not counted."""
    from llmpipe.evaluation import icl_tokens

    rel = "eval/local_data/commonsense_reasoning/copa.jsonl"
    (tmp_path / "mirror" / rel).parent.mkdir(parents=True)
    rows = [{"query": words(2 + i), "choices": [words(1, i), words(3, i)], "gold": i % 2} for i in range(3)]
    write_jsonl(tmp_path / "mirror" / rel, rows)
    task = {"label": "copa", "dataset_uri": rel, "icl_task_type": "multiple_choice", "num_fewshot": [0, 1]}
    cfg = config_with()
    cfg["results_dir"] = str(tmp_path / "results")
    cfg["eval"].update(batch_size=4, val_batches=2)
    cfg["eval"]["suites"] = {"mine": {"icl_tasks": [dict(task, subset_items=5)]}}
    cfg["models"]["mpt-tiny"]["eval_suite"] = "mine"
    works, missing = eval_tasks.planned_works(cfg, "mpt-tiny")   # not fetched: the held-out batches only
    assert [w.label for w in works] == ["eval"] and missing == ["copa"]
    assert works[0].batches == ((4, 128),) * 2
    cfg["eval"]["task_data"] = {"source": "local", "local_dir": str(tmp_path / "mirror")}
    with pytest.raises(ConfigError, match=r"eval\.suites\.mine\.icl_tasks\[0\]\.subset_items is 5 but the task has 3"):
        eval_tasks.check_suite(cfg, "mpt-tiny")
    cfg["eval"]["suites"]["mine"]["icl_tasks"] = [dict(task, num_fewshot=[3])]
    with pytest.raises(ConfigError, match=r"num_fewshot has 3 shots but the task has 3 items"):
        eval_tasks.check_suite(cfg, "mpt-tiny")
    cfg["eval"]["suites"]["mine"]["icl_tasks"] = [task]
    assert eval_tasks.planned_works(cfg, "mpt-tiny")[1] == ["copa"]   # the tokenizer is not prepared yet
    tok = write_tokenizer_folder(tmp_path / "results/tokenizers/bpe-builtin-docs")
    works, missing = eval_tasks.planned_works(cfg, "mpt-tiny", world_size=2)
    assert missing == [] and [w.label for w in works] == ["eval", "copa/0-shot", "copa/1-shot"]
    enc = icl_tokens.Encoder.from_folder(str(tok))
    exact = icl_tokens.item_tokens(eval_tasks.foundry_task(task), rows, enc, num_fewshot=0)
    assert works[1].batches == tuple(icl_tokens.batch_shapes("multiple_choice", exact, 128, 4, "trimmed", 2))
    assert works[1].world_size == 2 and works[1].tokens == icl_tokens.batch_tokens(
        "multiple_choice", exact, 128, 4, "trimmed", 2)
    one_shot = icl_tokens.item_tokens(eval_tasks.foundry_task(task), rows, enc, num_fewshot=1)
    assert abs(works[2].tokens - icl_tokens.batch_tokens("multiple_choice", one_shot, 128, 4, "trimmed", 2)) <= \
        0.15 * works[2].tokens   # the few-shot preambles estimated by the mean example


def test_the_dry_run_names_what_it_cannot_count_yet_with_the_items_it_knows(tmp_path):
    """A task the time plan cannot count yet is listed with the items it will be scored on as far as the dry run
    knows them: a built task's ``num_items``, a standard file's count once in the mirror (at most ``subset_items``),
    ``subset_items`` alone for a file not fetched yet, None when nothing tells."""
    rel = "eval/local_data/commonsense_reasoning/copa.jsonl"
    (tmp_path / "mirror" / rel).parent.mkdir(parents=True)
    write_jsonl(tmp_path / "mirror" / rel, [{"query": words(2), "choices": [words(1), words(3)], "gold": 0}] * 9)
    copa = {"label": "copa", "dataset_uri": rel, "icl_task_type": "multiple_choice", "num_fewshot": [0, 1]}
    piqa = {"label": "piqa", "dataset_uri": "eval/local_data/commonsense_reasoning/piqa.jsonl",
            "icl_task_type": "multiple_choice", "num_fewshot": [0]}
    built = {"label": "cloze", "kind": "cloze", "num_items": 40, "num_fewshot": [0]}
    cfg = config_with()
    cfg["results_dir"] = str(tmp_path / "results")
    cfg["eval"]["suites"] = {"mine": {"icl_tasks": [dict(copa, subset_items=5), piqa, dict(piqa, label="p2",
                                                                                         subset_items=7), built]}}
    cfg["models"]["mpt-tiny"]["eval_suite"] = "mine"
    works, missing = eval_tasks.planned_works(cfg, "mpt-tiny")
    assert missing == ["copa", "piqa", "p2", "cloze"]
    got = eval_tasks.uncounted_tasks(cfg, "mpt-tiny", missing)
    assert [(t["label"], t["items"], t["shots"], t["icl_task_type"], t["max_seq_len"]) for t in got] == [
        ("copa", 5, [0, 1], "multiple_choice", 128), ("piqa", None, [0], "multiple_choice", 128),
        ("p2", 7, [0], "multiple_choice", 128), ("cloze", 40, [0], "language_modeling", 128)]
    cfg["eval"]["task_data"] = {"source": "local", "local_dir": str(tmp_path / "mirror")}
    cfg["eval"]["suites"]["mine"]["icl_tasks"][0] = dict(copa, subset_items=12)   # the file has 9: the file wins
    assert eval_tasks.uncounted_tasks(cfg, "mpt-tiny", ["copa"])[0]["items"] == 9


def write_tokenizer_folder(folder):
    """A prepared tokenizer folder as the tokenizer step leaves it for the dry run: the word-level tokenizer's
    ``tokenizer.json`` and a manifest whose probes let :func:`llmpipe.data.tokenizer.load_backend` use it."""
    core = word_tokenizer()
    folder.mkdir(parents=True)
    core.save(str(folder / "tokenizer.json"))
    text = words(5)
    (folder / "manifest.json").write_text(json.dumps({"eos_token_id": 0, "probes": [
        {"text": text, "ids": core.encode(text).ids}]}))
    return folder


def long_answer_task(d, seq=128):
    """A 3-item multiple-choice file whose second item has a choice of ``seq + 2`` words (tokens)."""
    items = [{"query": words(3, i), "choices": [WORDS[i], words(seq + 2 if i == 1 else 2)], "gold": 0}
             for i in range(3)]
    return {"label": "long", "dataset_uri": write_jsonl(d / "long.jsonl", items), "icl_task_type": "multiple_choice",
            "num_fewshot": [0]}


def test_dry_run_check_of_answers_longer_than_the_context(tmp_path):
    """With the task file and the run's tokenizer on disk, a task whose answer leaves no context token in the
    run's context (mpt-tiny: 128 tokens) is refused, naming the task, the counts and the fix; without the
    tokenizer (before its step ran) the check is left to the evaluation job."""
    task = long_answer_task(tmp_path)
    cfg = config_with([task])
    cfg["results_dir"] = str(tmp_path / "results")
    eval_tasks.check_suite(cfg, "mpt-tiny")  # no tokenizer yet: nothing to count with
    write_tokenizer_folder(tmp_path / "results/tokenizers/bpe-builtin-docs")
    with pytest.raises(ConfigError) as err:
        eval_tasks.check_suite(cfg, "mpt-tiny")
    assert str(err.value).startswith(
        "eval.icl_tasks[0]: ICL task long: 1 of 3 items have an answer of 128 tokens or more (e.g. item 2; the "
        "longest 130 tokens), which leaves no context token in the evaluation's 128-token context "
        "(data.concat_tokens of mpt-tiny)")
    assert "Fix: drop long from the run's suite, or evaluate it with a model whose context is longer than 130 " \
        "tokens." in str(err.value)
    eval_tasks.check_suite(config_with([dict(task, subset_items=1)]) | {"results_dir": cfg["results_dir"]},
                           "mpt-tiny")  # the first item alone fits
    short = long_answer_task(tmp_path, seq=125)  # 127 tokens: one context token is left
    eval_tasks.check_suite(config_with([short]) | {"results_dir": cfg["results_dir"]}, "mpt-tiny")


def test_dry_run_refuses_an_answer_longer_than_the_context(workdir):
    """The same refusal through Snakemake's dry run, once the tokenizer step's folder exists."""
    write_tokenizer_folder(workdir / "results/tokenizers/bpe-builtin-docs")
    task = long_answer_task(workdir)
    proc = snakemake(workdir, "-n", "--config", f"eval={{'icl_tasks': [{task!r}], 'eval_gauntlet': null}}",
                     check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "eval.icl_tasks[0]: ICL task long: 1 of 3 items have an answer of 128 tokens or more" in out, out[-3000:]
    assert "Fix: drop long from the run's suite" in out


def test_project_suites():
    """The tiny model's suite is built offline from held-out text; MPT-1B's is llm-foundry's gauntlet v0.3, every
    benchmark of its gauntlet a task of the suite, all data under eval/local_data/."""
    cfg = project_config()
    name, s = eval_tasks.check_suite(cfg, "mpt-tiny")
    assert name == "default" and {eval_tasks.data_source(t) for t in s["icl_tasks"]} == {"built"}
    name, s = eval_tasks.check_suite(cfg, "mpt-1b")
    assert name == "standard" and {eval_tasks.data_source(t) for t in s["icl_tasks"]} == {"foundry"}
    labels = {t["label"] for t in s["icl_tasks"]}
    assert {"hellaswag", "piqa", "lambada_openai", "arc_easy", "arc_challenge", "winogrande", "copa", "boolq",
            "openbook_qa", "mmlu"} <= labels
    assert len(s["eval_gauntlet"]["categories"]) == 5
    assert eval_tasks.suite_name(cfg, "mpt-tiny-sft") == "default" and eval_tasks.suite_name(cfg, "mpt-7b-dolly") \
        == "standard"


def test_dry_run_refuses_too_many_shots(workdir):
    proc = snakemake(workdir, "-n", "--config", "eval={'icl_tasks': [{'label': 'c', 'kind': 'cloze', "
                     "'num_items': 4, 'num_fewshot': [0, 4]}], 'eval_gauntlet': null}", check=False)
    assert proc.returncode != 0
    assert "eval.icl_tasks[0].num_fewshot has 4 shots but the task has 4 items" in proc.stdout + proc.stderr
