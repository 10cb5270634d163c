"""The test suite in a few lines, from the log of ``pytest -v`` (with or without pytest-xdist), for the end of
``make test``: CI shows only the last lines of its output, which come after the second lock's checks.

Prints the suite's summary line (or that it has none: the suite was stopped), every FAILED/ERROR line, the tests
that had started and never reported (what ran when the suite was stopped), crashed xdist workers, and the slowest
tests of ``--durations``. Usage: ``python tests/helpers/suite_digest.py LOG [RC] [--write-seconds JSON]``.

``--write-seconds`` writes the test seconds of every file (:func:`file_seconds`) to ``JSON``, the basis from which
``tests/conftest.py`` hands out the longest test files first (``tests/file-seconds.json``).
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict

#: pytest-xdist -v: "tests/x.py::test_y " when a worker starts a test, "[gw0] [ 12%] PASSED tests/x.py::test_y"
#: when it reports; without xdist: "tests/x.py::test_y PASSED [ 12%]".
STARTED = re.compile(r"^(tests/\S+::\S+) ?$")
REPORTED = re.compile(r"^(?:\[gw\d+\] \[\s*\d+%\] (?:PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (tests/\S+)"
                      r"|(tests/\S+::\S+) (?:PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS))")
SUMMARY = re.compile(r"^=+ .*\b(passed|failed|error|errors|no tests ran)\b.* in [\d.]+s.* =+$")
DURATION = re.compile(r"^([\d.]+)s (call|setup|teardown)\s+(\S+)")


def file_seconds(text: str) -> dict[str, float]:
    """Seconds of setup, call and teardown of every test file in the ``--durations`` lines of the pytest log ``text``,
    longest first (rounded to 0.1 s). With ``--durations=0`` pytest hides phases under 5 ms, so a file's sum is low by
    at most 5 ms per hidden phase; with ``--durations=N`` only the N slowest phases count."""
    seconds: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if m := DURATION.match(line):
            seconds[m.group(3).split("::", 1)[0]] += float(m.group(1))
    return {f: round(s, 1) for f, s in sorted(seconds.items(), key=lambda kv: (-kv[1], kv[0]))}


def digest(text: str, rc: str = "", slowest: int = 8) -> list[str]:
    """The digest's lines for the pytest log ``text`` (``rc``: pytest's exit status, shown when given)."""
    started: dict[str, None] = {}
    reported = set()
    failed, crashed, durations, summary = [], [], [], None
    in_run = True   # the run's own lines, before the sections pytest prints at the end (warnings, failures, ...)
    for line in text.splitlines():
        if line.startswith("=") and re.search(r"warnings summary|FAILURES|ERRORS|slowest|short test summary", line):
            in_run = False
        if in_run and (m := STARTED.match(line)):
            started[m.group(1)] = None
        elif m := REPORTED.match(line):
            reported.add(m.group(1) or m.group(2))
        if line.startswith(("FAILED ", "ERROR ")):
            failed.append(line[:300])
        elif "node down" in line or "replacing crashed worker" in line:
            crashed.append(line.strip())
        elif m := DURATION.match(line):
            durations.append(line.strip())
        elif SUMMARY.match(line):
            summary = line.strip("= ").strip()
    out = [f"suite: {summary or 'no summary line: the suite was stopped before it ended'}"
           f"{f' (pytest exit status {rc})' if rc else ''}"]
    out += failed[:30] + crashed[:10]
    unfinished = [t for t in started if t not in reported]
    if unfinished and not summary:
        out.append("started and never reported: " + ", ".join(unfinished[:10]))
    if durations:
        out.append(f"slowest {min(slowest, len(durations))}: " + "; ".join(durations[:slowest]))
    return out


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); returns the exit status."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", help="the pytest -v log")
    ap.add_argument("rc", nargs="?", default="", help="pytest's exit status")
    ap.add_argument("--write-seconds", metavar="JSON", help="write every test file's seconds to JSON")
    args = ap.parse_args(argv)
    with open(args.log, errors="replace") as fh:
        text = fh.read()
    print("\n".join(digest(text, args.rc)))
    if args.write_seconds:
        with open(args.write_seconds, "w") as fh:
            json.dump(file_seconds(text), fh, indent=1)
            fh.write("\n")
        print(f"test seconds by file: {args.write_seconds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
