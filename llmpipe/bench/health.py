"""GPU health check of the all-reduce gate: a short matmul on every GPU and an all-reduce across the allocation,
one line per GPU, and the rule that names slow GPUs by host.

:class:`HealthTask` runs in every task of a ``nodes x tasks_per_node`` job (one task per GPU), like the bandwidth
bench (:class:`llmpipe.bench.allreduce_bw.AllReduceTask`). Each rank:

* times ``iters`` back-to-back ``n x n @ n x n`` matmuls (``matmul_dtype``, bf16 by default) after ``warmup``
  untimed ones and reports ``tflops = 2 n^3 iters / time / 1e12`` (a square matmul's multiply-adds counted as
  two FLOPs each); every rank computes alone (a barrier before and after), so a slow GPU shows in its own figure;
* then takes part in ``iters`` in-place all-reduces of ``size_bytes`` (float32) and reports its own time and the
  bus bandwidth nccl-tests defines (:func:`llmpipe.bench.allreduce_bw.bandwidths`). The all-reduce is collective: every rank
  waits for the slowest, so a slow link lowers every rank's figure; the absolute floor (``allreduce.gate
  .min_busbw_gbps``) catches that, the fraction of the median catches ranks whose own timing lags the others.

Rank 0 gathers the lines (rank, node, host, device, figures); :func:`judge` marks the slow ones.

Test hook: ``LLMPIPE_HEALTH_TEST_SLOW_RANK=<rank>:<seconds>`` makes that rank sleep ``seconds`` inside each timed
matmul (CI makes one of two CPU ranks slow with it); nothing else reads it.

This module imports without torch (the Snakefile imports it to plan the DAG); torch is imported inside the task.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import time
from typing import Any

from llmpipe.bench.allreduce_bw import bandwidths

#: Matmul element types of the check (``allreduce.health.matmul_dtype``).
MATMUL_DTYPES = ("bfloat16", "float16", "float32")

#: The environment variable of the test hook (see the module's docstring).
SLOW_RANK_ENV = "LLMPIPE_HEALTH_TEST_SLOW_RANK"


def matmul_tflops(n: int, iters: int, seconds: float) -> float:
    """TFLOP/s of ``iters`` square ``n x n`` matmuls taking ``seconds`` in all: ``2 n^3 iters / seconds / 1e12``."""
    return 2.0 * n ** 3 * iters / seconds / 1e12 if seconds > 0 else 0.0


def _slow_hook(rank: int) -> float:
    """Seconds rank ``rank`` sleeps in each timed matmul: from :data:`SLOW_RANK_ENV` (test hook), else 0."""
    spec = os.environ.get(SLOW_RANK_ENV, "")
    if not spec:
        return 0.0
    r, _, sec = spec.partition(":")
    return float(sec or 0) if int(r) == rank else 0.0


class HealthTask:
    """The health check as submitit runs it in every task of the job; rank 0 returns one dict per rank.

    Args:
        size_bytes: all-reduce message size in bytes (the gate's ``size_bytes``), float32 elements.
        matmul_size: ``n`` of the ``n x n`` matmul.
        matmul_dtype: one of :data:`MATMUL_DTYPES`.
        warmup, iters: untimed and timed calls, matmul and all-reduce alike.
        backend: ``auto`` (NCCL when CUDA is available, else gloo), ``nccl`` or ``gloo``.
    """

    def __init__(self, size_bytes: int, matmul_size: int = 8192, matmul_dtype: str = "bfloat16", warmup: int = 3,
                 iters: int = 10, backend: str = "auto"):
        self.size_bytes, self.n, self.dtype = int(size_bytes), int(matmul_size), matmul_dtype
        self.warmup, self.iters, self.backend = int(warmup), int(iters), backend

    def __call__(self) -> list[dict] | None:
        import torch.distributed as dist

        from llmpipe.bench.allreduce_bw import init_group

        env, backend, device, device_name = init_group(self.backend)
        rank, ws = int(env["rank"]), int(env["world_size"])
        host = env.get("hostname") or socket.gethostname()
        try:
            dist.barrier()
            tflops = self._matmul(device, _slow_hook(rank))
            dist.barrier()
            t_s = self._allreduce(device)
            _, busbw = bandwidths(self.size_bytes // 4 * 4, t_s, ws)
            line = {"rank": rank, "local_rank": int(env["local_rank"]), "node_rank": int(env.get("node_rank", 0)),
                    "host": host, "device": device_name, "backend": backend,
                    "matmul_size": self.n, "matmul_dtype": self.dtype, "tflops": tflops,
                    "size_bytes": self.size_bytes // 4 * 4, "allreduce_time_us": round(t_s * 1e6, 3),
                    "busbw_gbps": busbw}
            print(f"llmpipe: health rank {rank}/{ws} on {host} ({device_name}): {tflops:.3f} TFLOP/s "
                  f"({self.dtype} {self.n}^2), all-reduce {line['busbw_gbps']:.2f} GB/s busbw", flush=True)
            lines: list[Any] = [None] * ws
            dist.all_gather_object(lines, line)
            dist.barrier()
        finally:
            # as in AllReduceTask: gloo's destroy_process_group can block once a peer has exited
            if backend == "nccl":
                dist.destroy_process_group()
        return sorted(lines, key=lambda d: d["rank"]) if rank == 0 else None

    def _matmul(self, device, sleep_s: float) -> float:
        """This rank's matmul TFLOP/s (CUDA events on GPUs, wall clock on CPUs)."""
        import torch

        dtype = getattr(torch, self.dtype)
        a = torch.randn(self.n, self.n, device=device).to(dtype)
        b = torch.randn(self.n, self.n, device=device).to(dtype)
        for _ in range(self.warmup):
            torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(self.iters):
            torch.matmul(a, b)
            if sleep_s:
                time.sleep(sleep_s)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return matmul_tflops(self.n, self.iters, time.perf_counter() - t0)

    def _allreduce(self, device) -> float:
        """Seconds per in-place all-reduce of ``size_bytes`` as this rank timed it."""
        import torch
        import torch.distributed as dist

        buf = torch.ones(max(1, self.size_bytes // 4), dtype=torch.float32, device=device)
        for _ in range(self.warmup):
            dist.all_reduce(buf)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(self.iters):
            dist.all_reduce(buf)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) / self.iters


def judge(lines: list[dict], min_fraction_of_median: float, min_tflops: float | None = None,
          min_busbw_gbps: float | None = None) -> list[dict]:
    """Mark every GPU's line: ``slow`` is the list of reasons it fails (empty when healthy).

    A GPU is slow when its ``tflops`` is below ``min_fraction_of_median`` x the median over all GPUs or below
    ``min_tflops``, or its ``busbw_gbps`` is below ``min_fraction_of_median`` x the median or below
    ``min_busbw_gbps`` (None: no absolute floor). Returns new dicts, in the order given, with ``slow`` set.
    """
    med_t = statistics.median(d["tflops"] for d in lines)
    med_b = statistics.median(d["busbw_gbps"] for d in lines)
    out = []
    for d in lines:
        why = []
        if d["tflops"] < min_fraction_of_median * med_t:
            why.append(f"matmul {d['tflops']:.4g} TFLOP/s < {min_fraction_of_median} x median {med_t:.4g}")
        if min_tflops is not None and d["tflops"] < min_tflops:
            why.append(f"matmul {d['tflops']:.4g} TFLOP/s < min_tflops {min_tflops}")
        if d["busbw_gbps"] < min_fraction_of_median * med_b:
            why.append(f"busbw {d['busbw_gbps']:.4g} GB/s < {min_fraction_of_median} x median {med_b:.4g}")
        if min_busbw_gbps is not None and d["busbw_gbps"] < min_busbw_gbps:
            why.append(f"busbw {d['busbw_gbps']:.4g} GB/s < min_busbw_gbps {min_busbw_gbps}")
        out.append({**d, "median_tflops": med_t, "median_busbw_gbps": med_b, "slow": why})
    return out


def describe(line: dict) -> str:
    """One GPU as the gate names it: ``rank 1 (host node07, local rank 1, NVIDIA H200)``."""
    return f"rank {line['rank']} (host {line['host']}, local rank {line['local_rank']}, {line['device']})"


def write_json(path: str, lines: list[dict]) -> None:
    """Write the per-GPU lines to ``path`` (a JSON list, one object per GPU) atomically."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(lines, fh, indent=1)
    os.replace(tmp, path)


def check(lines: list[dict], health: dict, min_busbw_gbps: float | None, where: str) -> tuple[list[dict], list[str]]:
    """Judge the check's per-GPU ``lines`` with the ``allreduce.health`` settings ``health`` (:func:`judge`).

    Returns ``(judged lines, warnings)``; ``warnings`` names every slow GPU (empty when all pass) when
    ``health['on_slow']`` is ``warn``. Raises:
        RuntimeError: some GPU is slow and ``on_slow`` is ``fail``; the message names each by rank and host.
    """
    judged = judge(lines, float(health["min_fraction_of_median"]), health.get("min_tflops"), min_busbw_gbps)
    slow = [f"{describe(d)}: {'; '.join(d['slow'])}" for d in judged if d["slow"]]
    if slow and health["on_slow"] == "fail":
        raise RuntimeError(
            f"{where}: training refuses to start: {len(slow)} of {len(judged)} GPU(s) failed the health check:\n  "
            + "\n  ".join(slow)
            + "\nFix: leave the named host(s) out of the allocation (Slurm: --exclude, slurm.extra), check the GPU "
              "(nvidia-smi -q: clocks, throttling, ECC; dcgmi diag) and its links, or set "
              "allreduce.health.on_slow: warn to train anyway.")
    return judged, [f"{where}: slow GPU {s}" for s in slow]
