"""The lease on a training's identity folder: at most one live training writes it.

Contract: rank 0 of a training takes the lease (:func:`acquire`) before it reads or writes the folder's checkpoints
and gives it back when the training ends (:func:`release`). The lease is ``.lease.json`` in the identity folder:
host, PID and process start time of rank 0, executor and job id. A training that finds the lease of a live other
holder refuses to start (:class:`LeaseHeld`): two trainers on one folder would both write checkpoints and the loss
log. A lease whose holder is not alive is stale and taken over:

* Slurm: the holder's job is not live per ``squeue``/``sacct``, or it is this job (a requeued allocation of the
  same job id starts a new process);
* local executor: the holder's process (PID and start time, which tells a reused PID apart) is gone from this host.

A local holder on another host cannot be checked from here: its lease holds until it is removed by hand (the message
says how). Before a step submits a training it waits while a live training of another job holds the folder
(:func:`wait_until_free`), e.g. one that a killed Snakemake left running whose submission record is gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable

from llmpipe.atomic import atomic_write_json
from llmpipe.orphans import process_start_time

#: The lease file in an identity folder.
LEASE_NAME = ".lease.json"

#: Slurm states of a job that has not ended.
_LIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED", "STAGE_OUT"}


class LeaseHeld(RuntimeError):
    """The identity folder is held by a live training (or one this host cannot check); the message names it and
    the fix."""


def this_holder() -> dict:
    """The lease record of this process: ``host``, ``pid``, ``start`` (clock ticks since boot), ``executor``
    (``slurm`` inside a Slurm job, else ``local``), ``job_id`` (Slurm's, or submitit's local job id, which is the
    PID of the job's controller; "" outside a job) and ``since`` (Unix seconds)."""
    slurm_id = os.environ.get("SLURM_JOB_ID", "")
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": process_start_time(os.getpid()),
            "executor": "slurm" if slurm_id else "local",
            "job_id": slurm_id or os.environ.get("SUBMITIT_LOCAL_JOB_ID", ""), "since": round(time.time(), 3)}


def read(folder: str) -> dict | None:
    """The lease of ``folder``, or None when there is none (or it is unreadable: a lease is written atomically, so
    an unreadable one was never complete)."""
    try:
        with open(os.path.join(folder, LEASE_NAME)) as fh:
            rec = json.load(fh)
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def describe(rec: dict) -> str:
    """``<executor> job <id> (pid <pid> on <host>, since HH:MM:SS)`` for messages."""
    since = time.strftime("%H:%M:%S", time.localtime(float(rec.get("since") or 0)))
    job = f"job {rec.get('job_id')} " if rec.get("job_id") else ""
    return f"{rec.get('executor', '?')} {job}(pid {rec.get('pid')} on {rec.get('host')}, since {since})"


def holder_alive(rec: dict, me: dict | None = None) -> bool | None:
    """Whether the holder of lease ``rec`` is a live training other than ``me`` (default :func:`this_holder`);
    None when this host cannot tell (a local holder on another host).

    A Slurm holder is asked about with :func:`llmpipe.slurm.job_info`; when Slurm does not answer it counts as
    alive (a duplicate trainer costs more than a wait).
    """
    me = this_holder() if me is None else me
    if rec.get("executor") == "slurm" and rec.get("job_id"):
        if str(rec["job_id"]) == str(me.get("job_id")) and me.get("executor") == "slurm":
            return False   # this job's earlier allocation: requeued, its processes are gone
        from llmpipe import slurm

        try:
            info = slurm.job_info(str(rec["job_id"]), timeout=30)
        except RuntimeError:
            return True
        return bool(info) and (info.get("State") or "").split(" ")[0] in _LIVE
    if rec.get("host") != me.get("host"):
        return None
    pid = rec.get("pid")
    if pid == me.get("pid") and rec.get("start") == me.get("start"):
        return False   # this process
    return isinstance(pid, int) and rec.get("start") is not None and process_start_time(pid) == rec.get("start")


@contextlib.contextmanager
def _locked(folder: str):
    """An exclusive ``flock`` on ``<folder>/.lease.lock`` while a lease is read and replaced (two trainings that
    start at once must not both take over a stale lease)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, ".lease.lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def acquire(folder: str) -> tuple[dict, dict | None]:
    """Take the lease of identity folder ``folder`` for this process; returns ``(this lease, the stale lease it
    replaced or None)`` and prints a line when it replaced a stale one.

    Raises:
        LeaseHeld: a live training of another job holds it, or a local holder on another host does (its message
            names the holder and the fix).
    """
    me = this_holder()
    with _locked(folder):
        old = read(folder)
        if old is not None:
            alive = holder_alive(old, me)
            if alive is None:
                raise LeaseHeld(f"{folder} is held by {describe(old)}, a local training on another host that this "
                                f"host cannot check. Fix: if that training has ended, remove "
                                f"{os.path.join(folder, LEASE_NAME)}; else wait for it.")
            if alive:
                raise LeaseHeld(f"{folder} is held by {describe(old)}, a live training of the same identity: two "
                                f"trainers would both write its checkpoints. Fix: wait for it to end (the next run "
                                f"then reuses or resumes its checkpoints), or stop it first.")
        atomic_write_json(os.path.join(folder, LEASE_NAME), me)
    if old is not None:
        print(f"llmpipe: took over the lease of {folder} from {describe(old)}, which has ended", flush=True)
    return me, old


def release(folder: str) -> bool:
    """Give back this process's lease of ``folder`` (another holder's is left alone); True when one was removed."""
    me = this_holder()
    with _locked(folder):
        rec = read(folder)
        if rec is None or rec.get("pid") != me["pid"] or rec.get("host") != me["host"] \
                or rec.get("start") != me["start"]:
            return False
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder, LEASE_NAME))
    return True


def wait_until_free(folder: str, say: Callable[[str], None], except_job: str | None = None,
                    poll_s: float = 10.0) -> float:
    """Wait while a live training other than job ``except_job`` holds ``folder``'s lease, saying once what it waits
    for; return the seconds waited (0 when the folder is free or its lease is stale).

    Called by a step before it submits a training: the holder (e.g. a training a killed Snakemake left running)
    finishes or resumes this identity's checkpoints, and the step then reuses its result or resumes after it.

    Raises:
        LeaseHeld: a local holder on another host (cannot be checked from here).
    """
    t0 = time.time()
    told = False
    while True:
        rec = read(folder)
        if rec is None or (except_job and str(rec.get("job_id")) == str(except_job)):
            break
        alive = holder_alive(rec, {"host": socket.gethostname(), "pid": None, "start": None, "executor": "",
                                   "job_id": ""})
        if alive is None:
            raise LeaseHeld(f"{folder} is held by {describe(rec)}, a local training on another host that this host "
                            f"cannot check. Fix: if that training has ended, remove {os.path.join(folder, LEASE_NAME)}; "
                            f"else wait for it.")
        if not alive:
            break
        if not told:
            say(f"the checkpoint folder {folder} is held by {describe(rec)}, a live training of this identity: "
                f"waiting for it to end before submitting (it keeps its checkpoints; this step then reuses or resumes "
                f"them)")
            told = True
        time.sleep(poll_s)
    if not told:
        return 0.0
    waited = time.time() - t0
    say(f"the training that held {folder} ended after {waited:.0f} s of waiting")
    return waited
