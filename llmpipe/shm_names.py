"""Per-job shared-memory names for the streaming library, so trainings that start together on one node never collide.

mosaicml-streaming names a dataset's shared memory ``/NNNNNN_locals``, ``/NNNNNN_barrier`` ... with the first
prefix number no other dataset on the node uses: every rank scans from 0 for the first free number, and the node's
local leader then creates ``/NNNNNN_locals``. Two jobs starting in the same second both find the same free number
and one fails with ``FileExistsError: '/0000NN_locals'`` (seen on clusters that pack jobs on a node). Here each job
starts its scan at its own offset (:func:`prefix_start`, from the job id that all its ranks share), so concurrent
jobs choose different numbers; within a job every rank still computes the same one (same offset, same scan).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

#: Prefix numbers per job slot: a job scans ``[start, start + SLOT)`` first (more datasets than that in one job
#: just continue into the next slot) ...
SLOT = 100
#: ... and there are this many slots (``SLOT x SLOTS`` stays below the 6 digits of streaming's ``{:06}`` names).
SLOTS = 9973


def job_number(environ: dict | None = None) -> int:
    """The number that every rank of this job shares: Slurm's job id (``SLURM_JOB_ID``; each array task has its own),
    else submitit's local job id (``SUBMITIT_LOCAL_JOB_ID``), else this process's id (single-process runs)."""
    env = os.environ if environ is None else environ
    for var in ("SLURM_JOB_ID", "SUBMITIT_LOCAL_JOB_ID"):
        value = str(env.get(var) or "")
        if value.isdigit():
            return int(value)
    return os.getpid()


def prefix_start(environ: dict | None = None) -> int:
    """The first shared-memory prefix number this job tries: ``(job number mod SLOTS) x SLOT``."""
    return (job_number(environ) % SLOTS) * SLOT


def per_job_prefixes(environ: dict | None = None) -> int:
    """Make mosaicml-streaming scan for a free shared-memory prefix from this job's own offset; return the offset.

    Replaces ``streaming.base.shared.prefix._each_prefix_int`` (the generator its prefix search iterates, read as a
    module global at each search). Idempotent; call in every rank before any ``StreamingDataset`` is built.
    """
    from streaming.base.shared import prefix

    start = prefix_start(environ)

    def each_prefix_int() -> Iterator[int]:
        n = start
        while True:
            yield n
            n += 1

    each_prefix_int.llmpipe_start = start  # type: ignore[attr-defined]
    prefix._each_prefix_int = each_prefix_int
    return start
