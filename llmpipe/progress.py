"""Training progress on the console while a step waits for its job.

The training's per-batch line (``llmpipe: batch 15/120  loss ...  ETA ...``, written by the job's rank 0 into its
stdout log) otherwise reaches only that log file, and the console shows ``job N is RUNNING`` until the step ends.
:class:`ProgressEcho` reads what rank 0's log gained since the last look, at most every ``every_s`` seconds, and
prints the newest such line as ``[llmpipe HH:MM:SS] <step>: batch ...`` on stderr (the console, not the rule log,
which keeps the submission and state lines).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

#: The prefix of the training's progress lines (llmpipe.train's monitor).
PREFIX = "llmpipe: batch "


class ProgressEcho:
    """Echo the newest progress line of ``job``'s first task (its stdout log) every ``every_s`` seconds."""

    def __init__(self, job: Any, what: str, every_s: float = 30.0):
        self.what, self.every_s = what, float(every_s)
        task = (getattr(job, "_sub_jobs", None) or [job])[0]
        try:
            self.path = str(task.paths.stdout)
        except Exception:  # noqa: BLE001 - a job without log paths (debug executor) echoes nothing
            self.path = None
        self.offset, self.last_time, self.last_line = 0, 0.0, None

    def poll(self, now: float | None = None) -> str | None:
        """Print and return the newest progress line written since the last poll, if ``every_s`` has passed."""
        now = time.time() if now is None else now
        if self.path is None or now - self.last_time < self.every_s or not os.path.exists(self.path):
            return None
        self.last_time = now
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            chunk = fh.read()
        cut = chunk.rfind(b"\n") + 1          # whole lines only; the rest is read next time
        self.offset += cut
        lines = [ln for ln in chunk[:cut].decode(errors="replace").splitlines() if ln.startswith(PREFIX)]
        if not lines or lines[-1] == self.last_line:
            return None
        self.last_line = lines[-1]
        text = f"[llmpipe {time.strftime('%H:%M:%S')}] {self.what}: {lines[-1][len('llmpipe: '):].strip()}"
        print(text, file=sys.stderr, flush=True)
        return text
