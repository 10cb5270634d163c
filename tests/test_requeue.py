"""A training on a partition shorter than the training: requeued as often as it needs while each allocation makes
progress; the cap counts allocations without progress. Runs submitit's own checkpoint-and-requeue arithmetic
(``submitit.core.job_environment._checkpoint``) on the real TrainTask, allocation after allocation."""

from __future__ import annotations

from pathlib import Path

import pytest
from submitit.core import job_environment
from submitit.helpers import DelayedSubmission

from llmpipe.train import checkpoints as ckpt
from llmpipe.dispatch import requeue
from llmpipe.config.runs import run_settings
from llmpipe.train.pretrain import TrainTask
from tests.conftest import project_config


def task(tmp_path, cap: int) -> TrainTask:
    t = TrainTask(run_settings(project_config(), "mpt-tiny"), str(tmp_path / "mds"), str(tmp_path / "tok"), str(tmp_path / "run"), "{}",
                  resources={"nodes": 1})
    t.requeue_cap = cap
    ckpt.prepare_identity_folder(str(tmp_path / "run" / "checkpoints"), "{}")
    return t


def save_checkpoint(tmp_path, batch: int) -> None:
    folder = ckpt.identity_folder(str(tmp_path / "run" / "checkpoints"), "{}")  # the task's identity: "{}"
    path = f"{folder}/ep0-ba{batch}-rank0.pt"
    with open(path, "wb") as fh:
        fh.write(b"x")
    ckpt.mark_complete(path, batch)


def allocation_ends(delayed, pickle_path):
    """What submitit does in the job when Slurm's USR2 comes at the time limit (checkpoint_and_try_requeue)."""
    countdown = delayed._timeout_countdown - 1  # timed out
    reason = job_environment._checkpoint(delayed, pickle_path, countdown)
    if countdown < 0:
        reason = "timed-out too many times"
    return reason, (DelayedSubmission.load(pickle_path) if not reason else None)


def test_a_training_that_progresses_is_requeued_as_often_as_it_needs(tmp_path):
    t = task(tmp_path, cap=3)
    delayed = DelayedSubmission(t)
    delayed.set_timeout(2, requeue.first_countdown(3))  # what the executor submits (slurm.max_requeue_timeouts 3)
    pickle_path = tmp_path / "submitted.pkl"
    for alloc in range(1, 11):  # ten allocations, each checkpointing a later batch
        save_checkpoint(tmp_path, 10 * alloc)
        reason, delayed = allocation_ends(delayed, pickle_path)
        assert not reason, f"allocation {alloc}: {reason}"
        assert delayed.function.requeue_no_progress == 0 and delayed.function.requeue_start_batch == 10 * alloc


def test_the_cap_counts_allocations_without_progress(tmp_path, capsys):
    t = task(tmp_path, cap=2)
    delayed = DelayedSubmission(t)
    delayed.set_timeout(2, requeue.first_countdown(2))
    pickle_path = tmp_path / "submitted.pkl"
    save_checkpoint(tmp_path, 10)
    reason, delayed = allocation_ends(delayed, pickle_path)  # progress
    assert not reason
    for _ in range(2):  # two allocations without a newer checkpoint: allowed
        reason, delayed = allocation_ends(delayed, pickle_path)
        assert not reason
    save_checkpoint(tmp_path, 20)  # progress again: costs nothing
    reason, delayed = allocation_ends(delayed, pickle_path)
    assert not reason and delayed.function.requeue_no_progress == 2
    with pytest.raises(RuntimeError) as e:  # a third without progress: over the cap
        allocation_ends(delayed, pickle_path)
    msg = str(e.value)
    assert ("training made no progress in 3 of 5 allocations (no newer checkpoint than batch 20), more than "
            "slurm.max_requeue_timeouts=2 allows") in msg and "Fix: " in msg, msg
    assert "allocation 4 ends at checkpoint batch 20 (progress; 2 of at most 2" in capsys.readouterr().out


def test_submitits_remaining_timeouts_never_rise_on_planned_requeues(tmp_path):
    """submitit's "Requeued job N (K remaining timeouts)" prints the running allocation's countdown - 1: from the
    first submission on (the executor's max_num_timeout) K is the cap minus the allocations without progress so far,
    so progress leaves it unchanged and K never rises (it read 2, then 3, when the first countdown was the cap)."""
    t = task(tmp_path, cap=3)
    delayed = DelayedSubmission(t)
    delayed.set_timeout(2, requeue.first_countdown(3))
    pickle_path = tmp_path / "submitted.pkl"
    printed = []
    for batch in (10, 20, 20, 30, 30, 40):   # progress, progress, none, progress, none, progress
        save_checkpoint(tmp_path, batch)
        printed.append(delayed._timeout_countdown - 1)   # submitit's K, computed before checkpoint() runs
        reason, delayed = allocation_ends(delayed, pickle_path)
        assert not reason
    assert printed == [3, 3, 3, 2, 2, 1], printed
    assert delayed.function.requeue_no_progress == 2


def test_a_rank_waiting_for_a_requeue_that_never_comes_ends():
    with pytest.raises(RuntimeError, match=r"rank 1: the job was not requeued within 0 s"):
        requeue.wait_to_be_requeued(timeout_s=0.05, rank=1)


def test_a_finished_slurm_task_ignores_a_late_time_limit_signal(tmp_path):
    """The wrapper a Slurm job runs: once the function returned, USR2 neither requeues nor kills the exiting task
    (without it the default action ends the process: exit 140 in Slurm, the allocation recorded FAILED)."""
    import subprocess
    import sys

    repo = str(Path(__file__).resolve().parents[1])
    wrapped = (f"import os, signal, sys; sys.path.insert(0, {repo!r}); "
               f"from llmpipe.dispatch.requeue import IgnoreSignalAfterReturn; "
               f"f = IgnoreSignalAfterReturn(lambda x: x + 1); assert f(1) == 2; "
               f"os.kill(os.getpid(), signal.SIGUSR2); print('alive')")
    bare = "import os, signal; os.kill(os.getpid(), signal.SIGUSR2); print('alive')"
    ok = subprocess.run([sys.executable, "-c", wrapped], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.strip() == "alive", ok.stderr
    killed = subprocess.run([sys.executable, "-c", bare], capture_output=True, text=True, timeout=60)
    assert killed.returncode == -12 and "alive" not in killed.stdout      # what the wrapper prevents


#: A Slurm task in miniature: its own USR2 handler (the training's), shared memory before the signal, USR2 to the
#: whole process group (as slurmstepd signals every process of a step), then shared memory again (an evaluation
#: right after the signal). Prints whether multiprocessing's resource tracker outlived the signal.
SIGNALLED_TASK = """
import os, signal, sys, time
sys.path.insert(0, {repo!r})
from multiprocessing import resource_tracker, shared_memory
from llmpipe.dispatch.requeue import IgnoreSignalAfterReturn

def task():
    signal.signal(signal.SIGUSR2, lambda *a: print("rank handler", flush=True))
    first = shared_memory.SharedMemory(create=True, size=64)
    pid = resource_tracker._resource_tracker._pid
    os.killpg(0, signal.SIGUSR2)
    time.sleep(1.0)
    alive = os.waitpid(pid, os.WNOHANG) == (0, 0)
    second = shared_memory.SharedMemory(create=True, size=64)
    for shm in (first, second):
        shm.close(); shm.unlink()
    return alive, resource_tracker._resource_tracker._pid == pid

print("tracker alive, same:", {call})
"""


@pytest.mark.parametrize("wrapped", [True, False])
def test_the_resource_tracker_outlives_slurms_time_limit_signal(wrapped):
    """Slurm signals every process of the step: wrapped, the task's resource tracker ignores USR2 and the shared
    memory made after the signal registers with the same tracker; bare, the tracker dies (what the wrapper fixes)."""
    import subprocess
    import sys

    repo = str(Path(__file__).resolve().parents[1])
    code = SIGNALLED_TASK.format(repo=repo, call="IgnoreSignalAfterReturn(task)()" if wrapped else "task()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         start_new_session=True)
    assert out.returncode == 0 and "rank handler" in out.stdout, out.stdout + out.stderr
    if wrapped:
        assert "tracker alive, same: (True, True)" in out.stdout, out.stdout + out.stderr
        assert "died unexpectedly" not in out.stderr, out.stderr
    else:
        assert "tracker alive, same: (False, False)" in out.stdout, out.stdout + out.stderr


def test_the_wrapper_keeps_the_task_and_wraps_every_requeued_allocation(tmp_path):
    import cloudpickle

    t = task(tmp_path, cap=3)
    wrapped = requeue.IgnoreSignalAfterReturn(t)
    assert wrapped.checkpoint_folder() == t.checkpoint_folder() and wrapped.requeue_cap == 3
    assert getattr(wrapped, "__submitit_checkpoint__", None) is None     # submitit then asks for checkpoint
    delayed = DelayedSubmission(wrapped)
    delayed.set_timeout(2, requeue.first_countdown(3))
    pickle_path = tmp_path / "submitted.pkl"
    for alloc in (1, 2):
        save_checkpoint(tmp_path, 10 * alloc)
        reason, delayed = allocation_ends(delayed, pickle_path)
        assert not reason and isinstance(delayed.function, requeue.IgnoreSignalAfterReturn), alloc
        assert delayed.function.fn.requeue_start_batch == 10 * alloc
    again = cloudpickle.loads(cloudpickle.dumps(delayed.function))
    assert isinstance(again, requeue.IgnoreSignalAfterReturn) and again.fn.requeue_allocations == 2
    plain = requeue.IgnoreSignalAfterReturn(lambda: 1)
    assert not hasattr(plain, "checkpoint")      # a function without checkpoint stays not checkpointable


def test_the_slurm_executor_starts_the_countdown_at_the_cap_plus_one(tmp_path, monkeypatch):
    """The first submission's countdown is what the never-rising count above starts from."""
    import stat

    from llmpipe.dispatch import slurm

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sbatch", "srun"):   # make_executor only checks that they exist
        (bin_dir / tool).write_text("#!/bin/sh\nexit 1\n")
        (bin_dir / tool).chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    config = {"dispatch": {"executor": "slurm"}, "slurm": {"max_requeue_timeouts": 2}}
    ex = slurm.make_executor(config, {"nodes": 1, "gpus_per_node": 0, "tasks_per_node": 1, "cpus_per_task": 1,
                                      "mem_gb": 0, "time_min": 5}, str(tmp_path / "logs"), "t")
    assert ex.max_num_timeout == requeue.first_countdown(2) == 3
