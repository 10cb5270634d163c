"""Functions the Slurm tests run as jobs (pickled by value: the nodes need not import this module)."""

from __future__ import annotations

import json
import os
import socket
import time

import submitit


def where(out_dir: str) -> dict:
    """Export torch.distributed's variables from Slurm's as the steps do (llmpipe.dispatch.rendezvous.export_dist_env);
    write and return what this task sees."""
    from llmpipe.dispatch.rendezvous import export_dist_env

    dist = export_dist_env()
    seen = {
        "host": socket.gethostname(),
        "rank": dist["rank"],
        "world_size": dist["world_size"],
        "local_rank": dist["local_rank"],
        "local_world_size": dist["local_world_size"],
        "node_rank": int(os.environ.get("SLURM_NODEID", -1)),
        "master_addr": dist["master_addr"],
        "master_port": dist["master_port"],
        "master_ip": socket.gethostbyname(dist["master_addr"]),
        "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                               "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID")},
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank{dist['rank']}.json"), "w") as fh:
        json.dump(seen, fh)
    return seen


def environment(names: list[str]) -> dict:
    """The values of some environment variables in the task, and its host name."""
    return {"host": socket.gethostname(), "env": {n: os.environ.get(n) for n in names}}


def fail(message: str) -> None:
    """A step whose bad setting only shows at run time."""
    print("about to fail", flush=True)
    raise ValueError(message)


def die_hard(code: int) -> None:
    """A task that exits without raising (no result pickle): only Slurm's state tells what happened."""
    print("exiting hard", flush=True)
    os._exit(code)


def sleep_then(seconds: float, token: str) -> dict:
    """Sleep, then return the token and the job id (for re-attach tests)."""
    time.sleep(seconds)
    return {"token": token, "job_id": os.environ.get("SLURM_JOB_ID")}


class Counter(submitit.helpers.Checkpointable):
    """Counts to ``n_steps`` one step a second; on Slurm's USR2 it checkpoints its position and is requeued."""

    def __init__(self) -> None:
        self.pos = 0

    def __call__(self, n_steps: int, start: int = 0) -> dict:
        for i in range(start, n_steps):
            self.pos = i
            time.sleep(1)
        return {"steps": n_steps, "started_at": start, "restarts": os.environ.get("SLURM_RESTART_COUNT"),
                "job_id": os.environ.get("SLURM_JOB_ID")}

    def checkpoint(self, n_steps: int, start: int = 0) -> submitit.helpers.DelayedSubmission:
        print(f"checkpoint at step {self.pos}", flush=True)
        return submitit.helpers.DelayedSubmission(Counter(), n_steps, start=self.pos + 1)


def deaf_counter(folder: str, n_steps: int, per_allocation: int | None = None) -> dict:
    """Counts to ``n_steps`` one step a second from the newest ``step-N`` file in ``folder`` (a stand-in for a
    checkpoint, one written per step), deaf to Slurm's USR2: the time-limit signal never reaches it, as when it
    comes while the batch script still runs its set-up, so the job ends TIMEOUT. With ``per_allocation``, one job
    counts at most that many steps and then waits to be killed: how far a job gets no longer depends on when Slurm's
    time-limit check (up to a minute late) and its KillWait end it."""
    import signal

    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    os.makedirs(folder, exist_ok=True)
    start = max((int(n.split("-")[1]) for n in os.listdir(folder) if n.startswith("step-")), default=0)
    stop = n_steps if per_allocation is None else min(n_steps, start + per_allocation)
    for i in range(start + 1, stop + 1):
        time.sleep(1)
        open(os.path.join(folder, f"step-{i}"), "w").close()
    while stop < n_steps:   # this allocation's share is done: wait for the time limit
        time.sleep(1)
    return {"steps": n_steps, "started_at": start, "job_id": os.environ.get("SLURM_JOB_ID")}


def square(x: int) -> dict:
    """One unit of a map_steps array."""
    return {"x": x, "square": x * x, "array_task": os.environ.get("SLURM_ARRAY_TASK_ID")}


def square_slowly(x: int) -> dict:
    """A unit of an array that runs long enough to kill its driver meanwhile."""
    time.sleep(6)
    return square(x)
