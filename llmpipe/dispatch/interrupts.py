"""Interrupts of a step that waits for its jobs: local jobs stop with it, Slurm jobs run on, one line says which.

A rule script is interrupted by SIGINT (Ctrl-C to Snakemake's process group, or Snakemake passing on a SIGINT or
SIGTERM sent to it alone: :func:`llmpipe.dispatch.orphans.interrupt_rule_scripts_on_signal`) or SIGTERM (``kill`` of
the step, or :func:`llmpipe.dispatch.orphans.exit_when_snakemake_dies`). While it waits for its jobs
(:func:`jobs_stop_with_us`, used by :mod:`llmpipe.dispatch.jobs`), it then cancels the local ones and waits until
their processes are gone, leaves Slurm jobs running for a rerun to re-attach to, says so in one line and raises
:class:`StepInterrupted`; :func:`llmpipe.steps.run_rule` turns that into exit code 130 without a traceback. submitit's
local controller prints a ``KeyboardInterrupt`` traceback whenever it is cancelled: its stderr is a file
(:func:`controller_stderr`), not the console.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any


class StepInterrupted(KeyboardInterrupt):
    """The step was interrupted while waiting for its jobs (SIGINT, e.g. Ctrl-C or Snakemake passing on its own
    interrupt; or SIGTERM) and has said so in one line: its local jobs cancelled, its Slurm jobs left running for a
    rerun to re-attach to. The message is that line."""


def is_slurm_job(job) -> bool:
    """Whether ``job`` is a submitit Slurm job (else local or in-process)."""
    return type(job).__name__ == "SlurmJob"


#: The file beside a step's job folders that submitit's local controllers write their stderr to
#: (:func:`controller_stderr`).
CONTROLLER_LOG = "local-controller.err"


@contextlib.contextmanager
def controller_stderr(local: bool, log_dir: str):
    """While a local job is submitted, this process's stderr (file descriptor 2) is ``<log_dir>/`` :data:`CONTROLLER_LOG`
    (appended to), so that the controller submitit starts inherits that file instead of the console: the controller
    prints a ``KeyboardInterrupt`` traceback whenever it is cancelled (submitit's cancel is a SIGINT) or Ctrl-C
    reaches it, and its tasks write to their own logs anyway. No-op unless ``local`` (the local executor)."""
    if not local:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    target = os.open(os.path.join(log_dir, CONTROLLER_LOG), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(target, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(target)


#: Seconds a cancelled local job's controller gets to end its tasks (submitit's controller sends them SIGINT, then
#: SIGKILL a second later) before it is killed (its tasks end with it: :class:`llmpipe.dispatch.orphans.DieWithParent`).
_CANCEL_WAIT_S = 5.0


def _ids(jobs: Sequence[Any]) -> str:
    return f"{', '.join(str(j.job_id) for j in jobs[:8])}{' ...' if len(jobs) > 8 else ''}"


def _cancel_local(jobs: Sequence[Any]) -> None:
    """Cancel local ``jobs`` (submitit's ``cancel``: SIGINT to each controller) and wait until their controllers
    have ended, killing one still there after :data:`_CANCEL_WAIT_S` s: once this returns, their tasks are gone."""
    for job in jobs:
        with contextlib.suppress(Exception):   # best effort while unwinding
            job.cancel()
    deadline = time.time() + _CANCEL_WAIT_S
    for job in jobs:
        proc = getattr(job, "_process", None)  # submitit's controller (a Popen); None when re-attached
        if proc is None:
            continue
        try:
            proc.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)


def ignore_interrupts() -> None:
    """Ignore further SIGINT/SIGTERM in this process (main thread only) while it stops: Ctrl-C reaches a rule script
    from the terminal and again from Snakemake (:func:`llmpipe.dispatch.orphans.interrupt_rule_scripts_on_signal`),
    and a second ``KeyboardInterrupt`` during the clean-up would skip it and print a traceback."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


@contextlib.contextmanager
def jobs_stop_with_us(jobs: Sequence[Any], what: str, say: Callable[[str], None]):
    """While waiting for ``jobs``: if this process is interrupted (Ctrl-C, or SIGTERM, e.g. ``kill`` of the step or
    Snakemake stopping its jobs), cancel the local ones that are still running (:func:`_cancel_local`) before
    re-raising.

    submitit's ``LocalJob.cancel`` sends SIGINT to the job's controller, which interrupts its task processes and
    kills them a second later; a unit being converted then removes its temporary folder. Without this, ``kill`` of
    the step process left its local workers running (they were started in the same session but not killed with it),
    and a rerun's workers could race them for the same units. Slurm jobs are left alone: they survive the Snakemake
    process by design and a rerun re-attaches to them (:func:`llmpipe.dispatch.jobs.run_step`). ``say`` prints a
    line on the console and in the rule log. SIGTERM becomes ``SystemExit`` only while
    waiting, and only in the main thread (the only place Python runs signal handlers).

    Raises:
        StepInterrupted: on ``KeyboardInterrupt`` or ``SystemExit`` (the interrupt), after one line naming the local
            jobs cancelled or the Slurm jobs left running (and how to cancel those: ``scancel``). Any other error is
            re-raised as it is, after the cancel line.
    """
    local = [j for j in jobs if not is_slurm_job(j)]
    previous = None
    if local and threading.current_thread() is threading.main_thread():
        def on_sigterm(signum, frame):
            raise SystemExit(f"{what}: terminated by signal {signum}")
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    except BaseException as exc:
        interrupted = isinstance(exc, (KeyboardInterrupt, SystemExit))
        if interrupted:
            ignore_interrupts()
            previous = None
        running = [j for j in local if not j.done()]
        _cancel_local(running)
        line = None
        if running:
            line = f"{what}: interrupted; cancelled {len(running)} local job(s) still running ({_ids(running)})"
        elif interrupted:
            slurm_jobs = [j for j in jobs if is_slurm_job(j) and not j.done()]
            ids = sorted({str(j.job_id).split("_")[0] for j in slurm_jobs})
            line = (f"{what}: interrupted; Slurm job(s) {', '.join(ids)} run on: a rerun re-attaches to them; "
                    f"scancel {' '.join(ids)} cancels them" if ids else f"{what}: interrupted")
        if line:
            say(line)
        if interrupted:
            raise StepInterrupted(line) from None
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
