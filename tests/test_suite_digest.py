"""The suite's digest at the end of ``make test`` (tests/helpers/suite_digest.py): what CI's tail shows."""

from __future__ import annotations

from tests.helpers.suite_digest import digest

STOPPED = """\
tests/test_a.py::test_one 
tests/test_b.py::test_hangs 
[gw0] [ 10%] PASSED tests/test_a.py::test_one 
tests/test_a.py::test_two 
[gw0] [ 20%] FAILED tests/test_a.py::test_two 
[gw1] node down: Not properly terminated
"""

ENDED = STOPPED + """\
=============================== warnings summary ===============================
tests/test_c.py::test_warned
  UserWarning: something
============================= slowest 40 durations =============================
300.50s call     tests/test_b.py::test_hangs
2.00s setup    tests/test_a.py::test_one
=========================== short test summary info ============================
FAILED tests/test_a.py::test_two - AssertionError: 1 == 2
============= 1 failed, 1 passed, 3 warnings in 310.00s (0:05:10) ==============
"""


def test_a_stopped_suite_names_the_tests_that_never_reported_and_the_crashed_worker():
    lines = digest(STOPPED, "124")
    assert lines[0] == "suite: no summary line: the suite was stopped before it ended (pytest exit status 124)"
    assert "started and never reported: tests/test_b.py::test_hangs" in lines, lines
    assert "[gw1] node down: Not properly terminated" in lines


def test_an_ended_suite_gives_its_summary_failures_and_slowest_tests():
    lines = digest(ENDED, "1", slowest=1)
    assert lines[0] == "suite: 1 failed, 1 passed, 3 warnings in 310.00s (0:05:10) (pytest exit status 1)"
    assert "FAILED tests/test_a.py::test_two - AssertionError: 1 == 2" in lines
    assert not any(line.startswith("started and never") for line in lines), lines   # the suite ended
    assert lines[-1] == "slowest 1: 300.50s call     tests/test_b.py::test_hangs"
