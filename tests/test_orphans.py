"""Local executor: a job's tasks die with submitit's controller, the PID the step prints ("submitted job N").

``kill -9 N`` of a running training used to leave its task writing checkpoints while the rerun started a second
trainer on the same identity folder (issue 31, item 1)."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from llmpipe.dispatch import lease
from llmpipe.atomic import atomic_write_json
from llmpipe.dispatch.orphans import DieWithParent, process_start_time
from llmpipe.steps import THIS_RUN
from tests.conftest import REPO, SHORT_TINY, SNAKEMAKE, copy_run, planned_jobs

TRAIN = "results/mpt-tiny/train.json"


_PARENT = """
import subprocess, sys, time
child = (f"import sys; sys.path.insert(0, {repo!r}); from llmpipe.dispatch.orphans import die_with_parent; "
         f"die_with_parent(); open({mark!r}, 'w').write(str(__import__('os').getpid())); "
         f"__import__('time').sleep(120)")
subprocess.Popen([sys.executable, "-c", child])
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_a_task_dies_with_its_parent(tmp_path):
    """A process that armed die_with_parent ends when its parent is SIGKILLed (what kill -9 of the controller is)."""
    mark = tmp_path / "pid"
    script = tmp_path / "parent.py"
    script.write_text(f"repo, mark = {str(REPO)!r}, {str(mark)!r}\n" + _PARENT)
    parent = subprocess.Popen([sys.executable, str(script)])
    for _ in range(300):
        if mark.exists() and mark.read_text():
            break
        time.sleep(0.1)
    child = int(mark.read_text())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    for _ in range(50):
        if process_start_time(child) is None:   # gone, or a zombie
            break
        time.sleep(0.1)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the child outlived its SIGKILLed parent")


class _Task:
    def __call__(self, x):
        return x + 1

    def checkpoint(self):
        return "requeue"


_TASK = """
import sys
sys.path.insert(0, {repo!r})
from llmpipe.dispatch.orphans import DieWithParent
DieWithParent(lambda: open({mark!r}, "w").write("ran"))()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_a_task_whose_controller_ended_before_it_started_ends_at_once(tmp_path):
    """The wrapped function never runs in a task whose controller (the job id in SUBMITIT_LOCAL_JOB_ID) is gone; it
    runs when the job id is the task's parent, or a live process that is not (a controller started through a
    shell)."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    other = subprocess.Popen(["sleep", "30"])
    try:
        for job_id, runs in ((gone.pid, False), (os.getpid(), True), (other.pid, True)):
            mark = tmp_path / f"ran-{job_id}"
            proc = subprocess.run([sys.executable, "-c", _TASK.format(repo=str(REPO), mark=str(mark))],
                                  env={**os.environ, "SUBMITIT_LOCAL_JOB_ID": str(job_id)}, timeout=60)
            assert mark.exists() == runs, (job_id, proc.returncode)
            assert proc.returncode == (0 if runs else -signal.SIGKILL), (job_id, proc.returncode)
    finally:
        other.kill()


def test_wrapper_keeps_the_function_and_its_attributes():
    import pickle
    w = DieWithParent(_Task())
    assert w(1) == 2 and w.checkpoint() == "requeue"
    assert pickle.loads(pickle.dumps(w))(2) == 3


_RULE_SCRIPT = """
import signal, sys, time
def on_int(*args):
    print("rule script got SIGINT", flush=True)
    sys.exit(3)
signal.signal(signal.SIGINT, on_int)
open({ready!r}, "w").write("ready")
time.sleep(60)
"""

_SNAKEMAKE_STAND_IN = """
import os, subprocess, sys, time
sys.path.insert(0, {repo!r})
from llmpipe.dispatch.orphans import interrupt_rule_scripts_on_signal
script = subprocess.Popen([sys.executable, {script!r}])
other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
interrupt_rule_scripts_on_signal()
try:
    time.sleep(60)
except KeyboardInterrupt:
    print("scheduler: KeyboardInterrupt", flush=True)
    print("rule script exit", script.wait(timeout=30), "other process", other.poll(), flush=True)
    other.kill()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_snakemake_alone_reaches_its_rule_scripts_as_ctrl_c(tmp_path, sig):
    """SIGTERM or SIGINT to the Snakemake process alone: each rule script below it (a copy of run_rule.py) gets
    SIGINT, as from Ctrl-C, other processes are left alone, and Snakemake's scheduler gets ``KeyboardInterrupt`` (it
    stops as on Ctrl-C; its own SIGTERM handler would wait for the running jobs to finish)."""
    ready = tmp_path / "ready"
    script = tmp_path / "tmpx1y2z3.run_rule.py"   # the name Snakemake gives its copy of a rule's script
    script.write_text(_RULE_SCRIPT.format(ready=str(ready)))
    stand_in = tmp_path / "snakemake.py"
    stand_in.write_text(_SNAKEMAKE_STAND_IN.format(repo=str(REPO), script=str(script)))
    proc = subprocess.Popen([sys.executable, str(stand_in)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        t0 = time.time()
        while not ready.exists() and time.time() - t0 < 60:
            time.sleep(0.1)
        time.sleep(0.5)   # the handler is installed right after the children start
        os.kill(proc.pid, sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "rule script got SIGINT" in out and "scheduler: KeyboardInterrupt" in out, out
    assert "rule script exit 3 other process None" in out, out


@pytest.mark.slow
def test_kill_of_the_printed_pid_ends_the_training_and_the_rerun_trains_once(tiny_run, tmp_path):
    """SIGKILL of the local job's printed PID mid-training: the step fails, nothing writes the identity folder
    afterwards; the rerun resumes with one trainer and the loss log holds each batch once."""
    wd = copy_run(tiny_run, tmp_path / "wd")
    shutil.rmtree(wd / "results/mpt-tiny/checkpoints")
    (wd / TRAIN).unlink()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [*SNAKEMAKE, "-s", str(REPO / "Snakefile"), "-d", str(wd), "--cores", "2", TRAIN, "--config", SHORT_TINY]
    proc = subprocess.Popen(cmd, cwd=wd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = f"{wd}/results/mpt-tiny/checkpoints/*/ep0-ba20*.complete"
    t0 = time.time()
    while not glob.glob(first) and time.time() - t0 < 600:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.1)
    log = (wd / "results/logs/train/mpt-tiny.log").read_text().split(THIS_RUN)[-1]   # this run's lines
    pid = int(re.search(r"submitted job (\d+) \(local", log).group(1))
    os.kill(pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, out[-3000:]
    ident = glob.glob(f"{wd}/results/mpt-tiny/checkpoints/*/")[0]
    before = sorted(os.listdir(ident)), (wd / ident / "train_log.jsonl").read_text()
    time.sleep(5)   # an orphaned trainer would log more batches in this time (a line every 5 batches)
    assert (sorted(os.listdir(ident)), (wd / ident / "train_log.jsonl").read_text()) == before
    assert lease.read(ident) is None   # the failed step gave back the lease: its job's controller is gone
    # a live training of this identity still holds the folder (a stand-in process as its local job's controller):
    # the rerun waits for it to end, then takes the lease over and trains
    holder = subprocess.Popen(["sleep", "6"])
    atomic_write_json(os.path.join(ident, lease.LEASE_NAME), lease.job_holder("local", str(holder.pid)))
    try:
        rerun = subprocess.run(cmd, cwd=wd, env=env, capture_output=True, text=True, timeout=900)
    finally:
        holder.kill()
    assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-3000:]
    log = (wd / "results/logs/train/mpt-tiny.log").read_text().split(THIS_RUN)[-1]
    assert f"is held by local job {holder.pid} (pid {holder.pid} on " in log and "waiting for it to end" in log, log
    assert re.search(r"the training that held \S+ ended after \d+ s of waiting", log), log
    assert f"took over the lease of {ident.rstrip('/')} from local job {holder.pid}" in log, log
    assert log.index("ended after") < log.index("submitted job"), log      # no second trainer meanwhile
    assert lease.read(ident) is None   # given back once the job ended
    train = json.loads((wd / TRAIN).read_text())
    assert train["steps"] == 60 and train["resumed_from"] and "ep0-ba" in train["resumed_from"]
    batches = [json.loads(line)["batch"] for line in open(os.path.join(ident, "train_log.jsonl")) if line.strip()]
    assert len(batches) == len(set(batches)) and batches == sorted(batches) and batches[-1] == 60, batches


def _descendants(root: int) -> set[int]:
    """PIDs of the processes below ``root`` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for d in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = open(d).read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(d.split("/")[2]))
    out, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


@pytest.mark.slow
def test_kill_of_snakemake_alone_ends_its_rule_script_and_the_history_keeps_the_submission(tiny_run, tmp_path):
    """``kill -9`` of the Snakemake process (not its group) mid-training: the rule script, its shell and the local
    job end within seconds (no watcher writes into a later run's log); the append-only history beside the rule log
    keeps the submission line. (A rerun's new log naming that history: tests/test_slurm_pipeline.py's killed-Snakemake
    test.)"""
    wd = copy_run(tiny_run, tmp_path / "wd")
    shutil.rmtree(wd / "results/mpt-tiny/checkpoints")
    (wd / TRAIN).unlink()
    log = wd / "results/logs/train/mpt-tiny.log"
    log.unlink()   # the copied run's log has its own submission line and no THIS_RUN marker before it
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [*SNAKEMAKE, "-s", str(REPO / "Snakefile"), "-d", str(wd), "--cores", "2", TRAIN, "--config", SHORT_TINY]
    proc = subprocess.Popen(cmd, cwd=wd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)

    def submission() -> re.Match | None:
        text = log.read_text() if log.exists() else ""
        return re.search(r".*submitted job (\d+) \(local.*\n", text.split(THIS_RUN)[-1]) if THIS_RUN in text else None

    t0 = time.time()
    while submission() is None and time.time() - t0 < 600:
        assert proc.poll() is None
        time.sleep(0.2)
    time.sleep(3)   # the job's controller and task start
    below = _descendants(proc.pid)
    line = submission().group(0).rstrip("\n")
    assert int(re.search(r"job (\d+)", line).group(1)) in below
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    t0 = time.time()
    while any(process_start_time(p) is not None for p in below) and time.time() - t0 < 60:
        time.sleep(0.5)
    left = [p for p in below if process_start_time(p) is not None]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, "processes outlived the killed Snakemake"
    # nor did the training run on meanwhile: its 60 batches would end well within that wait
    assert not list(wd.glob("results/mpt-tiny/checkpoints/*/ep0-ba60*")), "the cancelled training ran to its end"
    history = wd / "results/logs/train/mpt-tiny.log.history"
    assert line in history.read_text()


#: A tiny training short enough to run again in the test (20 batches, a checkpoint every 5).
_INTERRUPTED = "models={'mpt-tiny': {'train': {'max_duration_batches': 20, 'save_interval_batches': 5}}}"


@pytest.mark.slow
@pytest.mark.parametrize("to_group", [False, True], ids=["sigint-to-snakemake", "ctrl-c-to-the-group"])
def test_interrupted_snakemake_cancels_the_local_training_and_a_plain_rerun_finishes_it(tiny_run, tmp_path, to_group):
    """SIGINT to Snakemake's PID alone (``kill -INT``; it used to wait while the training ran to its end, leaving
    ``train.json`` flagged incomplete), or to its whole process group (Ctrl-C; it used to print screens of
    ``KeyboardInterrupt`` tracebacks from submitit's controller and the rule script), mid-training: every process
    below Snakemake is gone within seconds, the console has one line for the cancelled job and no traceback, no
    ``train.json`` is written; the same command without ``--rerun-incomplete`` then resumes and finishes (after
    Ctrl-C, whose run would be the same, its dry run plans the training without asking for ``--rerun-incomplete``)."""
    wd = copy_run(tiny_run, tmp_path / "wd")
    shutil.rmtree(wd / "results/mpt-tiny/checkpoints")
    (wd / TRAIN).unlink()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [*SNAKEMAKE, "-s", str(REPO / "Snakefile"), "-d", str(wd), "--cores", "2", TRAIN, "--config", _INTERRUPTED]
    proc = subprocess.Popen(cmd, cwd=wd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        first = f"{wd}/results/mpt-tiny/checkpoints/*/ep0-ba5*.complete"
        t0 = time.time()
        while not glob.glob(first) and time.time() - t0 < 600:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.1)
        below = _descendants(proc.pid)
        if to_group:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGINT)
        t0 = time.time()
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    left = [p for p in below if process_start_time(p) is not None]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"processes outlived the interrupted Snakemake:\n{out[-3000:]}"
    assert time.time() - t0 < 20 and proc.returncode != 0, out[-3000:]
    job = re.search(r"submitted job (\d+) \(local", out).group(1)
    assert re.findall(r".*: interrupted.*", out) == [
        re.search(rf".*train mpt-tiny: interrupted; cancelled 1 local job\(s\) still running \({job}\)", out).group(0)]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert not (wd / TRAIN).exists()
    assert not glob.glob(f"{wd}/results/mpt-tiny/checkpoints/*/ep0-ba20*"), "the training ran to its end"
    if to_group:   # Snakemake's incomplete marker blocks nothing (a dry run checks it as a run does): the run itself
        plan = subprocess.run([*cmd, "-n"], cwd=wd, env=env, capture_output=True, text=True, timeout=300)
        assert plan.returncode == 0 and planned_jobs(plan) == {"train": 1}, (plan.stdout + plan.stderr)[-3000:]
        return     # is the other case's
    rerun = subprocess.run(cmd, cwd=wd, env=env, capture_output=True, text=True, timeout=900)   # no --rerun-incomplete
    assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-3000:]
    train = json.loads((wd / TRAIN).read_text())
    assert train["steps"] == 20 and "ep0-ba" in (train["resumed_from"] or ""), train
