"""Where an evaluation job's wall time goes (llmpipe.evaluation.step_clock): consecutive phases that add up to the
wall time, from the job process's start to eval.json."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time

import pytest

from llmpipe.evaluation import step_clock
from tests.conftest import REPO


def test_phases_tile_the_job_and_the_hand_back_completes_the_wall_time(monkeypatch):
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    clock = step_clock.StepClock()
    s = clock.start
    for phase, at in [("imports_s", 2.0), ("task_check_s", 2.5), ("datasets_s", 3.0), ("model_load_s", 5.25),
                      ("batches_s", 9.0), ("results_s", 9.125)]:   # trainer_s not marked: it did not happen
        clock.mark(phase, s + at)
    out = clock.phases()
    assert out["phases"] == {"imports_s": 2.0, "task_check_s": 0.5, "datasets_s": 0.5, "model_load_s": 2.25,
                             "trainer_s": None, "batches_s": 3.75, "results_s": 0.125, "hand_back_s": None}
    assert out["job_s"] == 9.125 and out["wall_s"] is None
    # the job's last mark on the wall clock: 9.125 s after its start, which was ``now - (monotonic - start)``
    assert out["returned_at"] == pytest.approx(time.time() - (time.monotonic() - (s + 9.125)), abs=0.01)
    timing = step_clock.finish(out, written_at=out["returned_at"] + 1.5)
    assert "returned_at" not in timing and timing["phases"]["hand_back_s"] == 1.5
    assert timing["wall_s"] == 10.625 == sum(v for v in timing["phases"].values() if v is not None)
    # a job host whose clock runs ahead of the step's: no negative hand-back, the sum still holds
    late = clock.phases()
    assert step_clock.finish(late, written_at=late["returned_at"] - 3)["wall_s"] == late["job_s"]
    with pytest.raises(ValueError, match="unknown phase 'load_s'"):
        clock.mark("load_s")


def test_a_process_started_for_the_job_counts_from_its_start(monkeypatch):
    """Under submitit's local or Slurm executor the clock starts at the process's start (the interpreter and the
    imports count); in a process that ran before (a test, a benchmark, the debug executor), at the clock's creation."""
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    assert time.monotonic() - step_clock.StepClock().start < 0.1
    code = ("import time; time.sleep(1.5); from llmpipe.evaluation import step_clock; "
            "print(time.monotonic() - step_clock.StepClock().start)")
    env = {**os.environ, "SUBMITIT_EXECUTOR": "local", "PYTHONPATH": str(REPO)}
    age = float(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                               check=True).stdout)
    assert 1.5 <= age < 5.0   # the sleep, the interpreter's start and the import since the process started


def test_only_a_job_process_leaves_its_objects_to_the_exit(monkeypatch):
    before = gc.get_freeze_count()
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "debug")
    assert step_clock.leave_objects_to_exit() is False and gc.get_freeze_count() == before
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    try:
        assert step_clock.leave_objects_to_exit() is True and gc.get_freeze_count() > before
    finally:
        gc.unfreeze()
