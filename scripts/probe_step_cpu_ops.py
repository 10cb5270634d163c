#!/usr/bin/env python3
"""Micro-timing of the CPU work composer and llm-foundry do on every training batch, at several intra-op thread counts.

Times, on one 64 x 2048 int64 batch (MPT-125M's microbatch 64 at sequence length 2048): llm-foundry's token count
(``count_nonzero(eq(labels[..., 1:], -100))``), our ``drop_full_attention_mask`` check (``mask.all()``), the
``sum(attention_mask).item()`` count and ``pin_memory`` (CUDA machines only). Prints one line per thread count
(torch's default, 4, 1) with the mean microseconds per call. Used for ``benchmarks/cpu-ops-device-h200x2-32cpu.txt``:
``python3 scripts/probe_step_cpu_ops.py``.
"""

import time

import torch


def per_call_us(f, n: int = 200) -> float:
    """Mean wall microseconds of ``f()`` over ``n`` calls after one warm-up call."""
    f()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    x = torch.randint(0, 50000, (64, 2048))
    m = torch.ones_like(x)
    for th in (torch.get_num_threads(), 4, 1):
        torch.set_num_threads(th)
        line = (f"threads={th:3d}  count_nonzero(eq) {per_call_us(lambda: torch.count_nonzero(torch.eq(x[..., 1:], -100))):8.1f} us  "
                f"mask.all {per_call_us(lambda: bool(m.all())):8.1f} us  "
                f"sum(mask) {per_call_us(lambda: int(torch.sum(m).item())):8.1f} us")
        if torch.cuda.is_available():
            line += f"  pin_memory {per_call_us(lambda: x.pin_memory(), 50):8.1f} us"
        print(line, flush=True)


if __name__ == "__main__":
    main()
