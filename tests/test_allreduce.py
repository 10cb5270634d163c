"""The all-reduce bandwidth test: sweep arithmetic, a real 1-node x 2-task gloo sweep through the workflow (local
executor), the training gate, and a 2-node sweep on the Slurm test cluster."""

from __future__ import annotations

import json
import math
import os

import pandas as pd
import pytest

from llmpipe.bench import allreduce_bw as allreduce
from llmpipe.config.settings import ConfigError
from tests.conftest import REPO, planned_jobs, snakemake

MB = 2**20
LOCAL = {"allreduce": {"max_bytes": MB, "warmup": 2, "iters": 5, "nodes": [1],
                       "resources": {"gpus_per_node": 0, "tasks_per_node": 2, "cpus_per_task": 1, "time_min": 5}}}


def write_config(path, obj) -> str:
    import yaml
    path.write_text(yaml.safe_dump(obj))
    return str(path)


def check_sweep(df: pd.DataFrame, ranks: int, max_bytes: int) -> None:
    """Sizes 8 B x 2^k up to max_bytes, no wrong elements, and nccl-tests' bandwidth formulas."""
    assert list(df["size_bytes"]) == allreduce.sweep_sizes(8, max_bytes, 2)
    assert list(df["count"]) == [s // 4 for s in df["size_bytes"]]
    assert set(df["type"]) == {"float"} and set(df["redop"]) == {"sum"} and set(df["ranks"]) == {ranks}
    assert (df["oop_wrong"] == 0).all() and (df["ip_wrong"] == 0).all(), df[["size_bytes", "oop_wrong", "ip_wrong"]]
    for p in ("oop", "ip"):
        assert (df[f"{p}_time_us"] > 0).all()
        # algbw = size / time (GB/s = 1e9 B/s); busbw = algbw x 2(n-1)/n (nccl-tests doc/PERFORMANCE.md)
        algbw = df["size_bytes"] / (df[f"{p}_time_us"] * 1e-6) / 1e9
        assert ((df[f"{p}_algbw_gbps"] - algbw).abs() <= 1e-6 + 1e-3 * algbw).all()
        factor = 2 * (ranks - 1) / ranks
        assert ((df[f"{p}_busbw_gbps"] - df[f"{p}_algbw_gbps"] * factor).abs() <= 2e-6).all()


# ---------------------------------------------------------------------------------------------- arithmetic

def test_sweep_and_bandwidth_formulas():
    sizes = allreduce.sweep_sizes(8, 8 * 2**30, 2)
    assert sizes[0] == 8 and sizes[-1] == 8 * 2**30 and len(sizes) == 31  # the seed's -b 8 -e 8G -f 2
    assert allreduce.busbw_factor(1) == 0 and allreduce.busbw_factor(2) == 1.0
    assert allreduce.busbw_factor(128) == pytest.approx(2 * 127 / 128)
    # the seed's 16-node row at 4 GiB: 23774 us -> algbw 180.65, busbw 358.49 with 128 ranks (nccl-tests output)
    algbw, busbw = allreduce.bandwidths(4294967296, 23774e-6, 128)
    assert algbw == pytest.approx(180.66, abs=0.01) and busbw == pytest.approx(358.49, abs=0.02)


def test_gate_size_must_be_on_the_sweep():
    with pytest.raises(ConfigError, match="not one of the sweep's sizes"):
        allreduce.settings({"allreduce": {"gate": {"size_bytes": 1000, "min_busbw_gbps": 1}}})
    with pytest.raises(ConfigError, match="needs size_bytes and min_busbw_gbps"):
        allreduce.settings({"allreduce": {"gate": {"size_bytes": 1024}}})


def test_more_than_one_node_needs_slurm(workdir):
    proc = snakemake(workdir, "-n", "results/bench/allreduce/nodes2.csv", check=False)
    assert proc.returncode != 0 and "needs 2 nodes but dispatch.executor is 'local'" in proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------------- local, gloo

@pytest.fixture(scope="module")
def local_bench(tmp_path_factory):
    """results/bench/allreduce/nodes1.csv from 1 node x 2 gloo tasks through the workflow (local executor)."""
    wd = tmp_path_factory.mktemp("allreduce-local")
    cfg = write_config(wd / "bench.yaml", LOCAL)
    snakemake(wd, "--cores", "2", "--configfile", str(REPO / "config/config.yaml"), cfg, "--", "allreduce_all",
              timeout=600)
    return wd, cfg


def test_local_two_task_sweep_is_right(local_bench):
    wd, _ = local_bench
    df = pd.read_csv(wd / "results/bench/allreduce/nodes1.csv")
    check_sweep(df, ranks=2, max_bytes=MB)
    assert set(df["backend"]) == {"gloo"} and set(df["nodes"]) == {1}
    assert (df["warmup"] == 2).all() and (df["iters"] == 5).all()
    md = (wd / "results/bench/allreduce/nodes1.md").read_text()
    assert "| 1048576 | 262144 | float | sum | -1 |" in md
    png = (wd / "results/bench/allreduce/busbw.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_gate_blocks_training_below_threshold_and_passes_above(local_bench):
    wd, cfg = local_bench
    df = pd.read_csv(wd / "results/bench/allreduce/nodes1.csv")
    measured = float(df.loc[df["size_bytes"] == MB, "ip_busbw_gbps"].iloc[0])
    two_ranks = {"models": {"mpt-tiny": {"resources": {"tasks_per_node": 2}}}}

    def gated(floor):
        return write_config(wd / f"gate-{floor}.yaml",
                            {**two_ranks, "allreduce": {**LOCAL["allreduce"],
                                                        "gate": {"size_bytes": MB, "min_busbw_gbps": floor}}})

    # the plan: training of a 2-rank run waits for the gate, which reads the (existing) bench result
    jobs = planned_jobs(snakemake(wd, "-n", "--configfile", str(REPO / "config/config.yaml"), cfg, gated(1e6), "--",
                                  "results/mpt-tiny/train.json"))
    assert jobs.get("allreduce_gate") == 1 and "allreduce" not in jobs and jobs.get("train") == 1, jobs
    # below the threshold: the gate fails with what to check, and records nothing
    bad = snakemake(wd, "--cores", "1", "--configfile", str(REPO / "config/config.yaml"), cfg, gated(1e6), "--",
                    "results/bench/allreduce/gate/mpt-tiny.json", check=False)
    out = bad.stdout + bad.stderr
    assert bad.returncode != 0
    assert "training refuses to start" in out and "NCCL_SOCKET_IFNAME" in out and f"{measured:.2f} GB/s" in out, out
    assert not (wd / "results/bench/allreduce/gate/mpt-tiny.json").exists()
    # above it: the gate passes and records the measurement
    snakemake(wd, "--cores", "1", "--configfile", str(REPO / "config/config.yaml"), cfg, gated(measured / 2), "--",
              "results/bench/allreduce/gate/mpt-tiny.json")
    rec = json.loads((wd / "results/bench/allreduce/gate/mpt-tiny.json").read_text())
    assert rec["passed"] and rec["busbw_gbps"] == measured and rec["ranks"] == 2
    # a single-rank training (the default tiny run) has no gate
    one_rank = write_config(wd / "gate-one-rank.yaml",
                            {"allreduce": {**LOCAL["allreduce"], "gate": {"size_bytes": MB, "min_busbw_gbps": 1e6}}})
    jobs = planned_jobs(snakemake(wd, "-n", "--configfile", str(REPO / "config/config.yaml"), one_rank, "--",
                                  "results/mpt-tiny/train.json"))
    assert "allreduce_gate" not in jobs and "allreduce" not in jobs, jobs


# ---------------------------------------------------------------------------------------------- Slurm, 2 nodes

@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_two_node_sweep_on_the_slurm_cluster(slurm_cluster, tmp_path):
    cfg = write_config(tmp_path / "bench.yaml", {
        "dispatch": {"executor": "slurm", "poll_s": 0.5},
        "slurm": {"poll_s": 1, "partition": slurm_cluster.partition},
        "allreduce": {"max_bytes": 4 * MB, "warmup": 2, "iters": 5, "nodes": [2],
                      "resources": {"gpus_per_node": 0, "tasks_per_node": 1, "cpus_per_task": 1, "time_min": 10}}})
    snakemake(tmp_path, "--profile", str(REPO / "profiles/slurm"), "--configfile", str(REPO / "config/config.yaml"),
              str(REPO / "config/slurm-site.yaml"), cfg, "--", "allreduce_all", timeout=540)
    df = pd.read_csv(tmp_path / "results/bench/allreduce/nodes2.csv")
    check_sweep(df, ranks=2, max_bytes=4 * MB)
    assert set(df["backend"]) == {"gloo"} and set(df["nodes"]) == {2}
    log = (tmp_path / "results/logs/allreduce/nodes2.log").read_text()
    assert "(slurm, 2 node(s) x 1 task(s)" in log, log
    assert os.path.getsize(tmp_path / "results/bench/allreduce/busbw.png") > 10_000
    assert math.isfinite(df["ip_busbw_gbps"].iloc[-1]) and df["ip_busbw_gbps"].iloc[-1] > 0


def test_standalone_driver_runs_the_rule_code(tmp_path):
    """tools/allreduce_standalone.py (rule allreduce's step without Snakemake, as run on the device machine):
    a 2-task gloo sweep through the local executor writes the nccl-tests table with no wrong elements."""
    import subprocess
    import sys
    out = tmp_path / "ar"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "allreduce_standalone.py"), str(out), "--gpus", "0",
                           "--set", "{allreduce: {max_bytes: 4096, warmup: 1, iters: 2, resources: "
                           "{tasks_per_node: 2, cpus_per_task: 1}}}"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    check_sweep(pd.read_csv(out / "nodes1.csv"), ranks=2, max_bytes=4096)
    assert "| size (B) |" in (out / "nodes1.md").read_text() and "2 ranks, gloo" in proc.stdout
