#!/usr/bin/env python3
"""Training-throughput benchmark: the project's own training step, one GPU, synthetic tokens.

For each model (default: mpt-125m, mpt-350m, mpt-760m, mpt-1b from config/config.yaml) and each variant, this builds
the llm-foundry train config with the project's ``llmpipe.train.pretrain.foundry_train_config`` (world_size=1), overrides
only the data (a synthetic dataloader of uniformly random token ids, registered in llm-foundry's ``dataloaders``
registry as ``llmpipe_synthetic_tokens``), the duration, the batch (global batch = microbatch: no gradient
accumulation), checkpoints/loggers/eval (off), and the knobs the variant names; then runs
``llmfoundry.command_utils.train`` for ``--steps`` steps with CUDA synchronization at every batch end.

Output: one CSV row per (model, variant) with tokens/s, MFU (llmpipe.model.mfu: llm-foundry's FLOPs formula against the
detected dense bf16 peak), peak memory, microbatch, attention implementation and software versions. Two throughput
figures: ``tokens_per_s``/``mfu`` time steps ``--skip``+1 .. ``--steps`` (this tool's own window, as in every row
since the first); ``steady_tokens_per_s``/``steady_mfu`` (with ``steady_first_batch``, ``steady_last_batch``,
``steady_batches``) are ``train.json``'s steady state, computed by the same code (:func:`llmpipe.train.throughput.start`,
:func:`llmpipe.train.throughput.batch_end`, :meth:`llmpipe.train.throughput.StepTimer.steady`: the first 10% of the batches,
at least 2, left out as warm-up), so a pipeline run's steady MFU can be set beside the benchmark's. Rows written
before those columns existed have them empty; ``--append`` to such a file adds the new columns to its header first
(:func:`csv_fields`), keeping every old row's values.

Usage (on a GPU machine, from the repository root):

    python tools/bench_train_throughput.py --out /tmp/train-throughput.csv   # default: benchmarks/train-throughput.csv
    python tools/bench_train_throughput.py --models mpt-125m --variants default,torch_attn --steps 30

Variants are named in :data:`VARIANTS`; ``--variants default`` runs the configuration exactly as the project's
defaults produce it. ``--microbatch mpt-125m=32,...`` overrides a model's microbatch for all its variants.
"""

from __future__ import annotations

import argparse
import atexit
import csv
import datetime as _dt
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from llmpipe.config.runs import compile_settings  # noqa: E402
from llmpipe.dispatch.rendezvous import free_port  # noqa: E402
from llmpipe.model.mfu import detect_peak_flops, flops_per_token, mfu  # noqa: E402
from llmpipe.train import throughput  # noqa: E402
from llmpipe.train.speedups import dynamo_catalogue_fix, register_compile_blocks, register_fused_adamw  # noqa: E402
from tools.bench_profile import make_profiler  # noqa: E402

#: What each variant changes on top of the project's default train config. Keys:
#:   attn_impl: 'sdpa' | 'torch' (MPT attention; 'sdpa' = llmpipe.model.attention)
#:   drop_mask: add/remove the drop_full_attention_mask callback
#:   optimizer: 'fused_adamw' (torch.optim.AdamW(fused=True), decoupled weight decay) | 'decoupled_adamw'
#:   compile: True -> compile_config {} (torch.compile of the whole model through composer) | a dict -> that
#:       compile_config (torch.compile kwargs, e.g. mode) | 'blocks' -> each MPT
#:       block compiled in place (train setting `compile: blocks`, llmpipe.train.speedups.compile_blocks) | False -> none
#:   compile_fix: apply dynamo_catalogue_fix() first (without it compile fails on Python 3.12); when a variant does
#:       not name `compile` but the project config compiles (e.g. `default` for mpt-350m), the fix is applied, as
#:       the training step does
#:   sdpa_backend: pin SDPA's backend (flash | cudnn | efficient | math; llmpipe.model.attention.set_sdpa_backend)
#:   mb_scale: multiply the model's microbatch
#:   cpu_threads: torch.set_num_threads(n) in the training process for the run (default: torch's, one per core;
#:       the row's cpu_threads column says what it was)
#:   num_workers: dataloader worker processes (default: the model's train setting num_workers, 4 for the MPT
#:       models; 0 runs the synthetic loader in the training process; the CSV's num_workers column says which)
#:   train_metrics: False -> model.use_train_metrics False (no per-step LanguageCrossEntropy/Perplexity/TokenAccuracy
#:       over the logits; the loss itself is unchanged)
#:   fp8: the project's train setting `fp8` (llmpipe.train.fp8: torchao float8 linears): 'tensorwise' | 'rowwise' |
#:       a mapping {recipe, min_features}; the CSV's fp8 column says which (empty: bf16)
#:   fused_loss: the project's train setting `fused_loss` (llmpipe.model.fused_loss: chunked linear + cross-entropy
#:       without the full logits): False | True | {'chunk_size': tokens, 'kernel': torch|softmax|compile|liger};
#:       used only with train metrics off. Variants that set it False measure the stock loss over full logits.
_BEST = {'attn_impl': 'sdpa', 'drop_mask': True, 'optimizer': 'fused_adamw', 'train_metrics': False}
VARIANTS: dict[str, dict[str, Any]] = {
    'default': {},
    # the default without FSDP at world size 1 (train.fsdp_min_params: null; MPT-1B and up default to FSDP there)
    'no_fsdp': {'fsdp_min_params': None},
    # FSDP at world size 1 whatever the model's size (FULL_SHARD, PURE bf16 mixed precision)
    'fsdp_always': {'fsdp_min_params': 1},
    'torch_attn': {'attn_impl': 'torch', 'drop_mask': False, 'fused_loss': False},
    'sdpa_keep_mask': {'attn_impl': 'sdpa', 'drop_mask': False, 'fused_loss': False},
    'sdpa': {'attn_impl': 'sdpa', 'drop_mask': True, 'fused_loss': False},
    'sdpa_cudnn': {'attn_impl': 'sdpa', 'drop_mask': True, 'sdpa_backend': 'cudnn', 'fused_loss': False},
    'sdpa_flash': {'attn_impl': 'sdpa', 'drop_mask': True, 'sdpa_backend': 'flash', 'fused_loss': False},
    'fused_adamw': {'attn_impl': 'sdpa', 'drop_mask': True, 'optimizer': 'fused_adamw', 'fused_loss': False},
    'decoupled_adamw': {'attn_impl': 'sdpa', 'drop_mask': True, 'optimizer': 'decoupled_adamw', 'fused_loss': False},
    'mb_x2': {'attn_impl': 'sdpa', 'drop_mask': True, 'optimizer': 'fused_adamw', 'mb_scale': 2, 'fused_loss': False},
    'mb_x4': {'attn_impl': 'sdpa', 'drop_mask': True, 'optimizer': 'fused_adamw', 'mb_scale': 4, 'fused_loss': False},
    'compile_nofix': {'attn_impl': 'sdpa', 'drop_mask': True, 'optimizer': 'fused_adamw', 'compile': True,
                      'fused_loss': False},
    'compile': {'attn_impl': 'sdpa', 'drop_mask': True, 'optimizer': 'fused_adamw', 'compile': True,
                'compile_fix': True, 'fused_loss': False},
    'compile_mb_x2': {'attn_impl': 'sdpa', 'drop_mask': True, 'optimizer': 'fused_adamw', 'compile': True,
                      'compile_fix': True, 'mb_scale': 2, 'fused_loss': False},
    'compile_cudnn': {'attn_impl': 'sdpa', 'drop_mask': True, 'optimizer': 'fused_adamw', 'compile': True,
                      'compile_fix': True, 'sdpa_backend': 'cudnn', 'fused_loss': False},
    'nometrics_mb_x2': {'attn_impl': 'sdpa', 'drop_mask': True, 'optimizer': 'fused_adamw', 'mb_scale': 2,
                        'train_metrics': False, 'fused_loss': False},
    'compile_nometrics': {'attn_impl': 'sdpa', 'drop_mask': True, 'optimizer': 'fused_adamw', 'compile': True,
                          'compile_fix': True, 'train_metrics': False, 'fused_loss': False},
    'cudnn_fused': {'attn_impl': 'sdpa', 'drop_mask': True, 'optimizer': 'fused_adamw', 'sdpa_backend': 'cudnn',
                    'fused_loss': False},
    'cudnn_fused_mb_x2': {'attn_impl': 'sdpa', 'drop_mask': True, 'optimizer': 'fused_adamw',
                          'sdpa_backend': 'cudnn', 'mb_scale': 2, 'fused_loss': False},
    # the fused linear + cross-entropy on top of the best measured settings (SDPA + drop_full_attention_mask +
    # fused AdamW + no train metrics); `nometrics` is the same without it, at the same microbatch
    'nometrics': {**_BEST, 'fused_loss': False},
    'fused_loss': {**_BEST, 'fused_loss': True},
    'fused_loss_mb_x2': {**_BEST, 'fused_loss': True, 'mb_scale': 2},
    'fused_loss_mb_x4': {**_BEST, 'fused_loss': True, 'mb_scale': 4},
    'fused_loss_ewc': {**_BEST, 'fused_loss': {'kernel': 'compile'}},         # per-chunk softmax via torch.compile
    'fused_loss_ewc_mb_x2': {**_BEST, 'fused_loss': {'kernel': 'compile'}, 'mb_scale': 2},
    'fused_loss_chunk1k': {**_BEST, 'fused_loss': {'chunk_size': 1024}},
    'fused_loss_chunk8k': {**_BEST, 'fused_loss': {'chunk_size': 8192}},
    'compile_nometrics_nofl': {**_BEST, 'compile': True, 'compile_fix': True, 'fused_loss': False},
    'fused_loss_compile': {**_BEST, 'compile': True, 'compile_fix': True, 'fused_loss': True},
    'fused_loss_compile_mb_x2': {**_BEST, 'compile': True, 'compile_fix': True, 'fused_loss': True, 'mb_scale': 2},
    'fused_loss_compile_chunk8k_mb_x2': {**_BEST, 'compile': True, 'compile_fix': True,
                                         'fused_loss': {'chunk_size': 8192}, 'mb_scale': 2},
    'fused_loss_compile_chunk1k_mb_x2': {**_BEST, 'compile': True, 'compile_fix': True,
                                         'fused_loss': {'chunk_size': 1024}, 'mb_scale': 2},
    'fused_loss_autotune_mb_x2': {**_BEST, 'compile': {'mode': 'max-autotune-no-cudagraphs'}, 'compile_fix': True,
                                  'fused_loss': True, 'mb_scale': 2},
    # CUDA graphs of the compiled forward/backward (torch.compile mode reduce-overhead: cudagraph trees)
    'fused_loss_cudagraphs_mb_x2': {**_BEST, 'compile': {'mode': 'reduce-overhead'}, 'compile_fix': True,
                                    'fused_loss': True, 'mb_scale': 2},
    'fused_loss_compile_mb_x4': {**_BEST, 'compile': True, 'compile_fix': True, 'fused_loss': True, 'mb_scale': 4},
    'fused_loss_compile_mb_x2_w0': {**_BEST, 'compile': True, 'compile_fix': True, 'fused_loss': True,
                                    'mb_scale': 2, 'num_workers': 0},
    'default_w0': {'num_workers': 0},
    # each chunk's gradient from one softmax kernel (fused_loss.kernel: softmax) instead of fp32 exp + cast
    'default_softmax_grad': {'fused_loss': {'kernel': 'softmax'}},
    'fused_loss_softmax_grad_mb_x2': {**_BEST, 'compile': True, 'compile_fix': True,
                                      'fused_loss': {'kernel': 'softmax'}, 'mb_scale': 2},
    # each chunk's loss and gradient from Liger-Kernel's Triton cross-entropy (fused_loss.kernel: liger)
    'default_liger': {'fused_loss': {'kernel': 'liger'}},
    'default_torch_kernel': {'fused_loss': {'kernel': 'torch'}},
    'fused_loss_liger_mb_x2': {**_BEST, 'compile': True, 'compile_fix': True,
                               'fused_loss': {'kernel': 'liger'}, 'mb_scale': 2},
    'fused_loss_liger_mb_x4': {**_BEST, 'compile': True, 'compile_fix': True,
                               'fused_loss': {'kernel': 'liger'}, 'mb_scale': 4},
    # one intra-op CPU thread in the training process (torchrun's default OMP_NUM_THREADS=1 for several processes)
    'default_t1': {'cpu_threads': 1},
    'fused_loss_compile_mb_x2_t1': {**_BEST, 'compile': True, 'compile_fix': True, 'fused_loss': True,
                                    'mb_scale': 2, 'cpu_threads': 1},
    'fused_loss_compile_mb_x4_t1': {**_BEST, 'compile': True, 'compile_fix': True, 'fused_loss': True,
                                    'mb_scale': 4, 'cpu_threads': 1},
    # each transformer block compiled in place (embedding, final norm and the fused loss eager)
    'fused_loss_blocks': {**_BEST, 'compile': 'blocks', 'compile_fix': True, 'fused_loss': True},
    'fused_loss_blocks_mb_x2': {**_BEST, 'compile': 'blocks', 'compile_fix': True, 'fused_loss': True,
                                'mb_scale': 2},
    'fused_loss_blocks_mb_x4': {**_BEST, 'compile': 'blocks', 'compile_fix': True, 'fused_loss': True,
                                'mb_scale': 4},
    # FP8 training (train.fp8, torchao float8 linears) on top of the project's default config
    'fp8': {'fp8': 'tensorwise'},
    'fp8_rowwise': {'fp8': 'rowwise'},
    # FP8 without FSDP at world size 1 (MPT-1B and up default to FSDP there), and at twice the microbatch
    'fp8_no_fsdp': {'fp8': 'tensorwise', 'fsdp_min_params': None},
    'fp8_mb_x2': {'fp8': 'tensorwise', 'mb_scale': 2},
    'mb_x2_default': {'mb_scale': 2},
    # the default with activation checkpointing forced on / off instead of the memory plan's choice (auto)
    'ac_on': {'activation_checkpointing': True},
    'ac_off': {'activation_checkpointing': False},
}

CSV_FIELDS = [
    'run_id', 'machine', 'timestamp', 'model', 'variant', 'repeat', 'status', 'config_source', 'shims', 'attn_impl', 'attn_type', 'sdpa_backend',
    'drop_mask', 'optimizer', 'compile', 'train_metrics', 'fused_loss', 'fp8', 'fsdp', 'activation_checkpointing', 'num_workers', 'cpu_threads', 'microbatch', 'seq_len', 'steps', 'timed_steps',
    'tokens_per_s',
    'step_ms', 'mfu', 'steady_tokens_per_s', 'steady_mfu', 'steady_first_batch', 'steady_last_batch', 'steady_batches',
    'flops_per_token', 'flops_per_token_foundry', 'peak_flops', 'peak_mem_allocated_gb',
    'peak_mem_reserved_gb', 'mem_before_gb', 'n_params', 'gpu', 'torch', 'torchao', 'cuda', 'composer', 'llmfoundry', 'python', 'error',
    'command',
]


# ------------------------------------------------------------------------------------- registrations

def _register_synthetic_loader() -> None:
    """Register ``llmpipe_synthetic_tokens`` in llm-foundry's dataloader registry (idempotent)."""
    import torch
    from composer.core.data_spec import DataSpec
    from llmfoundry.data.utils import LossGeneratingTokensCollatorWrapper, get_tokens_per_batch_func
    from llmfoundry.registry import dataloaders
    from torch.utils.data import default_collate

    if 'llmpipe_synthetic_tokens' in dataloaders.get_all():
        return

    class _Tokens(torch.utils.data.Dataset):
        def __init__(self, n: int, seq_len: int, vocab: int, seed: int):
            g = torch.Generator().manual_seed(seed)
            self.data = torch.randint(0, vocab, (n, seq_len), generator=g, dtype=torch.long)

        def __len__(self) -> int:
            return len(self.data)

        def __getitem__(self, i: int) -> dict:
            ids = self.data[i]
            return {'input_ids': ids, 'attention_mask': torch.ones_like(ids), 'labels': ids.clone()}

    def build(tokenizer: Any, device_batch_size: int, *, seq_len: int, vocab_size: int, num_samples: int = 4096,
              seed: int = 17, num_workers: int = 0, **_: Any) -> DataSpec:
        """Random token ids in the format of llm-foundry's text collator (input_ids, attention_mask of ones,
        labels = input_ids; the model shifts them), loaded by ``num_workers`` worker processes as the project's
        train loader is (0: in the training process). As llm-foundry's text collator does
        (``llmfoundry.data.utils.get_text_collator``), the collator adds each row's token counts
        (``total_tokens``, ``loss_generating_tokens``), so the trainer sums them instead of counting the labels in
        the training process."""
        ds = _Tokens(num_samples, seq_len, vocab_size, seed)
        extra = {'persistent_workers': True, 'prefetch_factor': 2} if num_workers > 0 else {}
        collate = LossGeneratingTokensCollatorWrapper(default_collate, get_tokens_per_batch_func())
        dl = torch.utils.data.DataLoader(ds, batch_size=int(device_batch_size), shuffle=False, drop_last=True,
                                         num_workers=num_workers, pin_memory=True, collate_fn=collate, **extra)
        return DataSpec(dataloader=dl, get_num_tokens_in_batch=get_tokens_per_batch_func())

    dataloaders.register('llmpipe_synthetic_tokens', func=build)


def _dummy_tokenizer_dir(vocab: int) -> str:
    """A tiny local tokenizer (train() requires one; the device has no hub access; the synthetic loader never
    tokenizes text)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    d = tempfile.mkdtemp(prefix='bench-tok-')
    atexit.register(shutil.rmtree, d, True)  # the benchmark's process owns it; nothing reads it after exit
    tok = Tokenizer(WordLevel({'<|endoftext|>': 0, '<unk>': 1}, unk_token='<unk>'))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token='<|endoftext|>', unk_token='<unk>',
                            pad_token='<|endoftext|>').save_pretrained(d)
    return d


def _make_timer(flops_per_token_: float | None = None, peak_flops: float | None = None,
                clock: Any = time.perf_counter) -> Any:
    """A Composer callback: CUDA-synchronized wall time at every batch end (``clock``), the steady-state timer of
    ``train.json`` fed the same way the training step feeds it (:func:`llmpipe.train.throughput.start` at fit start,
    :func:`llmpipe.train.throughput.batch_end` at every batch end; one device), plus llm-foundry's own FLOPs per token
    (``flops_per_batch``) of the first batch, as a cross-check of :func:`llmpipe.model.mfu.flops_per_token`."""
    from composer.core import Callback

    class Timer(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.tokens: list[int] = []
            self.foundry_flops: float | None = None
            self.steady: throughput.StepTimer | None = None

        def fit_start(self, state: Any, logger: Any) -> None:
            self.steady = throughput.start(state, clock=clock, flops_per_token=flops_per_token_,
                                           peak_flops=peak_flops, world_size=1)

        def batch_end(self, state: Any, logger: Any) -> None:
            import torch
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.times.append(clock())
            throughput.batch_end(self.steady, state)
            self.tokens.append(int(state.batch['input_ids'].numel()))
            if self.foundry_flops is None:
                m = getattr(state.model, '_orig_mod', state.model)
                m = getattr(m, 'module', m)
                try:
                    self.foundry_flops = float(m.flops_per_batch(state.batch)) / state.batch['input_ids'].numel()
                except Exception:  # noqa: BLE001 - only a cross-check
                    self.foundry_flops = float('nan')

    return Timer()


def steady_columns(steady: dict) -> dict:
    """The CSV's ``steady_*`` columns from :meth:`llmpipe.train.throughput.StepTimer.steady`'s record (empty: none)."""
    w = steady['steady_window']
    return {'steady_tokens_per_s': _blank(steady['steady_tokens_per_s']), 'steady_mfu': _blank(steady['steady_mfu']),
            'steady_first_batch': _blank(w['first_batch']), 'steady_last_batch': _blank(w['last_batch']),
            'steady_batches': w['batches']}


def _blank(value: Any) -> Any:
    return '' if value is None else value


def csv_fields(path: str, append: bool) -> list[str]:
    """The columns to write to ``path``: :data:`CSV_FIELDS` for a new file; with ``append``, the existing file's
    columns, and when :data:`CSV_FIELDS` has columns it lacks, those added at the end of its header, the file
    rewritten (atomically) with every old row's values unchanged and the new columns empty."""
    if not (append and os.path.exists(path)):
        return list(CSV_FIELDS)
    with open(path, newline='') as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        fields = list(reader.fieldnames or [])
    if not fields:
        return list(CSV_FIELDS)
    missing = [c for c in CSV_FIELDS if c not in fields]
    if missing:
        fields += missing
        tmp = path + '.tmp'
        with open(tmp, 'w', newline='') as f:
            w = csv.DictWriter(f, fieldnames=fields, lineterminator='\n')
            w.writeheader()
            w.writerows(rows)
        os.replace(tmp, path)
        print(f'note: {path}: added column(s) {missing} (empty in its earlier rows)', file=sys.stderr)
    return fields


# ------------------------------------------------------------------------------------- config

def _load_project_config(path: str) -> dict:
    from llmpipe.config.schema import load_config
    return load_config(path)


def device_memory_gb(config: dict) -> float | None:
    """One GPU's memory in GiB: CUDA device 0's ``total_memory`` where there is one, else the card the config's
    ``gpu_type`` plans for (:func:`llmpipe.config.runs.gpu_memory`; None for ``auto`` without a GPU)."""
    import torch

    from llmpipe.config.runs import gpu_memory
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / 2**30
    return gpu_memory(config)


def build_train_config(config: dict, run: str, variant: dict, *, steps: int, mb_override: int | None,
                       tok_dir: str) -> tuple[dict, dict]:
    """The llm-foundry train config for one benchmark run and a summary of the knobs as used.

    Starts from ``llmpipe.train.pretrain.foundry_train_config(run_config(config, run), data_dir=None, save_folder=None,
    world_size=1)``
    and overrides only data, duration, batch, checkpoints/loggers/eval and the variant's knobs. Two shims make a
    config that llm-foundry would reject runnable, and are recorded in the row's ``shims`` column:
    ``attn_impl: sdpa`` written straight into MPT's ``attn_config`` (MPTConfig accepts only torch/flash) becomes
    :func:`llmpipe.model.attention.mpt_attn_config`, and a missing ``model.loss_fn`` (llm-foundry's default
    ``fused_crossentropy`` needs flash-attn) becomes ``torch_crossentropy``.
    """
    import dataclasses

    from llmpipe.config.runs import deep_merge, run_config, run_settings
    from llmpipe.model.attention import mpt_attn_config, stock_attn_config
    from llmpipe.plan.memory_time import resolve_settings
    from llmpipe.train.pretrain import foundry_train_config  # the project's own training step

    # train settings the project's own config selection depends on (the fused-loss model needs train metrics off)
    train_over = {k: variant[k] for k in ('train_metrics', 'fused_loss', 'fsdp_min_params', 'fp8')
                  if k in variant}
    if 'activation_checkpointing' in variant:
        train_over['fsdp'] = {'activation_checkpointing': variant['activation_checkpointing']}
    if train_over:
        config = deep_merge(config, {'models': {run: {'train': train_over}}})
    rc = run_config(config, run)
    # the benchmark's shape (global batch = microbatch, scaled by the variant) before anything is decided from it
    mb = int(mb_override or rc['train']['microbatch_size']) * int(variant.get('mb_scale', 1))
    rc = {**rc, 'train': {**rc['train'], 'microbatch_size': mb, 'global_batch_size': mb}}
    # activation_checkpointing: auto -> the memory plan's choice for one GPU of this machine, as a training job's
    # (the benchmark trains on one GPU: the run's typed settings are checked at that placement)
    one_gpu = {'resources': {'nodes': 1, 'gpus_per_node': 1}}
    if train_over.get('fp8'):  # FP8 trains in amp_bf16 (llmpipe.train.fp8.check_fp8)
        one_gpu['train'] = {'precision': 'amp_bf16'}
    one_gpu = deep_merge(config, {'models': {run: one_gpu}})
    settings = run_settings(one_gpu, run)
    settings = dataclasses.replace(settings, train=dataclasses.replace(settings.train, microbatch_size=mb,
                                                                       global_batch_size=mb))
    settings = resolve_settings(settings, rc, nodes=1, gpus_per_node=1, capacity_gb=device_memory_gb(config))
    cfg = foundry_train_config(settings, data_dir=None, save_folder=None, world_size=1)  # the tokenizer is set below
    cfg = json.loads(json.dumps(cfg))  # deep copy, plain types
    source = 'llmpipe.train.pretrain.foundry_train_config'
    shims = []
    ac = cfg['model'].get('attn_config') or {}
    if ac.get('attn_impl') == 'sdpa':
        cfg['model']['attn_config'] = mpt_attn_config(ac, 'sdpa')
        shims.append('attn_impl:sdpa->mpt_attn_config')
    if 'loss_fn' not in cfg['model']:
        cfg['model']['loss_fn'] = 'torch_crossentropy'
        shims.append('loss_fn:torch_crossentropy')
    arch = rc['arch']
    seq_len = int(rc['data']['concat_tokens'])


    # data: synthetic tokens instead of the MDS dataset, with the project's loader worker count; no eval
    workers = int(variant.get('num_workers', rc['train'].get('num_workers', 0)))
    cfg['train_loader'] = {'name': 'llmpipe_synthetic_tokens', 'seq_len': seq_len,
                           'vocab_size': int(arch['vocab_size']), 'num_samples': mb * 8, 'seed': 17,
                           'num_workers': workers}
    for k in ('eval_loader', 'eval_loaders', 'icl_tasks', 'eval_gauntlet'):
        cfg.pop(k, None)
    cfg['eval_interval'] = 1  # unused without an eval loader
    cfg['eval_first'] = False
    cfg['tokenizer'] = {'name': tok_dir}
    # duration and batch: global batch = microbatch
    cfg['max_duration'] = f'{steps}ba'
    cfg['global_train_batch_size'] = mb
    cfg['device_train_microbatch_size'] = mb
    cfg.pop('device_train_batch_size', None)
    cfg['device_eval_batch_size'] = mb
    # no checkpoints, loggers, resumption
    for k in ('save_folder', 'load_path', 'autoresume', 'save_interval', 'save_num_checkpoints_to_keep'):
        cfg.pop(k, None)
    cfg['loggers'] = {}
    cfg['progress_bar'] = False
    cfg['log_to_console'] = False
    cfg['python_log_level'] = 'warning'
    cfg['run_name'] = f'bench-{run}'
    callbacks = {k: v for k, v in (cfg.get('callbacks') or {}).items()
                 if k in ('llmpipe_fp8', 'drop_full_attention_mask', 'llmpipe_compile_blocks',
                          'llmpipe_single_device_fsdp')}  # speed-relevant only (FSDP at world size 1 included)
    # knobs
    model = cfg['model']
    attn_config = dict(model.get('attn_config') or {})
    if 'attn_impl' in variant:
        attn_config = mpt_attn_config(attn_config, variant['attn_impl'])
    model['attn_config'] = attn_config
    if 'drop_mask' in variant:
        if variant['drop_mask']:
            callbacks['drop_full_attention_mask'] = {}
        else:
            callbacks.pop('drop_full_attention_mask', None)
    cfg['callbacks'] = callbacks
    if 'optimizer' in variant:
        cfg['optimizer']['name'] = variant['optimizer']
    if 'compile' in variant:
        cfg.pop('compile_config', None)
        callbacks.pop('llmpipe_compile_blocks', None)
        settings = compile_settings({'compile': variant['compile']}, 'variant')   # the train setting's reader
        if settings is not None and settings['scope'] == 'blocks':
            callbacks['llmpipe_compile_blocks'] = dict(settings['options'])
        elif settings is not None:
            cfg['compile_config'] = dict(settings['options'])
    compile_scope = ('blocks' if 'llmpipe_compile_blocks' in callbacks
                     else 'model' if cfg.get('compile_config') is not None else '')
    compiled = bool(compile_scope)
    compile_mode = (callbacks.get('llmpipe_compile_blocks') or cfg.get('compile_config') or {}).get('mode')
    compile_fix = bool(variant.get('compile_fix', compiled and 'compile' not in variant))
    if 'train_metrics' in variant:
        model['use_train_metrics'] = bool(variant['train_metrics'])
    attn_impl = 'sdpa' if attn_config.get('attn_type', '').startswith('sdpa_') else attn_config.get('attn_impl')
    knobs = {
        'config_source': source,
        'shims': ';'.join(shims),
        'attn_impl': attn_impl,
        'attn_type': stock_attn_config(attn_config).get('attn_type', 'multihead_attention') if attn_impl != 'sdpa'
        else attn_config['attn_type'],
        'sdpa_backend': variant.get('sdpa_backend', os.environ.get('LLMPIPE_SDPA_BACKEND', '')) or 'auto',
        'drop_mask': 'drop_full_attention_mask' in callbacks,
        'optimizer': cfg['optimizer']['name'],
        'compile': compiled and (('blocks,' if compile_scope == 'blocks' else '') + ('fix' if compile_fix else 'nofix')
                                 + (f',{compile_mode}' if compile_mode else '')),
        'compile_fix': compile_fix,
        'num_workers': workers,
        'microbatch': mb,
        'seq_len': seq_len,
        'train_metrics': model.get('use_train_metrics', True),
        'fused_loss': _fused_loss_knob(model),
        'fp8': ','.join(f'{k}={v}' for k, v in callbacks['llmpipe_fp8'].items() if k != 'where')
        if 'llmpipe_fp8' in callbacks else '',
        'fsdp': 'llmpipe_single_device_fsdp' in callbacks or 'fsdp_config' in cfg,
        'activation_checkpointing': bool(((callbacks.get('llmpipe_single_device_fsdp') or {}).get('fsdp_config')
                                          or cfg.get('fsdp_config') or {}).get('activation_checkpointing')),
    }
    return cfg, knobs


def _fused_loss_knob(model: dict) -> str:
    """The CSV's ``fused_loss`` column: ``off``, or ``chunk=<rows>[,<kernel>]`` for the fused-loss model (no kernel:
    ``torch``; rows before the ``kernel`` setting wrote ``softmax_grad`` for today's ``softmax``)."""
    from llmpipe.train.pretrain import FUSED_LOSS_MODEL_KEYS
    if 'fused_loss_chunk_size' not in model:
        return 'off'
    assert set(FUSED_LOSS_MODEL_KEYS) <= set(model)
    from llmpipe.model.fused_loss import default_chunk_size
    chunk = model['fused_loss_chunk_size'] or default_chunk_size(int(model['vocab_size']))
    kernel = model['fused_loss_kernel']
    return f"chunk={chunk}" + ('' if kernel == 'torch' else f',{kernel}')


# ------------------------------------------------------------------------------------- run

def _versions() -> dict:
    import importlib.metadata

    import composer
    import llmfoundry
    import torch
    try:
        torchao = importlib.metadata.version('torchao')
    except importlib.metadata.PackageNotFoundError:
        torchao = ''
    return {
        'torchao': torchao,
        'gpu': torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu',
        'torch': torch.__version__,
        'cuda': torch.version.cuda or '',
        'composer': composer.__version__,
        'llmfoundry': llmfoundry.__version__,
        'python': sys.version.split()[0],
    }


def run_one(config: dict, run: str, vname: str, variant: dict, *, steps: int, skip: int, mb_override: int | None,
            tok_dir: str, profile_dir: str | None = None, trace: bool = False) -> dict:
    """Train one (model, variant) for ``steps`` steps; return its CSV row (status 'ok' or the error)."""
    import torch
    from llmfoundry.command_utils import train
    from omegaconf import OmegaConf

    import llmpipe.model.attention as attn

    row: dict[str, Any] = {'model': run, 'variant': vname, 'steps': steps,
                           'timestamp': _dt.datetime.now(_dt.UTC).isoformat(timespec='seconds')}
    trainer = None
    try:
        cfg, knobs = build_train_config(config, run, variant, steps=steps, mb_override=mb_override,
                                        tok_dir=tok_dir)
        row.update(knobs)
        attn.set_sdpa_backend(variant.get('sdpa_backend') or os.environ.get('LLMPIPE_SDPA_BACKEND') or 'auto')
        if knobs.pop('compile_fix'):
            dynamo_catalogue_fix()
        rc_arch = __import__('llmpipe.config.runs', fromlist=['run_config']).run_config(config, run)['arch']
        fpt = flops_per_token(rc_arch, knobs['seq_len'])
        peak = detect_peak_flops('bf16', config.get('gpu_peak_flops') or {})
        timer = _make_timer(fpt, peak)
        extra = [timer]
        if profile_dir:  # profile 3 steps after the timed window's start (timing of those steps is then perturbed)
            extra.append(make_profiler(skip + 2, 3, profile_dir, f'{run}-{vname}', trace=trace))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            # what an earlier variant in this process left allocated (it is inside the peak columns too)
            row['mem_before_gb'] = round(torch.cuda.memory_allocated() / 1e9, 2)

        # train() builds the callbacks from the config; add the timer through the registry-free path: wrap
        # Trainer.__init__ to append it (the config itself stays the project's).
        import composer
        orig_init = composer.Trainer.__init__

        def init(self, *a, **k):
            k['callbacks'] = list(k.get('callbacks') or []) + extra
            return orig_init(self, *a, **k)

        composer.Trainer.__init__ = init
        threads_before = torch.get_num_threads()
        try:
            if variant.get('cpu_threads'):
                torch.set_num_threads(int(variant['cpu_threads']))
            row['cpu_threads'] = torch.get_num_threads()
            trainer = train(OmegaConf.create(cfg))
        finally:
            composer.Trainer.__init__ = orig_init
            torch.set_num_threads(threads_before)
        t = timer.times
        if len(t) < steps or steps <= skip + 1:
            raise RuntimeError(f'only {len(t)} of {steps} steps timed')
        dt = t[-1] - t[skip - 1]
        n = len(t) - skip
        toks = sum(timer.tokens[skip:])
        tps = toks / dt
        cuda = torch.cuda.is_available()
        row.update({
            'status': 'ok',
            'timed_steps': n,
            'tokens_per_s': round(tps, 1),
            'step_ms': round(1000 * dt / n, 2),
            'mfu': round(mfu(tps, fpt, peak), 4) if peak else '',
            **steady_columns(timer.steady.steady()),
            'flops_per_token': int(fpt),
            'flops_per_token_foundry': int(timer.foundry_flops) if timer.foundry_flops == timer.foundry_flops
            else '',
            'peak_flops': peak or '',
            'peak_mem_allocated_gb': round(torch.cuda.max_memory_allocated() / 1e9, 2) if cuda else '',
            'peak_mem_reserved_gb': round(torch.cuda.max_memory_reserved() / 1e9, 2) if cuda else '',
            'n_params': sum(p.numel() for p in trainer.state.model.parameters()),
        })
    except Exception as e:  # noqa: BLE001 - one failed variant must not stop the others
        row['status'] = 'error'
        msg = ''.join(traceback.format_exception_only(type(e), e)).strip().replace('\n', ' | ')
        row['error'] = msg[-600:]
        traceback.print_exc()
    finally:
        if trainer is not None:
            try:
                trainer.close()
            except Exception:  # noqa: BLE001
                pass
            # composer's Engine registers atexit(engine._close, state, logger), which keeps the model, optimizer
            # and their GPU memory alive until the process exits; the next variant or repeat needs that memory
            import atexit
            atexit.unregister(trainer.engine._close)
        del trainer
        gc.collect()
        try:
            import torch._dynamo
            torch._dynamo.reset()
        except Exception:  # noqa: BLE001
            pass
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--config', default=os.path.join(ROOT, 'config', 'config.yaml'))
    ap.add_argument('--models', default='mpt-125m,mpt-350m,mpt-760m,mpt-1b')
    ap.add_argument('--variants', default='default', help=f'comma list of {sorted(VARIANTS)}')
    ap.add_argument('--steps', type=int, default=30)
    ap.add_argument('--skip', type=int, default=10, help='leading steps excluded from the timing')
    ap.add_argument('--microbatch', default='', help='per-model microbatch overrides: mpt-125m=32,mpt-1b=16')
    ap.add_argument('--out', default=os.path.join(ROOT, 'benchmarks', 'train-throughput.csv'))
    ap.add_argument('--append', action='store_true', help='append to --out instead of overwriting')
    ap.add_argument('--profile', default='', help='folder: also profile 3 steps with torch.profiler (kernel '
                    'time by category); those rows are marked profiled and their timing is perturbed')
    ap.add_argument('--machine', default='', help="written to the rows' machine column (e.g. nvidia-h200)")
    ap.add_argument('--run-id', default='', help="a name for this invocation, written to the rows' run_id column (rows of one invocation share it; benchmarks/plan-basis.json names the rows the time plans use by it)")
    ap.add_argument('--trace', action='store_true', help='with --profile: record Python stacks, write the Chrome '
                    'trace (.json.gz) and a report of what the host did while the GPU was idle (-gaps.txt)')
    ap.add_argument('--repeats', type=int, default=1, help='measure each (model, variant) this many times in this '
                    'process (rows carry the repeat number; the summary gives the median tokens/s)')
    args = ap.parse_args(argv)
    if args.steps < 30 or args.skip < 10:
        print('note: the method asks for >= 30 steps with the first 10 excluded', file=sys.stderr)

    # one process, one GPU: a single-rank process group for composer
    os.environ.setdefault('RANK', '0')
    os.environ.setdefault('WORLD_SIZE', '1')
    os.environ.setdefault('LOCAL_RANK', '0')
    os.environ.setdefault('LOCAL_WORLD_SIZE', '1')
    os.environ.setdefault('NODE_RANK', '0')
    os.environ.setdefault('MASTER_ADDR', '127.0.0.1')
    os.environ.setdefault('MASTER_PORT', str(free_port()))

    import llmpipe.model.attention as attention
    attention.register()  # sdpa attention classes + drop_full_attention_mask callback
    _register_synthetic_loader()
    register_fused_adamw()
    register_compile_blocks()
    from llmpipe.train.fp8 import register as register_fp8
    register_fp8()  # llmpipe_fp8 callback (the train config names it when train.fp8 is on)
    from llmpipe.train.fsdp import register as register_fsdp
    register_fsdp()  # llmpipe_single_device_fsdp (the train config names it for FSDP at world size 1)
    from llmpipe.model.fused_loss import register as register_fused_loss
    register_fused_loss()  # mpt_causal_lm_fused_loss (the train config names it when fused_loss is on)

    config = _load_project_config(args.config)
    mb_over = dict(kv.split('=') for kv in args.microbatch.split(',') if kv)
    variants = [v for v in args.variants.split(',') if v]
    for v in variants:
        if v not in VARIANTS:
            ap.error(f'unknown variant {v!r}; known: {sorted(VARIANTS)}')
    versions = _versions()
    tok_dir = _dummy_tokenizer_dir(64)
    command = 'python tools/bench_train_throughput.py ' + ' '.join(argv if argv is not None else sys.argv[1:])

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    mode = 'a' if args.append and os.path.exists(args.out) and os.path.getsize(args.out) else 'w'
    fields = csv_fields(args.out, mode == 'a')  # an older file: the new columns added to its header first
    rows = []
    with open(args.out, mode, newline='') as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction='ignore', lineterminator='\n')
        if mode == 'w':
            w.writeheader()
        for run in [m for m in args.models.split(',') if m]:
            for v, rep in [(v, r) for v in variants for r in range(1, args.repeats + 1)]:
                t0 = time.time()
                row = run_one(config, run, v, VARIANTS[v], steps=args.steps, skip=args.skip,
                              mb_override=int(mb_over[run]) if run in mb_over else None, tok_dir=tok_dir,
                              profile_dir=args.profile or None, trace=args.trace)
                if args.profile:
                    row['variant'] = f'{v}+profiled'
                row.update(versions)
                row.update(command=command, machine=args.machine, run_id=args.run_id, repeat=rep)
                w.writerow(row)
                f.flush()
                rows.append(row)
                print(f"[bench] {run:9s} {v:16s} {row.get('status')} mb={row.get('microbatch')} "
                      f"tok/s={row.get('tokens_per_s')} mfu={row.get('mfu')} "
                      f"steady tok/s={row.get('steady_tokens_per_s')} steady mfu={row.get('steady_mfu')} "
                      f"mem={row.get('peak_mem_allocated_gb')}GB ({time.time() - t0:.0f}s) "
                      f"{row.get('error', '')[:300]}",
                      flush=True)
    print('\nmodel      variant          mb   tokens/s    MFU    steady tok/s steady MFU mem(GB)  status')
    for r in rows:
        print(f"{r['model']:10s} {r['variant']:16s} {str(r.get('microbatch', '')):4s} "
              f"{str(r.get('tokens_per_s', '')):10s} {str(r.get('mfu', '')):6s} "
              f"{str(r.get('steady_tokens_per_s', '')):12s} {str(r.get('steady_mfu', '')):10s} "
              f"{str(r.get('peak_mem_allocated_gb', '')):7s} {r['status']}")
    if args.repeats > 1:
        print('\nmedian of the ok repeats (tokens/s, MFU):')
        for key in dict.fromkeys((r['model'], r['variant']) for r in rows):
            ok = sorted((r for r in rows if (r['model'], r['variant']) == key and r['status'] == 'ok'),
                        key=lambda r: r['tokens_per_s'])
            if ok:
                med = ok[len(ok) // 2]
                print(f"{key[0]:10s} {key[1]:16s} n={len(ok)} median tok/s={med['tokens_per_s']} mfu={med['mfu']} "
                      f"range {ok[0]['tokens_per_s']}-{ok[-1]['tokens_per_s']}")
    return 0 if all(r['status'] == 'ok' for r in rows) else 1


if __name__ == '__main__':
    sys.exit(main())
