"""Memory and time plans (llmpipe.plan.memory_time): calibration against the committed H200 measurements, and dry runs that
show the plans, refuse what cannot fit and name the settings to change."""

from __future__ import annotations

import copy
import csv
import json
import math
import re

import pytest

from llmpipe.plan import memory_time as plan
from llmpipe.config.runs import inference_plan, run_config, run_settings, step_resources
from llmpipe.config.settings import ConfigError
from tests.conftest import REPO, error_block, project_config, snakemake

GIB = 2**30


def _rc(config, run, **train):
    rc = copy.deepcopy(run_config(config, run))
    rc["train"].update(train)
    return rc


# ------------------------------------------------------------------------------------------- calibration

def _measured_rows():
    """(model, microbatch, peak GiB) of the benchmark's ok rows of the shipped training settings (fused loss with
    Liger, no train metrics) that started from an empty GPU (mem_before_gb 0)."""
    rows = []
    with open(REPO / "benchmarks/train-throughput.csv", newline="") as f:
        for r in csv.DictReader(f):
            if (r["status"] == "ok" and r["fused_loss"] == "chunk=8192,liger" and r["train_metrics"] == "False"
                    and r["mem_before_gb"] not in ("",) and float(r["mem_before_gb"]) == 0.0
                    and r["variant"] in ("default", "default_liger")):
                rows.append((r["model"], int(r["microbatch"]), float(r["peak_mem_allocated_gb"]) * 1e9 / GIB,
                             _row_ac(r)))
    return rows


def _row_ac(row) -> bool:
    """Whether a benchmark row trained with activation checkpointing: its column, or for rows written before the
    column existed the shipped config of their time (on for MPT-3B only)."""
    if row.get("activation_checkpointing"):
        return row["activation_checkpointing"] == "True"
    return row["model"] == "mpt-3b"


def test_estimates_match_measured_h200_peaks():
    config = project_config()
    rows = _measured_rows()
    assert {m for m, _, _, _ in rows} >= {"mpt-125m", "mpt-350m", "mpt-760m", "mpt-1b"}, rows
    for model, mb, measured, ac in rows:
        est = plan.train_memory(_rc(config, model, microbatch_size=mb), nodes=1, gpus_per_node=1,
                                activation_checkpointing=ac)
        # never below the measurement by more than 3%, never above it by more than the refusal margin; with
        # activation checkpointing (MPT-3B under FSDP) the estimate is known to be 10% high (docs/large-models.md)
        high = 1 + plan.MARGIN + (0.05 if est["activation_checkpointing"] else 0.0)
        assert measured * 0.97 <= est["total_gb"] <= measured * high, (model, mb, est["total_gb"], measured)
    # the checkpoint run of "Checkpoints at every scale": MPT-1B, FSDP at world size 1, no compile
    rec = json.loads((REPO / "benchmarks/checkpoints-h200-mpt-1b.json").read_text())
    tr = rec["overlay"]["models"]["mpt-1b"]["train"]
    assert rec["train"]["fsdp"] is True and rec["train"]["devices"] == 1
    est = plan.train_memory(_rc(config, "mpt-1b", microbatch_size=tr["microbatch_size"]), nodes=1, gpus_per_node=1,
                            activation_checkpointing=bool(tr.get("fsdp", {}).get("activation_checkpointing")))
    assert est["fsdp"] == "FULL_SHARD"  # FSDP from train.fsdp_min_params at world size 1
    measured = rec["train"]["peak_memory_per_device_gib"]
    assert measured * 0.97 <= est["total_gb"] <= measured * (1 + plan.MARGIN), (est, measured)


def test_sharding_and_checkpointing_shrink_the_plan():
    config = project_config()
    rc = _rc(config, "mpt-70b")
    one = plan.train_memory(rc, nodes=1, gpus_per_node=8)
    eight = plan.train_memory(rc, nodes=8, gpus_per_node=8)
    assert one["states_gb"] == pytest.approx(8 * eight["states_gb"])
    assert one["states_gb"] == pytest.approx(16 * one["params"] / 8 / GIB)  # fp32 weights, grads, 2 Adam moments
    no_ac = plan.train_memory(rc, nodes=8, gpus_per_node=8, activation_checkpointing=False)
    assert no_ac["activations_gb"] > 10 * eight["activations_gb"]
    half = plan.train_memory(rc, nodes=8, gpus_per_node=8, activation_checkpointing=False, microbatch_size=2)
    assert half["activations_gb"] == pytest.approx(no_ac["activations_gb"] / 2)


def test_auto_activation_checkpointing_follows_the_memory_plan():
    config = project_config()
    rc3 = run_config(config, "mpt-3b")
    assert rc3["train"]["fsdp"]["activation_checkpointing"] == "auto"  # the shipped setting
    # MPT-3B at microbatch 8 on one GPU: 81.6 GiB planned without recomputation (76.5 GiB allocated without FSDP on
    # one H200, benchmark call i23-2)
    assert plan.resolve_activation_checkpointing(rc3, nodes=1, gpus_per_node=1, capacity_gb=141)[
        "train"]["fsdp"]["activation_checkpointing"] is False
    assert plan.resolve_activation_checkpointing(rc3, nodes=1, gpus_per_node=1, capacity_gb=80)[
        "train"]["fsdp"]["activation_checkpointing"] is True
    # the decision is the plan's: off exactly when the plan without it is within AUTO_AC_SHARE of the GPU
    rc7 = run_config(config, "mpt-7b")
    without = plan.train_memory(rc7, nodes=2, gpus_per_node=8, activation_checkpointing=False)["total_gb"]
    for capacity in (80, 141, without / plan.AUTO_AC_SHARE * 0.99, without / plan.AUTO_AC_SHARE * 1.01):
        mem = plan.train_memory(rc7, nodes=2, gpus_per_node=8, capacity_gb=capacity)
        assert mem["activation_checkpointing_auto"] is True
        assert mem["activation_checkpointing"] is (without > plan.AUTO_AC_SHARE * capacity), capacity
        resolved = plan.resolve_activation_checkpointing(rc7, nodes=2, gpus_per_node=8, capacity_gb=capacity)
        assert resolved["train"]["fsdp"]["activation_checkpointing"] is mem["activation_checkpointing"]
    assert rc7["train"]["fsdp"]["activation_checkpointing"] == "auto"  # the caller's settings are not changed
    # no GPU: nothing to fit; no architecture: nothing to plan from, so recompute
    assert plan.resolve_activation_checkpointing(rc7, nodes=1, gpus_per_node=0, capacity_gb=80)[
        "train"]["fsdp"]["activation_checkpointing"] is False
    hub = {**rc7, "arch": {}}
    assert plan.resolve_activation_checkpointing(hub, nodes=1, gpus_per_node=8, capacity_gb=80)[
        "train"]["fsdp"]["activation_checkpointing"] is True
    # an explicit setting is kept, and the plan line names an automatic choice
    forced = _rc(config, "mpt-3b", fsdp={**rc3["train"]["fsdp"], "activation_checkpointing": True})
    assert plan.resolve_activation_checkpointing(forced, nodes=1, gpus_per_node=1, capacity_gb=141)[
        "train"]["fsdp"]["activation_checkpointing"] is True
    line = plan.plan_line("train", "mpt-3b", plan.train_memory(rc3, nodes=1, gpus_per_node=1, capacity_gb=141),
                          141, "h200")
    assert "activation checkpointing off (auto:" in line, line


def test_the_training_config_gets_the_resolved_choice():
    pytest.importorskip("omegaconf")
    from llmpipe.train.pretrain import foundry_train_config

    rc, rs = run_config(project_config(), "mpt-3b"), run_settings(project_config(), "mpt-3b")

    def ac(settings):
        cfg = foundry_train_config(settings, data_dir=None, save_folder=None, world_size=1)
        return cfg["callbacks"]["llmpipe_single_device_fsdp"]["fsdp_config"]["activation_checkpointing"]

    assert ac(plan.resolve_settings(rs, rc, nodes=1, gpus_per_node=1, capacity_gb=141)) is False
    assert ac(plan.resolve_settings(rs, rc, nodes=1, gpus_per_node=1, capacity_gb=80)) is True
    assert ac(rs) is True  # never resolved: composer gets a boolean, the one that fits


def test_gpu_type_table_and_unknown_type():
    assert plan.gpu_memory_gb("h100") == 80 and plan.gpu_memory_gb("H200") == 141
    assert plan.gpu_memory_gb("a100-40gb") == 40
    assert plan.gpu_memory_gb("h100", {"h100": 94}) == 94
    with pytest.raises(ConfigError, match=r"^gpu_type is 'v100', which is not a known GPU type .*gpu_memory_gb"):
        plan.gpu_memory_gb("v100")


def test_70b_time_projection_against_the_seed():
    """Projected from the committed benchmark: MPT-70B's 1.4e12 tokens take months on 8 nodes, not the seed's
    'about 2 months on 8 nodes, about a week on 64'."""
    config = project_config()
    rc = run_config(config, "mpt-70b")
    basis = plan.benchmark_basis(str(REPO / "benchmarks/train-throughput.csv"))
    assert basis["model"] == "mpt-1b" and basis["gpu"] == "NVIDIA H200"
    t8 = plan.train_time(rc, nodes=8, gpus_per_node=8, gpu_type="h100", basis=basis, activation_checkpointing=True)
    t64 = plan.train_time(rc, nodes=64, gpus_per_node=8, gpu_type="h100", basis=basis, activation_checkpointing=True)
    assert t8["tokens"] == 333800 * 2048 * 2048
    assert t8["seconds"] == pytest.approx(8 * t64["seconds"])
    # the benchmark's throughput scaled by FLOPs per token (same GPU peak: H100 SXM and H200 are both 989.5 TFLOPS)
    tps_gpu = basis["tokens_per_s"] * basis["flops_per_token"] / t8["flops_per_token"] * 0.75
    assert t8["tokens_per_s"] == pytest.approx(64 * tps_gpu, rel=0.01)
    assert t8["days"] > 3 * 60 and t64["days"] > 3 * 7  # the seed's figures are off by more than 3x
    assert "projection" in t8["basis"] and "benchmarks/train-throughput.csv" in t8["basis"]


def test_basis_is_the_median_of_the_named_runs_repeats(tmp_path):
    """The rows plan-basis.json names give their median; a newer run's rows (appended benchmark rows) change nothing."""
    import csv as _csv
    cols = ["run_id", "timestamp", "model", "variant", "status", "gpu", "tokens_per_s", "mfu",
            "flops_per_token", "peak_flops"]
    rows = [("old", "2026-11-01T00:00:00", 0.60), ("named", "2026-12-01T00:00:01", 0.52),
            ("named", "2026-12-01T00:00:02", 0.55), ("named", "2026-12-01T00:00:03", 0.50),
            ("newer", "2026-12-09T00:00:00", 0.70)]
    with open(tmp_path / "t.csv", "w", newline="") as f:
        w = _csv.writer(f)
        w.writerow(cols)
        for run_id, ts, m in rows:
            w.writerow([run_id, ts, "mpt-1b", "default", "ok", "NVIDIA H200", m * 1e5, m, 9e9, 989.5e12])
        w.writerow(["named", "2026-12-01T00:00:04", "mpt-1b", "default", "error", "", "", "", "", ""])
    chosen = {"csv": "t.csv", "model": "mpt-1b", "variant": "default", "run_id": "named"}
    (tmp_path / "basis.json").write_text(json.dumps(chosen))
    basis = plan.benchmark_basis(basis_path=str(tmp_path / "basis.json"))
    assert basis["run_id"] == "named" and basis["repeats"] == 3 and basis["mfu"] == pytest.approx(0.52)
    config = project_config()
    t = plan.train_time(run_config(config, "mpt-70b"), nodes=8, gpus_per_node=8, gpu_type="h100", basis=basis)
    assert "median of 3 runs" in t["basis"] and "run named of" in t["basis"]
    (tmp_path / "basis.json").write_text(json.dumps({**chosen, "run_id": "newer"}))
    assert plan.benchmark_basis(basis_path=str(tmp_path / "basis.json"))["mfu"] == pytest.approx(0.70)
    assert plan.benchmark_basis(basis_path=str(tmp_path / "missing.json")) is None


def test_the_committed_basis_names_rows_that_exist():
    """benchmarks/plan-basis.json names, for each card, rows that exist: a model, variant and run id with ok rows in
    the committed CSV (h200, and every card without rows of its own), or ok acceptance records (h100)."""
    chosen = json.loads((REPO / "benchmarks/plan-basis.json").read_text())
    assert chosen["other_cards"] == "h200" and set(chosen["cards"]) >= {"h200", "h100"}
    for card, rows in chosen["cards"].items():
        basis = plan.benchmark_basis(card=card)
        assert basis is not None and basis["card"] == card and basis["model"] == rows["model"], card
        assert basis["repeats"] >= 1 and 0.3 < basis["mfu"] < 0.8, card
    h200, h100 = plan.benchmark_basis(card="h200"), plan.benchmark_basis(card="h100")
    assert h200["run_id"] == chosen["cards"]["h200"]["run_id"] and h200["gpu"] == "NVIDIA H200"
    # the H100 row: the median steady window of the three MPT-1B acceptance records on an H100
    mfus = sorted(json.loads((REPO / "benchmarks" / f).read_text())["train"]["steady_mfu"]
                  for f in chosen["cards"]["h100"]["acceptance"])
    assert h100["gpu"] == "NVIDIA H100 80GB HBM3" and h100["repeats"] == 3 and h100["mfu"] == mfus[1]
    assert plan.benchmark_basis(card="a100-80gb")["card"] == "h200" == plan.benchmark_basis()["card"]
    t = plan.train_time(run_config(project_config(), "mpt-1b"), nodes=1, gpus_per_node=1, gpu_type="h100",
                        basis=h100)
    assert "acceptance-h100-mpt-1b-nokill.json" in t["basis"] and "named by benchmarks/plan-basis.json for h100" \
        in t["basis"]


# ------------------------------------------------------------------------------------------- dry runs

def test_dry_run_shows_70b_memory_and_time(workdir):
    proc = snakemake(workdir, "-n", "results/mpt-70b/train.json", "--config", "gpu_type=h100")
    out = proc.stdout + proc.stderr
    m = re.search(r"plan train mpt-70b: ([\d.]+) GiB per GPU of 80 GiB \(h100\) = states .*FULL_SHARD over 64 "
                  r"GPU\(s\) \(8 node\(s\) x 8\), microbatch 4 x 2048, activation checkpointing on "
                  r"\(auto: [\d.]+ GiB without it, off up to 85% "
                  r"of the GPU\); "
                  r"time (\d+) days", out)
    assert m, out[-3000:]
    est = plan.train_memory(run_config(project_config(), "mpt-70b"), nodes=8, gpus_per_node=8, capacity_gb=80)
    assert float(m.group(1)) == pytest.approx(est["total_gb"], abs=0.05)
    assert "projection: MFU" in out


def test_dry_run_refuses_training_that_cannot_fit(workdir):
    proc = snakemake(workdir, "-n", "results/mpt-70b/train.json", "--config", "gpu_type=a100-40gb",
                     "models={'mpt-70b': {'train': {'fsdp': {'activation_checkpointing': false}}}}", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert re.search(r"models\.mpt-70b: the train step of mpt-70b needs about \d+ GiB per GPU .* 40 GiB of one "
                     r"a100-40gb GPU \(gpu_type\)\. Fix: turn on models\.mpt-70b\.train\.fsdp\."
                     r"activation_checkpointing .*models\.mpt-70b\.train\.microbatch_size .*"
                     r"a GPU with more memory \(gpu_type\)\.", out), out[-3000:]
    # without recompute the activations alone (160 GiB per GPU at microbatch 4, 40 at 1) exceed the card at any GPU
    # count: more GPUs is no fix on its own (llmpipe.plan.memory_time.smallest_world_size)
    assert "more GPUs" not in out
    assert "rule train:" not in proc.stdout  # nothing planned to run


def test_a_real_run_refuses_a_plan_that_cannot_fit_before_any_job_starts(workdir):
    """Without -n, an evaluation whose plan cannot fit stops the run before the data steps, training, export and
    generation before it start (Snakemake evaluates a job's resources only when the job is ready; rules/common.smk's
    onstart makes every job's checks first: DagChecks.check_jobs), with the dry run's message: no result, no job
    log, nothing flagged incomplete, Snakemake's lock released, each plan printed once."""
    args = ("results/mpt-tiny/eval.json", "--config", "gpu_type=h100", "gpu_memory_gb={h100: 0.001}",
            "models={'mpt-tiny': {'step_resources': {'eval': {'gpus_per_node': 1}}}}")
    dry = snakemake(workdir, "-n", *args, check=False)
    real = snakemake(workdir, "--cores", "2", *args, check=False)
    dry_out, real_out = dry.stdout + dry.stderr, real.stdout + real.stderr
    assert dry.returncode != 0 and real.returncode != 0, real_out[-3000:]
    assert re.search(r"^rule generate:", dry_out, re.M), dry_out[-3000:]  # the dry run lists the steps before it
    refusal = error_block(dry, "InputFunctionException in rule eval in file")
    assert "ConfigError: models.mpt-tiny: the eval step of mpt-tiny needs about" in refusal, dry_out[-3000:]
    assert error_block(real, "InputFunctionException in rule eval in file") == refusal, real_out[-3000:]
    assert not re.search(r"^(local)?rule \w+:", real_out, re.M), real_out[-3000:]  # no job started
    for plan_line in ("plan convert mpt-tiny:", "plan eval mpt-tiny:"):
        assert dry_out.count(plan_line) == 1 and real_out.count(plan_line) == 1, (plan_line, real_out[-3000:])
    assert not [p for p in (workdir / "results").rglob("*") if p.is_file()]
    assert not list((workdir / ".snakemake" / "incomplete").iterdir())
    assert not list((workdir / ".snakemake" / "locks").iterdir())


def test_dry_run_plans_70b_inference_on_one_node_of_8_gpus(workdir):
    """MPT-70B's evaluation (250 GiB on one GPU) runs under FSDP over the 8 GPUs of one node, its generation
    (126 GiB of bf16 weights and KV cache) across them with device_map on 80 GB GPUs; the dry run passes and shows
    each step's per-GPU memory and projected time, and Snakemake's job asks for 8 GPUs."""
    proc = snakemake(workdir, "-n", "results/mpt-70b/eval.json", "results/mpt-70b/generate.json", "--config",
                     "gpu_type=h100")
    out = proc.stdout + proc.stderr
    config = project_config()
    rc = run_config(config, "mpt-70b")
    for step, how in (("eval", "FSDP FULL_SHARD"), ("generate", "device_map balanced")):
        m = re.search(rf"plan {step} mpt-70b: ([\d.]+) GiB per GPU of 80 GiB \(h100\) = weights ([\d.]+) .*; "
                      rf"1 node x 8 GPUs, {how}; time [\d.]+ (s|minutes|hours)", out)
        assert m, out[-3000:]
        est = plan.inference_memory(rc, step=step, batch_size=config["eval"]["batch_size"] if step == "eval" else 1,
                                    gpus=8)
        assert float(m.group(1)) == pytest.approx(est["total_gb"], abs=0.05) and float(m.group(1)) < 80
        one = plan.inference_memory(rc, step=step, batch_size=8 if step == "eval" else 1)
        assert float(m.group(2)) == pytest.approx(one["weights_gb"] / 8, abs=0.05)
    assert re.search(r"rule eval:(?:\n .*)*?\n    resources: .*gpus_per_node=8", proc.stdout), proc.stdout[-3000:]
    assert re.search(r"rule generate:(?:\n .*)*?\n    resources: .*gpus_per_node=8", proc.stdout)
    assert "projection: " in out and re.search(r"start \d+ s \+ 512 new tokens x [\d.]+ ms \(job-overheads-h200", out)
    # the evaluation's plan: the held-out batches counted, the standard suite's tasks named as not on disk yet
    assert re.search(r"plan eval mpt-70b: .*; time [\d.]+ minutes \(start \d+ s \+ 1 evaluator\(s\), 20 batches, "
                     r".* \(eval-plan-basis\.json: its h200 row at the h100 bf16 peak\); this time leaves out \d+ "
                     r"task\(s\) not counted yet", out), out[-3000:]


def test_shared_prefix_eval_plans_its_cache_on_one_gpu_only():
    """eval.icl_batches: shared_prefix adds the prefixes' KV cache and its per-sequence copy (1.5 x the batch's
    sequences of the whole context, K and V in bf16 per block) and a second bf16 logits buffer on one GPU; several
    GPUs take the trimmed forward, so their plan is unchanged; the dry run's eval line shows the cache."""
    config = project_config()
    rc = run_config(config, "mpt-1b")
    arch, seq = rc["arch"], rc["data"]["concat_tokens"]
    batch = config["eval"]["batch_size"]
    base = plan.inference_memory(rc, step="eval", batch_size=batch)
    shared = plan.inference_memory(rc, step="eval", batch_size=batch, shared_prefix=True)
    per_seq = 2 * arch["n_layers"] * seq * arch["d_model"] * 2
    assert base["kv_cache_gb"] == 0
    assert shared["kv_cache_gb"] * 2**30 == pytest.approx(1.5 * batch * per_seq)
    assert shared["logits_gb"] == pytest.approx(base["logits_gb"] * 8 / 6)
    assert plan.inference_memory(rc, step="eval", batch_size=batch, gpus=2, shared_prefix=True) == \
        plan.inference_memory(rc, step="eval", batch_size=batch, gpus=2)
    assert plan.inference_memory(rc, step="generate", shared_prefix=True) == plan.inference_memory(rc, step="generate")
    config["gpu_type"] = "h200"
    for icl_batches, kv in (("shared_prefix", shared["kv_cache_gb"]), ("trimmed", 0.0)):
        config["eval"]["icl_batches"] = icl_batches
        mem = inference_plan(config, "eval", "mpt-1b")["memory"]
        assert mem["kv_cache_gb"] == pytest.approx(kv)


def test_inference_gpu_count_follows_the_model_size():
    """125M-1B stay on one GPU (of any listed type); a model too large for one GPU gets the GPUs of one node of its
    run: evaluation one process per GPU, generation one process that places the model across them; a run's
    step_resources.<step>.gpus_per_node wins."""
    config = project_config()
    for gpu_type in ("h100", "h200", "a100-40gb"):
        config["gpu_type"] = gpu_type
        for run in ("mpt-125m", "mpt-350m", "mpt-760m", "mpt-1b"):
            for step in ("eval", "generate"):
                r = step_resources(config, step, run)
                assert (r["gpus_per_node"], r["tasks_per_node"]) == (1, 1), (gpu_type, run, step, r)
    config["gpu_type"] = "h100"
    assert (step_resources(config, "eval", "mpt-70b")["gpus_per_node"],
            step_resources(config, "eval", "mpt-70b")["tasks_per_node"]) == (8, 8)
    assert (step_resources(config, "generate", "mpt-70b")["gpus_per_node"],
            step_resources(config, "generate", "mpt-70b")["tasks_per_node"]) == (8, 1)
    config["models"]["mpt-70b"]["step_resources"] = {"eval": {"gpus_per_node": 4}}
    placed = step_resources(config, "eval", "mpt-70b")
    assert (placed["gpus_per_node"], placed["tasks_per_node"]) == (4, 4)
    config["models"]["mpt-70b"]["step_resources"] = {"eval": {"gpus_per_node": 0}}  # on CPU: never planned
    assert step_resources(config, "eval", "mpt-70b")["gpus_per_node"] == 0


def test_dry_run_refuses_an_inference_override_that_cannot_fit(workdir):
    """Two 80 GB GPUs cannot hold MPT-70B's fp32 evaluation: the dry run stops naming the override."""
    proc = snakemake(workdir, "-n", "results/mpt-70b/eval.json", "--config", "gpu_type=h100",
                     "models={'mpt-70b': {'step_resources': {'eval': {'gpus_per_node': 2}}}}", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert re.search(r"models\.mpt-70b: the eval step of mpt-70b needs about \d+ GiB per GPU over 2 GPU\(s\) .*80 "
                     r"GiB of one h100 GPU \(gpu_type\)\. The 2 GPU\(s\) come from "
                     r"models\.mpt-70b\.step_resources\.eval\.gpus_per_node\. Fix: raise "
                     r"models\.mpt-70b\.step_resources\.eval\.gpus_per_node", out), out[-3000:]
    assert "rule eval:" not in proc.stdout


def test_inference_override_beyond_one_node_is_refused():
    """Inference never spans nodes: more GPUs than one node of the run has is refused, naming the setting."""
    from llmpipe.config.runs import inference_plan

    config = project_config()
    config["gpu_type"] = "h100"
    config["models"]["mpt-70b"]["step_resources"] = {"eval": {"gpus_per_node": 16}}
    with pytest.raises(ConfigError, match=r"^models\.mpt-70b\.step_resources\.eval\.gpus_per_node is 16, more than "
                                          r"the 8 GPUs of one node of mpt-70b .* Fix: at most 8\."):
        inference_plan(config, "eval", "mpt-70b")
    config["models"]["mpt-70b"]["step_resources"] = {"eval": {"gpus_per_node": 8}}
    assert inference_plan(config, "eval", "mpt-70b")["gpus"] == 8


def test_the_fix_for_an_evaluation_that_cannot_fit_names_the_batch_size():
    from llmpipe.plan.inference_placement import plan_gpus

    rc = run_config(project_config(), "mpt-70b")
    placed = plan_gpus(rc, "eval", capacity_gb=80, section_gpus=1, node_gpus=8, batch_size=512)
    with pytest.raises(ConfigError, match=r"or a smaller eval\.batch_size \(activations and logits \d+ GiB per GPU\)"):
        plan.check_inference_fits("eval", "mpt-70b", placed, 80, "h100", "models.mpt-70b")


def test_a_model_too_large_for_one_node_is_refused():
    """No node of 8 GPUs holds a model of 300 GiB of bf16 weights per 80 GB GPU: refused, naming the node's GPUs."""
    from llmpipe.plan.inference_placement import plan_gpus

    rc = run_config(project_config(), "mpt-70b")
    rc["arch"] = {**rc["arch"], "n_layers": 1200}  # about a trillion parameters
    placed = plan_gpus(rc, "generate", capacity_gb=80, section_gpus=1, node_gpus=8)
    assert placed["gpus"] == 8 and placed["source"] == "node"
    with pytest.raises(ConfigError, match=r"over 8 GPU\(s\).*all of the node's \(models\.big\.resources\."
                                          r"gpus_per_node\)\. Fix: "):
        plan.check_inference_fits("generate", "big", placed, 80, "h100", "models.big")


def test_dry_run_unknown_gpu_type(workdir):
    proc = snakemake(workdir, "-n", "results/mpt-1b/train.json", "--config", "gpu_type=v100", check=False)
    assert proc.returncode != 0
    assert "gpu_type is 'v100', which is not a known GPU type" in proc.stdout + proc.stderr


def test_plans_of_the_large_models_fit_as_configured():
    """7B, 30B, 70B pretraining and the 7B/30B finetunes fit 80 GB GPUs at their configured node counts."""
    config = project_config()
    for run in ("mpt-7b", "mpt-30b", "mpt-70b", "mpt-7b-dolly", "mpt-7b-dolly-lora", "mpt-30b-instruct"):
        r = step_resources(config, "train", run)
        mem = plan.train_memory(run_config(config, run), nodes=r["nodes"], gpus_per_node=r["gpus_per_node"])
        plan.check_fits("train", run, mem, plan.gpu_memory_gb("h100"), "h100", f"models.{run}")
        assert mem["total_gb"] < 80, (run, mem)


def test_report_projection_uses_the_benchmark_without_a_gpu_run(tmp_path):
    """A CPU reference (no MFU) no longer projects CPU years: the report takes the dry run's time plan."""
    from llmpipe.report import tables as report

    config = project_config()
    config["gpu_type"] = "h200"   # this host has no GPU: the plans of an h200
    config["report"] = {"projection": {"nodes": [8, 64], "models": ["mpt-70b"]}}
    (tmp_path / "mpt-tiny").mkdir()
    (tmp_path / "mpt-tiny/train.json").write_text(json.dumps({
        "tokens_per_s_per_device": 900.0, "devices": 1, "nodes": 1, "flops_per_token": 1e6, "concat_tokens": 128,
        "mfu": None, "device": "cpu"}))
    basis = plan.benchmark_basis()
    df = report.projection(config, str(tmp_path), "mpt-tiny", basis)
    rc = run_config(config, "mpt-70b")
    want = plan.train_time(rc, nodes=8, gpus_per_node=8, gpu_type=config["gpu_type"], basis=basis,
                           activation_checkpointing=True)
    r = df[df["nodes"] == 8].iloc[0]
    assert r["reference"] == "benchmark" and r["devices"] == 64
    assert r["projected time (s)"] == pytest.approx(want["seconds"], rel=1e-6)
    assert "benchmarks/train-throughput.csv" in r["basis"]
    # without the basis, the CPU run stays the reference (as before)
    assert set(report.projection(config, str(tmp_path), "mpt-tiny")["reference"]) == {"mpt-tiny"}


def test_the_training_step_trains_with_the_plans_choice(tmp_path):
    """The training rule's task gets the boolean the memory plan chose for its job's GPUs and gpu_type: MPT-3B on
    1 x 8 GPUs needs 47 GiB without recompute, so no recompute on 80 GB GPUs; on 1 x 1 GPU of 80 GB it recomputes."""
    from types import SimpleNamespace

    from llmpipe.config.runs import deep_merge
    from llmpipe.steps.context import StepContext
    from llmpipe.steps.training import training_task

    tok = tmp_path / "tokenizer" / "manifest.json"
    tok.parent.mkdir()
    tok.write_text(json.dumps({"vocab_size": 50000}))

    def task_ac(gpus_per_node):
        config = deep_merge(project_config(), {"gpu_type": "h100",
                                               "models": {"mpt-3b": {"resources": {"gpus_per_node": gpus_per_node}}}})
        ctx = StepContext(rule="train", config=config, wildcards=SimpleNamespace(run="mpt-3b"),
                          input=SimpleNamespace(tokenizer=str(tok), data=str(tmp_path / "data" / "verified.json")),
                          output=[str(tmp_path / "mpt-3b" / "train.json")], params=SimpleNamespace(identity="x"),
                          log_file=str(tmp_path / "log"), log_dir=None, resources={}, key="k", executor="local")
        task = training_task(ctx, config, "mpt-3b", run_settings(config, "mpt-3b"))
        return task.settings.train.fsdp["activation_checkpointing"]

    assert task_ac(8) is False
    assert task_ac(1) is True


def test_auto_is_decided_at_the_microbatch_the_job_runs():
    """The training caps the microbatch at the per-device batch; the plan (and so auto) uses the capped one: the
    7B finetune on 8 nodes of 80 GB GPUs runs microbatch 1 (64 sequences over 64 GPUs) and needs no recompute."""
    from llmpipe.config.runs import deep_merge
    config = deep_merge(project_config(), {"finetunes": {"mpt-7b-dolly": {"resources": {"nodes": 8}}}})
    rc = run_config(config, "mpt-7b-dolly")
    assert rc["train"]["microbatch_size"] == 8 and rc["train"]["global_batch_size"] == 64
    mem = plan.train_memory(rc, nodes=8, gpus_per_node=8, capacity_gb=80)
    assert mem["microbatch_size"] == 1 and mem["activation_checkpointing"] is False
    one_node = plan.train_memory(rc, nodes=1, gpus_per_node=8, capacity_gb=80)
    assert one_node["microbatch_size"] == 8 and one_node["activation_checkpointing"] is True
    line = plan.plan_line("train", "mpt-7b-dolly", one_node, 80, "h100")
    assert f"(auto: {one_node['without_checkpointing_gb']:.1f} GiB without it, off up to 85% of the GPU)" in line


def test_a_scaling_study_recomputes_at_every_node_count_or_at_none():
    """auto is decided once per study, at its smallest node count: MPT-13B needs recompute on 1 node of H200s but
    not on 2, so a study over 1..8 nodes recomputes at each (speedups compare the same FLOPs per token)."""
    from llmpipe.bench import scaling_study as scaling
    from llmpipe.config.runs import deep_merge
    config = deep_merge(project_config(), {"gpu_type": "h200", "scaling": {"nodes": [1, 2, 4, 8]}})
    rc13 = run_config(config, "mpt-13b")
    alone = {n: plan.train_memory(rc13, nodes=n, gpus_per_node=8, capacity_gb=141)["activation_checkpointing"]
             for n in (1, 2)}
    assert alone == {1: True, 2: False}
    for n in (1, 2, 4, 8):
        study = run_config(scaling.study_config(config, "mpt-13b", n), "mpt-13b")
        assert study["train"]["fsdp"]["activation_checkpointing"] is True, n
        assert study["resources"]["nodes"] == n
    config2 = deep_merge(config, {"scaling": {"nodes": [2, 4]}})
    for n in (2, 4):
        assert run_config(scaling.study_config(config2, "mpt-13b", n), "mpt-13b")["train"]["fsdp"][
            "activation_checkpointing"] is False


def test_fsdp_null_is_planned_as_the_training_runs_it():
    """fsdp: null trains under composer's defaults (FULL_SHARD) on more than one GPU; the plan shards likewise."""
    rc = _rc(project_config(), "mpt-13b", fsdp=None)
    mem = plan.train_memory(rc, nodes=4, gpus_per_node=8, capacity_gb=141)
    assert mem["fsdp"] == "FULL_SHARD" and mem["activation_checkpointing"] is False
    assert mem["states_gb"] == pytest.approx(16 * mem["params"] / 32 / GIB)


def test_fused_loss_kernel_null_is_planned_as_the_default_kernel():
    """``fused_loss: {kernel: null}`` trains with the default kernel (liger: one chunk of logits in place), so its
    plan equals ``fused_loss: true``'s; ``kernel: torch`` keeps a second chunk-sized buffer and plans twice that."""
    def logits_gb(fused):
        rc = copy.deepcopy(run_config(project_config(), "mpt-1b"))
        rc["train"].update(fused_loss=fused, train_metrics=False)
        return plan.train_memory(rc, nodes=1, gpus_per_node=8, capacity_gb=141)["logits_gb"]
    assert logits_gb({"kernel": None}) == logits_gb(True) == logits_gb({"kernel": "liger"})
    assert logits_gb({"kernel": "torch"}) == pytest.approx(2 * logits_gb(True))


def test_refusal_without_fsdp_names_fsdp_not_recompute():
    """Activation checkpointing exists only under FSDP: a one-GPU training without FSDP that does not fit is told to
    train under FSDP (train.fsdp_min_params), not to turn on a recompute it cannot get."""
    rc = _rc(project_config(), "mpt-3b", fsdp_min_params=None)
    mem = plan.train_memory(rc, nodes=1, gpus_per_node=1, capacity_gb=40)
    assert mem["fsdp"] is None and mem["activation_checkpointing"] is False
    with pytest.raises(ConfigError) as err:
        plan.check_fits("train", "mpt-3b", mem, 40, "a100-40gb", "models.mpt-3b")
    msg = str(err.value)
    assert "train under FSDP, which allows activation checkpointing: models.mpt-3b.train.fsdp_min_params" in msg
    assert "turn on models.mpt-3b.train.fsdp.activation_checkpointing" not in msg


def _short_1b(**train):
    from llmpipe.config.runs import deep_merge
    over = {"max_duration_batches": 20, "save_interval_batches": 10, "eval_interval_batches": 20,
            "eval_subset_batches": 4, **train}
    return run_config(deep_merge(project_config(), {"models": {"mpt-1b": {"train": over}}}), "mpt-1b")


def test_train_time_adds_start_compile_saves_and_evaluations():
    """The job's costs besides its batches (benchmarks/job-overheads-h200.json): one start, compile per block, a save
    per save interval (12 bytes per parameter at the measured write rate, split over the nodes), an evaluation per
    eval interval (its forward tokens at a third of a training token's time)."""
    from llmpipe.model.mfu import mpt_param_count
    ov = plan.job_overheads()
    basis = plan.benchmark_basis()
    rc = _short_1b()
    params = mpt_param_count(rc["arch"])["total"]
    assert plan.checkpoint_bytes(rc) == 12 * params
    kw = dict(nodes=1, gpus_per_node=1, gpu_type="h200", basis=basis)
    bare, full = plan.train_time(rc, **kw), plan.train_time(rc, **kw, overheads=ov)
    ex = full["overheads"]
    assert bare["overheads"] is None and (ex["n_saves"], ex["n_evals"]) == (2, 1)
    assert ex["per_save"] == pytest.approx(12 * params / ov["save_bytes_per_s"])
    assert ex["compile"] == pytest.approx(ov["compile_s_per_layer"] * rc["arch"]["n_layers"])
    per_gpu = bare["tokens_per_s"]
    assert ex["per_eval"] == pytest.approx(4 * rc["train"]["eval_microbatch_size"] * 2048 / (3 * per_gpu))
    assert full["seconds"] == pytest.approx(bare["seconds"] + ov["start_s"] + ex["compile"] + ex["saves"] + ex["evals"])
    assert f"2 save(s) of {12 * params / 2**30:.3g} GiB x" in full["basis"] and "job-overheads-h200.json" in full["basis"]
    # compile off costs no compile; 2 nodes write their halves at once; 25 batches at a save every 10: 3 saves
    assert plan.train_time(_short_1b(compile=False), **kw, overheads=ov)["overheads"]["compile"] == 0
    two = plan.train_time(rc, **{**kw, "nodes": 2}, overheads=ov)["overheads"]
    assert two["per_save"] == pytest.approx(ex["per_save"] / 2)
    assert plan.train_overheads(_short_1b(max_duration_batches=25), nodes=1, tokens_per_s_per_gpu=per_gpu,
                                overheads=ov)["n_saves"] == 3


def test_convert_and_generate_times_count_start_checkpoint_io_and_tokens():
    from llmpipe.plan import inference_placement as ip
    from llmpipe.model.mfu import mpt_param_count
    ov = plan.job_overheads()
    rc = _short_1b()
    params = mpt_param_count(rc["arch"])["total"]
    t = plan.convert_time(rc, ov)
    assert t["seconds"] == pytest.approx(ov["convert_start_s"] + params * ov["convert_s_per_param"])
    assert f"+ {params / 1e9:.3g}B parameters {params * ov['convert_s_per_param']:.0f} s (" in t["basis"], t["basis"]
    # the tiny model (well under a billion parameters, under a second of work): its count and no "0.00B ... 0 s"
    tiny_rc = run_config(project_config(), "mpt-tiny")
    tiny = mpt_param_count(tiny_rc["arch"])["total"]
    basis = plan.convert_time(tiny_rc, ov)["basis"]
    assert f"+ {plan.human_count(tiny)} parameters under 1 s (" in basis and "0.00B" not in basis, basis
    assert plan.human_count(tiny)[-1] in "KM" and plan.human_count(6.9e9) == "6.9B" and plan.human_count(999) == "999"
    g = ip.inference_time(rc, "generate", gpus=1, gpu_type="h200", basis=None, new_tokens=512, weights_gb=2.45,
                          overheads=ov)
    assert g["seconds"] == pytest.approx(ov["generate_start_s"] + 512 * 24 * ov["generate_s_per_token_per_layer"])
    bound = ip.inference_time(rc, "generate", gpus=1, gpu_type="h200", basis=None, new_tokens=512, weights_gb=2.45)
    assert bound["seconds"] < g["seconds"] and "lower bound" in bound["basis"]


def test_job_overhead_constants_cite_committed_sources():
    """Every constant says what it covers and how it was derived: from files in the repository (which exist), or from
    a manual page (Slurm's requeue hold)."""
    raw = json.loads((REPO / "benchmarks/job-overheads-h200.json").read_text())
    entries = {k: v for k, v in raw.items() if isinstance(v, dict)}
    assert set(plan.job_overheads()) - {"source"} == set(entries)
    for name, e in entries.items():
        assert e["value"] > 0 and e["unit"] and e["what"], name
        cited = re.findall(r"[\w./-]+\.(?:json|csv|md)", e["derivation"])
        assert cited or re.search(r"\w+\.\w+\(\d\)", e["derivation"]), name
        for f in cited:
            assert (REPO / "benchmarks" / f).exists() or (REPO / f).exists(), (name, f)


def test_convert_plans_host_memory_and_asks_for_it():
    """convert's host memory: the process, plus the larger of the bf16 export and the verification reload (two fp32
    models); with mem_gb 0 the job asks for the plan + 10%, an explicit mem_gb wins."""
    from llmpipe.config.runs import deep_merge
    from llmpipe.model.mfu import mpt_param_count
    ov = plan.job_overheads()
    config = project_config()
    rc = run_config(config, "mpt-70b")
    params = mpt_param_count(rc["arch"])["total"]
    m = plan.convert_memory(rc, ov)
    assert m["export_gb"] == pytest.approx(ov["convert_base_gib"] + 2 * params / 2**30)
    assert m["verify_gb"] == pytest.approx(ov["convert_base_gib"] + ov["convert_verify_bytes_per_param"] * params
                                           / 2**30)
    assert m["total_gb"] == max(m["export_gb"], m["verify_gb"]) > 128   # 70B in bf16 alone is 128 GiB
    assert step_resources(config, "convert", "mpt-70b")["mem_gb"] == int(-(-m["total_gb"] * 1.1 // 1))
    mine = deep_merge(config, {"models": {"mpt-70b": {"step_resources": {"convert": {"mem_gb": 900}}}}})
    assert step_resources(mine, "convert", "mpt-70b")["mem_gb"] == 900


def test_a_training_longer_than_its_time_limit_counts_allocations_and_requeues():
    """Beyond one allocation, each requeue adds Slurm's hold, a start, a compile and the checkpoint's read; the plan
    says how many allocations of the limit the training takes, or that a restart alone outlasts the limit."""
    ov = plan.job_overheads()
    basis = plan.benchmark_basis()
    rc = run_config(project_config(), "mpt-1b")   # 24,800 batches of 512 x 2048 tokens: days on one GPU
    kw = dict(nodes=1, gpus_per_node=1, gpu_type="h200", basis=basis, overheads=ov)
    free = plan.train_time(rc, **kw)
    limit = 24 * 3600.0
    t = plan.train_time(rc, **kw, time_limit_s=limit)
    ex = t["overheads"]
    restart = ov["requeue_hold_s"] + ex["start"] + ex["compile"] + plan.checkpoint_bytes(rc) / ov["load_bytes_per_s"]
    assert ex["restart"] == pytest.approx(restart)
    n = ex["allocations"]
    assert n == math.ceil((free["seconds"] - restart) / (limit - restart)) and n >= 2
    assert t["seconds"] == pytest.approx(free["seconds"] + (n - 1) * restart)
    assert f"{n} allocations of the 24 h limit" in t["basis"] and "Slurm's hold 121 s" in t["basis"]
    # within one allocation nothing changes; a limit shorter than a restart cannot progress
    assert plan.train_time(rc, **kw, time_limit_s=free["seconds"] + 1)["seconds"] == pytest.approx(free["seconds"])
    stuck = plan.train_time(rc, **kw, time_limit_s=60.0)
    assert stuck["overheads"]["allocations"] is None and "NO PROGRESS" in stuck["basis"]

