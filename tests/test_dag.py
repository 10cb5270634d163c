"""Dry runs of the full-size models: the whole chain is planned, with resources, fast, without torch."""

from __future__ import annotations

import os
import re

import pytest

from tests.conftest import REPO, planned_jobs, project_config, snakemake

ALL_RULES = {"corpus", "tokenizer", "mds", "verify_mds", "icl_task", "train", "convert", "generate", "eval"}
#: the full-size models are scored on llm-foundry's standard suite: its files are fetched, no task is built
STANDARD_RULES = ALL_RULES - {"icl_task"} | {"eval_task_data"}


def _rule_block(dry_run_stdout: str, rule: str) -> str:
    """The lines a dry run prints for the first job of ``rule`` (up to the next blank line)."""
    block = dry_run_stdout[dry_run_stdout.index(f"rule {rule}:"):]
    return block[: block.index("\n\n")] if "\n\n" in block else block


@pytest.fixture
def no_torch(tmp_path):
    """A PYTHONPATH entry whose `torch` (and transformers, llmfoundry) cannot be imported."""
    d = tmp_path / "blocked"
    d.mkdir()
    for name in ("torch", "transformers", "llmfoundry", "composer"):
        (d / f"{name}.py").write_text(f"raise ImportError('{name} must not be imported by a dry run')\n")
    return {"PYTHONPATH": os.pathsep.join([str(d), str(REPO)])}


@pytest.mark.parametrize("model", ["mpt-1b", "mpt-70b"])
def test_dry_run_plans_whole_chain_without_torch(workdir, no_torch, model):
    # MPT-70B's evaluation holds its fp32 weights on one GPU (242 GiB): planned on a GPU that large
    # (tests/test_plan.py checks that a real one refuses it)
    big = ["--config", "gpu_type=big", "gpu_memory_gb={big: 320}"] if model == "mpt-70b" else []
    proc = snakemake(workdir, "-n", f"results/{model}/eval.json", *big, env=no_torch)
    jobs = planned_jobs(proc)
    # hub tokenizer: no tokenizer training on a corpus, but every stage is there, generation included
    assert set(jobs) == STANDARD_RULES, jobs
    train_block = _rule_block(proc.stdout, "train")
    nodes = {"mpt-1b": 1, "mpt-70b": 8}[model]
    assert f"nodes={nodes}" in train_block and "gpus_per_node=8" in train_block and "runtime=1440" in train_block


def test_default_target_plans_tiny_pipeline(workdir):
    n_icl = len(project_config()["eval"]["icl_tasks"])
    jobs = planned_jobs(snakemake(workdir, "-n"))
    assert jobs == {r: 1 for r in ALL_RULES} | {"all": 1, "icl_task": n_icl}, jobs


def test_dataset_shared_between_models(workdir):
    """Two models on the same corpus/tokenizer/concat length share one data preparation."""
    jobs = planned_jobs(snakemake(workdir, "-n", "results/mpt-125m/train.json", "results/mpt-350m/train.json"))
    assert jobs["mds"] == 1 and jobs["corpus"] == 1 and jobs["train"] == 2, jobs


def test_slurm_plan_rules_wait_without_local_cores(workdir, no_torch):
    """Under the Slurm profile, rules that only wait on Slurm take no local cores (threads 0), so the login node's
    core count (profiles/default: cores: all) does not cap how many wait at once; locally they take their CPUs."""
    proc = snakemake(workdir, "-n", "--profile", str(REPO / "profiles/slurm"), "results/mpt-1b/eval.json",
                     "--config", "slurm={preflight: false}", env=no_torch)
    train_block = _rule_block(proc.stdout, "train")
    assert "threads: 0" in train_block, train_block
    block = _rule_block(snakemake(workdir, "-n", "results/mpt-1b/eval.json", env=no_torch).stdout, "train")
    threads = int(re.search(r"threads: (\d+)", block).group(1))
    assert threads >= 1, block   # 8 tasks x 8 CPUs asked, capped by Snakemake at this machine's --cores


def test_thread_env_of_slurm_waiting_rules_is_made_valid(monkeypatch):
    """Snakemake exports OMP_NUM_THREADS=0 (and the BLAS variants) for threads: 0; the rule script and the Slurm
    job it submits (sbatch exports the environment) get 1 instead; other values stay."""
    from llmpipe.dispatch import jobs as dispatch
    monkeypatch.setenv("OMP_NUM_THREADS", "0")
    monkeypatch.setenv("MKL_NUM_THREADS", "0")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "4")
    dispatch.normalize_thread_env()
    assert os.environ["OMP_NUM_THREADS"] == "1" and os.environ["MKL_NUM_THREADS"] == "1"
    assert os.environ["OPENBLAS_NUM_THREADS"] == "4"
