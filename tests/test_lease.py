"""The lease on a training's identity folder (llmpipe.lease): one live training at a time, stale leases taken over."""

from __future__ import annotations

import os
import subprocess
import threading

import pytest

from llmpipe import lease
from llmpipe.atomic import atomic_write_json
from llmpipe.orphans import process_start_time


def _hold(folder, **over) -> dict:
    rec = {**lease.this_holder(), **over}
    atomic_write_json(os.path.join(folder, lease.LEASE_NAME), rec)
    return rec


@pytest.fixture
def live():
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def test_acquire_and_release(tmp_path):
    me, stale = lease.acquire(str(tmp_path))
    assert stale is None and lease.read(str(tmp_path)) == me and me["pid"] == os.getpid()
    assert lease.acquire(str(tmp_path))[1] == me          # this process again: its own lease is no obstacle
    assert lease.release(str(tmp_path)) and lease.read(str(tmp_path)) is None
    assert not lease.release(str(tmp_path))


def test_a_live_holder_refuses_and_its_end_frees_the_folder(tmp_path, live, capsys):
    held = _hold(tmp_path, pid=live.pid, start=process_start_time(live.pid), job_id=str(live.pid))
    with pytest.raises(lease.LeaseHeld, match=rf"held by local job {live.pid} \(pid {live.pid} on .*two trainers"):
        lease.acquire(str(tmp_path))
    assert lease.read(str(tmp_path)) == held and not lease.release(str(tmp_path))   # another's lease stays
    live.kill()
    live.wait()
    me, stale = lease.acquire(str(tmp_path))
    assert stale == held and lease.read(str(tmp_path)) == me
    assert f"took over the lease of {tmp_path} from local job {live.pid}" in capsys.readouterr().out


def test_a_reused_pid_is_not_the_holder(tmp_path, live):
    _hold(tmp_path, pid=live.pid, start="1", job_id="x")   # same PID, another start time: another process
    assert lease.acquire(str(tmp_path))[1]["pid"] == live.pid


def test_a_requeued_slurm_job_takes_over_its_own_lease(tmp_path, monkeypatch):
    _hold(tmp_path, executor="slurm", job_id="4242", host="n1", pid=1, start="5")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")    # a new allocation of the same job: Slurm is not asked
    me, stale = lease.acquire(str(tmp_path))
    assert stale["host"] == "n1" and me["executor"] == "slurm" and me["job_id"] == "4242"


def test_a_slurm_holder_is_alive_while_slurm_lists_its_job(tmp_path, monkeypatch):
    from llmpipe import slurm

    states = {"77": {"State": "RUNNING"}, "78": {"State": "COMPLETED"}}
    monkeypatch.setattr(slurm, "job_info", lambda jid, timeout=30: states.get(jid))
    me = {"host": "login", "pid": 1, "start": "1", "executor": "local", "job_id": ""}
    assert lease.holder_alive({"executor": "slurm", "job_id": "77"}, me) is True
    assert lease.holder_alive({"executor": "slurm", "job_id": "78"}, me) is False
    assert lease.holder_alive({"executor": "slurm", "job_id": "79"}, me) is False     # Slurm forgot it

    def unanswered(jid, timeout=30):
        raise RuntimeError("sacct timed out")
    monkeypatch.setattr(slurm, "job_info", unanswered)
    assert lease.holder_alive({"executor": "slurm", "job_id": "77"}, me) is True      # unknown is not gone


def test_a_local_holder_on_another_host_cannot_be_checked(tmp_path):
    _hold(tmp_path, host="elsewhere", pid=1, start="1")
    with pytest.raises(lease.LeaseHeld, match=r"another host that this host cannot check. Fix: .* remove "):
        lease.acquire(str(tmp_path))
    with pytest.raises(lease.LeaseHeld, match="cannot check"):
        lease.wait_until_free(str(tmp_path), print)


def test_wait_until_free_waits_for_a_live_holder_only(tmp_path, live):
    lines: list[str] = []
    assert lease.wait_until_free(str(tmp_path), lines.append) == 0 and not lines       # no lease
    _hold(tmp_path, pid=live.pid, start=process_start_time(live.pid), job_id="91")
    assert lease.wait_until_free(str(tmp_path), lines.append, except_job="91") == 0    # the step's own job
    threading.Timer(1.0, live.kill).start()
    waited = lease.wait_until_free(str(tmp_path), lines.append, poll_s=0.1)
    assert 0.9 <= waited < 30, waited
    assert len(lines) == 2 and f"is held by local job 91 (pid {live.pid}" in lines[0] and "waiting" in lines[0]
    assert "ended after" in lines[1], lines
