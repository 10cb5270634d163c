"""Per-batch timing of a training job: the live step log and the steady-state throughput of ``train.json``.

The whole-run figures of ``train.json`` (``tokens_per_s``, ``mfu``) divide the tokens this job trained by the time
from ``fit_start`` to the end, so they include start-up (compile, the first batches), evaluation and checkpoint
saves. The steady-state figures (``steady_tokens_per_s``, ``steady_mfu``, ``steady_window``) use only the
*clean* intervals after warm-up:

* an interval is the wall time from one batch's end to the next batch's end (composer's order per batch: data
  loading, forward/backward/optimizer step, ``BATCH_END``, evaluation if due, checkpoint save if due), so it holds
  the data loading and the step of one batch;
* an interval is dropped when an evaluation ran or a checkpoint was saved in it (:meth:`StepTimer.exclude`);
* the first :func:`warmup_batches` batches of the job are dropped (compile, allocator and data-loader warm-up).

steady tokens/s = sum of the kept intervals' tokens / sum of their seconds (all ranks: tokens are global);
steady MFU = steady tokens/s per device x FLOPs per token / peak FLOP/s per device (:func:`llmpipe.model.mfu.mfu`).

Pure Python: the composer callback (:class:`llmpipe.train.pretrain.RunMonitor`) feeds it timestamps, through :func:`start`
and :func:`batch_end`; the training-throughput benchmark (``tools/bench_train_throughput.py``, its ``steady_*``
columns) feeds it the same way, so both report this one definition.
"""
from __future__ import annotations

import time

from llmpipe.config.settings import RunSettings
from llmpipe.dispatch import progress

WARMUP_FRACTION = 0.1
WARMUP_MIN, WARMUP_MAX = 2, 50


def warmup_batches(batches_planned: int) -> int:
    """Batches at the start of a job left out of the steady window: 10 % of the batches this job plans to train,
    at least 2 and at most 50 (never all of them: at most ``batches_planned - 1``; 0 for one batch or none)."""
    n = min(WARMUP_MAX, max(WARMUP_MIN, int(batches_planned * WARMUP_FRACTION)))
    return max(0, min(n, batches_planned - 1))


def format_eta(seconds: float | None) -> str:
    """``H:MM:SS`` (``?`` when unknown)."""
    if seconds is None or seconds < 0:
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class StepTimer:
    """Collects one (batch, tokens, seconds, clean) entry per trained batch of this job.

    Args:
        total_batches: the training's last batch (``max_duration``), or None when not counted in batches.
        start_batch: the batch the job starts from (a resumed job: its checkpoint's batch).
        flops_per_token: model FLOPs per token (:func:`llmpipe.model.mfu.flops_per_token`), or None.
        peak_flops: peak FLOP/s of one device, or None (CPU, unknown GPU): MFU is then None.
        world_size: devices (ranks) training together.
        clock: a function returning seconds (tests pass a fake clock).
    """

    def __init__(self, total_batches: int | None, start_batch: int, *, flops_per_token: float | None = None,
                 peak_flops: float | None = None, world_size: int = 1, clock=time.time):
        self.total_batches = total_batches
        self.start_batch = int(start_batch)
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.world_size = max(1, int(world_size))
        self.clock = clock
        self.entries: list[tuple[int, int, float, bool]] = []  # (batch, tokens in interval, seconds, clean)
        self._t_last = clock()
        self._tokens_last: int | None = None
        self._dirty = False
        self._printed_at = 0  # index into entries of the last progress line
        self.last: dict = {}  # the figures of the last progress line, for the tracking loggers
        self.last_figures: dict[str, str] = {}  # the same, display-ready, for the progress record
        self.last_position: tuple = (start_batch, total_batches, None)  # (batch, total, ETA s) of that line

    def exclude(self) -> None:
        """Mark the current interval as not steady (an evaluation or a checkpoint save ran in it)."""
        self._dirty = True

    def batch_end(self, batch: int, tokens_total: int) -> None:
        """Close the interval ending at this batch; ``tokens_total``: the training's token count after it."""
        now = self.clock()
        tokens = tokens_total - self._tokens_last if self._tokens_last is not None else None
        if tokens is None:  # the job's first batch: its tokens are the count since the start
            tokens = tokens_total
        self.entries.append((int(batch), int(tokens), now - self._t_last, not self._dirty))
        self._t_last, self._tokens_last, self._dirty = now, int(tokens_total), False

    def set_start_tokens(self, tokens: int) -> None:
        """Tokens already trained when the job started (a resumed job), so the first interval counts only its own."""
        self._tokens_last = int(tokens)

    def _mfu(self, tps: float | None) -> float | None:
        from llmpipe.model.mfu import mfu
        if not tps or not self.flops_per_token or not self.peak_flops:
            return None
        return mfu(tps / self.world_size, self.flops_per_token, self.peak_flops)

    def steady(self) -> dict:
        """The steady-state record for ``train.json`` (module docstring): ``steady_tokens_per_s``,
        ``steady_tokens_per_s_per_device``, ``steady_mfu`` (None when no clean interval is left) and
        ``steady_window`` {first_batch, last_batch, batches, seconds, tokens, warmup_batches, excluded_batches}."""
        planned = (self.total_batches - self.start_batch) if self.total_batches else len(self.entries)
        warm = warmup_batches(planned)
        window = self.entries[warm:]
        kept = [e for e in window if e[3] and e[2] > 0]
        seconds = sum(e[2] for e in kept)
        tokens = sum(e[1] for e in kept)
        tps = tokens / seconds if seconds > 0 else None
        m = self._mfu(tps)
        return {
            "steady_tokens_per_s": round(tps, 1) if tps else None,
            "steady_tokens_per_s_per_device": round(tps / self.world_size, 1) if tps else None,
            "steady_mfu": round(m, 4) if m is not None else None,
            "steady_window": {
                "first_batch": kept[0][0] if kept else None, "last_batch": kept[-1][0] if kept else None,
                "batches": len(kept), "seconds": round(seconds, 3), "tokens": tokens,
                "warmup_batches": warm, "excluded_batches": len(window) - len(kept)},
        }

    def progress(self, loss: float | None, memory_gib: float | None) -> str:
        """One step-log line: batch/total, loss, tokens/s and MFU over the clean intervals since the previous line
        (all intervals when none is clean), peak memory and the ETA (remaining batches x mean clean interval)."""
        recent = self.entries[self._printed_at:]
        self._printed_at = len(self.entries)
        clean = [e for e in recent if e[3] and e[2] > 0] or [e for e in recent if e[2] > 0]
        seconds = sum(e[2] for e in clean)
        tps = sum(e[1] for e in clean) / seconds if seconds > 0 else None
        batch = self.entries[-1][0] if self.entries else self.start_batch
        eta = None
        if self.total_batches and clean:
            eta = (self.total_batches - batch) * seconds / len(clean)
        m = self._mfu(tps)
        self.last = {"llmpipe/tokens_per_s": tps, "llmpipe/mfu": m, "llmpipe/memory_gib": memory_gib,
                     "llmpipe/eta_s": eta}
        self.last_figures = {"loss": f"{loss:.4f}" if loss is not None else "?",
                             "tokens/s": f"{tps:,.0f}" if tps else "?",
                             "MFU": f"{100 * m:.1f}%" if m is not None else "-"}
        self.last_position = (batch, self.total_batches, eta)
        parts = [f"batch {batch}/{self.total_batches or '?'}",
                 f"loss {loss:.4f}" if loss is not None else "loss ?",
                 f"tokens/s {tps:,.0f}" if tps else "tokens/s ?",
                 f"MFU {100 * m:.2f}%" if m is not None else "MFU -",
                 f"mem {memory_gib:.2f} GiB" if memory_gib is not None else "mem ?",
                 f"ETA {format_eta(eta)}"]
        return "llmpipe: " + "  ".join(parts)


def start(state, *, clock=None, **timer_args) -> StepTimer:
    """The :class:`StepTimer` of a composer training at its ``FIT_START`` (``state``: composer's ``State``): the
    last batch from ``max_duration`` (:func:`total_batches`), the batch and token count it starts from (a resumed
    job: its checkpoint's). ``timer_args``: ``flops_per_token``, ``peak_flops``, ``world_size``
    (:func:`monitor_args`); ``clock``: seconds (default ``time.time``).

    The one way a training's steady state is timed: ``train.json`` (:class:`llmpipe.train.pretrain.RunMonitor`) and the
    throughput benchmark (``tools/bench_train_throughput.py``) both start here, close each batch with
    :func:`batch_end` and read :meth:`StepTimer.steady`."""
    timer = StepTimer(total_batches(state), int(state.timestamp.batch), clock=clock or time.time, **timer_args)
    timer.set_start_tokens(int(state.timestamp.token))
    return timer


def batch_end(timer: StepTimer, state) -> None:
    """Close the interval of the batch composer just trained (``BATCH_END``): its batch count and token total."""
    timer.batch_end(int(state.timestamp.batch), int(state.timestamp.token))


def report(timer: StepTimer, loss: float | None, logger, rank: int) -> None:
    """Print the step-log line on rank 0, write it as the job's progress record (:mod:`llmpipe.dispatch.progress`: batch/total,
    loss, tokens/s, MFU, ETA) and hand its figures (tokens/s, MFU, memory, ETA; those known) to composer's ``logger``
    (the tracking loggers, :mod:`llmpipe.train.tracking`; rank-0 loggers ignore other ranks)."""
    line = timer.progress(loss, memory_gib())
    if rank == 0:
        print(line, flush=True)
        batch, total, eta = timer.last_position
        progress.update(batch, total, "batch", eta_s=eta, figures=timer.last_figures)   # the step's console line
    logger.log_metrics({k: v for k, v in timer.last.items() if v is not None})


def peak_host_rss_gib() -> float:
    """This process's peak resident set size in GiB (``getrusage``'s ``ru_maxrss``, KiB on Linux)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def memory_gib() -> float | None:
    """Peak memory of this process: the GPU's allocated peak when CUDA is in use, else the host's peak RSS (GiB)."""
    import torch
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return peak_host_rss_gib()


def total_batches(state) -> int | None:
    """The training's last batch from a composer ``State`` whose ``max_duration`` is in batches, else None."""
    md = getattr(state, "max_duration", None)
    if md is None or getattr(md.unit, "name", "") != "BATCH":
        return None
    return int(md.value)


def monitor_args(settings: RunSettings, world_size: int, peak_flops_table: dict | None) -> dict:
    """The ``llmpipe_run_monitor`` callback's throughput arguments for a run's typed settings
    (:func:`llmpipe.config.runs.run_settings`): FLOPs per token (:func:`llmpipe.model.mfu.flops_per_token`), the device's peak
    FLOP/s (:func:`llmpipe.model.mfu.detect_peak_flops`, None on CPU) and the world size; the same inputs as
    ``train.json``'s whole-run MFU."""
    from llmpipe.model import mfu
    return {"flops_per_token": mfu.flops_per_token(settings.arch.as_dict(), settings.data.concat_tokens),
            "peak_flops": mfu.detect_peak_flops(settings.train.precision, peak_flops_table),
            "world_size": int(world_size)}


__all__ = ["StepTimer", "warmup_batches", "format_eta", "memory_gib", "total_batches", "monitor_args", "start",
           "batch_end"]
