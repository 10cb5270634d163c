"""The checkpoint folder holds only complete checkpoints of the current training identity."""

from __future__ import annotations

import os

from llmpipe.train import clear_save_folder, newest_checkpoint, prepare_save_folder


def touch(path, text="x"):
    with open(path, "w") as fh:
        fh.write(text)


def test_prepare_keeps_complete_checkpoints_of_the_same_identity(tmp_path):
    d = str(tmp_path / "ckpt")
    prepare_save_folder(d, "id-1")
    touch(os.path.join(d, "ep0-ba40-rank0.pt"))
    touch(os.path.join(d, "ep0-ba40-rank0.pt.complete"))
    touch(os.path.join(d, "ep0-ba80-rank0.pt"))              # killed while saving: no marker
    touch(os.path.join(d, "ep0-ba120-rank0.pt.complete"))    # marker without its checkpoint
    prepare_save_folder(d, "id-1")
    assert sorted(os.listdir(d)) == ["ep0-ba40-rank0.pt", "ep0-ba40-rank0.pt.complete", "identity.json"]
    assert newest_checkpoint(d).endswith("ep0-ba40-rank0.pt")


def test_prepare_clears_checkpoints_of_another_identity(tmp_path):
    d = str(tmp_path / "ckpt")
    prepare_save_folder(d, "id-1")
    touch(os.path.join(d, "ep0-ba40-rank0.pt"))
    touch(os.path.join(d, "ep0-ba40-rank0.pt.complete"))
    os.makedirs(os.path.join(d, "some-dir"))
    prepare_save_folder(d, "id-2")
    assert os.listdir(d) == ["identity.json"]
    assert open(os.path.join(d, "identity.json")).read() == "id-2"
    assert newest_checkpoint(d) is None


def test_clear_save_folder_empties_it(tmp_path):
    d = str(tmp_path / "ckpt")
    prepare_save_folder(d, "id-1")
    touch(os.path.join(d, "ep0-ba40-rank0.pt"))
    os.makedirs(os.path.join(d, "sub", "deeper"))
    clear_save_folder(d)
    assert os.path.isdir(d) and os.listdir(d) == []
