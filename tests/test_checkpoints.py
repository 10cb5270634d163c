"""The checkpoint folder (llmpipe.train.checkpoints): one folder per training identity, complete checkpoints only,
retention over every job's saves, damaged checkpoints moved aside, weights read from sharded checkpoints."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from llmpipe.train import checkpoints as ckpt


def touch(path, text="x"):
    with open(path, "w") as fh:
        fh.write(text)


def full_checkpoint(path, batch, value=1.0):
    """A full composer-style checkpoint (torch's zip format) with its .complete marker."""
    torch.save({"state": {"model": {"model.w": torch.full((4, 4), value)}}, "rng": None}, path)
    ckpt.mark_complete(path, batch)
    return path


def sharded_checkpoint(path, tensors: dict[str, torch.Tensor]):
    """A PyTorch distributed checkpoint folder with composer's key layout (state.model.<name>), no process group."""
    import torch.distributed.checkpoint as dcp
    dcp.save({"state": {"model": dict(tensors), "optimizers": {"adam": {"m": torch.zeros(3)}}}},
             storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    return path


def test_identities_get_their_own_folders_and_nothing_is_deleted(tmp_path):
    root = str(tmp_path / "checkpoints")
    a = ckpt.prepare_identity_folder(root, '{"lr": 1}')
    full_checkpoint(os.path.join(a, "ep0-ba40-rank0.pt"), 40)
    b = ckpt.prepare_identity_folder(root, '{"lr": 2}')
    assert a != b and os.path.basename(a) == ckpt.identity_key('{"lr": 1}')
    assert ckpt.newest_checkpoint(a).endswith("ep0-ba40-rank0.pt")   # the other identity's work is still there
    assert ckpt.newest_checkpoint(b) is None
    # the same identity in another text form (key order, 1.0 for 1) maps to the same folder
    assert ckpt.identity_folder(root, '{"lr": 1.0}') == a


def test_prepare_removes_what_a_killed_save_left_and_keeps_complete_checkpoints(tmp_path):
    root = str(tmp_path)
    d = ckpt.prepare_identity_folder(root, '"id"')
    full_checkpoint(os.path.join(d, "ep0-ba40-rank0.pt"), 40)
    touch(os.path.join(d, "ep0-ba80-rank0.pt"))                   # killed while saving: no marker
    os.makedirs(os.path.join(d, "ep0-ba90"))                      # a sharded save killed midway
    touch(os.path.join(d, "ep0-ba70-rank0.pt.complete"))          # marker without its checkpoint
    ckpt.prepare_identity_folder(root, '"id"')
    assert sorted(os.listdir(d)) == ["ep0-ba40-rank0.pt", "ep0-ba40-rank0.pt.complete", "identity.json", "last_used"]


def test_flat_layout_of_earlier_versions_is_adopted(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    touch(root / "identity.json", '{"seed": 17}')
    full_checkpoint(str(root / "ep0-ba40-rank0.pt"), 40)
    touch(root / "result.json", "{}")
    folder = ckpt.prepare_identity_folder(str(root), '{"seed": 17}')
    assert ckpt.newest_checkpoint(folder).endswith("ep0-ba40-rank0.pt")
    assert os.path.exists(os.path.join(folder, "result.json")) and not (root / "ep0-ba40-rank0.pt").exists()


def test_retention_counts_every_jobs_checkpoints_and_keeps_the_newest(tmp_path):
    d = ckpt.prepare_identity_folder(str(tmp_path), '"id"')
    for b in (40, 80, 120, 160):  # saved by four different jobs (requeues)
        full_checkpoint(os.path.join(d, f"ep0-ba{b}-rank0.pt"), b)
    os.makedirs(os.path.join(d, "ep0-ba200"))
    ckpt.mark_complete(os.path.join(d, "ep0-ba200"), 200)       # a sharded one counts too
    removed = ckpt.prune_checkpoints(d, 2)
    assert [ckpt.checkpoint_batch(p) for p in removed] == [40, 80, 120]
    assert [b for b, _ in ckpt.complete_checkpoints(d)] == [160, 200]
    assert not os.path.exists(os.path.join(d, "ep0-ba40-rank0.pt.complete"))
    assert ckpt.prune_checkpoints(d, -1) == [] and len(ckpt.complete_checkpoints(d)) == 2


def test_earlier_identities_beyond_the_kept_number_are_removed_oldest_first(tmp_path):
    root = str(tmp_path)
    folders = []
    for i in range(3):
        folders.append(ckpt.prepare_identity_folder(root, json.dumps({"i": i})))
        time.sleep(0.01)
    current = ckpt.prepare_identity_folder(root, '{"i": 9}')
    removed = ckpt.prune_earlier_identities(root, current, 1)
    assert sorted(removed) == sorted(folders[:2])          # the most recently used earlier one (i=2) stays
    assert os.path.isdir(folders[2]) and os.path.isdir(current)


def test_a_damaged_newest_checkpoint_is_moved_aside_and_the_older_one_used(tmp_path, capsys):
    d = ckpt.prepare_identity_folder(str(tmp_path), '"id"')
    full_checkpoint(os.path.join(d, "ep0-ba40-rank0.pt"), 40)
    bad = os.path.join(d, "ep0-ba80-rank0.pt")
    touch(bad, "not a checkpoint")
    ckpt.mark_complete(bad, 80)
    assert ckpt.loadable_checkpoint(d).endswith("ep0-ba40-rank0.pt")
    assert os.path.exists(os.path.join(d, "damaged", "ep0-ba80-rank0.pt"))
    assert os.path.exists(os.path.join(d, "damaged", "ep0-ba80-rank0.pt.complete"))
    assert "ep0-ba80-rank0.pt cannot be loaded" in capsys.readouterr().out


def test_a_truncated_full_checkpoint_fails_its_check(tmp_path):
    path = full_checkpoint(str(tmp_path / "ep0-ba40-rank0.pt"), 40)
    assert ckpt.checkpoint_problem(path) is None
    data = open(path, "rb").read()
    with open(path, "wb") as fh:
        fh.write(data[: len(data) // 2])
    assert ckpt.checkpoint_problem(path) is not None
    assert ckpt.checkpoint_problem(path, deep=False) is not None


def test_when_every_checkpoint_is_damaged_the_error_says_what_went_where(tmp_path):
    d = ckpt.prepare_identity_folder(str(tmp_path), '"id"')
    for b in (40, 80):
        touch(os.path.join(d, f"ep0-ba{b}-rank0.pt"), "garbage")
        ckpt.mark_complete(os.path.join(d, f"ep0-ba{b}-rank0.pt"), b)
    with pytest.raises(RuntimeError, match=r"ep0-ba80-rank0.pt .*-> .*damaged/ep0-ba80-rank0.pt.*ep0-ba40"):
        ckpt.loadable_checkpoint(d)


def test_sharded_weights_load_without_a_process_group_in_the_dtype_asked(tmp_path):
    tensors = {"model.transformer.wte.weight": torch.randn(8, 4), "model.transformer.blocks.0.w": torch.randn(4, 4)}
    path = sharded_checkpoint(str(tmp_path / "ep0-ba40"), tensors)
    assert ckpt.is_sharded(path) and ckpt.checkpoint_problem(path) is None
    names = ckpt.model_weight_names(path)
    assert names == {k: (tuple(v.shape), "float32") for k, v in tensors.items()}   # no optimizer state
    got = ckpt.load_model_weights(path, torch.bfloat16)
    assert set(got) == {"transformer.wte.weight", "transformer.blocks.0.w"}
    for k, v in tensors.items():
        assert got[k[len("model."):]].dtype == torch.bfloat16
        assert torch.equal(got[k[len("model."):]], v.to(torch.bfloat16))


def test_a_truncated_shard_file_fails_the_sharded_check(tmp_path):
    path = sharded_checkpoint(str(tmp_path / "ep0-ba40"), {"model.w": torch.randn(64, 64)})
    shard = next(f for f in os.listdir(path) if f.endswith(".distcp"))
    with open(os.path.join(path, shard), "r+b") as fh:
        fh.truncate(100)
    assert "truncated" in ckpt.checkpoint_problem(path)


def test_loss_log_is_cut_back_to_the_resumed_checkpoint(tmp_path):
    log = tmp_path / "train_log.jsonl"
    log.write_text("".join(json.dumps({"batch": b, "loss": 1.0}) + "\n" for b in (1, 5, 10, 15, 20)))
    ckpt.cut_loss_log(str(log), 10)
    assert [json.loads(line)["batch"] for line in log.read_text().splitlines()] == [1, 5, 10]
    ckpt.cut_loss_log(str(log), 0)
    assert not log.exists()


def test_a_finished_training_is_found_by_identity_after_other_settings_ran(tmp_path):
    root = str(tmp_path / "checkpoints")
    a = ckpt.prepare_identity_folder(root, '{"lr": 1}')
    final = full_checkpoint(os.path.join(a, "ep0-ba120-rank0.pt"), 120)
    ckpt.write_result(a, {"steps": 120, "final_checkpoint": final})
    b = ckpt.prepare_identity_folder(root, '{"lr": 2}')
    full_checkpoint(os.path.join(b, "ep0-ba40-rank0.pt"), 40)
    assert ckpt.recorded_result(root, '{"lr": 1}', 120)["steps"] == 120
    assert ckpt.recorded_result(root, '{"lr": 2}', 120) is None
    touch(final, "damaged")  # a damaged final checkpoint is not a finished training
    assert ckpt.recorded_result(root, '{"lr": 1}', 120) is None


def test_non_tensor_entries_of_a_sharded_checkpoint_come_back_nested(tmp_path):
    """A finetune's sharded checkpoint keeps the Hugging Face config among its non-tensor entries; conversion
    reads them back without a process group."""
    import torch.distributed.checkpoint as dcp
    hf = {"model": {"config": {"content": {"model_type": "mpt", "d_model": 8, "attn_config": {"alibi": True}}},
                    "peft_config": None}}
    dcp.save({"state": {"model": {"model.w": torch.ones(2)}, "integrations": {"huggingface": hf}}},
             storage_writer=dcp.FileSystemWriter(str(tmp_path / "ep0-ba1")), no_dist=True)
    got = ckpt.load_objects(str(tmp_path / "ep0-ba1"), "state.integrations")
    assert got == {"state": {"integrations": {"huggingface": hf}}}
