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


def test_file_seconds_sum_every_phase_of_a_file_longest_first():
    from tests.helpers.suite_digest import file_seconds

    log = ENDED.replace("2.00s setup    tests/test_a.py::test_one",
                        "2.00s setup    tests/test_a.py::test_one\n1.25s call     tests/test_a.py::test_two\n"
                        "0.50s teardown tests/test_c.py::test_warned")
    assert list(file_seconds(log).items()) == [("tests/test_b.py", 300.5), ("tests/test_a.py", 3.2),
                                               ("tests/test_c.py", 0.5)]


def test_units_are_handed_out_slurm_first_then_unmeasured_then_longest(monkeypatch):
    import tests.conftest as conftest

    monkeypatch.setattr(conftest, "_file_seconds", lambda: {"tests/test_short.py": 3.0, "tests/test_long.py": 90.0,
                                                             "tests/test_slurm_pipeline.py": 600.0})
    monkeypatch.setattr(conftest, "xdist_unit", lambda nodeid: conftest.SLURM_UNIT if "slurm" in nodeid else nodeid)
    nodeids = ["tests/test_short.py::test_a", "tests/test_long.py::test_b", "tests/test_new.py::test_c",
               "tests/test_short.py::test_d", "tests/test_slurm_pipeline.py::test_e"]
    assert sorted(nodeids, key=conftest.unit_order) == [
        "tests/test_slurm_pipeline.py::test_e", "tests/test_new.py::test_c", "tests/test_long.py::test_b",
        "tests/test_short.py::test_a", "tests/test_short.py::test_d"]


def test_the_committed_basis_names_existing_test_files():
    import tests.conftest as conftest

    seconds = conftest._file_seconds()
    assert seconds, f"{conftest.FILE_SECONDS} is missing or empty"
    missing = [f for f in seconds if not (conftest.REPO / f).is_file()]
    assert not missing, f"{conftest.FILE_SECONDS} names removed files {missing}: rewrite it (docs/testing.md)"
