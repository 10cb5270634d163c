"""Where an evaluation job's wall time goes: consecutive phases from the job's start to its ``eval.json``.

The job (:func:`llmpipe.evaluation.icl_eval.evaluate`) marks the ends of its phases on ``time.monotonic``; the step
that writes ``eval.json`` (another process, on Slurm another host) adds the hand-back from the job's return to the
write, on the wall clock (:func:`finish`). The phases are consecutive, so they add up to ``wall_s``.
"""

from __future__ import annotations

import gc
import os
import time

#: The phases of an evaluation job, in order (eval.json's ``timing.phases``; docs/outputs.md describes each).
PHASES = ("imports_s", "task_check_s", "datasets_s", "model_load_s", "trainer_s", "batches_s", "results_s",
          "hand_back_s")


def _seconds_since_process_start() -> float | None:
    """Seconds since this process started (Linux: its start time in clock ticks since boot,
    :func:`llmpipe.dispatch.orphans.process_start_time`, against ``CLOCK_BOOTTIME``, both counted from the boot;
    resolution one clock tick, 10 ms), or None without ``/proc``."""
    from llmpipe.dispatch.orphans import process_start_time

    ticks = process_start_time(os.getpid())
    if ticks is None:
        return None
    try:
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - int(ticks) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, AttributeError):
        return None


def started_for_this_job() -> bool:
    """Whether this process was started to run the job: submitit's local or Slurm executor start a process per
    task (``SUBMITIT_EXECUTOR``); the debug executor, a test or a benchmark call the evaluation in a process that
    was running before."""
    return os.environ.get("SUBMITIT_EXECUTOR") in ("local", "slurm")


def leave_objects_to_exit() -> bool:
    """In a process started for the job (:func:`started_for_this_job`), whose end follows the return of its
    result: move every object to the collector's permanent generation (``gc.freeze``), so that the interpreter's
    shutdown does not walk the millions of objects that torch, transformers and llm-foundry's imports made (about
    2 s of the eval step's hand-back on a 2-core CPU; the memory goes back to the system with the process). Return
    whether it did; elsewhere (a test, a benchmark, the debug executor) nothing changes."""
    if not started_for_this_job():
        return False
    gc.freeze()
    return True


class StepClock:
    """The phase marks of one evaluation job.

    Its start is the process's start when the process was started for the job (:func:`started_for_this_job`: the
    interpreter's start, submitit's unpickling and the imports count), else the clock's creation. Marks are
    ``time.monotonic()`` readings; :meth:`phases` turns them into seconds.
    """

    def __init__(self) -> None:
        now = time.monotonic()
        since = _seconds_since_process_start() if started_for_this_job() else None
        self.start = now - (since or 0.0)
        self.marks: dict[str, float] = {}

    def mark(self, phase: str, at: float | None = None) -> None:
        """End ``phase`` (one of :data:`PHASES`) now, or at the monotonic reading ``at``."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; phases: {', '.join(PHASES)}")
        self.marks[phase] = time.monotonic() if at is None else at

    def phases(self) -> dict:
        """``{"phases": {phase: seconds or None}, "job_s": job start to the last mark, "wall_s": None (set by
        :func:`finish`), "returned_at": wall-clock time of that mark (epoch seconds, for :func:`finish`)}``. A phase without a mark did not happen and is None
        (``hand_back_s`` until :func:`finish`); the next marked phase counts from the last mark before it, so the
        phases always add up to ``job_s`` (each rounded to the millisecond)."""
        out: dict[str, float | None] = {}
        last = self.start
        for phase in PHASES:
            at = self.marks.get(phase)
            if at is None:
                out[phase] = None
                continue
            out[phase] = round(max(0.0, at - last), 3)
            last = max(last, at)
        return {"phases": out, "job_s": round(last - self.start, 3), "wall_s": None,
                "returned_at": time.time() - (time.monotonic() - last)}


def finish(timing: dict, written_at: float | None = None) -> dict:
    """Complete an evaluation's ``timing`` (:meth:`StepClock.phases` under ``timing``'s keys) where ``eval.json`` is
    written: ``phases.hand_back_s`` (the job's return to ``written_at``, wall clock: the job's end, its result's way
    back, the step noticing it), ``wall_s`` (the job's start to ``written_at``: the sum of the phases); drops
    ``returned_at``. Returns ``timing``.

    A hand-back that reads negative (the job's host's clock ahead of the step's) counts as 0."""
    written_at = time.time() if written_at is None else written_at
    returned_at = timing.pop("returned_at", None)
    if returned_at is None:
        return timing
    hand_back = round(max(0.0, written_at - returned_at), 3)
    timing["phases"]["hand_back_s"] = hand_back
    timing["wall_s"] = round(timing["job_s"] + hand_back, 3)
    return timing
