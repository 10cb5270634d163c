"""Shared-memory segments of dead jobs are removed at the next job start; a live job's survive (llmpipe.train.shm_names)."""

from __future__ import annotations

import subprocess
import sys

from llmpipe.train import shm_names


def _segments(d, start):
    for name in ("locals", "barrier", "filelock"):
        (d / f"{start:06d}_{name}").write_bytes(b"x")
    (d / f"{start + 1:06d}_locals").write_bytes(b"x")


def test_dead_jobs_segments_go_live_jobs_stay(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_pid = dead.pid
    shm_names.mark_owner(300, str(tmp_path), pid=dead_pid)   # its mark, written while it ran
    dead.wait()
    _segments(tmp_path, 300)
    shm_names.mark_owner(500, str(tmp_path))                   # this process: alive
    _segments(tmp_path, 500)
    (tmp_path / "000700_locals").write_bytes(b"x")             # a slot without marks: never touched
    other = tmp_path / "unrelated"
    other.write_bytes(b"x")
    removed = shm_names.remove_stale_segments(str(tmp_path))
    left = sorted(p.name for p in tmp_path.iterdir())
    assert sorted(p.split("/")[-1] for p in removed) == sorted(
        ["000300_locals", "000300_barrier", "000300_filelock", "000301_locals", f"llmpipe_000300_{dead_pid}.owner"])
    assert "000500_locals" in left and "000501_locals" in left and "000700_locals" in left and "unrelated" in left


def test_a_reused_pid_is_not_an_owner(tmp_path):
    """A mark whose PID now belongs to a process started at another time counts as dead."""
    import os
    path = shm_names.mark_owner(400, str(tmp_path))
    with open(path, "w") as fh:
        fh.write("1")   # another start time than this process's
    _segments(tmp_path, 400)
    shm_names.remove_stale_segments(str(tmp_path))
    assert not any(p.name.startswith("000400") for p in tmp_path.iterdir()) and not os.path.exists(path)
