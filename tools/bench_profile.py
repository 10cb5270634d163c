"""Profiling for tools/bench_train_throughput.py: where a training step's GPU time goes.

:func:`make_profiler` is a Composer callback that profiles a few batches with ``torch.profiler`` and writes
``{tag}-categories.txt`` (kernel time by :data:`KERNEL_CATEGORIES`), ``{tag}-kernels.txt`` (the top kernels) and,
with Python stacks, ``{tag}-gaps.txt`` (:func:`gpu_idle_report`: what the host did while the GPU waited). The
report functions also work on a saved Chrome trace (:func:`trace_kernels` + :func:`kernel_time_report`).
"""
from __future__ import annotations

import json
import os
import re
import time
from typing import Any

KERNEL_CATEGORIES = [
    # (category, substrings of the kernel name, lower case); first match wins
    ('attention', ('flash', 'fmha', 'attention', 'sdpa', 'cudnn_generated_fort_native_sdpa')),
    ('matmul', ('gemm', 'cutlass', 'xmma', 'nvjet', 'cublas', 'wgmma', 'sm90_')),
    ('optimizer', ('multi_tensor', 'fused_adam', 'adam')),
    ('loss/softmax', ('softmax', 'nll_loss', 'cross_entropy', 'logsumexp')),
    ('norm', ('layer_norm', 'layernorm', 'norm_', 'gammabeta')),
    ('triton (compiled)', ('triton',)),
    ('copy/cast', ('copy', 'memcpy', 'memset', 'cast', 'to_copy')),
    ('elementwise/reduce', ('elementwise', 'vectorized', 'reduce', 'unrolled')),
]


def is_profiler_range(name: str) -> bool:
    """True for the profiler's own GPU ranges, e.g. ``Optimizer.step#FusedAdamW.step`` (a user annotation spanning
    the optimizer's kernels, which would count them twice) or ``ProfilerStep#3``; False for kernels, whose names
    may contain '#' too (PyTorch's elementwise kernels name C++ lambdas: ``...::{lambda()#3}...``)."""
    return name.startswith('ProfilerStep') or re.fullmatch(r'[\w.]+#[\w.]+', name) is not None


def kernel_time_report(kernels: list[tuple[str, float]], n_steps: int, wall_us: float) -> tuple[str, str]:
    """Kernel time by category and by name.

    Args:
        kernels: ``(name, microseconds)`` per kernel execution.
        n_steps: steps the kernels cover; wall_us: their wall time (µs).

    Returns:
        ``(categories text, top-60 kernels text)``; categories by :data:`KERNEL_CATEGORIES` (first match of a
        lower-case substring; else 'other').
    """
    by_name: dict[str, list] = {}
    for name, t in kernels:
        d = by_name.setdefault(name, [0.0, 0])
        d[0] += t
        d[1] += 1
    total = sum(v[0] for v in by_name.values()) or 1e-9
    cats: dict[str, float] = {}
    for name, (t, _) in by_name.items():
        low = name.lower()
        cat = next((c for c, subs in KERNEL_CATEGORIES if any(x in low for x in subs)), 'other')
        cats[cat] = cats.get(cat, 0.0) + t
    head = (f'{n_steps} steps, wall {wall_us / 1e3:.1f} ms, CUDA kernel time {total / 1e3:.1f} ms '
            f'({100 * total / wall_us:.1f}% of wall)\n')
    cat_txt = head + ''.join(f'{c:22s} {t / 1e3:10.2f} ms  {100 * t / total:5.1f}%\n'
                             for c, t in sorted(cats.items(), key=lambda kv: -kv[1]))
    top_txt = ''.join(f'{t / 1e3:10.2f} ms {cnt:6d}x  {100 * t / total:5.1f}%  {name[:160]}\n'
                      for name, (t, cnt) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:60])
    return cat_txt, top_txt


def trace_kernels(trace: dict) -> list[tuple[str, float]]:
    """``(name, microseconds)`` of every GPU kernel, memcpy and memset in a torch.profiler Chrome trace."""
    return [(e['name'], float(e['dur'])) for e in trace.get('traceEvents', [])
            if e.get('ph') == 'X' and 'dur' in e and e.get('cat') in ('kernel', 'gpu_memcpy', 'gpu_memset')]


def gpu_idle_report(trace: dict, *, min_gap_us: float = 50.0, top: int = 45) -> str:
    """Where the GPU waits: the gaps between CUDA kernels of a torch.profiler Chrome trace, attributed to the Python
    frames the host was in meanwhile.

    Args:
        trace: the parsed JSON of ``torch.profiler.profile(with_stack=True).export_chrome_trace`` (its
            ``traceEvents``: complete events with ``ts``/``dur`` in microseconds; kernels have ``cat`` 'kernel',
            Python frames ``cat`` 'python_function').
        min_gap_us: gaps shorter than this (launch latency between back-to-back kernels) are not attributed.
        top: how many frames to list.

    Returns:
        Text: the span from the first kernel's start to the last kernel's end, kernel-busy and idle microseconds
        (overlapping kernels on several streams counted once), the number of gaps >= ``min_gap_us`` and their
        sum, then the Python frames of the main thread (the one running the script's ``<module>`` frame, else the
        one with most Python frames), ranked by how many microseconds of those gaps they overlapped (a frame and its callers all count,
        so the outer loop tops the list; the first specific frames are the answer).
        'no CUDA kernels in the trace' when there are none (a CPU run).
    """
    events = [e for e in trace.get('traceEvents', []) if e.get('ph') == 'X' and 'dur' in e]
    kernels = sorted((float(e['ts']), float(e['ts']) + float(e['dur'])) for e in events
                     if e.get('cat') in ('kernel', 'gpu_memcpy', 'gpu_memset'))
    if not kernels:
        return 'no CUDA kernels in the trace\n'
    busy, gaps, cur_s, cur_e = 0.0, [], kernels[0][0], kernels[0][1]
    for s, e in kernels[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            if s - cur_e >= min_gap_us:
                gaps.append((cur_e, s))
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = cur_e - kernels[0][0]   # the last merged interval ends at the latest kernel end
    gap_sum = sum(e - s for s, e in gaps)
    import bisect
    import collections
    # the main Python thread (the one running the script's <module> frame, the longest of them; else the one with
    # most Python frames):
    # it runs the training loop between steps. (Not the thread with most CUDA launches: on CUDA the backward runs
    # in autograd's own device thread.)
    py_threads = collections.Counter(e.get('tid') for e in events if e.get('cat') == 'python_function')
    modules = [e for e in events if e.get('cat') == 'python_function' and '<module>' in e['name']]
    longest = max(modules, key=lambda e: float(e['dur'])) if modules else None  # not a lazy import elsewhere
    main_tid = longest.get('tid') if longest else (py_threads.most_common(1)[0][0] if py_threads else None)
    starts = [g[0] for g in gaps]
    spans: dict[str, list] = {}
    for ev in events:
        if ev.get('cat') == 'python_function' and ev.get('tid') == main_tid:
            spans.setdefault(ev['name'], []).append((float(ev['ts']), float(ev['ts']) + float(ev['dur'])))
    frames: dict[str, float] = {}
    for name, ivs in spans.items():
        merged: list[list[float]] = []   # a frame nested in itself (recursion) counts once
        for s0, e0 in sorted(ivs):
            if merged and s0 <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], e0)
            else:
                merged.append([s0, e0])
        ov = 0.0
        for s0, e0 in merged:
            i = max(0, bisect.bisect_right(starts, s0) - 1)  # gaps are disjoint and sorted
            while i < len(gaps) and gaps[i][0] < e0:
                ov += max(0.0, min(e0, gaps[i][1]) - max(s0, gaps[i][0]))
                i += 1
        if ov > 0:
            frames[name] = ov
    lines = [f'kernel span {span / 1e3:.1f} ms, GPU busy {busy / 1e3:.1f} ms, idle {(span - busy) / 1e3:.1f} ms '
             f'({100 * (span - busy) / span:.1f}%); {len(gaps)} gaps >= {min_gap_us:.0f} us sum {gap_sum / 1e3:.1f} ms',
             'largest gaps (ms): ' + ', '.join(f'{(e - s) / 1e3:.2f}' for s, e in sorted(gaps, key=lambda g: g[0] - g[1])[:12]),
             'python frames of the main thread overlapping those gaps (ms; callers included):']
    for name, t in sorted(frames.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f'{t / 1e3:9.2f}  {name[:150]}')
    return '\n'.join(lines) + '\n'


def make_profiler(first: int, n: int, out_dir: str, tag: str, trace: bool = False) -> Any:
    """A Composer callback profiling batches ``first`` .. ``first + n - 1`` (0-based) with torch.profiler; on stop it
    writes ``{tag}-kernels.txt`` (top CUDA kernels) and ``{tag}-categories.txt`` (kernel time by category, and the
    share of wall time the GPU had a kernel running) into ``out_dir``. With ``trace``, Python stacks are recorded
    too and it also writes ``{tag}-trace.json.gz`` (the Chrome trace) and ``{tag}-gaps.txt``
    (:func:`gpu_idle_report`: what the host did while the GPU waited)."""
    from composer.core import Callback

    class Prof(Callback):
        def __init__(self) -> None:
            self.prof = None
            self.t0 = 0.0

        def batch_start(self, state: Any, logger: Any) -> None:
            import torch
            if int(state.timestamp.batch) == first and self.prof is None:
                acts = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                    acts.append(torch.profiler.ProfilerActivity.CUDA)
                self.prof = torch.profiler.profile(activities=acts, with_stack=trace)
                self.prof.__enter__()
                self.t0 = time.perf_counter()

        def batch_end(self, state: Any, logger: Any) -> None:
            import torch
            if self.prof is not None and int(state.timestamp.batch) == first + n:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                wall_us = (time.perf_counter() - self.t0) * 1e6
                self.prof.__exit__(None, None, None)
                self._write(wall_us)
                self.prof = None

        def _write(self, wall_us: float) -> None:
            import torch
            cuda = torch.cuda.is_available()  # on a CPU (smoke test) the CPU self time of operators stands in
            events = [e for e in self.prof.events() if (e.device_type.name == 'CUDA') == cuda
                      and not getattr(e, 'is_user_annotation', False) and not is_profiler_range(e.name)]
            kernels = [(e.name, e.device_time if cuda else e.self_cpu_time_total) for e in events]
            cat_txt, top_txt = kernel_time_report(kernels, n, wall_us)
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, f'{tag}-categories.txt'), 'w') as f:
                f.write(cat_txt)
            with open(os.path.join(out_dir, f'{tag}-kernels.txt'), 'w') as f:
                f.write(top_txt)
            print(cat_txt, flush=True)
            if trace:
                import gzip
                raw = os.path.join(out_dir, f'{tag}-trace.json')
                self.prof.export_chrome_trace(raw)
                with open(raw) as f:
                    data = json.load(f)
                with gzip.open(raw + '.gz', 'wt') as f:
                    json.dump(data, f)
                os.remove(raw)
                report = gpu_idle_report(data)
                with open(os.path.join(out_dir, f'{tag}-gaps.txt'), 'w') as f:
                    f.write(report)
                print(report, flush=True)

    return Prof()
