"""The training's batch lines reach the console while the step waits (llmpipe.progress)."""

from __future__ import annotations

from types import SimpleNamespace

from llmpipe.progress import ProgressEcho


def _job(path):
    return SimpleNamespace(paths=SimpleNamespace(stdout=path))


def test_newest_batch_line_is_echoed_at_most_every_interval(tmp_path, capsys):
    log = tmp_path / "0_log.out"
    echo = ProgressEcho(_job(log), "train mpt-tiny", every_s=30)
    assert echo.poll(now=100.0) is None                      # no log yet
    log.write_text("config ...\nllmpipe: batch 5/120  loss 7.1  ETA 0:01:00\nllmpipe: batch 10/120  loss 6.9  ETA "
                   "0:00:55\nllmpipe: batch 15/1")             # the last line is not complete yet
    line = echo.poll(now=130.0)
    assert line.endswith("train mpt-tiny: batch 10/120  loss 6.9  ETA 0:00:55")
    assert "batch 10/120" in capsys.readouterr().err
    with open(log, "a") as fh:
        fh.write("20  loss 6.5  ETA 0:00:50\n")
    assert echo.poll(now=140.0) is None                      # within the interval
    assert echo.poll(now=170.0).endswith("batch 15/120  loss 6.5  ETA 0:00:50")
    assert echo.poll(now=300.0) is None                      # nothing new


def test_a_job_without_log_paths_echoes_nothing():
    assert ProgressEcho(SimpleNamespace(), "x", every_s=0).poll(now=1.0) is None
