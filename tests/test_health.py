"""The all-reduce gate's GPU health check: its settings, the slow-GPU rule, and a real 1-node x 2-task gloo check
through the workflow (local executor, CPU matmuls scaled down) with one rank made slow by the test hook."""

from __future__ import annotations

import json
import socket

import pytest

from llmpipe.bench import allreduce_bw as allreduce, health
from llmpipe.config.settings import ConfigError
from tests.conftest import REPO, planned_jobs, snakemake

MB = 2**20
GATE = {"size_bytes": MB, "min_busbw_gbps": 0}
LOCAL = {"max_bytes": MB, "warmup": 1, "iters": 3, "nodes": [1], "gate": GATE,
         "resources": {"gpus_per_node": 0, "tasks_per_node": 2, "cpus_per_task": 1, "time_min": 5}}
#: a CPU-sized check: a bf16 128 x 128 matmul takes milliseconds on a CPU; the slow rank sleeps 200 ms in each
HEALTH = {"matmul_size": 128, "matmul_dtype": "bfloat16", "warmup": 1, "iters": 5, "min_fraction_of_median": 0.5}
SLOW = {health.SLOW_RANK_ENV: "1:0.2"}
TWO_RANKS = {"models": {"mpt-tiny": {"resources": {"tasks_per_node": 2}}}}


def write_config(path, obj) -> str:
    import yaml
    path.write_text(yaml.safe_dump(obj))
    return str(path)


def line(rank, tflops, busbw):
    return {"rank": rank, "local_rank": rank % 8, "host": f"node{rank // 8}", "device": "gpu", "tflops": tflops,
            "busbw_gbps": busbw}


# ---------------------------------------------------------------------------------------------- settings, rule

def test_health_settings_need_the_gate_and_fill_defaults():
    with pytest.raises(ConfigError, match="allreduce.health is set but allreduce.gate is null"):
        allreduce.settings({"allreduce": {"health": {}}})
    with pytest.raises(ConfigError, match="min_fraction_of_median"):
        allreduce.settings({"allreduce": {"gate": GATE, "max_bytes": MB, "health": {"min_fraction_of_median": 2}}})
    h = allreduce.settings({"allreduce": {"gate": GATE, "max_bytes": MB, "health": {"on_slow": "warn"}}})["health"]
    assert h["on_slow"] == "warn" and h["min_fraction_of_median"] == 0.8 and h["min_tflops"] is None
    assert h["matmul_dtype"] == "bfloat16" and h["matmul_size"] == 8192
    assert allreduce.settings({"allreduce": {"max_bytes": MB}})["health"] is None  # off by default


def test_judge_names_gpus_below_the_median_fraction_or_a_floor():
    lines = [line(0, 700.0, 400.0), line(1, 710.0, 410.0), line(2, 500.0, 405.0), line(3, 690.0, 200.0)]
    judged = health.judge(lines, 0.8)  # medians: 695 TFLOP/s, 402.5 GB/s
    assert [bool(d["slow"]) for d in judged] == [False, False, True, True]
    assert "matmul 500 TFLOP/s < 0.8 x median 695" in judged[2]["slow"][0]
    assert "busbw 200 GB/s < 0.8 x median 402.5" in judged[3]["slow"][0]
    # absolute floors name GPUs the median rule passes (here: all of them below 705 TFLOP/s; busbw below 405)
    judged = health.judge(lines, 0.0, min_tflops=705.0, min_busbw_gbps=405.0)
    assert [bool(d["slow"]) for d in judged] == [True, False, True, True]
    with pytest.raises(RuntimeError, match=r"2 of 4 GPU\(s\)[\s\S]*rank 2 \(host node0, local rank 2, gpu\)"):
        health.check(lines, {"on_slow": "fail", "min_fraction_of_median": 0.8, "min_tflops": None}, None, "gate")
    _, warnings = health.check(lines, {"on_slow": "warn", "min_fraction_of_median": 0.8, "min_tflops": None}, None,
                               "gate")
    assert len(warnings) == 2 and "rank 3 (host node0" in warnings[1]


def test_matmul_tflops_formula():
    assert health.matmul_tflops(8192, 10, 2 * 8192**3 * 10 / 790e12) == pytest.approx(790.0)


# ---------------------------------------------------------------------------------------------- local, gloo

@pytest.mark.timeout(900)
def test_gate_names_the_slow_rank_by_host_and_refuses_or_warns(tmp_path):
    wd = tmp_path
    base = str(REPO / "config/config.yaml")

    def cfg(name, **h):
        return write_config(wd / f"{name}.yaml", {**TWO_RANKS, "allreduce": {**LOCAL, "health": {**HEALTH, **h}}})

    fail, warn = cfg("fail", on_slow="fail"), cfg("warn", on_slow="warn")
    # the plan: a 2-rank training waits for the gate, which needs the sweep and the health check
    jobs = planned_jobs(snakemake(wd, "-n", "--configfile", base, fail, "--", "results/mpt-tiny/train.json"))
    assert jobs.get("allreduce_health") == 1 and jobs.get("allreduce") == 1 and jobs.get("allreduce_gate") == 1, jobs
    # rank 1 is slow: training refuses to start, naming it (and only it) by host, and the gate records nothing
    bad = snakemake(wd, "--cores", "2", "--configfile", base, fail, "--", "results/bench/allreduce/gate/mpt-tiny.json",
                    check=False, env=SLOW, timeout=600)
    out = bad.stdout + bad.stderr
    assert bad.returncode != 0 and "training refuses to start: 1 of 2 GPU(s) failed the health check" in out, out
    assert f"rank 1 (host {socket.gethostname()}, local rank 1, cpu): matmul" in out, out
    assert "rank 0 (host" not in out.split("failed the health check")[1], out
    assert not (wd / "results/bench/allreduce/gate/mpt-tiny.json").exists()
    lines = json.loads((wd / "results/bench/allreduce/health/nodes1.json").read_text())
    assert [d["rank"] for d in lines] == [0, 1] and all(d["backend"] == "gloo" for d in lines)
    assert lines[1]["tflops"] < lines[0]["tflops"] / 3  # the 200 ms sleeps, not noise
    assert all(d["busbw_gbps"] > 0 and d["size_bytes"] == MB for d in lines)
    # on_slow: warn re-judges the same measurement (thresholds are not the check's identity) and passes
    assert "allreduce_health" not in planned_jobs(snakemake(wd, "-n", "--configfile", base, warn, "--",
                                                            "results/bench/allreduce/gate/mpt-tiny.json"))
    snakemake(wd, "--cores", "2", "--configfile", base, warn, "--", "results/bench/allreduce/gate/mpt-tiny.json")
    rec = json.loads((wd / "results/bench/allreduce/gate/mpt-tiny.json").read_text())
    assert rec["passed"] and rec["slow_gpus"] == 1 and len(rec["gpus"]) == 2
    assert [d["rank"] for d in rec["gpus"]] == [0, 1] and rec["gpus"][1]["host"] == socket.gethostname()
    assert any(r.startswith("matmul") for r in rec["gpus"][1]["slow"])
    assert not any(r.startswith("matmul") for r in rec["gpus"][0]["slow"])
    log = (wd / "results/logs/allreduce/gate-mpt-tiny.log").read_text()
    assert "WARNING: allreduce gate for mpt-tiny: slow GPU rank 1" in log
    assert sum(ln.startswith('{"rank"') for ln in log.splitlines()) == 2  # one line per GPU
    # the matmul's size is what the check measured: changing it measures again
    resized = cfg("resized", on_slow="warn", matmul_size=64)
    assert planned_jobs(snakemake(wd, "-n", "--configfile", base, resized, "--",
                                  "results/bench/allreduce/gate/mpt-tiny.json")).get("allreduce_health") == 1
