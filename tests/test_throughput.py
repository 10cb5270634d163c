"""Steady-state throughput and the live step log (llmpipe/train/throughput.py, fed by RunMonitor in llmpipe/train/pretrain.py)."""
from __future__ import annotations

import shutil
import signal
import time
import types
from pathlib import Path

import pytest

from llmpipe.train.throughput import StepTimer, format_eta, warmup_batches
from tests.conftest import load_tool

REPO = Path(__file__).resolve().parent.parent


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def run_batches(timer: StepTimer, clock: FakeClock, seconds: list[float], tokens_per_batch: int, start: int = 0,
                dirty: tuple[int, ...] = ()):
    for i, s in enumerate(seconds, start=start + 1):
        if i in dirty:
            timer.exclude()
        clock.t += s
        timer.batch_end(i, i * tokens_per_batch)


def test_warmup_is_a_tenth_within_bounds():
    assert warmup_batches(120) == 12 and warmup_batches(10) == 2 and warmup_batches(10_000) == 50
    assert warmup_batches(1) == 0 and warmup_batches(2) == 1 and warmup_batches(0) == 0


def test_steady_window_drops_warmup_evaluation_and_save_intervals():
    clock = FakeClock()
    timer = StepTimer(40, 0, flops_per_token=6e6, peak_flops=1e12, world_size=2, clock=clock)
    # 4 slow warm-up batches (compile), then 1 s per batch, with an evaluation (30 s) and a save (20 s) in between
    secs = [50.0, 5.0, 5.0, 5.0] + [1.0] * 36
    secs[19], secs[29] = 31.0, 21.0          # batches 20 and 30 carry the evaluation and the save
    run_batches(timer, clock, secs, 1000, dirty=(20, 30))
    got = timer.steady()
    w = got["steady_window"]
    assert w["warmup_batches"] == 4                          # 10 % of 40, at least 2
    assert w["batches"] == 34 and w["excluded_batches"] == 2  # 36 after warm-up, minus the two interrupted ones
    assert w["seconds"] == 34.0 and w["tokens"] == 34_000 and w["first_batch"] == 5 and w["last_batch"] == 40
    assert got["steady_tokens_per_s"] == 1000.0 and got["steady_tokens_per_s_per_device"] == 500.0
    assert got["steady_mfu"] == pytest.approx(500 * 6e6 / 1e12, abs=1e-4)
    # the whole-run rate over the same batches is far lower: start-up, evaluation and save dominate
    assert 40_000 / sum(secs) < got["steady_tokens_per_s"] / 2


def test_resumed_job_counts_only_its_own_tokens():
    clock = FakeClock()
    timer = StepTimer(100, 80, clock=clock)
    timer.set_start_tokens(80 * 512)
    run_batches(timer, clock, [2.0] * 20, 512, start=80)
    got = timer.steady()
    assert got["steady_window"]["warmup_batches"] == 2          # 10 % of the 20 batches this job trains, at least 2
    assert got["steady_window"]["tokens"] == 18 * 512 and got["steady_tokens_per_s"] == 256.0
    assert got["steady_mfu"] is None                            # no peak FLOP/s (CPU)


def test_no_clean_interval_gives_none():
    clock = FakeClock()
    timer = StepTimer(1, 0, clock=clock)
    run_batches(timer, clock, [3.0], 100, dirty=(1,))
    got = timer.steady()
    assert got["steady_tokens_per_s"] is None and got["steady_window"]["batches"] == 0


def test_progress_line_has_batch_loss_rate_mfu_memory_and_eta():
    clock = FakeClock()
    timer = StepTimer(100, 0, flops_per_token=1e9, peak_flops=1e15, clock=clock)
    run_batches(timer, clock, [0.5] * 10, 2048)
    line = timer.progress(6.25, 3.5)
    assert line == "llmpipe: batch 10/100  loss 6.2500  tokens/s 4,096  MFU 0.41%  mem 3.50 GiB  ETA 0:00:45"
    # the rate covers the batches since the previous line only, skipping an evaluation's interval
    run_batches(timer, clock, [1.0] * 4 + [60.0], 2048, start=10, dirty=(15,))
    assert "batch 15/100" in (line := timer.progress(None, None)) and "tokens/s 2,048" in line
    assert "ETA 0:01:25" in line and "loss ?" in line and "mem ?" in line
    assert format_eta(3725) == "1:02:05" and format_eta(None) == "?"


# ------------------------------------------------------------------- the benchmark's steady state is train.json's

def _bench():
    return load_tool("bench_train_throughput")


def _state(batch: int, max_batches: int, per_batch: int):
    """The parts of composer's State that the two callbacks read at a batch end."""
    import torch
    unit = types.SimpleNamespace(name="BATCH")
    return types.SimpleNamespace(
        timestamp=types.SimpleNamespace(batch=batch, token=batch * per_batch),
        max_duration=types.SimpleNamespace(unit=unit, value=max_batches),
        batch={"input_ids": torch.zeros(per_batch // 8, 8, dtype=torch.long)}, model=None, loss=5.0, callbacks=[])


def test_benchmark_and_train_json_report_the_same_steady_state(monkeypatch, tmp_path):
    """One batch-timing log (a slow compile, a slow batch, then 1 s per batch) fed to the benchmark's timer callback
    (tools/bench_train_throughput.py) and to the training step's RunMonitor (whose StepTimer.steady() is train.json's
    steady state): the same window and figures, and the benchmark's CSV columns carry them."""
    from llmpipe.train import pretrain as train

    clock = FakeClock()
    monkeypatch.setattr(time, "time", clock)   # RunMonitor times with time.time, the benchmark with its clock
    signal.signal(signal.SIGUSR2, previous := signal.getsignal(signal.SIGUSR2))
    n, per_batch, fpt, peak = 30, 4096, 6e6, 1e12
    secs = [40.0, 3.0] + [1.0] * 9 + [2.0] + [1.0] * 18
    bench = _bench()
    bench_timer = bench._make_timer(fpt, peak, clock=clock)
    monitor = train._build_monitor_class()(log_interval=10, flops_per_token=fpt, peak_flops=peak, world_size=1)
    logger = types.SimpleNamespace(log_metrics=lambda metrics: None)   # composer's Logger: nothing is tracked here
    try:
        for cb in (bench_timer, monitor):
            cb.fit_start(_state(0, n, per_batch), logger)
        for b, s in enumerate(secs, start=1):
            clock.t += s
            for cb in (bench_timer, monitor):
                cb.batch_end(_state(b, n, per_batch), logger)
    finally:
        signal.signal(signal.SIGUSR2, previous)   # RunMonitor.fit_start defers Slurm's signal; put it back
    ours, theirs = bench_timer.steady.steady(), monitor.timer.steady()
    assert ours == theirs
    w = theirs["steady_window"]
    assert w["warmup_batches"] == 3 and (w["first_batch"], w["last_batch"], w["batches"]) == (4, 30, 27)
    assert theirs["steady_tokens_per_s"] == round(27 * per_batch / 28.0, 1)          # batch 12 took 2 s
    assert theirs["steady_mfu"] == pytest.approx(27 * per_batch / 28.0 * fpt / peak, abs=1e-4)
    assert bench.steady_columns(ours) == {
        "steady_tokens_per_s": theirs["steady_tokens_per_s"], "steady_mfu": theirs["steady_mfu"],
        "steady_first_batch": 4, "steady_last_batch": 30, "steady_batches": 27}
    assert bench_timer.times[-1] - bench_timer.times[9] == sum(secs[10:])    # the --skip 10 window, as before


def test_benchmark_csv_gains_the_steady_columns_keeping_old_rows(tmp_path):
    """--append to the committed CSV (written before the steady_* columns): its header gains them at the end, and
    every old row keeps its values (its line is unchanged up to the new empty columns)."""
    bench = _bench()
    path = tmp_path / "train-throughput.csv"
    shutil.copy(REPO / "benchmarks" / "train-throughput.csv", path)
    old = path.read_text().splitlines()
    fields = bench.csv_fields(str(path), append=True)
    new = path.read_text().splitlines()
    added = [c for c in fields if c not in old[0].split(",")]
    assert {"steady_tokens_per_s", "steady_mfu", "steady_batches"} <= set(added)
    assert new[0] == old[0] + "," + ",".join(added) and len(new) == len(old)
    assert all(b == a + "," * len(added) for a, b in zip(old[1:], new[1:]))
    assert bench.csv_fields(str(path), append=True) == fields and path.read_text().splitlines() == new   # once
    assert bench.csv_fields(str(tmp_path / "new.csv"), append=True) == bench.CSV_FIELDS
