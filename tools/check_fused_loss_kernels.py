#!/usr/bin/env python3
"""Check the fused loss's per-chunk kernels against an fp32 reference on this machine's GPU, and time them.

``llmpipe.model.fused_loss.linear_cross_entropy`` offers several per-chunk softmax/gradient kernels
(``fused_loss.kernel``: torch, softmax, compile, liger). The CPU tests cover ``torch`` and ``softmax`` (the others
need CUDA: Triton and Inductor kernels, and Liger-Kernel's Triton implementation does not load without a GPU driver). This script runs
every kernel on random inputs under bf16 autocast, as training does, with some targets set to ``ignore_index``,
and compares the loss and both gradients with the stock computation in fp32
(``F.cross_entropy(h.float() @ w.float().T)``), then times forward + backward of each kernel.

Usage (on a GPU node)::

    python tools/check_fused_loss_kernels.py --tokens 65536 --d 768 --vocab 50368 --out fused-loss-check.csv

Writes one CSV row per kernel: the relative errors of the loss and of the two gradients
(``max |a - b| / max |b|``), the time of one forward + backward in ms (median of ``--iters`` after 3 warm-up
calls, CUDA events), and the peak memory above the inputs. Exit status 1 when a kernel's error exceeds
``--tol`` (relative; bf16 matmuls give ~1e-2 on the gradients) or it fails.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import traceback


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--tokens', type=int, default=65536, help='rows N (microbatch x sequence length)')
    ap.add_argument('--d', type=int, default=768, help='hidden size d (MPT-125M: 768)')
    ap.add_argument('--vocab', type=int, default=50368, help='vocabulary V (MPT: 50,368)')
    ap.add_argument('--chunk', type=int, default=None, help='rows per chunk (default: the module default)')
    ap.add_argument('--ignored', type=float, default=0.05, help='fraction of targets set to ignore_index')
    ap.add_argument('--kernels', default='torch,softmax,compile,liger')
    ap.add_argument('--iters', type=int, default=10)
    ap.add_argument('--tol', type=float, default=3e-2)
    ap.add_argument('--out', default=None, help='CSV file to write')
    args = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from llmpipe.model.fused_loss import KERNELS, linear_cross_entropy

    if not torch.cuda.is_available():
        print('check_fused_loss_kernels: needs a CUDA GPU', file=sys.stderr)
        return 2
    kernels = [k for k in args.kernels.split(',') if k]
    unknown = [k for k in kernels if k not in KERNELS]
    if unknown:
        ap.error(f'--kernels: unknown {unknown}; choose from {KERNELS}')
    dev = 'cuda'
    g = torch.Generator(device=dev).manual_seed(0)
    h0 = torch.randn(args.tokens, args.d, device=dev, generator=g)
    w0 = torch.randn(args.vocab, args.d, device=dev, generator=g) * args.d ** -0.5
    t = torch.randint(0, args.vocab, (args.tokens,), device=dev, generator=g)
    t[torch.rand(args.tokens, device=dev, generator=g) < args.ignored] = -100

    # fp32 reference (the stock path's math, without autocast)
    h_ref = h0.clone().requires_grad_(True)
    w_ref = w0.clone().requires_grad_(True)
    ref = F.cross_entropy(h_ref @ w_ref.t(), t, ignore_index=-100)
    ref.backward()
    ref_loss, ref_gh, ref_gw = ref.detach(), h_ref.grad.detach(), w_ref.grad.detach()
    del h_ref, w_ref
    torch.cuda.empty_cache()

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))

    rows, bad = [], []
    for kernel in kernels:
        row = {'kernel': kernel, 'tokens': args.tokens, 'd': args.d, 'vocab': args.vocab,
               'chunk': args.chunk or '', 'gpu': torch.cuda.get_device_name(), 'torch': torch.__version__}
        try:
            h = h0.clone().requires_grad_(True)
            w = w0.clone().requires_grad_(True)

            def step(h: torch.Tensor = h, w: torch.Tensor = w) -> torch.Tensor:
                h.grad = w.grad = None
                with torch.autocast('cuda', dtype=torch.bfloat16):
                    loss = linear_cross_entropy(h, w, t, chunk_size=args.chunk, kernel=kernel)
                loss.backward()
                return loss

            loss = step()
            row.update({'loss_rel_err': rel(loss.detach(), ref_loss), 'grad_h_rel_err': rel(h.grad, ref_gh),
                        'grad_w_rel_err': rel(w.grad, ref_gw)})
            for _ in range(2):
                step()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(args.iters):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                step()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b))
            row.update({'fwd_bwd_ms': round(statistics.median(times), 3),
                        'peak_extra_gb': round((torch.cuda.max_memory_allocated() - base) / 1e9, 3),
                        'status': 'ok'})
            if max(row['loss_rel_err'], row['grad_h_rel_err'], row['grad_w_rel_err']) > args.tol:
                row['status'] = 'over_tol'
                bad.append(kernel)
            del h, w
        except Exception as e:  # noqa: BLE001 - report and go on with the next kernel
            traceback.print_exc()
            row.update({'status': 'error', 'error': f'{type(e).__name__}: {e}'[:300]})
            bad.append(kernel)
        torch.cuda.empty_cache()
        rows.append(row)
        print(f'[check] {row}', flush=True)
    if args.out:
        fields = ['kernel', 'status', 'loss_rel_err', 'grad_h_rel_err', 'grad_w_rel_err', 'fwd_bwd_ms',
                  'peak_extra_gb', 'tokens', 'd', 'vocab', 'chunk', 'gpu', 'torch', 'error']
        with open(args.out, 'w', newline='') as f:
            wr = csv.DictWriter(f, fieldnames=fields, extrasaction='ignore')
            wr.writeheader()
            wr.writerows(rows)
    if bad:
        print(f'check_fused_loss_kernels: {bad} failed or exceeded --tol {args.tol}', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
