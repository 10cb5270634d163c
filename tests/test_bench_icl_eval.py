"""tools/bench_icl_eval.py on the CPU with the repeat model and stand-in tasks of every type: the two paths
alternate, each run twice in one process; the record holds each run's timing and tokens, the speed-up, equal
accuracies and item-by-item agreement."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from tests.conftest import load_tool
from tests.helpers.repeat_model import write_repeat_model
from tests.test_eval_suite import context_tasks, standin_tasks

pytestmark = pytest.mark.slow


def standin_bench(tmp_path, monkeypatch):
    """The tool, a stand-in suite file of every task type (its tasks' files under ``tmp_path/foundry``) and the repeat
    model: (tool, task data folder, suite path, tasks, model path)."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    data = tmp_path / "foundry"
    data.mkdir()
    tasks = [t for t in standin_tasks(data) + context_tasks(data) if t["label"] != "long"]
    for t in tasks:
        t["dataset_uri"] = os.path.relpath(t["dataset_uri"], data)
    suite = tmp_path / "suite.yaml"
    suite.write_text(yaml.safe_dump({"eval": {"suites": {"standin": {"icl_tasks": tasks, "eval_gauntlet": None}}}}))
    return load_tool("bench_icl_eval"), data, suite, tasks, write_repeat_model(str(tmp_path / "model"))


def test_bench_alternates_paths_and_records_agreement(tmp_path, monkeypatch):
    tool, data, suite, tasks, model = standin_bench(tmp_path, monkeypatch)
    real_write = tool.atomic_write_json
    out = tmp_path / "record.json"
    written = []
    monkeypatch.setattr(tool, "atomic_write_json", lambda path, rec: (
        written.append((len(rec["runs"]), rec["complete"], sorted(rec["by_path"]))), real_write(path, rec)))
    assert tool.main(["--model", model, "--run", "mpt-tiny", "--seq", "64", "--task-data", str(data), "--suite",
                      str(suite), "--batch-size", "2", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    # rewritten after each of the six runs, complete only at the last; the first partial record has no comparison yet
    assert [w[:2] for w in written] == [(k, False) for k in range(1, 7)] + [(6, True)]
    assert written[0][2] == [] and written[1][2] == ["trimmed"]
    assert rec["complete"] and rec["runs_planned"] == 6
    assert [(r["path"], r["repeat"]) for r in rec["runs"]] == [
        (p, k) for k in (1, 2) for p in ("padded", "trimmed", "shared_prefix")]
    shared = rec["runs"][2]
    assert shared["accuracy"] == rec["runs"][0]["accuracy"] and shared["tokens_run"] == rec["runs"][1]["tokens_run"]
    assert set(rec["by_path"]) == {"trimmed", "shared_prefix"} and rec["speedup"] == rec["by_path"]["trimmed"]["speedup"]
    assert all(a["fraction"] == 1.0 for a in rec["by_path"]["shared_prefix"]["agreement"].values())
    padded, trimmed = rec["runs"][0], rec["runs"][1]
    assert padded["accuracy"] == trimmed["accuracy"] and padded["accuracy"]["mc/0-shot"] == pytest.approx(5 / 7)
    assert set(rec["accuracy_delta_points"].values()) == {0}
    assert trimmed["tokens_run_total"] < 0.5 * padded["tokens_run_total"]
    assert all(r["batches_s"] > 0 and r["to_first_batch_s"] > 0 for r in rec["runs"]) and rec["speedup"] > 0
    labels = {f"{t['label']}/{s}-shot" for t in tasks for s in t["num_fewshot"]}
    assert set(rec["agreement"]) == labels
    for label, a in rec["agreement"].items():
        # items scored = keys recorded (the 'cut' items differ in context, so none collapse)
        assert a["items_compared"] == a["items_padded"] == padded["items"][label.replace("/", "/", 1)], label
        assert a["fraction"] == 1.0, label
        choice_task = label.split("/")[0] in {"mc", "mc_first3", "schema"}
        assert ("margin_median" in a) == choice_task, (label, a)
        if choice_task:
            assert a["differing_margins"] == [] and a["margin_median"] >= 0, (label, a)
            assert 0 <= a["loglik_max_abs_diff"] < 1e-5, (label, a)   # fp32: the paths' log-likelihoods agree


def test_bench_runs_a_path_at_another_batch_size_on_a_task_subset(tmp_path, monkeypatch):
    """``padded@3`` is the reference at batch 3 beside padded at 2, compared item by item like any path; ``--tasks``
    keeps only the named tasks, in the runs and in the record's suite."""
    tool, data, suite, tasks, model = standin_bench(tmp_path, monkeypatch)
    out = tmp_path / "record.json"
    assert tool.main(["--model", model, "--run", "mpt-tiny", "--seq", "64", "--task-data", str(data), "--suite",
                      str(suite), "--batch-size", "2", "--repeats", "1", "--paths", "padded,padded@3,shared_prefix",
                      "--tasks", "mc,schema", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert [(r["path"], r["icl_batches"], r["batch_size"]) for r in rec["runs"]] == [
        ("padded", "padded", 2), ("padded@3", "padded", 3), ("shared_prefix", "shared_prefix", 2)]
    assert set(rec["by_path"]) == {"padded@3", "shared_prefix"}
    assert [t["label"] for t in rec["suite"]["eval"]["suites"]["standin"]["icl_tasks"]] == ["mc", "schema"]
    for path in rec["by_path"].values():
        assert set(path["agreement"]) == {"mc/0-shot", "schema/0-shot"}
        assert all(a["fraction"] == 1.0 and a["loglik_max_abs_diff"] < 1e-5 for a in path["agreement"].values())
    assert set(rec["runs"][1]["items"]) == {"mc/0-shot", "schema/0-shot"}


@pytest.mark.parametrize("spec, error", [
    ("trimmed,padded", "first entry must be padded"),
    ("padded@4,trimmed", "first entry must be padded"),
    ("padded,fast", "'fast': the path must be one of"),
    ("padded,padded@0", "'padded@0': the batch size after @ must be a positive integer"),
    ("padded,trimmed,trimmed@2", "'trimmed@2' is given twice"),
])
def test_parse_variants_names_the_bad_entry(spec, error):
    with pytest.raises(ValueError, match=error):
        load_tool("bench_icl_eval").parse_variants(spec, 2)


def test_bench_refuses_an_unknown_task_label(tmp_path, monkeypatch, capsys):
    tool, data, suite, _, model = standin_bench(tmp_path, monkeypatch)
    with pytest.raises(SystemExit):
        tool.main(["--model", model, "--task-data", str(data), "--suite", str(suite), "--tasks", "mc,winogrande",
                   "--out", str(tmp_path / "r.json")])
    assert "--tasks: winogrande not in" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_agreement_gives_the_margins_of_the_items_decided_differently():
    """A near-tie decided differently shows its padded margin; a clear item decided alike does not."""
    tool = load_tool("bench_icl_eval")
    padded = {"mc/0-shot": {(1,): {"choice": 0, "margin": 0.5}, (2,): {"choice": 1, "margin": 0.001},
                            (3,): {"choice": 0, "margin": 0.2}},
              "lm/0-shot": {(4,): True, (5,): False}}
    other = {"mc/0-shot": {(1,): {"choice": 0, "margin": 0.49}, (2,): {"choice": 0, "margin": 0.002},
                           (3,): {"choice": 0, "margin": 0.21}},
             "lm/0-shot": {(4,): True, (5,): True}}
    a = tool.agreement(padded, other)
    assert a["mc/0-shot"]["same_decision"] == 2 and a["mc/0-shot"]["differing_margins"] == [0.001]
    assert a["mc/0-shot"]["margin_median"] == 0.2 and a["mc/0-shot"]["fraction"] == pytest.approx(0.6667)
    assert a["lm/0-shot"]["same_decision"] == 1 and "differing_margins" not in a["lm/0-shot"]


def test_bench_switches_an_mpt_export_to_sdpa_for_every_path(tmp_path, monkeypatch):
    """``--attention sdpa`` switches the loaded MPT's attention modules before each evaluation (the record counts
    them), restricted to the ``--sdpa-backend`` kernels (the record names them), and the paths still agree in fp32; a
    model with nothing to switch fails the run instead of measuring the torch path under SDPA's name."""
    import torch

    from llmpipe.model.attention import set_sdpa_backend

    from tests.test_export import export

    tool, data, suite, tasks, repeat = standin_bench(tmp_path, monkeypatch)
    (tmp_path / "mpt").mkdir()
    model = export(tmp_path / "mpt", 0o022)
    out = tmp_path / "record.json"
    argv = ["--run", "mpt-tiny", "--seq", "64", "--task-data", str(data), "--suite", str(suite), "--batch-size", "2",
            "--repeats", "1", "--paths", "padded,trimmed", "--tasks", "mc,schema", "--attention", "sdpa"]
    try:
        assert tool.main(["--model", str(model), *argv, "--sdpa-backend", "math", "--out", str(out)]) == 0
        assert not torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    finally:
        set_sdpa_backend("auto")
    rec = json.loads(out.read_text())
    assert rec["sdpa_backend"] == "math"
    n_layers = json.loads((model / "config.json").read_text())["n_layers"]
    assert rec["attention"] == "sdpa" and [r["sdpa_modules"] for r in rec["runs"]] == [n_layers, n_layers]
    agreement = rec["by_path"]["trimmed"]["agreement"]
    assert all(a["fraction"] == 1.0 and a["loglik_max_abs_diff"] < 1e-5 for a in agreement.values()), agreement
    with pytest.raises(RuntimeError, match="--attention sdpa: the model has no MPT attention module"):
        tool.main(["--model", repeat, *argv, "--out", str(tmp_path / "gpt2.json")])
