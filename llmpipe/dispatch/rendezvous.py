"""The rendezvous port of a local job with several ranks.

Contract: torch.distributed's ``env://`` rendezvous binds ``MASTER_PORT`` on rank 0 and every other rank connects to
it, waiting up to the process group's timeout (llm-foundry's ``dist_timeout``, 600 s by default). Without a
``MASTER_PORT`` in the job's environment, submitit derives the port from the job id in 20000-60000
(``submitit.helpers.TorchDistributedEnvironment._get_master_port``). That range overlaps Linux's ephemeral ports
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default), which every outgoing connection on the machine
draws from, so a busy machine can hold the derived port already: rank 0 then fails with ``EADDRINUSE``.

On the local executor the step therefore picks the port itself (:func:`free_port`: below the ephemeral range, not
bound by anyone when picked) and puts it in the environment the job inherits, where submitit reads it
(:func:`local_master_port`). Slurm jobs keep submitit's port: their ranks start on other hosts, which the submitting
process cannot ask.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
from collections.abc import Iterator

#: The lowest port :func:`free_port` picks (submitit's lower bound; below it are many services' fixed ports).
LOWEST_PORT = 20000


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's ephemeral port range ``(low, high)``, inclusive; Linux's default ``(32768, 60999)`` where
    ``path`` cannot be read (not Linux)."""
    try:
        with open(path) as fh:
            low, high = (int(v) for v in fh.read().split()[:2])
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


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
