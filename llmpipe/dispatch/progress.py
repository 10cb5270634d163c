"""Progress of a running job on the console: the job writes a small record, the step that waits prints it.

Contract: the step that submits a job sets :data:`ENV` (the record's path, beside the job's submitit folder) in the
environment the job inherits (:mod:`llmpipe.dispatch.jobs`). The job's first task calls :func:`update` with what is done
of what total (training: batches; evaluation: items; conversion: tensors) and display-ready figures; the record is
rewritten atomically, at most every :data:`MIN_WRITE_S` seconds. While the step waits, :class:`ProgressEcho` reads
the record every ``dispatch.progress_s`` seconds and prints one console line when it changed:
``[llmpipe HH:MM:SS] <step>: <unit> <done>/<total> (<percent>%), <figures>, ETA <time>``.

ETA: the record's own ``eta_s`` when the job gives one (training: remaining batches x the mean clean batch time,
:mod:`llmpipe.train.throughput`), else the remaining count at the mean rate since the job's first record of the same
part, else at the rate since the part began (the record's ``since``, e.g. an evaluator's start): so a part shorter
than ``dispatch.progress_s`` still gets an ETA once one item of it is done.

Short steps: until the echo has printed its first line it looks every :data:`FIRST_LOOK_S` seconds (at most
``dispatch.progress_s``), so a job shorter than ``dispatch.progress_s`` still prints a line once its record exists.
"""

from __future__ import annotations

import json
import os
import sys
import time

#: The environment variable that names a job's progress record.
ENV = "LLMPIPE_PROGRESS_FILE"

#: Least seconds between two writes of the record by one process.
MIN_WRITE_S = 2.0

#: Seconds between looks at the record until the first line is printed (then ``dispatch.progress_s``).
FIRST_LOOK_S = 5.0

_last_write = {"t": 0.0}


def record_path(log_dir: str) -> str:
    """Where a step's job writes its progress record: ``<log_dir>/progress.json`` as an absolute path (jobs work in
    other folders; ``log_dir``: the step's submitit folder, one per step)."""
    return os.path.join(os.path.abspath(log_dir), "progress.json")


def update(done: int, total: int | None, unit: str, *, eta_s: float | None = None, task: str | None = None,
           figures: dict[str, str] | None = None, force: bool = False, since: float | None = None) -> bool:
    """Write this job's progress record (when :data:`ENV` names one): ``done`` of ``total`` ``unit`` (e.g. 40 of 120
    ``batch``), the part being worked on (``task``, e.g. an evaluation task's name), display-ready ``figures``
    (``{"loss": "2.3104", "tokens/s": "1,234"}``), ``eta_s`` (seconds; None: the reader estimates it) and
    ``since`` (``time.time()`` when this part's count began at 0: the reader's rate when it saw no earlier record of
    the part). Writes at
    most every :data:`MIN_WRITE_S` seconds unless ``force`` (the last update of a part). Returns whether it wrote.
    Never raises: progress must not fail a job."""
    path = os.environ.get(ENV)
    now = time.time()
    if not path or (not force and now - _last_write["t"] < MIN_WRITE_S):
        return False
    rec = {"done": int(done), "total": None if total is None else int(total), "unit": unit, "task": task,
           "eta_s": None if eta_s is None else round(float(eta_s), 1), "figures": dict(figures or {}),
           "time": round(now, 3), "pid": os.getpid(), "since": None if since is None else round(float(since), 3)}
    try:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            json.dump(rec, fh)
        os.replace(tmp, path)
    except OSError:
        return False
    _last_write["t"] = now
    return True


def read(path: str) -> dict | None:
    """The progress record at ``path``, or None when there is none yet (or it is unreadable)."""
    try:
        with open(path) as fh:
            rec = json.load(fh)
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and "done" in rec else None


def format_duration(seconds: float | None) -> str:
    """``1h02m``, ``3m20s`` or ``45s`` for a duration in seconds; ``?`` when unknown."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def line(rec: dict, first: dict | None = None) -> str:
    """The console text of record ``rec``; ``first`` (the job's first record seen of this part) gives the rate for
    an ETA the record does not carry, else the record's own ``since`` (the part's start) does."""
    done, total = int(rec["done"]), rec.get("total")
    parts = [f"{rec.get('task')}: " if rec.get("task") else ""]
    if total:
        parts.append(f"{rec.get('unit', '')} {done:,}/{int(total):,} ({100 * done / int(total):.0f}%)")
    else:
        parts.append(f"{rec.get('unit', '')} {done:,}")
    figures = [f"{k} {v}" for k, v in (rec.get("figures") or {}).items()]
    eta = 0.0 if total and done >= int(total) else rec.get("eta_s")
    if eta is None and total and first is not None and rec.get("pid") == first.get("pid"):
        span, gained = float(rec["time"]) - float(first["time"]), done - int(first["done"])
        if span > 0 and gained > 0:
            eta = (int(total) - done) * span / gained
    if eta is None and total and done > 0 and rec.get("since") is not None:
        span = float(rec["time"]) - float(rec["since"])
        if span > 0:
            eta = (int(total) - done) * span / done
    tail = ", ".join([*figures, f"ETA {format_duration(eta)}"] if total else figures)
    return "".join(parts) + (f", {tail}" if tail else "")


class ProgressEcho:
    """Print a job's progress record (:func:`update`) on the console while its step waits.

    Args:
        path: the record's path (:func:`record_path`); None echoes nothing.
        what: the step's name, the line's prefix.
        every_s: least seconds between two looks (``dispatch.progress_s``); :data:`FIRST_LOOK_S` until the first
            line is printed, when that is shorter.
    """

    def __init__(self, path: str | None, what: str, every_s: float = 30.0):
        self.path, self.what, self.every_s = path, what, float(every_s)
        self.last_time, self.last_seen, self.first = 0.0, None, None

    def poll(self, now: float | None = None) -> str | None:
        """Print and return the line of the record when it changed since the last one printed and ``every_s`` has
        passed since the last look; None otherwise."""
        now = time.time() if now is None else now
        every = self.every_s if self.last_seen is not None else min(self.every_s, FIRST_LOOK_S)
        if self.path is None or now - self.last_time < every:
            return None
        self.last_time = now
        rec = read(self.path)
        if rec is None or rec == self.last_seen:
            return None
        if (self.first is None or rec.get("pid") != self.first.get("pid") or rec["done"] < self.first["done"]
                or rec.get("task") != self.first.get("task")):
            self.first = rec   # a new job, allocation or part: its own rate
        self.last_seen = rec
        text = f"[llmpipe {time.strftime('%H:%M:%S')}] {self.what}: {line(rec, self.first)}"
        print(text, file=sys.stderr, flush=True)
        return text

