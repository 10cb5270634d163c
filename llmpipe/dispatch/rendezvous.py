"""The rendezvous of a job's ranks: torch.distributed's environment from submitit's, on a port no connection holds.

Contract: torch.distributed's ``env://`` rendezvous binds ``MASTER_PORT`` on rank 0 and every other rank connects to
it, waiting up to the process group's timeout (llm-foundry's ``dist_timeout``, 600 s by default). Without a
``MASTER_PORT`` in the job's environment, submitit derives the port from the job id in 20000-60000
(``submitit.helpers.TorchDistributedEnvironment._get_master_port``). That range overlaps Linux's ephemeral ports
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default), which every outgoing connection on the machine
draws from, so a busy machine can hold the derived port already: rank 0 then fails with ``EADDRINUSE``.

On the local executor the step therefore picks the port itself (:func:`free_port`: below the ephemeral range, not
bound by anyone when picked) and puts it in the environment the job inherits, where submitit reads it
(:func:`local_master_port`). A Slurm job's ranks start on other hosts, which the submitting process cannot ask: every
rank computes the same port from the job id, below Linux's default ephemeral range (:func:`job_port`), in the job
before submitit's helper reads it (:func:`export_dist_env`).
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
from collections.abc import Iterator

#: The lowest port :func:`free_port` and :func:`job_port` pick (submitit's lower bound; below it are many services'
#: fixed ports).
LOWEST_PORT = 20000

#: The first port of Linux's default ephemeral range (ip-sysctl.rst, ``ip_local_port_range``: 32768 60999).
DEFAULT_EPHEMERAL_LOW = 32768


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's ephemeral port range ``(low, high)``, inclusive; Linux's default ``(32768, 60999)`` where
    ``path`` cannot be read (not Linux)."""
    try:
        with open(path) as fh:
            low, high = (int(v) for v in fh.read().split()[:2])
        return low, high
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_LOW, 60999


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def free_port(tries: int = 64, rng: random.Random | None = None) -> int:
    """A TCP port that nothing on this machine is bound to now, from ``LOWEST_PORT`` up to just below the ephemeral
    range (:func:`ephemeral_range`), where no outgoing connection takes one by itself; after ``tries`` taken ports
    (or no such range), one the kernel hands out (bind to port 0).

    Returns:
        the port number (int).
    """
    rng = rng or random.SystemRandom()
    low = ephemeral_range()[0]
    if low - 1 > LOWEST_PORT:
        for _ in range(tries):
            port = rng.randint(LOWEST_PORT, low - 1)
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def job_port(job_id: str) -> int:
    """The rendezvous port of job ``job_id``, the same on every host that computes it: ``LOWEST_PORT`` to
    ``DEFAULT_EPHEMERAL_LOW - 1``, where no outgoing connection takes a port by itself on hosts with Linux's default
    ephemeral range (the hosts of a job cannot agree on a free one; submitit's own pick from the job id, 20000-60000,
    falls in that range 68% of the time). A requeued job keeps its id and so its port."""
    return random.Random(str(job_id)).randrange(LOWEST_PORT, DEFAULT_EPHEMERAL_LOW)


@contextlib.contextmanager
def local_master_port(executor: str, tasks: int) -> Iterator[int | None]:
    """While submitting a job: for a local job of more than one task, ``MASTER_PORT`` set to :func:`free_port` in
    this process's environment (which submitit's local executor passes to the job), restored afterwards. Yields
    the port, or None (one task, or not the local executor: nothing is set)."""
    if executor != "local" or tasks <= 1:
        yield None
        return
    before = os.environ.get("MASTER_PORT")
    port = free_port()
    os.environ["MASTER_PORT"] = str(port)
    try:
        yield port
    finally:
        if before is None:
            os.environ.pop("MASTER_PORT", None)
        else:
            os.environ["MASTER_PORT"] = before


def export_dist_env() -> dict:
    """Set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR, MASTER_PORT from submitit.

    Uses ``submitit.helpers.TorchDistributedEnvironment`` inside a submitit job (``MASTER_PORT``: a local step's, else
    :func:`job_port`); outside one (debug executor) a single process. Returns the values.
    """
    import submitit
    try:
        job = submitit.JobEnvironment()
    except RuntimeError:  # not inside a submitit job
        job = None
    if job is not None:  # the job's own values win over any inherited from the submitting process
        os.environ.setdefault("MASTER_PORT", str(job_port(job.job_id)))
        env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        os.environ["NODE_RANK"] = str(job.node)
        os.environ["LOCAL_WORLD_SIZE"] = str(env.local_world_size)
        out = {"rank": env.rank, "world_size": env.world_size, "local_rank": env.local_rank,
               "local_world_size": env.local_world_size, "node_rank": job.node,
               "master_addr": env.master_addr, "master_port": env.master_port, "hostname": job.hostname,
               "job_id": job.job_id}
    else:
        for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                     "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
            os.environ.setdefault(k, v)
        out = {"rank": 0, "world_size": 1, "local_rank": 0, "local_world_size": 1, "node_rank": 0}
    return out
