"""Trainings that start together on one node never collide in the streaming library's shared-memory names."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from llmpipe.train import shm_names
from tests.conftest import REPO

streaming = pytest.importorskip("streaming")

# one "job": waits for the common start time, builds a StreamingDataset (which registers its shared memory), reads a
# sample, holds the dataset a moment (as a training does) and prints the prefix number it got
JOB = """
import json, os, sys, time
sys.path.insert(0, {repo!r})
from llmpipe.train import shm_names
start = shm_names.per_job_prefixes()
from streaming import StreamingDataset
time.sleep(max(0.0, {go:.3f} - time.time()))
ds = StreamingDataset(local={local!r}, batch_size=1, shuffle=False)
first = ds[0]
time.sleep(1.0)
print(json.dumps({{"start": start, "prefix": ds._shm_prefix_int, "tokens": len(first["text"])}}))
"""


@pytest.fixture
def mds(tmp_path):
    from streaming import MDSWriter

    out = tmp_path / "mds"
    with MDSWriter(out=str(out), columns={"text": "str"}) as w:
        for i in range(8):
            w.write({"text": f"sample {i}"})
    return out


def test_two_jobs_choose_different_prefixes_in_the_race_window():
    """Both jobs scan before either registers (the window in which two trainings collided): they must differ."""
    from streaming.base.shared.prefix import LOCALS, _check_and_find

    here = [f"/tmp/llmpipe-shm-test-{os.getpid()}"]
    got = []
    try:
        for job_id in ("4101", "4102"):
            shm_names.per_job_prefixes({"SLURM_JOB_ID": job_id})
            got.append(_check_and_find(here, [None], LOCALS))
    finally:
        shm_names.per_job_prefixes()
    assert got[0] != got[1], got
    # each job's scan starts at its own offset; a number there that another process on this machine holds (a
    # segment or a file lock of a running training) is skipped, so the found one is in the job's slot, not at its start
    for job_id, found in zip(("4101", "4102"), got):
        start = shm_names.prefix_start({"SLURM_JOB_ID": job_id})
        assert start <= found < start + shm_names.SLOT, (job_id, found, start)


def test_every_rank_of_a_job_gets_the_same_start():
    a = shm_names.prefix_start({"SLURM_JOB_ID": "777", "SLURM_PROCID": "0"})
    b = shm_names.prefix_start({"SLURM_JOB_ID": "777", "SLURM_PROCID": "3"})
    local = shm_names.prefix_start({"SUBMITIT_LOCAL_JOB_ID": "777"})
    assert a == b == local == 77700
    assert 0 <= shm_names.prefix_start({"SLURM_JOB_ID": str(10 ** 9)}) <= 999999 - shm_names.SLOT


def test_two_trainings_starting_at_once_on_one_node(mds, tmp_path):
    go = time.time() + 3.0
    procs = []
    for job_id in ("5101", "5102"):
        script = JOB.format(repo=str(REPO), go=go, local=str(mds))
        procs.append(subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env={**os.environ, "SUBMITIT_LOCAL_JOB_ID": job_id}))
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    got = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert got[0]["prefix"] != got[1]["prefix"], got
    assert [g["prefix"] for g in got] == [g["start"] for g in got], got


def test_a_reader_removes_its_own_segments_and_leaves_other_jobs_ones(mds):
    """The MDS checks' reader (llmpipe.train.shm_names.open_reader): its dataset's segments are in this job's
    slot and gone after the block; a live job's segment elsewhere on the node stays (streaming's
    ``clean_stale_shared_memory()``, which the checks used before, unlinks every segment from prefix 0 on)."""
    start = shm_names.prefix_start()
    foreign = os.path.join(shm_names.SHM_DIR, f"{(start + shm_names.SLOT + 50) % 999_900:06d}_locals")
    with open(foreign, "wb") as fh:        # another job's segment: no owner mark, so never stale
        fh.write(b"x")
    try:
        with shm_names.open_reader(str(mds)) as ds:
            assert ds[0]["text"] and start <= ds._shm_prefix_int < start + shm_names.SLOT
            mine = [p for p in os.listdir(shm_names.SHM_DIR) if p[:6] == f"{ds._shm_prefix_int:06d}"]
            assert mine, "the dataset made no segment in this job's slot"
        assert not [p for p in mine if os.path.exists(os.path.join(shm_names.SHM_DIR, p))], mine
        assert os.path.exists(foreign)
    finally:
        os.remove(foreign)
    # and no step opens a reader with streaming's node-wide clean-up
    users = [str(p.relative_to(REPO)) for p in (REPO / "llmpipe").rglob("*.py")
             if re.search(r"import[^\n]*\bclean_stale_shared_memory\b", p.read_text())]
    assert not users, users


def test_a_reader_leaves_nothing_for_the_resource_tracker_to_warn_about(mds):
    """A process that read a dataset back through open_reader (as verify_mds does) exits without the resource
    tracker's "leaked shared_memory objects" warning and its failed unlinks, which reached the console of every
    run: the segments the block removed are taken off the tracker too."""
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
            "from llmpipe.train import shm_names\n"
            f"with shm_names.open_reader({str(mds)!r}) as ds:\n"
            "    assert ds[0]['text']\n"
            "print('read')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "read", proc.stderr[-3000:]
    assert "resource_tracker" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
