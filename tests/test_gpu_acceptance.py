"""tools/gpu_acceptance.py on the CPU with the tiny model: every phase of the literal chain, the kill after the first
checkpoint (no tagged process survives, each logged batch once, the rerun resumes), the record, and a rerun that
finds every phase finished. The acceptance suite reads stand-in files of the four task types in llm-foundry's layout
(the real files are not in the repository)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.conftest import REPO, load_tool
from tests.test_eval_suite import write_jsonl

pytestmark = pytest.mark.slow

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


def _standin_foundry_files(root):
    """100 short items for each file the acceptance suite names, in its task type's keys."""
    d = root / "eval" / "local_data"
    (d / "world_knowledge").mkdir(parents=True)
    (d / "language_understanding").mkdir(parents=True)
    w = [WORDS[i % len(WORDS)] for i in range(120)]
    write_jsonl(d / "world_knowledge/arc_easy.jsonl",
                [{"query": f"{w[i]} {w[i + 1]}", "choices": [w[i + 2], w[i + 3]], "gold": i % 2} for i in range(100)])
    write_jsonl(d / "language_understanding/winogrande.jsonl",
                [{"context_options": [f"{w[i]} a", f"{w[i + 1]} b"], "continuation": f"{w[i + 2]} c",
                  "gold": i % 2} for i in range(100)])
    write_jsonl(d / "language_understanding/lambada_openai.jsonl",
                [{"context": f"{w[i]} {w[i + 1]} {w[i + 2]}", "continuation": f" {w[i + 3]}"} for i in range(100)])
    write_jsonl(d / "world_knowledge/triviaqa_sm_sub.jsonl",
                [{"context": f"{w[i]} {w[i + 1]}?", "answer": w[i + 2], "aliases": [w[i + 2]]} for i in range(100)])
    return root


def _tool():
    return load_tool("gpu_acceptance")


def test_acceptance_tool_runs_kills_resumes_and_records(tiny_run, tmp_path, monkeypatch):
    monkeypatch.delenv("LLMPIPE_COMMIT", raising=False)
    tool = _tool()
    data = _standin_foundry_files(tmp_path / "foundry")
    out = tmp_path / "record.json"
    # the corpus, tokenizer and MDS shards of the session's tiny run (the overlay's same data), modification times
    # kept: the data phase finds them up to date and runs no job
    for folder in ("data", "tokenizers"):
        shutil.copytree(tiny_run / "results" / folder, tmp_path / "res" / folder, copy_function=shutil.copy2)
    argv = ["--run", "mpt-tiny", "--gpus", "0", "--batches", "20", "--save-every", "10", "--eval-every", "20",
            "--global-batch", "8", "--task-data", str(data), "--results", str(tmp_path / "res"), "--out", str(out)]
    assert tool.main(argv) == 0
    rec = json.loads(out.read_text())
    ph = rec["phases"]
    assert rec["ok"] is True
    assert ph["train_killed"]["killed"] and ph["train_killed"]["alive_after_sweep"] == []
    assert [c.split("-rank")[0] for c in ph["train_killed"]["complete_checkpoints"]] == ["ep0-ba10"]
    assert rec["train"]["resumed_from"].endswith("ep0-ba10-rank0.pt") and rec["train"]["steps"] == 20
    assert rec["each_logged_batch_once"] and rec["train_log_batches"][-1] == 20
    assert all(ph[p]["returncode"] == 0 for p in ("data", "train", "convert", "generate", "eval"))
    assert rec["overlay"]["models"]["mpt-tiny"]["eval_suite"] == "acceptance" and "compile" not in \
        rec["overlay"]["models"]["mpt-tiny"]["train"]
    tasks = rec["eval"]["tasks"]
    assert set(tasks) == {"arc_easy", "winogrande", "lambada_openai", "triviaqa_sm_sub"}
    assert all(shot["items"] == 100 for t in tasks.values() for shot in t.values())
    assert rec["stack"]["torch"] and rec["export_bytes"] > 0 and rec["checkpoint_bytes"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    assert rec["commit"] == (head or None)
    # a rerun finds every phase finished and only writes the record again; a named commit wins over git's
    before = json.dumps(ph, sort_keys=True)
    monkeypatch.setenv("LLMPIPE_COMMIT", "0" * 40)
    assert tool.main(argv) == 0
    rerun = json.loads(out.read_text())
    assert json.dumps(rerun["phases"], sort_keys=True) == before and rerun["commit"] == "0" * 40
