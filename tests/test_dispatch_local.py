"""Local dispatch (submitit's LocalExecutor): jobs started by a step die with the step.

A step process that is killed (SIGTERM: ``kill``, or Snakemake stopping its jobs) or interrupted must not leave its
local worker processes running: they would keep converting units behind the back of the next run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from llmpipe.dispatch.interrupts import CONTROLLER_LOG
from tests.conftest import REPO

STEP = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {repo!r})
    from llmpipe.dispatch import jobs as dispatch

    def sleeper(i):
        with open(os.path.join({tmp!r}, f"worker-{{i}}.pid"), "w") as fh:
            fh.write(str(os.getpid()))
        time.sleep(120)
        return i

    config = {{"dispatch": {{"executor": "local", "state_dir": os.path.join({tmp!r}, "state"), "poll_s": 1}}}}
    if sys.argv[1] == "map":
        dispatch.map_steps(sleeper, [0, 1], step="probe map", resources={{"time_min": 5}}, config=config,
                           log_dir=os.path.join({tmp!r}, "logs"))
    else:
        dispatch.run_step(sleeper, 0, step="probe run", resources={{"time_min": 5}}, config=config,
                          log_dir=os.path.join({tmp!r}, "logs"), key="probe")
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as fh:
            state = next(line for line in fh if line.startswith("State:"))
    except (FileNotFoundError, ProcessLookupError):
        return False
    return " Z " not in state and "zombie" not in state   # a zombie has exited; only its parent has not reaped it


def _wait_for(cond, timeout: float) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


@pytest.mark.parametrize("mode,workers", [("map", 2), ("run", 1)])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_killed_step_takes_its_local_workers_with_it(tmp_path, mode, workers, sig):
    _kill_step_and_check_its_workers(tmp_path, mode, workers, sig)


@pytest.mark.parametrize("mode,workers", [("map", 2), ("run", 1)])
def test_a_step_started_in_the_background_still_takes_its_local_workers_with_it(tmp_path, mode, workers):
    """A step process that ignores SIGINT, as one started by a non-interactive shell's ``cmd &`` does, stopped with
    SIGTERM: its local workers end too. (submitit cancels with a SIGINT to the job's controller, which would inherit
    the ignored signal: llmpipe.dispatch.orphans.sigint_cancels_children.)"""
    _kill_step_and_check_its_workers(tmp_path, mode, workers, signal.SIGTERM, ignore_sigint=True)


def _kill_step_and_check_its_workers(tmp_path, mode: str, workers: int, sig: int, ignore_sigint: bool = False):
    script = tmp_path / "step.py"
    script.write_text(STEP.format(repo=str(REPO), tmp=str(tmp_path)))
    # a session of its own: the signal reaches the step process only, as with `kill <pid>`, not its process group
    proc = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True,
                            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None)
    try:
        pid_files = [tmp_path / f"worker-{i}.pid" for i in range(workers)]
        assert _wait_for(lambda: all(p.exists() and p.read_text() for p in pid_files), 90), proc.communicate()
        pids = [int(p.read_text()) for p in pid_files]
        assert all(_alive(p) for p in pids)
        os.kill(proc.pid, sig)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode != 0
        assert "interrupted; cancelled" in out, out
        assert _wait_for(lambda: not any(_alive(p) for p in pids), 20), f"workers still running: {pids}\n{out}"
        # the cancelled controllers' KeyboardInterrupt tracebacks went to their own file, not to the console
        assert "submitit/local" not in out, out
        assert "KeyboardInterrupt" in (tmp_path / "logs" / CONTROLLER_LOG).read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in tmp_path.glob("worker-*.pid"):
            try:
                os.kill(int(p.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


def _double(i: int) -> int:
    return 2 * i


def test_no_literal_job_id_folder_is_left_in_the_log_dir(tmp_path):
    """submitit takes its folder pattern ``logs/%j`` literally for staging (and its local controller creates it);
    after the jobs, the log folder holds only the jobs' own folders."""
    from llmpipe.dispatch import jobs as dispatch

    config = {"dispatch": {"executor": "local", "state_dir": str(tmp_path / "state"), "poll_s": 0.2}}
    logs = tmp_path / "logs"
    assert dispatch.map_steps(_double, [1, 2], step="pattern map", resources={"time_min": 5}, config=config,
                              log_dir=str(logs / "map")) == [2, 4]
    assert dispatch.run_step(_double, 3, step="pattern run", resources={"time_min": 5}, config=config,
                             log_dir=str(logs / "run"), key="pattern") == 6
    for sub in ("map", "run"):
        names = os.listdir(logs / sub)
        assert names and "%j" not in names and all(n.isdigit() for n in names), names


def test_the_end_of_a_local_job_is_seen_before_the_next_poll(tmp_path):
    """A local job's end is seen when its process exits, not ``dispatch.poll_s`` later: with checks a minute
    apart, two steps of a quick function return long before the first check."""
    from llmpipe.dispatch import jobs as dispatch

    config = {"dispatch": {"executor": "local", "state_dir": str(tmp_path / "state"), "poll_s": 60}}
    t0 = time.time()
    for i in range(2):
        assert dispatch.run_step(_double, i, step=f"quick {i}", resources={"time_min": 5}, config=config,
                                 log_dir=str(tmp_path / "logs"), key=f"quick-{i}") == 2 * i
    assert time.time() - t0 < 50


def test_no_literal_job_id_folder_after_a_failed_step(tmp_path):
    from llmpipe.dispatch import jobs as dispatch

    config = {"dispatch": {"executor": "local", "state_dir": str(tmp_path / "state"), "poll_s": 0.2}}
    with pytest.raises(dispatch.StepFailed):
        dispatch.run_step(_double, None, step="pattern fail", resources={"time_min": 5}, config=config,
                          log_dir=str(tmp_path / "logs"), key="pattern-fail")
    names = os.listdir(tmp_path / "logs")
    assert names and "%j" not in names, names


def test_a_job_slurm_still_lists_as_running_is_reattached_not_resubmitted(tmp_path, monkeypatch):
    """A killed Snakemake left a Slurm job whose result is already written (submitit calls it done) while Slurm
    still shows RUNNING: the rerun re-attaches and waits for it; it never submits a second copy."""
    from llmpipe.dispatch import jobs as dispatch

    class FinishingJob:
        job_id, state, num_tasks = "27", "RUNNING", 1

        def done(self, force_check=False):
            return True

    config = {"dispatch": {"executor": "slurm", "state_dir": str(tmp_path / "jobs")}}
    dispatch._write_record(dispatch._record_path(config, "k"), {"executor": "slurm", "job_id": "27"})
    monkeypatch.setattr(dispatch, "_reattach", lambda config, record: FinishingJob())
    monkeypatch.setattr(dispatch, "make_executor", lambda *a, **k: pytest.fail("submitted a second copy"))
    monkeypatch.setattr(dispatch, "_wait", lambda job, *a, **k: [f"result of {job.job_id}"])
    log = tmp_path / "rule.log"
    got = dispatch.run_step(print, step="train x", resources={}, config=config, log_dir=str(tmp_path / "logs"),
                            key="k", log_file=str(log))
    assert got == "result of 27"
    assert "re-attaching to job 27 (RUNNING)" in log.read_text()


def test_dry_run_names_the_live_jobs_of_another_driver(tmp_path):
    """A step's local job runs under another process (a driver); a dry run in the same folder says so."""
    from tests.conftest import snakemake

    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from llmpipe.dispatch.jobs import run_step
        cfg = {{"dispatch": {{"executor": "local", "state_dir": ".llmpipe/jobs", "poll_s": 0.2}}}}
        run_step(time.sleep, 60, step="train mpt-tiny", resources={{"time_min": 5}}, config=cfg,
                 log_dir="logs", key="k")
    """)
    driver = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 30
        while not list((tmp_path / ".llmpipe/jobs").glob("*.json")) and time.time() < deadline:
            time.sleep(0.2)
        (tmp_path / ".snakemake/locks").mkdir(parents=True)
        (tmp_path / ".snakemake/locks/0.input.lock").write_text("")  # what the running driver's Snakemake holds
        proc = snakemake(tmp_path, "-n", "results/mpt-tiny/train.json")
        out = proc.stdout + proc.stderr
        assert "llmpipe: 1 job(s) submitted by the Snakemake that holds this folder (.snakemake/locks) are still " \
               "live:" in out, out[-3000:]
        assert re.search(r"llmpipe:   train mpt-tiny: local job \d+ is RUNNING; it runs under the Snakemake that "
                         r"started it", out), out[-3000:]
    finally:
        os.killpg(driver.pid, signal.SIGTERM)
        driver.wait(30)
