"""Checkpoints through the real pipeline: FSDP over 2 CPU processes (gloo) saves sharded checkpoints, a job killed on
2 ranks resumes on 1, retention counts every job's saves, the sharded checkpoint converts without a training
launch, a changed run killed mid-training never costs the finished one, and a damaged newest checkpoint is skipped.

A kill is real: tests/helpers/sitecustomize.py SIGKILLs every training rank once a given checkpoint's .complete
marker exists (LLMPIPE_TEST_KILL_AT), like a node dying right after that save.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from llmpipe.train import checkpoints as ckpt
from llmpipe.config.runs import run_settings
from llmpipe.steps import THIS_RUN
from tests.conftest import SHORT_TINY, SHORT_TRAIN, copy_run, no_symlink_env, project_config, snakemake
from tests.test_convert import LOAD_WITHOUT_FOUNDRY

pytestmark = pytest.mark.slow

TWO_RANKS = "models={'mpt-tiny': {'resources': {'tasks_per_node': 2, 'cpus_per_task': 1}}}"
#: the FSDP run's training on 2 ranks (:data:`tests.conftest.SHORT_TRAIN`: 60 batches, a checkpoint every 20)
FSDP_TWO_RANKS = "models={'mpt-tiny': {'resources': {'tasks_per_node': 2, 'cpus_per_task': 1}, " + SHORT_TRAIN + "}}"
TRAIN = "results/mpt-tiny/train.json"


def load(wd, rel):
    return json.loads((wd / rel).read_text())


def run_killed_at(wd, marker_glob: str, *config: str):
    """Train until ``marker_glob`` (relative to ``wd``) exists, then SIGKILL the ranks; the step must fail."""
    env = {**no_symlink_env(wd), "LLMPIPE_TEST_KILL_AT": str(wd / marker_glob)}
    args = ["--config", *config] if config else []
    proc = snakemake(wd, "--cores", "2", TRAIN, *args, env=env, check=False)
    assert proc.returncode != 0, proc.stdout[-3000:]
    return proc


@pytest.fixture(scope="module")
def fsdp_run(tiny_run, tmp_path_factory):
    """The tiny model trained under FSDP with sharded checkpoints (:data:`tests.conftest.SHORT_TRAIN`: 60 batches):
    2 ranks killed after batch 20, then 1 rank to the end. Data and tokenizer come from the tiny run (same identity).
    Returns the working folder and the shard files of the 2 ranks' checkpoint, listed before the second job's
    retention removed it. (A resume on the same 2 ranks after a kill: tests/test_slurm_pipeline.py's SIGKILL test.)"""
    wd = copy_run(tiny_run, tmp_path_factory.mktemp("fsdp") / "wd")
    shutil.rmtree(wd / "results/mpt-tiny/checkpoints")
    (wd / TRAIN).unlink()
    run_killed_at(wd, "results/mpt-tiny/checkpoints/*/ep0-ba20.complete", FSDP_TWO_RANKS)
    two_rank_shards = sorted(p.name for p in wd.glob("results/mpt-tiny/checkpoints/*/ep0-ba20/*.distcp"))
    snakemake(wd, "--cores", "2", TRAIN, "--config", SHORT_TINY, env=no_symlink_env(wd))
    return wd, two_rank_shards


def test_fsdp_training_killed_on_two_ranks_resumes_on_one_with_exact_steps(fsdp_run):
    wd, two_rank_shards = fsdp_run
    train = load(wd, TRAIN)
    assert train["steps"] == 60 and train["fsdp"] is True and train["devices"] == 1
    assert train["activation_checkpointing"] is False  # what composer ran with (fsdp: null: its defaults)
    assert train["resumed_from"].endswith("ep0-ba20"), train["resumed_from"]
    assert train["batches_this_job"] == 40
    folder = wd / train["final_checkpoint"]
    assert ckpt.is_sharded(str(folder)) and (folder / ".metadata").exists()
    # the job on 2 ranks wrote one shard per rank (the checkpoint resumed from); the job on 1 rank one shard
    assert two_rank_shards == ["__0_0.distcp", "__1_0.distcp"]
    assert sorted(p.name for p in folder.glob("*.distcp")) == ["__0_0.distcp"]


def test_retention_counts_the_checkpoints_of_every_job(fsdp_run):
    """checkpoints_to_keep is 2: after two jobs (20; then 40, 60) only the two newest remain, the first job's gone."""
    wd, _ = fsdp_run
    folder = (wd / load(wd, TRAIN)["final_checkpoint"]).parent
    assert [b for b, _ in ckpt.complete_checkpoints(str(folder))] == [40, 60]
    assert not any(p.name.startswith("ep0-ba20") for p in folder.iterdir())


def test_the_loss_log_holds_each_batch_once_after_a_kill(fsdp_run):
    wd, _ = fsdp_run
    rows = [json.loads(line) for line in (wd / load(wd, TRAIN)["train_log"]).read_text().splitlines()]
    batches = [r["batch"] for r in rows]
    assert batches == [1] + list(range(5, 61, 5)), batches


def test_sharded_checkpoint_converts_with_fp32_logits_of_the_trained_model(fsdp_run, tmp_path):
    """The export of the sharded checkpoint (weights only, no process group) matches the model as torch's own
    converter (dcp_to_torch_save) restores it, and loads with transformers alone."""
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from llmpipe.hf.export import convert_checkpoint, mpt_config_dict
    from llmpipe.config.stage_settings import ConvertSettings

    wd, _ = fsdp_run
    rc = run_settings(project_config(), "mpt-tiny")
    final = str(wd / load(wd, TRAIN)["final_checkpoint"])
    out = tmp_path / "hf"
    manifest = convert_checkpoint(rc, final, str(wd / "results/tokenizers/bpe-builtin-docs"), str(out),
                                  ConvertSettings(dtype="float32", max_shard_size="1MB"))
    assert manifest["source_checkpoint_sharded"] and len(manifest["safetensors_files"]) > 1  # 3.7 MB in 1 MB files
    assert (out / "model.safetensors.index.json").exists() and manifest["peak_rss_gib_export"] > 0

    dcp_to_torch_save(final, str(tmp_path / "whole.pt"))
    state = torch.load(tmp_path / "whole.pt", weights_only=False)["state"]["model"]
    ref = MPTForCausalLM(MPTConfig(**mpt_config_dict(rc)))
    ref.load_state_dict({k[len("model."):]: v for k, v in state.items()})
    ids = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(3))
    torch.save(ids, tmp_path / "ids.pt")
    proc = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_FOUNDRY, str(out), str(tmp_path / "ids.pt"),
                           str(tmp_path / "logits.pt")], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with torch.no_grad():
        want = ref.eval()(input_ids=ids).logits
    assert (torch.load(tmp_path / "logits.pt") - want).abs().max().item() <= 1e-4


def test_resume_skips_a_damaged_newest_and_a_half_written_checkpoint_without_symlinks(tiny_run, tmp_path):
    """Lose train.json; the final checkpoint (batch 120) is damaged but has its ``.complete`` marker, and a
    half-written file at batch 100 (no marker) lies beside it: the rerun moves the damaged one aside, ignores and
    removes the half-written one, resumes from the newest complete loadable one (batch 80) and ends at exactly the
    configured step count; with symlinks refused, as on shared drives that refuse them."""
    wd = copy_run(tiny_run, tmp_path / "wd")
    train0 = load(wd, TRAIN)
    final = wd / train0["final_checkpoint"]
    ck = final.parent   # the identity's folder under results/mpt-tiny/checkpoints
    final.write_bytes(b"garbage, not a zip file")          # its .complete marker stays
    (ck / "ep0-ba100-rank0.pt").write_bytes(b"half-written")  # no .complete marker: must be ignored
    (wd / TRAIN).unlink()
    snakemake(wd, "--cores", "2", TRAIN, env=no_symlink_env(wd))
    train1 = load(wd, TRAIN)
    assert train1["resumed_from"].endswith("ep0-ba80-rank0.pt"), train1["resumed_from"]
    assert train1["steps"] == train0["steps"] == 120 and train1["batches_this_job"] == 40, train1
    assert (ck / "damaged" / final.name).exists()
    assert not (ck / "ep0-ba100-rank0.pt").exists()
    job_logs = "".join(p.read_text() for p in (wd / "results/logs/train").rglob("*_0_log.out"))
    assert f"checkpoint {final}" in job_logs and "cannot be loaded" in job_logs


def test_a_full_checkpoint_is_not_resumed_under_fsdp_and_the_error_comes_before_a_job(tiny_run, tmp_path):
    wd = copy_run(tiny_run, tmp_path / "wd")
    final = wd / load(wd, TRAIN)["final_checkpoint"]
    final.unlink()
    (wd / TRAIN).unlink()
    proc = snakemake(wd, "--cores", "2", TRAIN, "--config", TWO_RANKS, check=False)
    assert proc.returncode != 0
    log = (wd / "results/logs/train/mpt-tiny.log").read_text()
    assert "is a full checkpoint saved on 1 device without FSDP" in log and "Resume it on 1 device" in log
    assert "submitted job" not in log.split(THIS_RUN)[-1]
