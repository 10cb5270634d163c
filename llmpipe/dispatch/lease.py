"""The lease on a training's identity folder: at most one live training writes it.

Contract: the step that trains an identity takes the lease of its identity folder (:class:`Lease`) before it submits
the training, hands it to the job once the job has an id, and gives it back when the job has ended. The lease is
``.lease.json`` in the identity folder: executor, job id and, for a process on this host, host, PID and process start
time (which tells a reused PID apart). A step that finds the lease of a live training of another job waits for it to
end (it keeps its checkpoints; the step then reuses or resumes them) and never submits a second trainer: two
trainers on one folder would both write its checkpoints and loss log. A lease whose holder is not alive is stale and
taken over:

* a Slurm job: not live per ``squeue``/``sacct`` (a requeued job keeps its id and stays live throughout);
* a local job: its controller, the PID the step printed ("submitted job N"), is gone from this host (the job's
  tasks die with it: :mod:`llmpipe.dispatch.orphans`);
* a step that had not submitted yet: its process is gone from this host.

A local holder on another host cannot be checked from here: its lease holds until it is removed by hand (the message
says how). The lease is kept while the job it names runs on after its step stopped (a Slurm job outlives a killed
Snakemake; the next run re-attaches to it through the submission record, :mod:`llmpipe.dispatch.jobs`).
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
from llmpipe.dispatch.orphans import process_start_time

#: The lease file in an identity folder.
LEASE_NAME = ".lease.json"

#: Slurm states of a job that has not ended.
_LIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED", "STAGE_OUT"}


class LeaseHeld(RuntimeError):
    """The identity folder is held by a live training (or one this host cannot check); the message names it and
    the fix."""


def this_holder() -> dict:
    """The lease record of this process (a step that has not submitted its job yet): ``executor`` "step",
    ``host``, ``pid``, ``start`` (clock ticks since boot), ``job_id`` "" and ``since`` (Unix seconds)."""
    return {"executor": "step", "host": socket.gethostname(), "pid": os.getpid(),
            "start": process_start_time(os.getpid()), "job_id": "", "since": round(time.time(), 3)}


def job_holder(executor: str, job_id: str) -> dict:
    """The lease record of a submitted job: a Slurm job by its id; a local job by its controller process (submitit's
    local job id is the controller's PID) on this host."""
    rec = {"executor": executor, "job_id": str(job_id), "host": socket.gethostname(), "pid": None, "start": None,
           "since": round(time.time(), 3)}
    if executor == "local" and str(job_id).isdigit():
        rec["pid"] = int(job_id)
        rec["start"] = process_start_time(int(job_id))
    return rec


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
    """``<executor> job <id> (pid <pid> on <host>, since HH:MM:SS)`` (the parts that are known) for messages."""
    since = time.strftime("%H:%M:%S", time.localtime(float(rec.get("since") or 0)))
    what = {"step": "the step", "slurm": "Slurm", "local": "local"}.get(rec.get("executor"), str(rec.get("executor")))
    job = f" job {rec['job_id']}" if rec.get("job_id") else ""
    where = f"pid {rec['pid']} on {rec.get('host')}, " if rec.get("pid") and rec.get("executor") != "slurm" else ""
    return f"{what}{job} ({where}since {since})"


def holder_alive(rec: dict) -> bool | None:
    """Whether the holder of lease ``rec`` is alive; None when this host cannot tell (a process on another host).

    A Slurm holder is asked about with :func:`llmpipe.dispatch.slurm.job_info`; when Slurm does not answer it counts as
    alive (a duplicate trainer costs more than a wait).
    """
    if rec.get("executor") == "slurm":
        from llmpipe.dispatch import slurm

        try:
            info = slurm.job_info(str(rec.get("job_id")), timeout=30)
        except RuntimeError:
            return True
        return bool(info) and (info.get("State") or "").split(" ")[0] in _LIVE
    if rec.get("host") != socket.gethostname():
        return None
    pid = rec.get("pid")
    return isinstance(pid, int) and rec.get("start") is not None and process_start_time(pid) == rec.get("start")


@contextlib.contextmanager
def _locked(folder: str):
    """An exclusive ``flock`` on the folder itself while a lease is read and replaced (two steps that start at once
    must not both take a free lease); no lock file is left behind. Where the filesystem gives no ``flock`` on a
    folder (NFS, Lustre mounted without it) there is no lock: the read-and-replace is then only as safe as its few
    milliseconds."""
    os.makedirs(folder, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)   # closing releases the lock


def _same(a: dict | None, b: dict | None) -> bool:
    if not a or not b:
        return False
    return all(a.get(k) == b.get(k) for k in ("executor", "job_id", "host", "pid", "start"))


class Lease:
    """The lease of one identity folder, held by a step (a context manager).

    Entering waits while a live training of another job holds ``folder`` (saying once what it waits for, and when it
    ended) and then takes the lease, replacing a stale one (said too); :meth:`hand_over` names the submitted job;
    leaving gives the lease back unless the job it names is still alive (a Slurm job outlives its step).

    Args:
        folder: the identity folder (created when missing).
        say: prints and logs one line (the step's rule log).
        except_job: the id of the job this step re-attaches to (its submission record): its lease is this step's.
        poll_s: seconds between looks at a live holder.

    Raises:
        LeaseHeld: (on entering) a holder this host cannot check: a local process on another host.
    """

    def __init__(self, folder: str, say: Callable[[str], None], except_job: str | None = None,
                 poll_s: float = 10.0):
        self.folder, self.say, self.except_job, self.poll_s = folder, say, except_job, poll_s
        self.mine: dict | None = None
        self.waited_s = 0.0

    def __enter__(self) -> Lease:
        t0, told = time.time(), False
        while True:
            with _locked(self.folder):
                old = read(self.folder)
                ours = old is not None and bool(self.except_job) and str(old.get("job_id")) == str(self.except_job)
                alive = False if old is None or ours else holder_alive(old)
                if alive is None:
                    raise LeaseHeld(f"{self.folder} is held by {describe(old)}, a process on another host that this "
                                    f"host cannot check. Fix: if that training has ended, remove "
                                    f"{os.path.join(self.folder, LEASE_NAME)}; else wait for it.")
                if not alive:
                    self.mine = old if ours else this_holder()
                    if not ours:
                        atomic_write_json(os.path.join(self.folder, LEASE_NAME), self.mine)
                    break
            if not told:
                self.say(f"the checkpoint folder {self.folder} is held by {describe(old)}, a live training of this "
                         f"identity: waiting for it to end before submitting (it keeps its checkpoints; this step "
                         f"then reuses or resumes them)")
                told = True
            time.sleep(self.poll_s)
        if told:
            self.waited_s = time.time() - t0
            self.say(f"the training that held {self.folder} ended after {self.waited_s:.0f} s of waiting")
        if old is not None and not ours:
            self.say(f"took over the lease of {self.folder} from {describe(old)}, which has ended")
        return self

    def hand_over(self, executor: str, job_id: str) -> None:
        """Name the job this step submitted (or re-attached to) as the holder."""
        rec = job_holder(executor, job_id)
        with _locked(self.folder):
            atomic_write_json(os.path.join(self.folder, LEASE_NAME), rec)
        self.mine = rec

    def __exit__(self, *exc: object) -> None:
        with _locked(self.folder):
            if _same(read(self.folder), self.mine) and (self.mine.get("executor") == "step"
                                                        or holder_alive(self.mine) is False):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.folder, LEASE_NAME))
