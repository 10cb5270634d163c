"""Requeues of a training on Slurm: as many allocations as it needs while each one makes progress.

submitit requeues a checkpointable job when Slurm signals the end of its allocation (``--signal=USR2@N``) and
counts time limits against ``max_num_timeout`` (``slurm.max_requeue_timeouts``): a training on a partition whose
time limit is shorter than the training failed after that many allocations although every one of them trained and
checkpointed. Here the count is of allocations that made **no** progress (no newer complete checkpoint than the one
the allocation started from), over the training's whole life; an allocation that checkpointed a later batch costs
nothing. Once more allocations than the cap made no progress, the training fails with a message that says so.

The cap is ``task.requeue_cap`` (set by the step from ``slurm.max_requeue_timeouts``); the counters live on the task,
which submitit pickles into each requeued submission.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import submitit


class DelayedSubmission(submitit.helpers.DelayedSubmission):
    """submitit's resubmission of a task whose time-limit countdown is what :func:`resubmission` allows.

    (The class keeps submitit's name: ``DelayedSubmission.load`` checks the class name of what it unpickles.)
    submitit sets the countdown of a resubmission to the running one's minus 1 per time limit; this keeps it at
    ``allowed`` instead, so submitit's own "timed-out too many times" never ends a training that makes progress.
    """

    allowed: int = 1

    def set_timeout(self, timeout_min: int, max_num_timeout: int) -> None:
        super().set_timeout(timeout_min, self.allowed)


def start_resource_tracker_immune_to_usr2() -> None:
    """Start multiprocessing's resource tracker (if it is not running yet) with ``USR2`` ignored, so that Slurm's
    time-limit signal does not kill it.

    Slurm delivers ``--signal=USR2@N`` to every process of a job step, helpers included. The tracker is a separate
    interpreter (fork + exec, so a Python handler is not inherited) whose default action for ``USR2`` is to die;
    every later ``SharedMemory`` of the task (streaming creates some for each dataset iteration, an evaluation right
    after the signal included) then fails with ``BrokenPipeError``, or the tracker is restarted and the segments it
    knew leak. An ignored disposition survives exec, so the tracker started here keeps running.

    Raises nothing: outside the main thread (no signal disposition can be changed) it does nothing.
    """
    from multiprocessing import resource_tracker

    try:
        previous = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    except ValueError:   # not the main thread
        return
    try:
        resource_tracker.ensure_running()
    finally:
        signal.signal(signal.SIGUSR2, previous)


class IgnoreSignalAfterReturn:
    """A picklable wrapper of the function a Slurm job runs: the task's helpers survive ``USR2``, and once ``fn``
    returned the task ignores it.

    Slurm sends ``USR2`` up to 60 s before the time asked for (``--signal``) to every process of the step:
    - before ``fn`` runs, multiprocessing's resource tracker is started with ``USR2`` ignored
      (:func:`start_resource_tracker_immune_to_usr2`); the task's own handler checkpoints and requeues;
    - a signal that reaches a finished task while it writes its result and exits would requeue a finished job
      (submitit's handler) or, after the interpreter reset its handlers, kill the task (exit 140), which records the
      job's last allocation FAILED although its result was written.
    Other attributes are ``fn``'s (submitit sees the same task); the submission that ``fn.checkpoint`` returns for a
    requeue runs wrapped too, so every allocation starts and ends the same way.
    """

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start_resource_tracker_immune_to_usr2()
        out = self.fn(*args, **kwargs)
        with contextlib.suppress(ValueError):   # not the main thread (the debug executor): nothing to ignore
            signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        return out

    def __getattr__(self, name: str) -> Any:
        if name == "fn":   # not set yet (unpickling): no recursion
            raise AttributeError(name)
        attr = getattr(self.fn, name)
        if name != "checkpoint":
            return attr

        def checkpoint(*args: Any, **kwargs: Any) -> Any:
            again = attr(*args, **kwargs)
            if again is not None and not isinstance(again.function, IgnoreSignalAfterReturn):
                again.function = IgnoreSignalAfterReturn(again.function)
            return again
        return checkpoint


def resubmission(task: Any, batch: int) -> DelayedSubmission:
    """What a checkpointable training's ``checkpoint()`` returns when Slurm ends its allocation.

    Compares ``batch``, the newest complete checkpoint's batch (0: none), with the one at the end of the previous
    allocation
    (``task.requeue_start_batch``; the first allocation counts as progress when any checkpoint exists) and counts an
    allocation without progress in ``task.requeue_no_progress``.

    Raises:
        RuntimeError: more than ``task.requeue_cap`` allocations made no progress; the message names the count,
            the newest checkpoint's batch, the setting and the fix. The job then ends as failed.
    """
    cap = int(getattr(task, "requeue_cap", 3))
    start = getattr(task, "requeue_start_batch", None)
    progressed = batch > (start if start is not None else 0)
    task.requeue_no_progress = int(getattr(task, "requeue_no_progress", 0)) + (0 if progressed else 1)
    task.requeue_allocations = int(getattr(task, "requeue_allocations", 0)) + 1
    task.requeue_start_batch = batch
    print(f"llmpipe: allocation {task.requeue_allocations} ends at checkpoint batch {batch} "
          f"({'progress' if progressed else 'no progress'}; {task.requeue_no_progress} of at most {cap} allocations "
          f"without progress)", flush=True)
    if task.requeue_no_progress > cap:
        raise RuntimeError(
            f"training made no progress in {task.requeue_no_progress} of {task.requeue_allocations} allocations (no "
            f"newer checkpoint than batch {batch}), more than slurm.max_requeue_timeouts={cap} allows; not "
            f"requeued. Fix: give each allocation time to start and checkpoint (raise time_min, lower "
            f"slurm.signal_delay_s, or save checkpoints more often), or raise slurm.max_requeue_timeouts.")
    out = DelayedSubmission(task)
    out.allowed = first_countdown(cap) - task.requeue_no_progress  # submitit subtracts 1 at a time limit: >= 0
    return out


def first_countdown(cap: int) -> int:
    """The time-limit countdown (submitit's ``max_num_timeout``) of a step's first submission, for a requeue cap
    ``cap`` (``slurm.max_requeue_timeouts``).

    At a time-limit signal submitit logs ``Requeued job N (K remaining timeouts)`` with ``K`` = the running
    allocation's countdown - 1, computed before ``checkpoint()`` runs; :func:`resubmission` gives the next
    allocation ``cap + 1 - (allocations without progress so far)``. Starting at ``cap + 1`` too, ``K`` is ``cap``
    minus the allocations without progress before the running one: it never rises, and an allocation that
    checkpointed a later batch leaves it unchanged.
    """
    return int(cap) + 1


def resubmit_after_timeout(state: str, job_id: str, start: int, now: int, counts: dict, step: str, cap: int,
                           say: Callable[[str], None]) -> bool:
    """Whether a Slurm training job that ended in ``state`` is submitted again by its step: it ended ``TIMEOUT``, and
    its newest complete checkpoint (batch ``now``) is later than when it was submitted (``start``) or at most ``cap``
    (``slurm.max_requeue_timeouts``) of its ends made no progress. Counts in ``counts`` (``resubmitted``,
    ``no_progress``) and says the decision with the batch the next job resumes from.

    Slurm sends ``--signal`` up to 60 s before the time asked for and only to job steps: a signal that comes while the
    batch script still runs its set-up is lost, and the training runs into the limit. Its checkpoints are complete,
    so a new job resumes from the newest one, as a requeue would have.
    """
    if state != "TIMEOUT":
        return False
    progressed = now > start
    counts["no_progress"] += 0 if progressed else 1
    if counts["no_progress"] > cap:
        say(f"{step}: the job ended TIMEOUT {counts['no_progress']} time(s) without a newer checkpoint than batch "
            f"{now}, more than slurm.max_requeue_timeouts={cap} allows: not submitted again. Fix: give each "
            f"allocation time to start and checkpoint (raise time_min, lower slurm.signal_delay_s, save checkpoints "
            f"more often).")
        return False
    counts["resubmitted"] += 1
    say(f"{step}: job {job_id} ended TIMEOUT: the time-limit signal did not reach the training in time (Slurm "
        f"sends it up to 60 s early, to job steps only). Its newest checkpoint is at batch {now} "
        f"({'progress' if progressed else 'no progress'} since batch {start}): submitting it again (resubmission "
        f"{counts['resubmitted']}; it resumes from batch {now})")
    return True


def wait_to_be_requeued(timeout_s: float = 90.0, rank: int | None = None) -> None:
    """What a rank that did not handle the signal does at the checkpoint barrier: wait for Slurm to requeue the job
    (which ends every task), but not forever.

    Raises:
        RuntimeError: the job was not requeued within ``timeout_s`` seconds (rank 0 gave up, e.g. the requeue cap),
            so this rank ends too instead of holding its node until the time limit.
    """
    time.sleep(timeout_s)
    who = f"rank {rank}" if rank is not None else f"process {os.getpid()}"
    raise RuntimeError(f"{who}: the job was not requeued within {timeout_s:.0f} s after the checkpoint (the rank "
                       f"that handles Slurm's signal gave up; see its log); ending this rank too")
