"""The evaluation's time plan (llmpipe.plan.eval_time) and its calibration tool (tools/calibrate_eval_plan.py)."""

from __future__ import annotations

import json
import os

import pytest

from llmpipe.model.mfu import flops_per_token, mpt_param_count, peak_flops_for_name
from llmpipe.plan import eval_time
from tests.conftest import REPO, load_tool
from tests.test_eval_suite import standin_tasks, write_tokenizer_folder

ARCH = {"d_model": 64, "n_heads": 4, "n_layers": 3, "max_seq_len": 128, "vocab_size": 100}


def basis(**over):
    values = {"device": "h200", "start_s": 10.0, "batch_s": 0.05, "forward_s_per_flop": 1e-13,
              "decode_s_per_layer": 0.001, "peak_flops": peak_flops_for_name("h200", "bf16"), "source": "b.json"}
    values.update(over)
    return eval_time.DeviceBasis(**values)


def test_plan_is_start_plus_each_batch_as_hand_computed():
    """Two right-padded batches, one generation batch, the held-out split: each batch costs batch_s + its forward
    FLOPs (rows x width x a third of llm-foundry's training FLOPs per token at that width) x s per FLOP, and a
    generation batch its new tokens x blocks x s per decoding step; two ranks halve the batches' time."""
    mc = eval_time.EvaluatorWork("mc/0-shot", ((8, 40), (6, 20)))
    gen = eval_time.EvaluatorWork("gen/3-shot", ((4, 100),), new_tokens=12)
    val = eval_time.heldout_work(2, 4, 128)
    b = basis()
    plan = eval_time.plan_seconds(ARCH, [val, mc, gen], b)
    fwd = {w: flops_per_token(ARCH, w) / 3 for w in (20, 40, 100, 128)}
    expect = {"eval": 2 * 0.05 + 2 * 4 * 128 * fwd[128] * 1e-13,
              "mc/0-shot": 2 * 0.05 + (8 * 40 * fwd[40] + 6 * 20 * fwd[20]) * 1e-13,
              "gen/3-shot": 0.05 + 4 * 100 * fwd[100] * 1e-13 + 12 * 3 * 0.001}
    assert plan["evaluators_s"] == pytest.approx(expect, rel=1e-12)
    assert plan["batches_s"] == pytest.approx(sum(expect.values()))
    assert plan["seconds"] == pytest.approx(10.0 + sum(expect.values()))
    assert plan["tokens"] == 2 * 4 * 128 + 8 * 40 + 6 * 20 + 4 * 100 and plan["batches"] == 5
    assert "start 10 s" in plan["basis"] and "b.json" in plan["basis"] and "decoding step" in plan["basis"]
    assert plan["basis"].count("MFU") == 1 and f"MFU {b.forward_mfu:.3f}" in plan["basis"]
    two = eval_time.plan_seconds(ARCH, [dataclass_world(w, 2) for w in (val, mc, gen)], b)
    assert two["batches_s"] == pytest.approx(plan["batches_s"] / 2)
    loads = eval_time.plan_seconds(ARCH, [val], basis(load_s_per_param=1e-6))   # the model's load joins the start
    assert loads["start_s"] == pytest.approx(10.0 + 1e-6 * mpt_param_count(ARCH)["total"])
    assert loads["seconds"] == pytest.approx(loads["start_s"] + expect["eval"])


def dataclass_world(work, world):
    import dataclasses
    return dataclasses.replace(work, world_size=world)


def test_the_plan_line_bounds_what_it_cannot_count_yet():
    """The tasks not counted yet get their item scorings (items x shot counts) and a bound: one full-context row
    each, batched as the job batches, timed as the counted batches are; a task of unknown size is named without a
    figure, and the text never reads as the whole."""
    b = basis(device="cpu", peak_flops=None)
    tasks = [{"label": "lm", "icl_task_type": "language_modeling", "shots": [0, 5], "items": 10, "max_seq_len": 128},
             {"label": "mc", "icl_task_type": "multiple_choice", "shots": [0], "items": 7, "max_seq_len": 128},
             {"label": "piqa", "icl_task_type": "multiple_choice", "shots": [0], "items": None, "max_seq_len": 128}]
    text = eval_time.uncounted_note(ARCH, tasks, 4, b)
    # 27 scorings of one 128-token row: 6 batches of 4 and one of 3
    rows = eval_time.EvaluatorWork("x", ((4, 128),) * 6 + ((3, 128),))
    bound = 7 * b.batch_s + eval_time.forward_flops(ARCH, rows, False) * b.forward_s_per_flop
    assert bound > 0.05
    assert text == ("this time leaves out 3 task(s) not counted yet (task file or tokenizer not on disk yet): "
                    "lm 0/5-shot 10 items, mc 0-shot 7 items, piqa 0-shot items unknown until its file exists: "
                    f"27 item scorings, at most +{bound:.1f} s at one full 128-token row each (x its choices for "
                    "multiple_choice); +? s for 1 task(s) of unknown size; the dry run counts them once their "
                    "files exist")
    assert "+? s for 1 task(s)" in eval_time.uncounted_note(ARCH, tasks[2:], 4, b)
    assert "at most" not in eval_time.uncounted_note(ARCH, tasks[2:], 4, b)


def test_other_gpus_scale_the_forward_by_their_peak_and_unknown_ones_get_no_plan(tmp_path):
    path = tmp_path / "basis.json"
    entry = {"start_s": {"value": 30.0}, "batch_s": {"value": 0.02}, "forward_s_per_flop": {"value": 4e-15},
             "decode_s_per_layer": {"value": 0.0009}}
    path.write_text(json.dumps({"devices": {"h200": dict(entry, peak_flops=peak_flops_for_name("h200", "bf16")),
                                            "cpu": dict(entry, forward_s_per_flop={"value": 5e-12})}}))
    h200 = eval_time.load_basis("h200", str(path))
    a100 = eval_time.load_basis("a100-80gb", str(path))
    assert h200.forward_s_per_flop == 4e-15 and h200.forward_mfu == pytest.approx(1 / (4e-15 * 989.5e12))
    assert a100.forward_s_per_flop == pytest.approx(4e-15 * 989.5 / 312) and a100.forward_mfu == pytest.approx(
        h200.forward_mfu)   # the same MFU on the slower part
    assert (a100.start_s, a100.batch_s, a100.decode_s_per_layer) == (30.0, 0.02, 0.0009)
    custom = eval_time.load_basis("mygpu", str(path), peak_overrides={"mygpu": 500e12})
    assert custom.forward_s_per_flop == pytest.approx(4e-15 * 989.5 / 500)
    assert eval_time.load_basis("mygpu", str(path)) is None   # no peak known: no plan rather than a wrong one
    cpu = eval_time.load_basis("cpu", str(path))
    assert cpu.forward_s_per_flop == 5e-12 and cpu.forward_mfu is None and "GFLOP/s (CPU)" in \
        eval_time.plan_seconds(ARCH, [eval_time.heldout_work(1, 1, 8)], cpu)["basis"]
    assert eval_time.load_basis("h200", str(tmp_path / "missing.json")) is None


def test_committed_basis_loads_for_the_shipped_devices():
    """benchmarks/eval-plan-basis.json (written by tools/calibrate_eval_plan.py) holds positive start and forward
    constants for the H200 and the CPU, each with its rows, and checks of the plan on rows outside the fit."""
    raw = json.loads((REPO / "benchmarks" / "eval-plan-basis.json").read_text())
    for device in ("h200", "cpu"):
        b = eval_time.load_basis(device)
        assert b.start_s > 0 and b.forward_s_per_flop > 0, device
        assert all((REPO / "benchmarks" / row).is_file() for row in raw["devices"][device]["rows"])
        assert any(not c["in_sample"] for c in raw["checks"] if c["device"] == device)


def test_calibration_recovers_the_constants_that_made_the_rows(tmp_path, monkeypatch):
    """Stand-in benchmark and step rows whose times were made by known constants: the fit finds them again, every
    check is on the mark, and a row whose recorded tokens differ from the rebuilt batches is refused."""
    tool = load_tool("calibrate_eval_plan")
    data = tmp_path / "foundry"
    data.mkdir()
    tasks = standin_tasks(data)
    for t in tasks:
        t["dataset_uri"] = os.path.relpath(t["dataset_uri"], data)
    suite = {"eval": {"suites": {"s": {"icl_tasks": tasks}}}}
    tok = write_tokenizer_folder(tmp_path / "tok")
    from llmpipe.evaluation.icl_tokens import Encoder

    enc = Encoder.from_folder(str(tok))
    arch = tool.run_arch("mpt-tiny")
    truth = eval_time.DeviceBasis("cpu", 7.0, 0.03, 2e-11, 0.002)
    bench = {"run": "mpt-tiny", "seq": 64, "batch_size": 2, "suite": suite, "runs": []}
    for repeat in (1, 2):
        for path in ("padded", "trimmed"):
            works = tool.works_of(tasks, str(data), enc, 64, 2, path, 1)
            plan = eval_time.plan_seconds(arch, works, truth)
            bench["runs"].append({"path": path, "repeat": repeat, "batches_s": plan["batches_s"],
                                  "evaluators_s": plan["evaluators_s"],
                                  "tokens_run": {w.label: w.tokens for w in works[1:]}})
    # a PATH@N run (tools/bench_icl_eval.py): rebuilt at its own batch size, not the record's
    works = tool.works_of(tasks, str(data), enc, 64, 1, "trimmed", 1)
    assert [len(w.batches) for w in works[1:]] != [
        len(w.batches) for w in tool.works_of(tasks, str(data), enc, 64, 2, "trimmed", 1)[1:]]
    plan = eval_time.plan_seconds(arch, works, truth)
    bench["runs"].append({"path": "trimmed@1", "icl_batches": "trimmed", "batch_size": 1, "repeat": 1,
                          "batches_s": plan["batches_s"], "evaluators_s": plan["evaluators_s"],
                          "tokens_run": {w.label: w.tokens for w in works[1:]}})
    works = tool.works_of(tasks, str(data), enc, 64, 4, "trimmed", 3)
    step = {"suite": suite, "phases": {"eval": {"seconds": eval_time.plan_seconds(arch, works, truth)["seconds"]}},
            "eval": {"run": "mpt-tiny", "icl_batches": "trimmed",
                     "val": {"seq_len": 64, "batch_size": 4, "batches": 3}}}
    bench_dir = tmp_path / "benchmarks"
    bench_dir.mkdir()
    (bench_dir / "bench.json").write_text(json.dumps(bench))
    (bench_dir / "step.json").write_text(json.dumps(step))
    monkeypatch.setattr(tool, "BENCH", str(bench_dir))
    monkeypatch.setattr(tool, "ROWS", {"cpu": {"rates": ["bench.json"], "start": ["step.json"], "checks": [],
                                               "why": "test"}})
    out = tmp_path / "basis.json"
    assert tool.main(["fit", "--tokenizer", str(tok), "--task-data", str(data), "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    got = rec["devices"]["cpu"]
    assert got["batch_s"]["value"] == pytest.approx(0.03, rel=1e-6)
    assert got["forward_s_per_flop"]["value"] == pytest.approx(2e-11, rel=1e-6)
    assert got["decode_s_per_layer"]["value"] == pytest.approx(0.002, rel=1e-6)
    assert got["start_s"]["value"] == pytest.approx(7.0, abs=0.01)
    assert got["load_s_per_param"]["value"] == 0   # one model size among the start rows: no load term
    assert len(rec["checks"]) == 6 and all(abs(c["error"]) < 1e-3 for c in rec["checks"])
    assert [c["path"] for c in rec["checks"]].count("trimmed@1") == 1
    assert eval_time.load_basis("cpu", str(out)).start_s == pytest.approx(7.0, abs=0.01)
    bench["runs"][0]["tokens_run"]["mc/0-shot"] += 1
    (bench_dir / "bench.json").write_text(json.dumps(bench))
    with pytest.raises(SystemExit, match="mc/0-shot: recorded .* tokens, the rebuilt batches"):
        tool.main(["fit", "--tokenizer", str(tok), "--task-data", str(data), "--out", str(out)])


def test_the_job_plans_shared_prefixes_as_the_dry_run_does(tmp_path):
    """eval.json's timing.planned (llmpipe.evaluation.icl_eval.planned_batches, from task_fits) counts the
    shared-prefix forwards on a GPU as llmpipe.plan.eval_time.task_works (the dry run's and the tool's builder)
    does: the same seconds per evaluator, and for multiple choice not the trimmed batches' (the stand-in items are so
    short that the second forward per batch costs more than the FLOPs it saves)."""
    from llmpipe.config.runs import run_settings
    from llmpipe.config.stage_settings import EvalSettings
    from llmpipe.evaluation.icl_eval import planned_batches
    from llmpipe.evaluation.icl_tokens import Encoder, task_fits
    from tests.conftest import project_config

    tool = load_tool("calibrate_eval_plan")
    data = tmp_path / "foundry"
    data.mkdir()
    # the job reads the subset's own file, the tool cuts the whole one: tasks without a subset here
    tasks = [t for t in standin_tasks(data) if t.get("subset_items") is None]
    enc = Encoder.from_folder(str(write_tokenizer_folder(tmp_path / "tok")))
    settings = run_settings(project_config(), "mpt-tiny")
    seq = int(settings.data.concat_tokens)
    plans = {}
    for path in ("trimmed", "shared_prefix"):
        fits, refused = task_fits(tasks, enc, seq, "test", batching=(4, path, 1))
        assert not refused
        job = planned_batches(settings, fits, tasks, EvalSettings(val_batches=2, batch_size=4, icl_batches=path), 1,
                              "h200")
        rel = [dict(t, dataset_uri=os.path.relpath(t["dataset_uri"], data)) for t in tasks]
        works = tool.works_of(rel, str(data), enc, seq, 4, path, 2)
        dry = eval_time.plan_seconds(settings.arch.as_dict(), works, eval_time.load_basis("h200"))
        assert job["evaluators_s"] == {k: round(v, 3) for k, v in dry["evaluators_s"].items()}
        plans[path] = job["evaluators_s"]
    assert plans["shared_prefix"]["mc/0-shot"] > plans["trimmed"]["mc/0-shot"]
