"""The node-scaling study: same identity at every node count, batch divisibility checked at DAG-build time for
every count, the table's arithmetic, and a real 1-vs-2-node study of the tiny model on the Slurm test cluster."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest
import yaml

from llmpipe.bench import scaling_study as scaling
from llmpipe.steps.scaling import study_identity
from llmpipe.steps.training import train_identity
from tests.conftest import REPO, copy_run, planned_jobs, project_config, snakemake


def load_config() -> dict:
    return project_config()


def test_nodes_are_not_identity():
    cfg = load_config()
    for n in (1, 2, 8):
        sc = scaling.study_config(cfg, "mpt-7b", n)
        assert sc["models"]["mpt-7b"]["resources"]["nodes"] == n
        assert train_identity(sc, "mpt-7b") == train_identity(cfg, "mpt-7b")
    short = {**cfg, "scaling": {"max_duration_batches": 50}}
    assert study_identity(short, "mpt-7b") != train_identity(cfg, "mpt-7b")  # a shorter training


def test_table_speedup_and_efficiency():
    base = {"run": "m", "devices": 8, "tokens": 1000, "tokens_per_s": 100.0, "tokens_per_s_per_device": 12.5,
            "mfu": 0.3, "peak_memory_per_device_gib": 20.0, "device": "NVIDIA H100 80GB HBM3"}
    res = {1: {**base, "nodes": 1, "wall_clock_s": 4708.0}, 2: {**base, "nodes": 2, "devices": 16,
                                                                  "wall_clock_s": 1764.0},
           8: {**base, "nodes": 8, "devices": 64, "wall_clock_s": 815.0}}
    df = scaling.table(res)
    assert list(df["nodes"]) == [1, 2, 8] and list(df["devices"]) == [8, 16, 64]
    # the seed's Table 2: 4708 s on 1 node, 1764 s on 2 (2.67x), 815 s on 8 (5.77x)
    assert list(df["speedup"]) == [1.0, 2.669, 5.777]
    assert list(df["scaling_efficiency"]) == [1.0, 1.334, 0.722]
    assert df["wall_clock"].iloc[0] == "1h18m28.000s"


def slurm_dry_run(workdir, extra: dict, *targets: str, check: bool = True):
    """A dry run with the Slurm profile, its preflight off (no cluster needed) and ``extra`` config on top."""
    f = workdir / "extra.yaml"
    f.write_text(yaml.safe_dump({"slurm": {"preflight": False}, **extra}))
    return snakemake(workdir, "-n", "--profile", str(REPO / "profiles/slurm"), "--configfile",
                     str(REPO / "config/config.yaml"), str(REPO / "config/slurm-site.yaml"), str(f), "--", *targets,
                     check=check)


def test_dry_run_names_every_node_count_where_the_batch_does_not_divide(workdir):
    proc = slurm_dry_run(workdir, {"scaling": {"nodes": [1, 2, 3, 5]}}, "results/scaling/mpt-7b/scaling.csv",
                         check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "node-scaling study of mpt-7b" in out
    assert ("at 3 node(s): models.mpt-7b.train.global_batch_size (1024) is not divisible by the number of GPUs at 3 "
            "node(s) (24 = 3 x 8 per node)") in out, out
    assert "at 5 node(s)" in out and "at 2 node(s)" not in out
    assert ("Fix: make global_batch_size a multiple of 240, or change scaling.nodes or "
            "model_defaults.resources.gpus_per_node (8).") in out


def test_dry_run_plans_one_training_per_node_count(workdir):
    proc = slurm_dry_run(workdir, {}, "results/scaling/mpt-7b/scaling.csv")
    jobs = planned_jobs(proc)
    assert jobs["scaling_train"] == 4 and jobs["scaling_table"] == 1 and "train" not in jobs, jobs
    for n in (1, 2, 4, 8):
        block = proc.stdout[proc.stdout.index(f"results/scaling/mpt-7b/nodes{n}/train.json"):][:800]
        assert f"nodes={n}," in block and "gpus_per_node=8" in block, block


def test_multi_node_study_needs_slurm(workdir):
    proc = snakemake(workdir, "-n", "--config", "scaling={'nodes': [1, 2]}", "--",
                     "results/scaling/mpt-tiny/scaling.csv", check=False)
    assert proc.returncode != 0 and "dispatch.executor is 'local'" in proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------------- Slurm

@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_one_vs_two_nodes_of_the_tiny_model_on_slurm(slurm_cluster, tiny_run, tmp_path):
    """mpt-tiny (cut to 12 batches) on 1 and on 2 nodes of the test cluster: the mechanics and the table, not a
    speedup (the namespace nodes share this machine's cores)."""
    base = [str(REPO / "config/config.yaml")]
    # the data of the tiny run (same corpus, tokenizer and MDS shards), without its training; then the study on Slurm
    wd = copy_run(tiny_run, tmp_path / "wd")
    shutil.rmtree(wd / "results/mpt-tiny")
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump({
        "dispatch": {"executor": "slurm", "poll_s": 0.5},
        "slurm": {"poll_s": 1, "partition": slurm_cluster.partition},
        "scaling": {"nodes": [1, 2], "max_duration_batches": 12, "runs": ["mpt-tiny"]},
        "report": {"runs": []}}))
    # --jobs 1: the two trainings run one after the other. Run at once on the same namespace node (the test cluster
    # has 2), their streaming dataloaders raced for the same shared-memory name once (FileExistsError '/000291_locals').
    args = ["--profile", str(REPO / "profiles/slurm"), "--jobs", "1", "--configfile", *base,
            str(REPO / "config/slurm-site.yaml"), str(site), "--"]
    snakemake(wd, *args, "scaling", timeout=1000)
    runs = {n: json.loads((wd / f"results/scaling/mpt-tiny/nodes{n}/train.json").read_text()) for n in (1, 2)}
    assert [runs[n]["nodes"] for n in (1, 2)] == [1, 2] and [runs[n]["devices"] for n in (1, 2)] == [1, 2]
    tiny = project_config()["models"]["mpt-tiny"]
    tokens = 12 * tiny["train"]["global_batch_size"] * tiny["data"]["concat_tokens"]   # the study's batches x global batch
    assert all(r["steps"] == 12 and r["tokens"] == tokens for r in runs.values())
    # each count ran as one Slurm job on that many nodes
    for n in (1, 2):
        log = (wd / f"results/logs/scaling/mpt-tiny/nodes{n}.log").read_text()
        assert f"(slurm, {n} node(s) x 1 task(s)" in log, log
    df = pd.read_csv(wd / "results/scaling/mpt-tiny/scaling.csv")
    assert list(df["nodes"]) == [1, 2] and list(df["devices"]) == [1, 2]
    assert list(df["tokens_per_s"]) == [runs[1]["tokens_per_s"], runs[2]["tokens_per_s"]]
    assert list(df["wall_clock_s"]) == [runs[1]["wall_clock_s"], runs[2]["wall_clock_s"]]
    assert df["speedup"].iloc[0] == 1.0
    assert df["speedup"].iloc[1] == pytest.approx(runs[1]["wall_clock_s"] / runs[2]["wall_clock_s"], abs=1e-3)
    assert df["scaling_efficiency"].iloc[1] == pytest.approx(df["speedup"].iloc[1] / 2, abs=1e-3)
    md = (wd / "results/scaling/mpt-tiny/scaling.md").read_text()
    assert md.count("\n| mpt-tiny |") == 2
    assert (wd / "results/scaling/mpt-tiny/speedup.png").stat().st_size > 10_000
    # the main training of mpt-tiny was never touched
    assert not (wd / "results/mpt-tiny/train.json").exists()
    # the report takes the existing study (report.runs is empty: nothing else is trained)
    snakemake(wd, *args, "report", timeout=300)
    assert (wd / "results/report/speedup.png").stat().st_size > 10_000


def test_dry_run_of_a_finetune_study(workdir):
    """A finetune's study trains its own task (instruction set, base model) at every count: the seed's Table 2."""
    if "mpt-7b-dolly" not in (load_config().get("finetunes") or {}):
        pytest.skip("no mpt-7b-dolly finetune in config/config.yaml")
    proc = slurm_dry_run(workdir, {}, "results/scaling/mpt-7b-dolly/scaling.csv")
    jobs = planned_jobs(proc)
    assert jobs["scaling_train"] == 4 and "finetune" not in jobs and "train" not in jobs, jobs
    block = proc.stdout[proc.stdout.index("results/scaling/mpt-7b-dolly/nodes8/train.json"):][:800]
    assert "nodes=8," in block, block
    assert "results/data/instructions/dolly_hhrlhf/manifest.json" in proc.stdout
