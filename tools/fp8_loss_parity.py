#!/usr/bin/env python3
"""FP8 loss parity: train one model twice from the same seed on the same data, bf16 and with ``train.fp8``, and
compare the training-loss curves.

Each training is the project's own (``llmpipe.train.pretrain.foundry_train_config`` of the model with ``data.concat_tokens``,
``train.max_duration_batches``, the batch and ``train.fp8`` overridden; llm-foundry's ``train``) on one GPU, over
an MDS dataset the pipeline prepared (``results/data/<corpus>/<tokenizer>/concat<N>/mds``), without eval or
checkpoints. Every step's loss comes from the project's run monitor (``llmpipe_run_monitor`` with log interval 1).

Writes ``<out>.csv`` (variant, batch, loss, tokens, elapsed_s) and ``<out>.json`` (per variant: final loss, mean of
the last 50 losses, wall time, tokens/s; and the FP8/bf16 ratios); ``--plot`` turns a CSV into the PNG of both
curves (run it where matplotlib is).

Usage (GPU machine, repository root):

    python tools/fp8_loss_parity.py --data results/data/builtin-docs/bpe-builtin-docs/concat512/mds \\
        --tokenizer results/tokenizers/bpe-builtin-docs --model mpt-350m --concat 512 --steps 500 \\
        --global-batch 16 --out benchmarks/fp8-loss-parity-mpt-350m
    python tools/fp8_loss_parity.py --plot benchmarks/fp8-loss-parity-mpt-350m.csv
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

#: The last-N window whose mean loss is compared besides the final step's loss.
TAIL = 50


def train_once(config: dict, run: str, fp8, *, data: str, tokenizer: str, concat: int, steps: int,
               global_batch: int, microbatch: int) -> tuple[list[dict], float]:
    """Train ``run`` for ``steps`` steps with ``train.fp8 = fp8``; return the run monitor's per-step records
    (batch, loss, tokens, elapsed_s) and the wall time of the training call."""
    import torch
    from llmfoundry.command_utils import train
    from omegaconf import OmegaConf

    from llmpipe.config.runs import deep_merge, run_settings
    from llmpipe.train.pretrain import foundry_train_config

    over = {'data': {'concat_tokens': concat},
            'train': {'max_duration_batches': steps, 'global_batch_size': global_batch,
                      'microbatch_size': microbatch, 'fp8': fp8, 'log_interval_batches': 1}}
    rc = run_settings(deep_merge(config, {'models': {run: over}}), run)
    cfg = foundry_train_config(rc, data_dir=data, save_folder=None, world_size=1, tokenizer_dir=tokenizer)
    cfg.pop('eval_loader', None)
    cfg['eval_interval'] = 1
    cfg['log_to_console'] = False
    cfg['python_log_level'] = 'warning'
    cfg['train_loader']['num_workers'] = 0
    cfg['train_loader'].update(prefetch_factor=None, persistent_workers=False)
    t0 = time.time()
    trainer = train(OmegaConf.create(cfg))
    wall = time.time() - t0
    monitor = next(cb for cb in trainer.state.callbacks if type(cb).__name__ == 'RunMonitor')
    records = list(monitor.records)
    trainer.close()
    del trainer
    gc.collect()
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return records, wall


def summarize(records: list[dict], wall: float) -> dict:
    """Final loss, mean of the last :data:`TAIL` losses, steps, wall time and tokens/s (whole fit, compile
    included) of one training."""
    losses = [r['loss'] for r in records]
    tail = losses[-TAIL:]
    fit_s = records[-1]['elapsed_s']
    return {'steps': records[-1]['batch'], 'first_loss': losses[0], 'final_loss': losses[-1],
            f'mean_last_{TAIL}': sum(tail) / len(tail), 'fit_s': fit_s, 'wall_s': round(wall, 1),
            'tokens_per_s_fit': round(records[-1]['tokens'] / fit_s, 1)}


def plot(csv_path: str, png: str | None = None) -> str:
    """Both loss curves of ``csv_path`` (one line per variant; light raw, dark moving mean of 20) and, below, the
    ratio of the two moving means with the 1% band, into a PNG (default: the CSV's name with ``.png``)."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    from llmpipe.report.plots import finish_and_save

    curves: dict[str, tuple[list[int], list[float]]] = {}
    with open(csv_path, newline='') as f:
        for row in csv.DictReader(f):
            xs, ys = curves.setdefault(row['variant'], ([], []))
            xs.append(int(row['batch']))
            ys.append(float(row['loss']))
    summary_path = csv_path[:-4] + '.json'
    title = 'training loss, bf16 vs FP8'
    if os.path.exists(summary_path):
        with open(summary_path) as fh:
            s = json.load(fh)
        title = (f"{s['model']}, {s['corpus']}, concat {s['concat_tokens']}, batch {s['global_batch']}, seed "
                 f"{s['seed']}: final loss FP8/bf16 = {s['ratio_final_loss']:.4f}")
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=(3, 1))
    k = 20
    smooth = {}
    for (name, (xs, ys)), color in zip(curves.items(), ('tab:blue', 'tab:red', 'tab:green')):
        ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
        smooth[name] = [sum(ys[max(0, i - k + 1):i + 1]) / len(ys[max(0, i - k + 1):i + 1]) for i in range(len(ys))]
        ax.plot(xs, smooth[name], color=color, linewidth=1.6, label=f'{name} (moving mean of {k})')
    ax.set_yscale('log')
    names = list(curves)
    if len(names) == 2:   # second / first (FP8 / bf16) of the moving means, with the 1% band
        xs = curves[names[1]][0]
        ax2.plot(xs, [b / a for a, b in zip(smooth[names[0]], smooth[names[1]])], color='black', linewidth=1.2)
        for y in (0.99, 1.0, 1.01):
            ax2.axhline(y, color='gray', linestyle=':' if y != 1.0 else '-', linewidth=0.8)
        ax2.set_ylabel(f'{names[1]} / {names[0]}', fontsize=8)
        ax2.grid(True, alpha=0.3)
        ax2.set_xlabel('step')
    png = png or csv_path[:-4] + '.png'
    finish_and_save(fig, ax, png, xlabel='', ylabel='training loss (log scale)', title=title,
                    has_data=bool(curves), empty_text='no data', grid_which='both')
    return png


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--plot', default='', help='only plot this CSV (no training)')
    ap.add_argument('--config', default=os.path.join(ROOT, 'config', 'config.yaml'))
    ap.add_argument('--data', help='the MDS folder (holds train/)')
    ap.add_argument('--tokenizer', help='the saved tokenizer folder')
    ap.add_argument('--corpus', default='builtin-docs', help='written to the summary')
    ap.add_argument('--model', default='mpt-350m')
    ap.add_argument('--concat', type=int, default=512)
    ap.add_argument('--steps', type=int, default=500)
    ap.add_argument('--global-batch', type=int, default=16)
    ap.add_argument('--microbatch', type=int, default=0, help='default: the global batch')
    ap.add_argument('--recipe', default='tensorwise')
    ap.add_argument('--machine', default='')
    ap.add_argument('--out', default=os.path.join(ROOT, 'benchmarks', 'fp8-loss-parity-mpt-350m'))
    args = ap.parse_args(argv)
    if args.plot:
        print(plot(args.plot))
        return 0

    for k, v in {'RANK': '0', 'WORLD_SIZE': '1', 'LOCAL_RANK': '0', 'LOCAL_WORLD_SIZE': '1', 'NODE_RANK': '0',
                 'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': '29517'}.items():
        os.environ.setdefault(k, v)
    import torch

    from llmpipe.train.pretrain import register_extensions
    from tools.bench_train_throughput import _load_project_config

    config = _load_project_config(args.config)
    register_extensions(compile_enabled=True)
    mb = args.microbatch or args.global_batch
    variants = {'bf16': False, f'fp8-{args.recipe}': args.recipe}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    summary: dict = {'model': args.model, 'corpus': args.corpus, 'concat_tokens': args.concat, 'steps': args.steps,
                     'global_batch': args.global_batch, 'microbatch': mb,
                     'seed': config['model_defaults']['train']['seed'], 'machine': args.machine,
                     'gpu': torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu',
                     'torch': torch.__version__, 'command': 'python tools/fp8_loss_parity.py ' + ' '.join(
                         argv if argv is not None else sys.argv[1:]), 'variants': {}}
    with open(args.out + '.csv', 'w', newline='') as f:
        w = csv.DictWriter(f, fieldnames=['variant', 'batch', 'loss', 'tokens', 'elapsed_s'])
        w.writeheader()
        for name, fp8 in variants.items():
            records, wall = train_once(config, args.model, fp8, data=args.data, tokenizer=args.tokenizer,
                                       concat=args.concat, steps=args.steps, global_batch=args.global_batch,
                                       microbatch=mb)
            for r in records:
                w.writerow({'variant': name, **r})
            f.flush()
            summary['variants'][name] = summarize(records, wall)
            print(f'[parity] {name}: {summary["variants"][name]}', flush=True)
    bf16, fp8 = (summary['variants'][n] for n in variants)
    summary['ratio_final_loss'] = fp8['final_loss'] / bf16['final_loss']
    summary[f'ratio_mean_last_{TAIL}'] = fp8[f'mean_last_{TAIL}'] / bf16[f'mean_last_{TAIL}']
    summary['within_1pct'] = abs(summary['ratio_final_loss'] - 1) <= 0.01
    with open(args.out + '.json', 'w') as fh:
        json.dump(summary, fh, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k != 'variants'}), flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
