"""The rule log's Slurm state lines (llmpipe.dispatch.slurm_watch.StateLog) from a sequence of controller views, no cluster.

The real cluster's sequence is checked in tests/test_slurm_dispatch.py (requeue, never-resolving PENDING)."""

from __future__ import annotations

import pytest

from llmpipe.dispatch import slurm_watch
from llmpipe.dispatch.slurm_watch import NeverRuns, StateLog


def view(state, reason="None", restarts="0", nodes="(null)", eligible="2026-12-05T17:38:30"):
    return {"JobState": state, "Reason": reason, "Restarts": restarts, "NodeList": nodes, "EligibleTime": eligible}


def test_each_change_once_with_reason_nodes_and_requeue(monkeypatch):
    monkeypatch.setattr(slurm_watch, "earlier_run_states", lambda job_id: ["PREEMPTED", "PENDING"])
    lines: list[str] = []
    log = StateLog("42", "train r", lines.append, progress=lambda: "resumes from the checkpoint at batch 40")
    for v in [view("PENDING", "Priority"), view("PENDING", "Priority"), view("PENDING", "Resources"),
              view("RUNNING", nodes="gpu[01-02]"), view("RUNNING", nodes="gpu[01-02]"),
              view("PENDING", "BeginTime", restarts="1"), view("RUNNING", restarts="1", nodes="gpu03"),
              view("NODE_FAIL", "NodeDown", restarts="1", nodes="gpu03")]:
        log.poll(v)
    assert lines == [
        "train r: job 42 is PENDING (Priority)",
        "train r: job 42 is PENDING (Resources)",
        "train r: job 42 is RUNNING on gpu[01-02]",
        "train r: job 42 was REQUEUED (restart 1; its earlier run ended PREEMPTED); resumes from the checkpoint at "
        "batch 40",
        "train r: (Slurm preempted the job for one of higher priority and requeued it; Slurm holds a requeued job "
        "PENDING (BeginTime) for the credential lifetime, slurm.conf's AuthInfo cred_expire: 120 s by default)",
        "train r: job 42 is PENDING (BeginTime) until 17:38:30",
        "train r: job 42 is RUNNING on gpu03",
        "train r: job 42 is NODE_FAIL (NodeDown) on gpu03",
    ]
    assert log.told_nodes


def test_a_reason_that_never_resolves_fails_once_it_holds(monkeypatch):
    lines: list[str] = []
    log = StateLog("7", "eval r", lines.append, confirm_s=0.0)
    log.poll(view("PENDING", "Resources"))  # resolves by itself: keeps waiting
    with pytest.raises(NeverRuns) as e:
        log.poll(view("PENDING", "InvalidQOS"))
    assert "job 7 is PENDING (InvalidQOS), which Slurm never resolves by itself" in str(e.value)
    assert "fix slurm.qos" in str(e.value) and "The job was cancelled" in str(e.value)


def test_a_never_resolving_reason_seen_once_is_not_enough():
    log = StateLog("8", "x", lambda line: None, confirm_s=60.0)
    log.poll(view("PENDING", "PartitionConfig"))
    log.poll(view("PENDING", "PartitionConfig"))  # not yet held 60 s
    log.poll(view("RUNNING", nodes="n1"))


def test_how_the_earlier_run_ended_follows_when_accounting_records_it_late(monkeypatch):
    answers = iter([["RUNNING"]] * 7 + [["NODE_FAIL", "PENDING"]])  # 7 answers while requeueing, then the record
    monkeypatch.setattr(slurm_watch, "earlier_run_states", lambda job_id: next(answers))
    monkeypatch.setattr(slurm_watch.time, "sleep", lambda s: None)
    lines: list[str] = []
    log = StateLog("9", "train r", lines.append)
    log.poll(view("RUNNING", nodes="n1"))
    log.poll(view("PENDING", "BeginTime", restarts="1"))
    log.poll(view("PENDING", "BeginTime", restarts="1"))
    assert lines[1:] == ["train r: job 9 was REQUEUED (restart 1)", "train r: job 9 is PENDING (BeginTime) until 17:38:30",
                         "train r: job 9's run before restart 1 ended NODE_FAIL",
                         "train r: (a node of the job failed and Slurm requeued the job (JobRequeue); Slurm holds a "
                         "requeued job PENDING (BeginTime) for the credential lifetime, slurm.conf's AuthInfo "
                         "cred_expire: 120 s by default)"], lines


@pytest.mark.parametrize("ended", ["REQUEUED", "NODE_FAIL", "PREEMPTED"])
def test_each_requeue_note_names_its_own_cause_once(monkeypatch, ended):
    """submitit's time-limit lines are explained after a planned requeue (the training's own ``scontrol requeue``,
    recorded REQUEUED) and never after a node failure or a preemption; each cause's note is said once."""
    monkeypatch.setattr(slurm_watch, "earlier_run_states", lambda job_id: [ended] * 3)
    lines: list[str] = []
    log = StateLog("5", "train r", lines.append)
    for v in [view("RUNNING", nodes="n1"), view("PENDING", "BeginTime", restarts="1"), view("RUNNING", restarts="1"),
              view("PENDING", "BeginTime", restarts="2")]:
        log.poll(v)
    notes = [line for line in lines if line.startswith("train r: (")]
    assert notes == [f"train r: ({slurm_watch.REQUEUE_NOTES[ended]}; {slurm_watch.REQUEUE_HOLD_NOTE})"], lines
    planned = ended == "REQUEUED"
    assert ("this job is timed-out" in notes[0]) == planned and ("remaining timeouts" in notes[0]) == planned
    assert ("planned requeue" in notes[0]) == planned and ("node of the job failed" in notes[0]) == (ended == "NODE_FAIL")
