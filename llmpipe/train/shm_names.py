"""Per-job shared-memory names for the streaming library, so trainings that start together on one node never collide.

mosaicml-streaming names a dataset's shared memory ``/NNNNNN_locals``, ``/NNNNNN_barrier`` ... with the first
prefix number no other dataset on the node uses: every rank scans from 0 for the first free number, and the node's
local leader then creates ``/NNNNNN_locals``. Two jobs starting in the same second both find the same free number
and one fails with ``FileExistsError: '/0000NN_locals'`` (seen on clusters that pack jobs on a node). Here each job
starts its scan at its own offset (:func:`prefix_start`, from the job id that all its ranks share), so concurrent
jobs choose different numbers; within a job every rank still computes the same one (same offset, same scan).

A SIGKILLed job never unlinks its segments, which then stay in the node's ``/dev/shm`` until reboot. Each rank
therefore leaves an owner mark for its slot (``llmpipe_NNNNNN_<pid>.owner``: its process start time, which tells a
reused PID apart), and every job start removes the segments of the slots whose every owner process is gone
(:func:`remove_stale_segments`). A slot with a live owner, or with no owner mark at all (a job of a version without
marks), is never touched; streaming's own ``clean_stale_shared_memory()`` would unlink live jobs' segments too.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
from collections.abc import Iterator
from multiprocessing import resource_tracker

from llmpipe.dispatch.orphans import process_start_time

#: Where POSIX shared memory lives on Linux.
SHM_DIR = "/dev/shm"
_OWNER = re.compile(r"llmpipe_(\d{6})_(\d+)\.owner$")

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
    if os.path.isdir(SHM_DIR):
        remove_stale_segments(SHM_DIR)
        mark_owner(start, SHM_DIR)
    return start


def segment_paths(shm_dir: str = SHM_DIR) -> list[str]:
    """The streaming library's shared-memory segments in ``shm_dir`` (``NNNNNN_*``), every job's."""
    return glob.glob(os.path.join(shm_dir, "[0-9]" * 6 + "_*"))


@contextlib.contextmanager
def open_reader(local: str, split: str | None = None) -> Iterator:
    """A ``StreamingDataset`` of ``local`` (``split``; unshuffled, batch size 1) opened only to read a dataset back
    (the MDS checks, not training). Its shared-memory names come from this job's slot (:func:`per_job_prefixes`,
    which also removes dead jobs' segments), and the segments of that slot that appeared while it was open are removed
    when the block ends, and taken off this process's ``multiprocessing`` resource tracker, which otherwise warns of
    "leaked shared_memory objects" at exit and fails to unlink each of them again (two lines of warning per segment
    on the console of every verify_mds run).

    This replaces streaming's ``clean_stale_shared_memory()``, which unlinks every segment from prefix 0 on, those of
    live trainings on the same node included."""
    from streaming import StreamingDataset

    start = per_job_prefixes()
    before = set(segment_paths())
    try:
        yield StreamingDataset(local=local, split=split, shuffle=False, batch_size=1)
    finally:
        for path in set(segment_paths()) - before:
            if start <= int(os.path.basename(path)[:6]) < start + SLOT:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
                # the name SharedMemory registered (a leading slash on POSIX); each once, so the tracker never
                # gets an unknown name (it would print a KeyError traceback)
                resource_tracker.unregister(f"/{os.path.basename(path)}", "shared_memory")


def mark_owner(start: int, shm_dir: str = SHM_DIR, pid: int | None = None) -> str:
    """Write this process's owner mark for the slot that begins at prefix ``start``; return its path."""
    pid = os.getpid() if pid is None else pid
    path = os.path.join(shm_dir, f"llmpipe_{start:06d}_{pid}.owner")
    with open(path, "w") as fh:
        fh.write(process_start_time(pid) or "")
    return path


def remove_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove the streaming segments (``NNNNNN_*``) of every slot whose owner marks all name processes that are gone
    (dead, or their PID reused by a process started at another time), and those marks; return the removed paths.
    Slots with a live owner or without marks are left alone."""
    owners: dict[int, list[tuple[str, bool]]] = {}
    for path in glob.glob(os.path.join(shm_dir, "llmpipe_*.owner")):
        m = _OWNER.search(os.path.basename(path))
        if not m:
            continue
        try:
            with open(path) as fh:
                started = fh.read().strip()
        except OSError:
            continue
        alive = bool(started) and process_start_time(int(m.group(2))) == started
        owners.setdefault(int(m.group(1)), []).append((path, alive))
    stale = [start for start, marks in owners.items() if not any(alive for _, alive in marks)]
    if not stale:
        return []
    segments = segment_paths(shm_dir)
    removed = []
    for start in stale:
        doomed = [p for p in segments if start <= int(os.path.basename(p)[:6]) < start + SLOT]
        for p in doomed + [path for path, _ in owners[start]]:
            try:
                os.remove(p)
                removed.append(p)
            except FileNotFoundError:
                pass
    return removed
