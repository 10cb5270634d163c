"""The lease on a training's identity folder (llmpipe.dispatch.lease): one live training at a time, stale leases taken over."""

from __future__ import annotations

import os
import socket
import subprocess
import threading

import pytest

from llmpipe.dispatch import lease
from llmpipe.atomic import atomic_write_json
from llmpipe.dispatch.orphans import process_start_time


def _hold(folder, **rec) -> dict:
    rec = {"executor": "local", "host": socket.gethostname(), "since": 0, **rec}
    atomic_write_json(os.path.join(folder, lease.LEASE_NAME), rec)
    return rec


@pytest.fixture
def live():
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_step_takes_hands_over_and_gives_back(tmp_path):
    lines: list[str] = []
    folder = str(tmp_path / "ident")
    with lease.Lease(folder, lines.append) as held:
        assert lease.read(folder)["executor"] == "step" and lease.read(folder)["pid"] == os.getpid()
        held.hand_over("debug", "1")
        assert lease.read(folder)["job_id"] == "1"
    assert lease.read(folder) is None and not lines     # nothing to wait for, nothing taken over


def test_a_live_local_job_makes_the_step_wait_then_its_lease_is_taken_over(tmp_path, live):
    _hold(tmp_path, job_id=str(live.pid), pid=live.pid, start=process_start_time(live.pid))
    lines: list[str] = []
    threading.Timer(1.0, live.kill).start()
    with lease.Lease(str(tmp_path), lines.append, poll_s=0.1) as held:
        assert lease.read(str(tmp_path))["pid"] == os.getpid()
    assert 0.9 <= held.waited_s < 30, held.waited_s
    assert f"is held by local job {live.pid} (pid {live.pid} on {socket.gethostname()}" in lines[0], lines
    assert "waiting for it to end before submitting" in lines[0]
    assert "ended after" in lines[1] and f"took over the lease of {tmp_path} from local job {live.pid}" in lines[2]


def test_a_reused_pid_is_not_the_holder(tmp_path, live):
    _hold(tmp_path, job_id="x", pid=live.pid, start="1")   # same PID, another start time: another process
    lines: list[str] = []
    with lease.Lease(str(tmp_path), lines.append, poll_s=0.1):
        pass
    assert len(lines) == 1 and "took over" in lines[0]


def test_the_job_the_step_reattaches_to_is_not_waited_for(tmp_path, live):
    held = _hold(tmp_path, job_id=str(live.pid), pid=live.pid, start=process_start_time(live.pid))
    lines: list[str] = []
    with lease.Lease(str(tmp_path), lines.append, except_job=str(live.pid)):
        assert lease.read(str(tmp_path)) == held
    assert not lines and lease.read(str(tmp_path)) == held    # still running: its lease stays


def test_a_slurm_holder_is_alive_while_slurm_lists_its_job(monkeypatch):
    from llmpipe.dispatch import slurm

    states = {"77": {"State": "RUNNING"}, "78": {"State": "COMPLETED"}, "80": {"State": "PENDING"}}
    monkeypatch.setattr(slurm, "job_info", lambda jid, timeout=30: states.get(jid))
    assert lease.holder_alive({"executor": "slurm", "job_id": "77"}) is True
    assert lease.holder_alive({"executor": "slurm", "job_id": "80"}) is True     # requeued: held by Slurm
    assert lease.holder_alive({"executor": "slurm", "job_id": "78"}) is False
    assert lease.holder_alive({"executor": "slurm", "job_id": "79"}) is False    # Slurm forgot it

    def unanswered(jid, timeout=30):
        raise RuntimeError("sacct timed out")
    monkeypatch.setattr(slurm, "job_info", unanswered)
    assert lease.holder_alive({"executor": "slurm", "job_id": "77"}) is True     # unknown is not gone


def test_a_slurm_job_that_outlives_its_step_keeps_the_lease(tmp_path, monkeypatch):
    from llmpipe.dispatch import slurm

    state = {"State": "RUNNING"}
    monkeypatch.setattr(slurm, "job_info", lambda jid, timeout=30: state)
    with lease.Lease(str(tmp_path), print) as held:
        held.hand_over("slurm", "4711")
    assert lease.read(str(tmp_path))["job_id"] == "4711"     # the step stopped waiting; the job runs on
    state["State"] = "COMPLETED"
    with lease.Lease(str(tmp_path), print, except_job="4711") as held:   # the next run re-attaches, the job ends
        pass
    assert lease.read(str(tmp_path)) is None


def test_a_process_on_another_host_cannot_be_checked(tmp_path):
    _hold(tmp_path, host="elsewhere", pid=1, start="1", job_id="5")
    with pytest.raises(lease.LeaseHeld, match=r"on elsewhere, .*another host that this host cannot check. Fix: .*"
                                              r"remove .*\.lease\.json"):
        with lease.Lease(str(tmp_path), print):
            pass
