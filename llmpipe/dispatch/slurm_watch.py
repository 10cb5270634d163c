"""What Slurm does with a waiting step's job, for the rule log: each state change with its reason.

:class:`StateLog` asks the controller (``scontrol show job``, no accounting lag) and reports, once per change:
PENDING and why (``Resources``, ``Priority``, ``BeginTime`` ...), RUNNING and on which nodes, a requeue with the
restart count, how the earlier run ended (``sacct --duplicates``: REQUEUED, PREEMPTED, NODE_FAIL, TIMEOUT) and the
step's progress (e.g. the newest checkpoint's batch), and any other state with its reason. A PENDING reason that
Slurm never resolves by itself (:data:`NEVER_RESOLVES`) raises :class:`NeverRuns` with the fix, so the step fails at
once instead of waiting in the queue forever.

This module imports neither torch nor submitit; it runs ``scontrol``/``sacct`` only.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

#: PENDING reasons that no amount of waiting resolves (the request breaks a partition, QOS or account limit, or
#: asks for what no node has), with the fix. Slurm's names (``squeue --help``, "JOB REASON CODES").
NEVER_RESOLVES: dict[str, str] = {
    "PartitionTimeLimit": "the time limit (time_min) is longer than the partition allows: lower time_min to the "
                          "partition's MaxTime (`scontrol show partition`) or choose another slurm.partition",
    "PartitionNodeLimit": "the job asks for more nodes than the partition allows: lower nodes or choose another "
                          "slurm.partition",
    "PartitionConfig": "the request does not fit the partition's configuration: check nodes, time_min and "
                       "slurm.partition against `scontrol show partition`",
    "BadConstraints": "no node has what the job asks for (slurm.constraint, GPUs, CPUs, memory): fix the "
                      "request or slurm.constraint",
    "InvalidAccount": "the account does not exist or you may not use it: fix slurm.account",
    "InvalidQOS": "the QOS does not exist or you may not use it: fix slurm.qos",
    "AccountNotAllowed": "the account may not use this partition: fix slurm.account or slurm.partition",
    "QOSMaxWallDurationPerJobLimit": "time_min is longer than the QOS allows: lower time_min or change slurm.qos",
    "QOSMaxNodePerJobLimit": "the job asks for more nodes than the QOS allows: lower nodes or change slurm.qos",
    "DependencyNeverSatisfied": "the job depends on a job that failed: cancel it and resubmit",
}


#: The rule log's note on a requeue, by how the earlier run ended (``sacct``), said once per cause: a note names
#: only its own cause. ``REQUEUED`` is ``scontrol requeue``, which is how a training requeues itself at Slurm's
#: time-limit signal (submitit's handler, :mod:`llmpipe.dispatch.requeue`); submitit's own task-log lines about it
#: are explained here and nowhere else.
REQUEUE_NOTES: dict[str, str] = {
    "REQUEUED": "a planned requeue: at Slurm's time-limit signal (slurm.signal_delay_s before time_min) the training "
                "saved a checkpoint and requeued its own job. submitit's task-log lines 'this job is timed-out' and "
                "'Requeued job N (K remaining timeouts)' belong to it and are not failures: K is how many more "
                "allocations may end without a newer checkpoint (slurm.max_requeue_timeouts), and an allocation "
                "that checkpointed a later batch costs nothing (the task log's 'allocation N ends at checkpoint "
                "batch B' lines)",
    "PREEMPTED": "Slurm preempted the job for one of higher priority and requeued it",
    "NODE_FAIL": "a node of the job failed and Slurm requeued the job (JobRequeue)",
}

#: Said with the first requeue note: why a requeued job is PENDING (BeginTime) for a while.
REQUEUE_HOLD_NOTE = ("Slurm holds a requeued job PENDING (BeginTime) for the credential lifetime, slurm.conf's "
                     "AuthInfo cred_expire: 120 s by default")


class NeverRuns(RuntimeError):
    """A job is PENDING for a reason Slurm never resolves; the message names the reason and the fix."""


def _kv(text: str) -> dict[str, str]:
    out = {}
    for tok in text.split():
        if "=" in tok:
            k, v = tok.split("=", 1)
            out.setdefault(k, v)
    return out


def controller_view(job_id: str, timeout: float = 30) -> dict[str, str] | None:
    """``scontrol show job --oneliner`` of ``job_id`` as a dict (JobState, Reason, Restarts, NodeList ...); None
    when the controller does not answer or no longer knows the job (it keeps ended jobs for MinJobAge)."""
    try:
        out = subprocess.run(["scontrol", "show", "job", "--oneliner", str(job_id)], capture_output=True,
                             text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    kv = _kv(out.stdout)
    return kv if "JobState" in kv else None


def earlier_run_states(job_id: str, timeout: float = 30) -> list[str]:
    """How each run of ``job_id`` ended, oldest first (``sacct --duplicates``; a requeued job has one row per run):
    e.g. ``['PREEMPTED', 'RUNNING']``. Empty when accounting does not answer."""
    try:
        out = subprocess.run(["sacct", "--noheader", "--parsable2", "--allocations", "--duplicates", "--jobs",
                              str(job_id), "--format", "State"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [(line.split() or [""])[0] for line in out.stdout.splitlines() if line.strip()]


def _nodes(view: dict[str, str]) -> str:
    nodes = view.get("NodeList") or ""
    return "" if nodes in ("(null)", "None", "None assigned") else nodes


class StateLog:
    """Reports a Slurm job's state changes through ``say`` (one line each), for the rule log.

    Args:
        job_id: the Slurm job id.
        what: the step's name, the lines' prefix.
        say: prints and logs one line.
        progress: returns a short text on the step's progress (e.g. ``newest checkpoint at batch 40``), or None;
            asked when the job is requeued.
        confirm_s: how long a reason of :data:`NEVER_RESOLVES` must hold before :meth:`poll` gives up (a reason
            seen once, while the controller re-evaluates the job, is not enough).
    """

    def __init__(self, job_id: str, what: str, say: Callable[[str], None],
                 progress: Callable[[], str | None] | None = None, confirm_s: float = 3.0) -> None:
        self.job_id = str(job_id)
        self.what = what
        self.say = say
        self.progress = progress
        self.last: tuple[str, str, str] | None = None
        self.restarts = None
        self.told_nodes = False
        self.stuck_since: float | None = None
        self.unsaid: tuple[str, float] | None = None  # (restart count, until when) of a requeue whose cause is unknown
        self.confirm_s = confirm_s
        self.explained: set[str] = set()   # the causes whose note (:data:`REQUEUE_NOTES`) was said

    def _explain(self, ended: str) -> None:
        """Say the note of a requeue whose earlier run ended ``ended`` (an ``sacct`` state), once per cause; the
        first note also says why the requeued job waits (:data:`REQUEUE_HOLD_NOTE`)."""
        note = REQUEUE_NOTES.get(ended)
        if note is None or ended in self.explained:
            return
        hold = "" if self.explained else f"; {REQUEUE_HOLD_NOTE}"
        self.explained.add(ended)
        self.say(f"{self.what}: ({note}{hold})")

    def poll(self, view: dict[str, str] | None = None) -> dict[str, str] | None:
        """Ask the controller (or use ``view``) and report what changed since the last call; return the view.

        Raises:
            NeverRuns: the job has been PENDING for a reason in :data:`NEVER_RESOLVES` for ``confirm_s``.
        """
        view = controller_view(self.job_id) if view is None else view
        if not view:
            return None
        state = (view.get("JobState") or "UNKNOWN").split()[0]
        reason = view.get("Reason") or "None"
        nodes = _nodes(view) if state not in ("PENDING", "REQUEUED") else ""
        restarts = view.get("Restarts", "0")
        if self.restarts is not None and restarts != self.restarts:
            runs = earlier_run_states(self.job_id)
            for _ in range(6):  # accounting records the earlier run a moment after the controller requeues
                if len(runs) >= 2:
                    break
                time.sleep(0.5)
                runs = earlier_run_states(self.job_id)
            ended = [s for s in runs[:-1] if s]
            how = f"; its earlier run ended {ended[-1]}" if ended else ""
            done = self.progress() if self.progress else None
            self.say(f"{self.what}: job {self.job_id} was REQUEUED (restart {restarts}{how})"
                     f"{f'; {done}' if done else ''}")
            if ended:
                self._explain(ended[-1])
            # accounting may record the earlier run later still: say how it ended once it does (up to 2 minutes)
            self.unsaid = None if ended else (restarts, time.monotonic() + 120)
        elif self.unsaid is not None:
            n, until = self.unsaid
            runs = earlier_run_states(self.job_id)
            if str(n).isdigit() and len(runs) > int(n) and runs[int(n) - 1]:
                self.say(f"{self.what}: job {self.job_id}'s run before restart {n} ended {runs[int(n) - 1]}")
                self._explain(runs[int(n) - 1])
                self.unsaid = None
            elif time.monotonic() > until:
                self.unsaid = None
        self.restarts = restarts
        now = (state, "" if reason == "None" else reason, nodes)
        if now != self.last:
            self.last = now
            why = f" ({now[1]})" if now[1] else ""
            where = f" on {nodes}" if nodes else ""
            eligible = view.get("EligibleTime") or ""
            if state == "PENDING" and reason == "BeginTime" and "T" in eligible:   # 2026-12-05T17:38:30
                where += f" until {eligible.split('T', 1)[1]}"
            self.say(f"{self.what}: job {self.job_id} is {state}{why}{where}")
            self.told_nodes = self.told_nodes or (state == "RUNNING" and bool(nodes))
        stuck = state == "PENDING" and reason in NEVER_RESOLVES
        if stuck and self.stuck_since is None:
            self.stuck_since = time.monotonic()
        elif not stuck:
            self.stuck_since = None
        if stuck and time.monotonic() - self.stuck_since >= self.confirm_s:
            raise NeverRuns(f"{self.what}: job {self.job_id} is PENDING ({reason}), which Slurm never resolves by "
                            f"itself: {NEVER_RESOLVES[reason]}. The job was cancelled.")
        return view
