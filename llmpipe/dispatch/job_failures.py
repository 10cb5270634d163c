"""Why a dispatched job failed: the first failing task, its exception line and its log's tail.

submitit keeps a task's traceback in its result pickle when the task's function raised; a task killed or exited
hard leaves only its stderr. :func:`first_failure` picks the task whose failure came first (other ranks usually fail
later because of it), and :func:`headline` finds the exception line in a log, skipping interpreter-shutdown noise.
Used by :mod:`llmpipe.dispatch.jobs` for the message of :class:`llmpipe.dispatch.jobs.StepFailed`.

Errors named at their cause: an ``OSError`` headline is named by its errno and path (:func:`named_oserror`); a step
that writes checkpoints asks :func:`out_of_space` whether the file systems it writes to are full, since a save that
runs out of space often leaves no result at all (submitit cannot dump the error, and the job's own log, on the same
disk, is cut).
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable, Sequence
from typing import Any


def log_tail(job, n: int = 40) -> str:
    """The last ``n`` lines of a submitit job's stderr and stdout, each under a ``--- stderr (last n lines) ---``
    header; "(no log output)" when both are empty or missing."""
    chunks = []
    for getter in ("stderr", "stdout"):
        try:
            text = getattr(job, getter)() or ""
        except Exception:  # noqa: BLE001 - a missing log file is not an error here
            text = ""
        if text:
            chunks.append(f"--- {getter} (last {n} lines) ---\n" + "\n".join(text.splitlines()[-n:]))
    return "\n".join(chunks) or "(no log output)"


def logged_host(log_path) -> str:
    """The host a submitit task ran on, from the ``Starting with JobEnvironment(..., hostname=<host>, ...)`` line
    submitit writes at the top of the task's output log; "" when the log or the line is missing."""
    try:
        with open(log_path, errors="replace") as fh:
            m = re.search(r"JobEnvironment\([^)]*hostname=([^,\s)]+)", fh.read(20000))
    except OSError:
        return ""
    return m.group(1) if m else ""


def local_state(job) -> str:
    """A local job's state for a failure message: submitit says FINISHED for any ended job, also one whose
    function raised (its controller process exits 0 either way); FAILED, or INTERRUPTED when a signal ended it and
    no task had raised (a job is ended once one of its tasks raised, :func:`any_task_raised`)."""
    if any_task_raised(job):
        return "FAILED"
    proc = getattr(job, "_process", None)
    code = proc.poll() if proc is not None else None
    return f"INTERRUPTED (signal {-code})" if code is not None and code < 0 else "FAILED"


#: An exception line: ``ValueError: ...``, ``torch.distributed.DistBackendError: ...``, ``KeyboardInterrupt``,
#: with an optional ``[rank1]:`` prefix (torch's per-rank log prefix).
ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)\b(?::.*)?)$")


def headline(text: str) -> str | None:
    """The first real exception line of a task's stderr, or None.

    Skips the noise of interpreter shutdown: an error inside an ``Exception ignored in ...`` block (e.g. a
    shared-memory ``__del__`` raising ``KeyError``/``FileNotFoundError``) and resource-tracker warnings about leaked
    shared memory. The first one is the cause; later ones are its consequences.
    """
    ignored = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("Exception ignored"):
            ignored = True
            continue
        m = ERROR_LINE.match(stripped)
        if m:
            if ignored or "resource_tracker" in line or "leaked shared_memory" in line:
                ignored = False
                continue
            return m.group(1)
    return None


#: The headline of a task that left neither a result nor an exception line in its log.
NO_RESULT = "wrote no result (killed, or exited without raising)"


def task_failure(task) -> tuple[int, float, str] | None:
    """(kind, when, headline) of a task that failed, None for one that returned a result.

    kind 0: its function raised; the headline is the exception's line from the traceback submitit keeps in the
    task's result pickle, ``when`` that pickle's time. kind 1: no result (killed, exited hard) but its stderr has an
    exception line (:func:`headline`); kind 2: neither. For kinds 1 and 2 ``when`` is the stderr's time.
    """
    import submitit

    pickle_path = task.paths.result_pickle
    if pickle_path.exists():
        try:
            outcome, trace = submitit.core.utils.pickle_load(pickle_path)
        except Exception:  # noqa: BLE001 - unreadable result: judge from the log
            outcome, trace = "error", ""
        if outcome != "error":
            return None
        lines = [ln for ln in str(trace).strip().splitlines() if ln.strip()]
        exc_lines = [ln.strip() for ln in lines if ERROR_LINE.match(ln.strip())]
        text = exc_lines[-1] if exc_lines else (lines[-1].strip() if lines else "")
        return 0, pickle_path.stat().st_mtime, text or "(no exception text)"
    try:
        err = task.paths.stderr
        text = err.read_text(errors="replace") if err.exists() else ""
        when = err.stat().st_mtime if err.exists() else float("inf")
    except OSError:
        text, when = "", float("inf")
    line = headline(text)
    return (1, when, line) if line else (2, when, NO_RESULT)


def any_task_raised(job) -> bool:
    """Whether a task of a local job with several tasks has already written a result that is an error: the job has
    failed, and its other ranks would only wait out the process group's timeout for the missing one. False for a
    job of one task (it ends by itself) and for a task still running or killed without a result."""
    import submitit

    for task in getattr(job, "_sub_jobs", None) or []:
        path = task.paths.result_pickle
        if path.exists():
            try:
                outcome = submitit.core.utils.pickle_load(path)[0]
            except Exception:  # noqa: BLE001 - written but not yet readable: look again at the next poll
                continue
            if outcome == "error":
                return True
    return False


def first_failure(job, exc: Exception) -> tuple[int, str, Any]:
    """(rank, headline, task job) of the first task of ``job`` that failed: a task whose function raised before one
    that only has an error in its log, before one killed without either (ranks killed because another failed);
    among those the one whose failure was recorded first (other ranks often fail later because of it: a broken
    connection, a timeout), lowest rank on a tie."""
    tasks = list(getattr(job, "_sub_jobs", None) or [job])
    failed = []
    for rank, task in enumerate(tasks):
        got = task_failure(task)
        if got is not None:
            failed.append((got[0], got[1], rank, got[2], task))
    if not failed:
        lines = str(exc).strip().splitlines()
        return 0, f"{type(exc).__name__}: {lines[-1] if lines else ''}", tasks[0]
    _, _, rank, line, task = min(failed, key=lambda f: (f[0], f[1], f[2]))
    return rank, line, task


# ------------------------------------------------------------------------------------------- errors named at their cause

#: An OSError's text: ``[Errno 28] No space left on device: '/path'`` (a second path after `` -> `` for a rename).
_OSERROR = re.compile(r"^(?P<cls>[A-Za-z_][\w.]*(?:Error|Exception)): \[Errno (?P<num>\d+)\] (?P<text>.*?)"
                      r"(?:: '(?P<path>[^']*)'(?: -> '(?P<path2>[^']*)')?)?$")


def named_oserror(line: str) -> str:
    """An exception line of an ``OSError`` (or a subclass) that carries an errno, named by the errno's symbol and the
    path: ``OSError: [Errno 28] No space left on device: '/x/ep0-ba40.pt'`` ->
    ``ENOSPC (No space left on device) on /x/ep0-ba40.pt (OSError)``. Any other line is returned unchanged."""
    m = _OSERROR.match(line.strip())
    if not m:
        return line
    name = errno.errorcode.get(int(m["num"]), f"errno {m['num']}")
    where = f" on {m['path']}" + (f" -> {m['path2']}" if m["path2"] else "") if m["path"] else ""
    return f"{name} ({m['text']}){where} ({m['cls']})"


def size_text(n: int) -> str:
    """``n`` bytes for a message: ``12,345,678 bytes (12.3 MB)``, decimal units."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n:,} bytes ({n / scale:.1f} {unit})"
    return f"{n:,} bytes"


def free_bytes(path: str, statvfs: Callable[[str], Any] = os.statvfs) -> int | None:
    """Bytes an unprivileged process may still write on the file system of ``path`` (``f_bavail * f_frsize`` of
    statvfs(3)), asked of its nearest existing folder (the path may not exist yet); None when statvfs fails."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        st = statvfs(path)
    except OSError:
        return None
    return int(st.f_bavail) * int(st.f_frsize)


#: What a failure's text says when a write ran out of space (or over a quota): the errno texts and numbers.
_NO_SPACE = re.compile(r"No space left on device|Disk quota exceeded|\[Errno (?:28|122)\]|ENOSPC|EDQUOT")


def out_of_space(failure: str, places: Sequence[tuple[str, str]], planned_bytes: int, kept: str,
                 statvfs: Callable[[str], Any] = os.statvfs) -> str | None:
    """The headline of a job that ran out of space while saving, or None when the failure is not that.

    Args:
        failure: the whole failure text (:class:`llmpipe.dispatch.jobs.StepFailed`: headline and log tail).
        places: ``(what, path)`` of each folder the job writes to, e.g. ``("checkpoint folder", ...)``,
            ``("results_dir", ...)``; their free space is asked now (:func:`free_bytes`).
        planned_bytes: what one save needs (the memory plan's ``checkpoint_bytes``,
            :func:`llmpipe.plan.memory_time.checkpoint_bytes`).
        kept: what became of the earlier checkpoint, for the message (``the checkpoint at batch 40 is untouched``).
        statvfs: ``os.statvfs`` (tests pass a stand-in).

    Returns:
        ``out of space: <what> <path> has <free> free, less than the <planned> one checkpoint needs ...; <kept>``
        when the job wrote no result (:data:`NO_RESULT`) or its text says the disk is full (ENOSPC, EDQUOT), and a
        place has less free space than ``planned_bytes`` (the place with the least, when the text says the disk is
        full but every place has room again: a failed save's partial files are removed). None otherwise.
    """
    said_full = bool(_NO_SPACE.search(failure))
    if not (said_full or NO_RESULT in failure):
        return None
    free = [(what, path, free_bytes(path, statvfs)) for what, path in places]
    free = [(what, path, n) for what, path, n in free if n is not None]
    short = [f for f in free if f[2] < planned_bytes]
    if not short and not (said_full and free):
        return None
    what, path, n = min(short or free, key=lambda f: f[2])
    said = " (the job's error says the disk is full)" if said_full else ""
    need = (f"less than the {size_text(planned_bytes)} one checkpoint of this run needs" if n < planned_bytes else
            f"one checkpoint of this run needs {size_text(planned_bytes)}")
    return (f"out of space{said}: {what} {path} has {size_text(n)} free, {need} (the memory plan's checkpoint_bytes); "
            f"{kept}. Fix: free space there (or point results_dir at a larger file system) and run the same command "
            f"again: the training resumes from its newest complete checkpoint")
