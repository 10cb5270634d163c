"""Inference across processes (llmpipe.plan.inference_placement): the tiny model's evaluation over 2 CPU processes (gloo,
FSDP through llm-foundry's config, dispatched as the eval step's multi-task job) scores what one process scores."""

from __future__ import annotations

import json
import math

import pytest

from llmpipe.dispatch import jobs as dispatch
from llmpipe.config.runs import run_config, run_settings
from llmpipe.config.stage_settings import EvalSettings
from tests.conftest import project_config

pytestmark = pytest.mark.slow


def _evaluate(wd, tmp_path, processes: int) -> dict:
    """Rank 0's eval.json record of mpt-tiny's export, from a local job of ``processes`` tasks."""
    from llmpipe.evaluation.icl_eval import evaluate

    config = project_config()
    results = wd / "results"
    corpus = results / "data/builtin-docs"
    # every held-out sequence: the same ones on any world size
    settings = EvalSettings.from_section({**config["eval"], "val_batches": -1})
    tasks = config["eval"]["icl_tasks"]
    icl = {t["label"]: str(corpus / "icl" / f"{t['label']}.jsonl") for t in tasks}
    jobs = {"executor": "local", "state_dir": str(tmp_path / f"state{processes}"), "poll_s": 1}
    return dispatch.run_step(
        evaluate, run_settings(config, "mpt-tiny"), str(results / "mpt-tiny/hf"),
        str(corpus / "bpe-builtin-docs/concat128/mds"), icl, eval_settings=settings,
        suite={"name": "default", "icl_tasks": tasks, "eval_gauntlet": None}, step=f"eval x{processes}",
        resources={"nodes": 1, "gpus_per_node": 0, "tasks_per_node": processes, "time_min": 30},
        config={"dispatch": jobs}, log_dir=str(tmp_path / f"logs{processes}"), key=f"eval-{processes}")


def test_evaluation_over_two_processes_scores_what_one_process_scores(tiny_run, tmp_path):
    one = _evaluate(tiny_run, tmp_path, 1)
    two = _evaluate(tiny_run, tmp_path, 2)
    assert (one["processes"], one["fsdp"]) == (1, False)
    assert (two["processes"], two["fsdp"]) == (2, True), json.dumps(two)[:2000]
    # every ICL item once, whatever the world size: the same items, so the same accuracies
    assert set(one["metrics"]) == set(two["metrics"]) and {"cloze_heldout/0-shot", "eval"} <= set(one["metrics"])
    assert one["tasks"] and two["tasks"].keys() == one["tasks"].keys()
    for task, by_shot in one["tasks"].items():
        for shots, rec in by_shot.items():
            assert two["tasks"][task][shots]["items"] == rec["items"] > 0, (task, shots, two["tasks"][task])
            assert two["tasks"][task][shots]["accuracy"] == pytest.approx(rec["accuracy"], abs=1e-6), (task, shots)
    for label in one["metrics"]:
        if label != "eval":
            for name, value in one["metrics"][label].items():
                assert two["metrics"][label][name] == pytest.approx(value, abs=1e-6), (label, name)
    # held-out tokens: each of the 2 ranks gets half of the split, padded by at most one repeated sequence
    seq = run_config(project_config(), "mpt-tiny")["data"]["concat_tokens"]
    assert one["val"]["tokens"] <= two["val"]["tokens"] <= one["val"]["tokens"] + seq
    assert two["val"]["loss"] == pytest.approx(one["val"]["loss"], rel=2e-3) and math.isfinite(two["val"]["loss"])
    assert two["val"]["token_accuracy"] == pytest.approx(one["val"]["token_accuracy"], rel=2e-3)
