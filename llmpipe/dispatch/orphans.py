"""Processes that die with the process that started them (Linux ``prctl(PR_SET_PDEATHSIG)``).

Contract: on the local executor a job's tasks are children of submitit's controller, whose PID is the job id the
step prints ("submitted job N"); the tasks are not in its process group, so ``kill -9 N`` alone left them running
(a training went on writing its identity folder while the rerun started a second one). :class:`DieWithParent` wraps
the function a local job runs: the task asks the kernel for ``SIGKILL`` when its parent (the controller) ends, so
the job's whole process tree ends with it (torch's data-loader workers exit when their parent is gone). A task
whose controller is already gone when it starts ends at once. On other systems the wrapper only calls the function.

Rule scripts run under Snakemake through a shell, so their parent is not Snakemake and outlives it:
:func:`exit_when_snakemake_dies` watches the Snakemake ancestor instead and ends the script when it is gone, so no
watcher of a killed run keeps writing into the next run's rule log.

SIGINT or SIGTERM to the Snakemake process alone (``kill -INT <pid>``) reaches none of its rule scripts: Snakemake's
local executor then waits for them to end (SIGTERM: "Will exit after finishing currently running jobs"), so a local
training ran on to its end. :func:`interrupt_rule_scripts_on_signal`, installed in Snakemake's process when it starts
its jobs, passes the interrupt on to each rule script (:func:`rule_scripts_below`) as Ctrl-C would, and stops Snakemake
the way Ctrl-C does.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

#: prctl(2) option: the signal the calling process gets when its parent thread ends.
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent ends; if the parent (``parent``, default the
    current one) is already gone, send ``sig`` to this process now. Returns False where prctl is not available
    (not Linux); True once armed.

    Raises:
        OSError: prctl refused the request.
    """
    if not sys.platform.startswith("linux"):
        return False
    expected = os.getppid() if parent is None else parent
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    if os.getppid() != expected:  # the parent ended before the request was armed
        os.kill(os.getpid(), sig)
    return True


def sigint_cancels_children() -> bool:
    """Make SIGINT end the processes this one starts from now on: where this process ignores SIGINT (a process
    started in the background by a non-interactive shell, ``cmd &``), restore Python's handler in it.

    Contract: submitit cancels a local job by sending SIGINT to the job's controller, which then ends its tasks. An
    ignored signal stays ignored across ``exec``, so a controller started by a process that ignores SIGINT ignores
    the cancel, and the job runs on after its step was stopped. A handled signal is reset to the default in the
    child, where Python installs its own handler. Only the main thread may set a handler; elsewhere nothing
    changes. Returns True when the handler was restored."""
    import threading

    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is not \
            signal.SIG_IGN:
        return False
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return True


def _controller() -> int | None:
    """The parent this task must have: submitit's local controller, whose PID is the job id it gives its tasks
    (``SUBMITIT_LOCAL_JOB_ID``), when that process is this one's parent or is gone (it ended while this task was
    still starting, before the request was armed: :func:`die_with_parent` then ends the task). None (the current
    parent) without the variable, or when the job id names a live process that is not the parent (a controller
    started through a shell gives its tasks the shell's parent's PID)."""
    job_id = os.environ.get("SUBMITIT_LOCAL_JOB_ID", "")
    if not job_id.isdigit():
        return None
    pid = int(job_id)
    return pid if pid == os.getppid() or process_start_time(pid) is None else None


class DieWithParent:
    """A picklable callable for submitit's local executor: arms :func:`die_with_parent` (SIGKILL), then returns
    ``fn(*args, **kwargs)``. ``checkpoint`` and other attributes are ``fn``'s, so submitit sees the same task."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        die_with_parent(signal.SIGKILL, parent=_controller())
        return self.fn(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "fn":   # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.fn, name)


# ------------------------------------------------------------------------------------------- rule scripts

def _stat(pid: int) -> list[str] | None:
    """Fields of ``/proc/<pid>/stat`` after the command name (index 0 is the state), or None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_start_time(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22), which tells a
    reused PID apart; None when it is gone or a zombie (or there is no ``/proc``)."""
    fields = _stat(pid)
    return None if fields is None or fields[0] == "Z" else fields[19]


def _same_process_alive(pid: int, start: str) -> bool:
    """Whether ``pid`` is alive (not a zombie) and is the process that started at ``start``."""
    return process_start_time(pid) == start


def _is_snakemake(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = [a.decode(errors="replace") for a in fh.read().split(b"\0")]
    except OSError:
        return False
    return argv[1:3] == ["-m", "snakemake"] or any(os.path.basename(a) == "snakemake" for a in argv[:2])


def snakemake_ancestor() -> tuple[int, str] | None:
    """The nearest ancestor of this process that is Snakemake (``snakemake ...`` or ``python -m snakemake ...``),
    as ``(pid, start time in clock ticks)`` (the pair tells a reused PID apart), or None (not under Snakemake, or
    no ``/proc``)."""
    pid = os.getppid()
    while pid > 1:
        fields = _stat(pid)
        if fields is None:
            return None
        if _is_snakemake(pid):
            return pid, fields[19]   # field 22 of stat(5), starttime
        pid = int(fields[1])         # field 4, ppid
    return None


def exit_when_snakemake_dies(poll_s: float = 2.0) -> tuple[int, str] | None:
    """Watch this process's Snakemake ancestor (:func:`snakemake_ancestor`) from a daemon thread; when it is gone
    (``kill -9`` of Snakemake alone leaves its rule scripts running), send this process SIGTERM: a step waiting for
    local jobs cancels them (:mod:`llmpipe.dispatch.jobs`), one waiting for a Slurm job stops waiting (the job runs on, and
    the next run re-attaches to it). Returns the watched ``(pid, start)``, or None when there is none."""
    import threading

    who = snakemake_ancestor()
    if who is None:
        return None

    def watch() -> None:
        while _same_process_alive(*who):
            time.sleep(poll_s)
        print(f"[llmpipe {time.strftime('%H:%M:%S')}] Snakemake (pid {who[0]}) is gone: this step stops "
              f"(local jobs are cancelled; a Slurm job runs on and the next run re-attaches to it)",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="llmpipe-snakemake-watch", daemon=True).start()
    return who


# ------------------------------------------------------------------------------------------- interrupts of Snakemake

def _children() -> dict[int, list[int]]:
    """Every process's children, from the parent links in ``/proc/<pid>/stat``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def _is_rule_script(pid: int) -> bool:
    """Whether ``pid`` runs a copy of ``scripts/run_rule.py`` (Snakemake runs ``python
    .snakemake/scripts/tmp<random>.run_rule.py``)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return False
    return len(argv) >= 2 and argv[1].endswith("run_rule.py")


def rule_scripts_below(pid: int) -> list[int]:
    """PIDs of the rule scripts (:func:`_is_rule_script`) among the descendants of ``pid``, not looking below a rule
    script (its jobs are its own to stop); [] without ``/proc``."""
    children = _children()
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        if _is_rule_script(child):
            found.append(child)
        else:
            todo.extend(children.get(child, []))
    return sorted(found)


def interrupt_rule_scripts_on_signal() -> bool:
    """In Snakemake's process (its ``onstart`` hook, once its scheduler has set its own SIGTERM handler): make SIGINT
    and SIGTERM to this process alone act as Ctrl-C to its whole process group.

    Contract: on either signal, SIGINT goes to each rule script below this process (:func:`rule_scripts_below`), which
    cancels the local jobs it waits for, or leaves its Slurm job running for a rerun to re-attach to, prints one line
    saying which, and exits (:mod:`llmpipe.dispatch.jobs`, :func:`llmpipe.steps.run_rule`); then ``KeyboardInterrupt``
    is raised here, so that Snakemake's scheduler stops as on Ctrl-C ("Terminating processes on user request") and
    waits for those scripts. Snakemake's own SIGTERM handling would instead wait for the running jobs to finish.
    Only the main thread may set handlers; elsewhere nothing changes. Returns True once installed."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return False

    def interrupt(signum, frame):
        for pid in rule_scripts_below(os.getpid()):
            try:
                os.kill(pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    return True
