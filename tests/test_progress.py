"""A job's progress record reaches the console while its step waits (llmpipe.dispatch.progress)."""

from __future__ import annotations

import json

from llmpipe.dispatch import progress
from llmpipe.train import throughput
from llmpipe.dispatch.progress import ProgressEcho


def test_update_writes_the_record_named_by_the_environment_at_most_every_few_seconds(tmp_path, monkeypatch):
    path = tmp_path / "progress.json"
    monkeypatch.delenv(progress.ENV, raising=False)
    assert not progress.update(1, 10, "batch", force=True)            # no record asked for
    monkeypatch.setenv(progress.ENV, str(path))
    assert progress.update(5, 120, "batch", eta_s=61.26, figures={"loss": "7.1000"}, force=True)
    rec = json.loads(path.read_text())
    assert (rec["done"], rec["total"], rec["unit"], rec["eta_s"], rec["figures"]) == (5, 120, "batch", 61.3,
                                                                                     {"loss": "7.1000"})
    assert not progress.update(6, 120, "batch")                       # within MIN_WRITE_S of the last write
    assert json.loads(path.read_text())["done"] == 5
    monkeypatch.setenv(progress.ENV, str(tmp_path / "missing" / "progress.json"))
    assert not progress.update(7, 120, "batch", force=True)           # an unwritable record never fails a job


def test_the_echo_prints_a_changed_record_at_most_every_interval(tmp_path, capsys):
    path = tmp_path / "progress.json"
    echo = ProgressEcho(str(path), "train mpt-tiny", every_s=30)
    assert echo.poll(now=100.0) is None                              # no record yet
    path.write_text(json.dumps({"done": 10, "total": 120, "unit": "batch", "eta_s": 55, "time": 1.0, "pid": 7,
                                "figures": {"loss": "6.9000", "tokens/s": "1,234", "MFU": "-"}}))
    line = echo.poll(now=130.0)
    assert line.endswith("train mpt-tiny: batch 10/120 (8%), loss 6.9000, tokens/s 1,234, MFU -, ETA 55s"), line
    assert line in capsys.readouterr().err
    path.write_text(json.dumps({"done": 15, "total": 120, "unit": "batch", "eta_s": 3725, "time": 2.0, "pid": 7,
                                "figures": {"loss": "6.5000"}}))
    assert echo.poll(now=140.0) is None                              # within the interval
    assert echo.poll(now=170.0).endswith("batch 15/120 (12%), loss 6.5000, ETA 1h02m")   # the changed record
    assert echo.poll(now=300.0) is None                              # unchanged: nothing printed


def test_an_eta_the_record_lacks_comes_from_the_rate_since_the_first_record(tmp_path):
    path = tmp_path / "progress.json"
    echo = ProgressEcho(str(path), "eval mpt-tiny", every_s=0)
    path.write_text(json.dumps({"done": 100, "total": 1000, "unit": "item", "task": "arc_easy", "time": 10.0,
                                "pid": 3}))
    assert echo.poll(now=1.0).endswith("eval mpt-tiny: arc_easy: item 100/1,000 (10%), ETA ?")
    path.write_text(json.dumps({"done": 300, "total": 1000, "unit": "item", "task": "arc_easy", "time": 30.0,
                                "pid": 3}))
    assert echo.poll(now=2.0).endswith("item 300/1,000 (30%), ETA 1m10s")   # 200 items in 20 s, 700 to go
    path.write_text(json.dumps({"done": 1000, "total": 1000, "unit": "item", "task": "arc_easy", "time": 40.0,
                                "pid": 3}))
    assert echo.poll(now=3.0).endswith("item 1,000/1,000 (100%), ETA 0s")


def test_no_record_path_echoes_nothing():
    assert ProgressEcho(None, "x", every_s=0).poll(now=1.0) is None


def test_the_training_step_log_line_is_also_the_progress_record(tmp_path, monkeypatch):
    path = tmp_path / "progress.json"
    monkeypatch.setenv(progress.ENV, str(path))
    monkeypatch.setitem(progress._last_write, "t", 0.0)
    clock = iter(float(t) for t in range(100))
    timer = throughput.StepTimer(120, 0, clock=lambda: next(clock))
    for b in range(1, 21):
        timer.batch_end(b, 1000 * b)
    logger = type("L", (), {"log_metrics": lambda self, m: None})()
    throughput.report(timer, 2.5, logger, rank=0)
    rec = json.loads(path.read_text())
    assert (rec["done"], rec["total"], rec["unit"], rec["figures"]["loss"]) == (20, 120, "batch", "2.5000"), rec
    assert rec["eta_s"] == timer.last["llmpipe/eta_s"] and rec["eta_s"] > 0


def test_a_step_shorter_than_the_interval_prints_a_line(tmp_path):
    """A 29 s evaluation with dispatch.progress_s 30: the first look finds no record yet, and the echo looks again
    every FIRST_LOOK_S seconds until it has printed a line (then every progress_s)."""
    path = tmp_path / "progress.json"
    echo = ProgressEcho(str(path), "eval mpt-tiny", every_s=30)
    assert echo.poll(now=100.0) is None                              # the job is still loading its model
    path.write_text(json.dumps({"done": 40, "total": 200, "unit": "item", "task": "arc", "time": 10.0, "pid": 3}))
    assert echo.poll(now=100.0 + progress.FIRST_LOOK_S - 1) is None  # not before FIRST_LOOK_S
    assert echo.poll(now=100.0 + progress.FIRST_LOOK_S).endswith("arc: item 40/200 (20%), ETA ?")
    path.write_text(json.dumps({"done": 80, "total": 200, "unit": "item", "task": "arc", "time": 12.0, "pid": 3}))
    assert echo.poll(now=100.0 + 2 * progress.FIRST_LOOK_S) is None   # a line printed: back to every 30 s


def test_an_eta_comes_from_the_parts_own_start_once_an_item_is_done(tmp_path, monkeypatch):
    """Each evaluator counts from 0: a record of a new part with one item done carries the part's start (``since``),
    so its line has an ETA even when the echo saw no earlier record of that part."""
    path = tmp_path / "progress.json"
    monkeypatch.setenv(progress.ENV, str(path))
    assert progress.update(0, 100, "item", task="b", force=True, since=1000.0)
    rec = json.loads(path.read_text())
    assert progress.line({**rec, "time": 1004.0}) == "b: item 0/100 (0%), ETA ?"          # no item done: no rate
    rec = {**rec, "done": 20, "time": 1010.0}
    assert progress.line(rec) == "b: item 20/100 (20%), ETA 40s"                         # 20 items in 10 s
    echo = ProgressEcho(str(path), "eval r", every_s=0)
    path.write_text(json.dumps({"done": 90, "total": 100, "unit": "item", "task": "a", "time": 999.0, "pid": 3}))
    echo.poll(now=1.0)
    path.write_text(json.dumps({**rec, "pid": 3}))                   # the next evaluator, further along than "a" was not
    assert echo.poll(now=2.0).endswith("b: item 20/100 (20%), ETA 40s")
