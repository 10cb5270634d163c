"""Memory and time plans of a step, computed from its settings before anything is queued (the dry run shows them).

Memory per GPU, in GiB (2**30 bytes), for training (``train_memory``) and inference (``inference_memory``):

* **Model states** (training): fp32 master weights, fp32 gradients and the two fp32 Adam moments, 16 bytes per
  trained parameter (ZeRO paper, Rajbhandari et al. 2020, section 3.1: 2+2+12 bytes for mixed precision; composer
  keeps fp32 weights and fp32 gradients under ``amp_bf16``, so 4+4+8). FSDP ``FULL_SHARD`` divides them by the
  world size, ``HYBRID_SHARD`` by the GPUs of a node, ``SHARD_GRAD_OP`` shards gradients and moments only. A
  LoRA finetune trains only its adapters (``r x (in + out)`` per adapted linear layer,
  :func:`llmpipe.train.lora.adapter_param_count`), 16 bytes each; its frozen weights count 4 bytes each (llm-foundry
  wraps the adapter layers in FSDP units of their own, so no frozen weight gets a gradient or Adam moments, and
  the optimizer holds state only for parameters with a gradient). Under FSDP the gathered bf16
  weights and bf16 gradients of two transformer blocks (the one computing and the one prefetched) are added.
* **Activations**: 32 bytes per layer x token x ``d_model`` (Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models", section 4.1: ``sbh(34 + 5as/h)`` per layer, without the ``5as/h``
  attention-score terms, which flash/SDPA attention never stores, and without the two 1-byte dropout masks, as MPT
  trains with dropout 0). With activation checkpointing (FSDP only, as llm-foundry applies it) each layer keeps
  its bf16 input (2 bytes) and one layer is recomputed at a time (32 bytes). ``activation_checkpointing: auto``
  (the shipped setting) recomputes only when the plan without it exceeds :data:`AUTO_AC_SHARE` of the GPU's memory
  (:func:`resolve_activation_checkpointing`).
* **Logits**: the fused loss keeps one chunk of fp32 log-probabilities (``llmpipe.model.fused_loss``; Liger's kernel
  writes the gradient in place, the others beside it); without it, bf16 logits, their fp32 copy and fp32 gradient
  (10 bytes per token x vocabulary).
* **Inference**: the weights in the step's dtype (generation: bf16; evaluation: fp32, as llm-foundry's
  ``hf_causal_lm`` loads them under ``amp_bf16``), generation's KV cache (K and V, bf16, per layer, for the whole
  context), one layer's activations of evaluation's batch and one forward's logits (bf16 and fp32). Evaluation
  with shared prefixes on one GPU (``eval.icl_batches: shared_prefix``, :mod:`llmpipe.evaluation.shared_prefix`)
  adds the prefixes' KV cache and its copy per sequence (at most 1.5 x the batch's sequences of the whole context:
  a multiple-choice item has two sequences or more) and a second bf16 logits buffer (the two forwards' logits
  assembled into one).

The GPU's memory is the datasheet figure of ``gpu_type`` (80 for an 80 GB part), read as GiB: what torch reports as
``total_memory`` is within about 1.5% of it (H100 80 GB: 79.6 GiB; H200 141 GB: about 139-140 GiB). A step is refused
when its estimate exceeds the GPU's memory by more than :data:`MARGIN`: the estimates run 0-6% above the peaks
measured on one H200 (docs/large-models.md), so only a step that clearly cannot fit is stopped.

Time (``train_time``): the committed benchmark's measured bf16 MFU (the rows of ``benchmarks/train-throughput.csv``
that ``benchmarks/plan-basis.json`` names) times the planned GPU's dense peak, divided by the run's model FLOPs per token (:func:`llmpipe.model.mfu.flops_per_token`), gives
tokens/s per GPU; with activation checkpointing the forward is computed twice (x 3/4). A LoRA finetune computes no
weight gradients of its frozen base: ``4 P + 12 n_layers d_model L`` instead of ``6 P + ...`` FLOPs per token (the
input gradients and attention are still computed; the adapters' own FLOPs are negligible). It is a projection: it
assumes the single-GPU MFU holds at every scale (no communication or restart costs).

What a job spends besides its compute (``job_overheads``, ``train_overheads``, ``convert_time``, and generation in
:func:`llmpipe.plan.inference_placement.inference_time`) comes from ``benchmarks/job-overheads-h200.json``, each value with
its derivation from earlier committed measurements: job start-up (imports, model build, loaders), torch.compile per
transformer block, checkpoint saves (12 bytes per trained parameter: fp32 weights and two Adam moments; a LoRA
finetune's frozen base is not saved) at the measured write rate per node, in-training evaluations (their forward tokens at a third of a training
token's time), ``convert``'s start and its work per parameter, and generation's time per new token and block.
The rates are one H200 host's (virtio disk); a cluster's shared file system differs, and the plan says which file the
constants come from.

This module imports without torch (the Snakefile imports it) and takes explicit arguments, never the workflow config.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
import math
import os
import types
from collections.abc import Mapping
from pathlib import Path

from llmpipe.config.settings import FUSED_LOSS_DEFAULT_KERNEL, ConfigError, RunSettings
from llmpipe.model.mfu import flops_per_token, mpt_param_count, peak_flops_for_name
from llmpipe.train.lora import adapter_param_count

__all__ = [
    'AUTO_AC_SHARE',
    'BENCHMARK_CSV',
    'PLAN_BASIS_JSON',
    'GPU_MEMORY_GB',
    'benchmark_basis',
    'check_fits',
    'smallest_world_size',
    'check_inference_fits',
    'gpu_memory_gb',
    'human_time',
    'inference_memory',
    'JOB_OVERHEADS_JSON',
    'checkpoint_bytes',
    'convert_memory',
    'convert_time',
    'job_overheads',
    'train_overheads',
    'plan_line',
    'resolve_activation_checkpointing',
    'train_memory',
    'train_time',
]

GB = 2**30  # GiB: the plans' unit
#: The committed training-throughput benchmark (``tools/bench_train_throughput.py`` appends to it).
BENCHMARK_CSV = str(Path(__file__).resolve().parents[2] / 'benchmarks' / 'train-throughput.csv')
#: Which of its rows the time plans (and the report's projection) start from, and why (:func:`benchmark_basis`).
PLAN_BASIS_JSON = os.path.join(os.path.dirname(BENCHMARK_CSV), 'plan-basis.json')
#: Bytes per layer x token x d_model of the activations a transformer block stores for its backward (see module doc).
ACT_BYTES = 32
#: A step is refused when its estimate exceeds the GPU's memory by more than this share (see module doc).
MARGIN = 0.10
#: Plans above this share of the GPU's memory are marked as tight (allocator fragmentation, CUDA context, NCCL).
TIGHT = 0.9
#: ``train.fsdp.activation_checkpointing: auto`` turns recomputation off when the plan without it stays within this
#: share of the GPU's memory (the estimates run 0-6% above measured peaks; the rest is allocator and NCCL headroom).
AUTO_AC_SHARE = 0.85

#: Memory per GPU (datasheet GB, read as GiB) by ``gpu_type`` (vendor datasheets); the config's ``gpu_memory_gb``
#: adds to or overrides it.
#: The name, with '-' read as ' ', also picks the peak FLOP/s of :data:`llmpipe.model.mfu.PEAK_FLOPS` for the time plan.
GPU_MEMORY_GB: dict[str, float] = {
    'h100': 80,          # H100 SXM5 80 GB HBM3 (H100 datasheet)
    'h100-pcie': 80,     # H100 PCIe 80 GB HBM2e
    'h100-nvl': 94,      # H100 NVL 94 GB HBM3
    'h200': 141,         # H200 SXM 141 GB HBM3e (H200 datasheet)
    'h200-nvl': 141,     # H200 NVL 141 GB HBM3e
    'a100-80gb': 80,     # A100 80 GB HBM2e (A100 datasheet)
    'a100-40gb': 40,     # A100 40 GB HBM2
    'b200': 180,         # HGX B200, 180 GB HBM3e per GPU
    'l40s': 48,          # L40S 48 GB GDDR6
    'mi300x': 192,       # AMD Instinct MI300X 192 GB HBM3
}


def gpu_memory_gb(gpu_type: str, overrides: Mapping[str, float] | None = None) -> float:
    """Memory of one GPU of ``gpu_type`` in GiB (its datasheet GB): ``overrides`` (config ``gpu_memory_gb``) first, then
    :data:`GPU_MEMORY_GB`.

    Raises:
        ConfigError: an unknown type, naming ``gpu_type`` and the known ones.
    """
    table = {**GPU_MEMORY_GB, **{str(k).lower(): float(v) for k, v in (overrides or {}).items()}}
    key = str(gpu_type).lower()
    if key not in table:
        raise ConfigError(f"gpu_type is {gpu_type!r}, which is not a known GPU type "
                          f"(known: {', '.join(sorted(table))}). "
                          f"Fix: set gpu_type to one of them (or auto: this machine's GPU, by nvidia-smi), or give "
                          f"its memory with gpu_memory_gb: {{{gpu_type}: <GB>}} (and its dense bf16 peak with "
                          f"gpu_peak_flops: {{{gpu_type}: <FLOP/s>}}, for the time plans).")
    return float(table[key])


def _fsdp(rc: Mapping, world_size: int, gpus_per_node: int) -> dict | None:
    """The FSDP settings a training runs under (None: plain data parallel), as llmpipe.train.pretrain.uses_fsdp decides."""
    fsdp = rc['train'].get('fsdp') or {}   # null: composer's defaults (FULL_SHARD), as the training gets them
    if world_size > 1:
        return dict(fsdp)
    threshold = rc['train'].get('fsdp_min_params')
    if threshold is None or 'd_model' not in (rc.get('arch') or {}):
        return None
    return dict(fsdp) if mpt_param_count(rc['arch'])['total'] >= float(threshold) else None


def _logits_bytes(rc: Mapping, tokens: int, vocab: int) -> float:
    train = rc['train']
    fused = train['fused_loss']
    if rc.get('kind') != 'finetune' and fused and not train['train_metrics']:
        chunk = fused.get('chunk_size') if isinstance(fused, Mapping) else None
        rows = int(chunk) if chunk else min(8192, max(1, 2**29 // vocab))
        # the kernel as training resolves it (llmpipe.config.runs.fused_loss_settings): absent or null is the default
        kernel = (fused.get('kernel') if isinstance(fused, Mapping) else None) or FUSED_LOSS_DEFAULT_KERNEL
        return min(rows, tokens) * vocab * 4 * (1 if kernel == 'liger' else 2)
    return tokens * vocab * 10


def train_memory(rc: Mapping, *, nodes: int, gpus_per_node: int, activation_checkpointing: bool | None = None,
                 microbatch_size: int | None = None, capacity_gb: float | None = None) -> dict:
    """Per-GPU memory plan of one training (see the module doc for each term and its source).

    Args:
        rc: the run's merged settings (:func:`llmpipe.config.runs.run_config`): ``arch``, ``data.concat_tokens``,
            ``train`` (``microbatch_size``, ``fsdp``, ``fsdp_min_params``, ``fused_loss``), ``lora`` for finetunes.
        nodes, gpus_per_node: the job's GPUs (world size = their product).
        activation_checkpointing, microbatch_size: override the run's settings (to say what a change would give).
        capacity_gb: one GPU's memory (:func:`gpu_memory_gb`); decides ``activation_checkpointing: auto`` (off when
            the plan without it is at most :data:`AUTO_AC_SHARE` of it; on when not given).

    Returns:
        ``{'params': P, 'trained_params': P, or the LoRA adapters' count, 'lora': bool, 'world_size', 'nodes',
        'gpus_per_node', 'fsdp':
        sharding strategy or None, 'activation_checkpointing': bool, 'activation_checkpointing_auto': bool (the
        setting was ``auto``), 'without_checkpointing_gb': the total without recompute that decided ``auto`` (else
        None), 'microbatch_size' (capped at the per-device batch, as the training runs it), 'seq_len', 'states_gb',
        'fsdp_buffers_gb', 'activations_gb', 'logits_gb', 'total_gb'}``.
    """
    arch = rc['arch']
    world = max(1, int(nodes) * max(1, int(gpus_per_node)))
    counts = mpt_param_count(arch)
    params = counts['total']
    d, n_layers, vocab = int(arch['d_model']), int(arch['n_layers']), int(arch['vocab_size'])
    per_block = counts['non_embedding'] / n_layers
    fsdp = _fsdp(rc, world, gpus_per_node)
    strategy = str(fsdp.get('sharding_strategy', 'FULL_SHARD')).upper() if fsdp is not None else None
    auto = fsdp is not None and fsdp.get('activation_checkpointing') == 'auto' and activation_checkpointing is None
    ac = bool(fsdp.get('activation_checkpointing')) if fsdp is not None else False
    without_gb = None
    if activation_checkpointing is not None:
        ac = bool(activation_checkpointing) and fsdp is not None
    elif auto:
        without_gb = train_memory(rc, nodes=nodes, gpus_per_node=gpus_per_node, activation_checkpointing=False,
                                  microbatch_size=microbatch_size)['total_gb']
        ac = capacity_gb is None or without_gb > AUTO_AC_SHARE * float(capacity_gb)
    # the training runs at most its per-device batch (llmpipe.train.pretrain.foundry_train_config caps it)
    mb = min(int(microbatch_size or rc['train']['microbatch_size']),
             max(1, int(rc['train']['global_batch_size']) // world))
    seq = int(rc['data']['concat_tokens'])
    tokens = mb * seq

    adapters = adapter_param_count(arch, rc.get('lora'))
    trained = adapters if rc.get('lora') else params   # LoRA: only the adapters get gradients and moments
    weights, rest = 4 * (params + adapters), 12 * trained    # fp32 weights; fp32 gradients + two fp32 Adam moments
    shard = {None: 1, 'NO_SHARD': 1, 'FULL_SHARD': world, 'SHARD_GRAD_OP': world,
             'HYBRID_SHARD': max(1, int(gpus_per_node)), '_HYBRID_SHARD_ZERO2': max(1, int(gpus_per_node))}
    n = shard.get(strategy, world)
    states = (weights if strategy in ('SHARD_GRAD_OP', '_HYBRID_SHARD_ZERO2') else weights / n) + rest / n
    buffers = 2 * (2 + 2) * per_block if fsdp is not None else 0.0
    if ac:
        acts = 2 * tokens * d * n_layers + ACT_BYTES * tokens * d
    else:
        acts = ACT_BYTES * tokens * d * n_layers
    logits = _logits_bytes(rc, tokens, vocab)
    total = states + buffers + acts + logits
    return {'params': params, 'trained_params': trained, 'lora': bool(rc.get('lora')), 'world_size': world,
            'nodes': max(1, int(nodes)), 'gpus_per_node': max(1, int(gpus_per_node)), 'fsdp': strategy,
            'activation_checkpointing': ac, 'activation_checkpointing_auto': auto,
            'without_checkpointing_gb': without_gb,
            'microbatch_size': mb, 'seq_len': seq, 'states_gb': states / GB, 'fsdp_buffers_gb': buffers / GB,
            'activations_gb': acts / GB, 'logits_gb': logits / GB, 'total_gb': total / GB}


def resolve_activation_checkpointing(rc: Mapping, *, nodes: int, gpus_per_node: int,
                                     capacity_gb: float | None) -> dict:
    """``rc`` with ``train.fsdp.activation_checkpointing: auto`` replaced by the boolean the training runs with:
    :func:`train_memory`'s decision for ``nodes x gpus_per_node`` GPUs of ``capacity_gb`` GiB (None: on); off for a
    CPU job (``gpus_per_node`` 0) or a run without FSDP, on for a base without a known architecture. Any other value
    is kept; ``rc`` itself is never changed (the result is a copy)."""
    fsdp = rc['train'].get('fsdp')
    if not isinstance(fsdp, Mapping) or fsdp.get('activation_checkpointing') != 'auto':
        return dict(rc)
    if int(gpus_per_node) <= 0:
        on = False
    elif 'd_model' not in (rc.get('arch') or {}):  # a hub base without its architecture: nothing to plan from
        on = True
    else:
        on = bool(train_memory(rc, nodes=nodes, gpus_per_node=gpus_per_node,
                               capacity_gb=capacity_gb)['activation_checkpointing'])
    return {**rc, 'train': {**rc['train'], 'fsdp': {**fsdp, 'activation_checkpointing': on}}}


def resolve_settings(settings: RunSettings, rc: Mapping, *, nodes: int, gpus_per_node: int,
                     capacity_gb: float | None) -> RunSettings:
    """The typed settings ``settings`` of the run whose merged settings are ``rc`` (the memory plan's input) with
    ``train.fsdp`` as :func:`resolve_activation_checkpointing` resolves it for ``nodes x gpus_per_node`` GPUs of
    ``capacity_gb`` GiB; what a training job trains with."""
    resolved = resolve_activation_checkpointing(rc, nodes=nodes, gpus_per_node=gpus_per_node,
                                                capacity_gb=capacity_gb)
    return dataclasses.replace(settings, train=dataclasses.replace(settings.train, fsdp=resolved['train']['fsdp']))


def inference_memory(rc: Mapping, *, step: str, batch_size: int = 1, context: int | None = None,
                     gpus: int = 1, shared_prefix: bool = False) -> dict:
    """Per-GPU memory plan of generation (``step='generate'``: bf16 weights, one prompt at a time) or evaluation
    (``'eval'``: fp32 weights under ``amp_bf16``, ``batch_size`` sequences of the run's length, no KV cache but
    shared prefixes', below) on
    ``gpus`` GPUs (:mod:`llmpipe.plan.inference_placement`).

    On more than one GPU, evaluation runs under FSDP ``FULL_SHARD``: the weights are divided by ``gpus`` and the
    bf16 weights of two gathered blocks (the one computing and the one prefetched) are added; each GPU keeps its own
    batch's activations and logits. Generation's ``device_map`` splits the blocks, so weights and KV cache are
    divided by ``gpus``; the logits stay whole on the last GPU. ``shared_prefix`` (evaluation on one GPU with
    ``eval.icl_batches: shared_prefix``; ignored otherwise, as several processes take the trimmed forward) adds the
    prefixes' KV cache and its per-sequence copy, 1.5 x ``batch_size`` sequences of ``context`` tokens at most, and a
    second bf16 logits buffer (module docstring).

    ``context`` is the tokens a sequence holds at most (default: generation the model's ``max_seq_len``, as prompt
    + new tokens stay within it; evaluation ``data.concat_tokens``). Returns ``{'params', 'gpus', 'weights_gb',
    'fsdp_buffers_gb', 'kv_cache_gb', 'activations_gb', 'logits_gb', 'total_gb'}`` (GiB per GPU).
    """
    arch = rc['arch']
    counts = mpt_param_count(arch)
    params = counts['total']
    d, n_layers, n_heads = int(arch['d_model']), int(arch['n_layers']), int(arch['n_heads'])
    attn = arch.get('attn_config') or {}
    kv_heads = int(arch.get('kv_n_heads') or attn.get('kv_n_heads') or n_heads)
    ctx = int(context or (arch.get('max_seq_len') if step == 'generate' else rc['data']['concat_tokens']))
    gen = step == 'generate'
    n = max(1, int(gpus))
    weights = (2 if gen else 4) * params / n
    buffers = 2 * 2 * counts['non_embedding'] / n_layers if (n > 1 and not gen) else 0
    kv_per_seq = 2 * n_layers * ctx * (d * kv_heads // n_heads) * 2
    prefixes = shared_prefix and not gen and n == 1
    kv = kv_per_seq * batch_size / n if gen else (1.5 * kv_per_seq * batch_size if prefixes else 0)
    acts = 0 if gen else ACT_BYTES * batch_size * ctx * d
    logits = batch_size * ctx * int(arch['vocab_size']) * (2 + 4 + (2 if prefixes else 0))
    total = weights + buffers + kv + acts + logits
    return {'params': params, 'gpus': n, 'weights_gb': weights / GB, 'fsdp_buffers_gb': buffers / GB,
            'kv_cache_gb': kv / GB, 'activations_gb': acts / GB, 'logits_gb': logits / GB, 'total_gb': total / GB}


def _acceptance_rows(folder: str, records: list[str], model: str) -> list[dict]:
    """The training phases of the acceptance records ``records`` (files in ``folder``, ``tools/gpu_acceptance.py``)
    of ``model`` that are ok and have a steady window: ``{'gpu', 'timestamp', 'tokens_per_s', 'mfu',
    'flops_per_token', 'peak_flops', 'source'}`` each, from the window's tokens/s and MFU (start-up, compile and
    checkpoint saves left out, as the benchmark's timed steps leave them out)."""
    rows = []
    for name in records:
        try:
            with open(os.path.join(folder, name)) as f:
                rec = json.load(f)
        except FileNotFoundError:
            continue
        t = rec.get('train') or {}
        if not rec.get('ok') or rec.get('run') != model or not t.get('steady_mfu'):
            continue
        rows.append({'gpu': t.get('device') or (rec.get('stack') or {}).get('device', ''),
                     'timestamp': rec.get('date', ''), 'tokens_per_s': float(t['steady_tokens_per_s_per_device']),
                     'mfu': float(t['steady_mfu']), 'flops_per_token': float(t['flops_per_token']),
                     'peak_flops': float(t['peak_flops_per_device']), 'source': name})
    return rows


def benchmark_basis(csv_path: str | None = None, model: str | None = None, variant: str | None = None,
                    run_id: str | None = None, basis_path: str = PLAN_BASIS_JSON,
                    card: str | None = None) -> dict | None:
    """The time plan's basis for GPU type ``card``: the median by MFU of the measured rows ``basis_path`` names for it.

    Which rows is a committed choice, not the newest row: ``basis_path`` (``benchmarks/plan-basis.json``) holds, per
    card under ``cards``, either the training throughput CSV (``csv``, relative to its folder, written by
    ``tools/bench_train_throughput.py``) with a ``model``, ``variant`` and ``run_id`` (its ``ok`` rows: one, or the
    repeats of ``--repeats``), or ``acceptance``: acceptance records of ``model`` (``tools/gpu_acceptance.py``; each
    record's steady training window, :func:`_acceptance_rows`). A card without its own rows (or ``card`` None) gets
    the rows of ``other_cards``, which :func:`train_time` scales by the card's own bf16 peak. A file without
    ``cards`` is one CSV choice for every card. ``csv_path``, ``model``, ``variant`` and ``run_id``, when given,
    override the CSV choice (tests).

    Returns ``{'model', 'variant', 'gpu', 'run_id', 'timestamp', 'tokens_per_s', 'mfu', 'flops_per_token',
    'peak_flops', 'repeats', 'card': the key of the rows used, 'source': where they are, for the plan's text}``;
    None when a file or such a row is missing.
    """
    try:
        with open(basis_path) as f:
            chosen = json.load(f)
    except FileNotFoundError:
        return None
    folder = os.path.dirname(basis_path)
    cards = chosen.get('cards')
    key = None
    if cards:
        key = str(card).lower() if card is not None and str(card).lower() in cards else chosen['other_cards']
        chosen = cards[key]
    model, variant = model or chosen['model'], variant or chosen.get('variant', 'default')
    if chosen.get('acceptance') and not (csv_path or run_id):
        rows = sorted(_acceptance_rows(folder, list(chosen['acceptance']), model), key=lambda r: r['mfu'])
        if not rows:
            return None
        r = rows[(len(rows) - 1) // 2]
        return {'model': model, 'variant': variant, 'gpu': r['gpu'], 'run_id': r['source'], 'repeats': len(rows),
                'timestamp': r['timestamp'], 'tokens_per_s': r['tokens_per_s'], 'mfu': r['mfu'],
                'flops_per_token': r['flops_per_token'], 'peak_flops': r['peak_flops'], 'card': key,
                'source': (f"steady training windows of {', '.join('benchmarks/' + n for n in chosen['acceptance'])}"
                           if len(rows) > 1 else f"the steady training window of benchmarks/{r['source']}")}
    csv_path = csv_path or os.path.join(folder, chosen['csv'])
    run_id = run_id or chosen['run_id']
    try:
        with open(csv_path, newline='') as f:
            rows = sorted((r for r in csv.DictReader(f) if r.get('model') == model and r.get('variant') == variant
                           and r.get('run_id') == run_id and r.get('status') == 'ok' and r.get('mfu')),
                          key=lambda r: float(r['mfu']))
    except FileNotFoundError:
        return None
    if not rows:
        return None
    r = rows[(len(rows) - 1) // 2]
    return {'model': model, 'variant': variant, 'gpu': r['gpu'], 'run_id': run_id, 'repeats': len(rows),
            'timestamp': r['timestamp'], 'tokens_per_s': float(r['tokens_per_s']), 'mfu': float(r['mfu']),
            'flops_per_token': float(r['flops_per_token']), 'peak_flops': float(r['peak_flops']), 'card': key,
            'source': f"run {run_id} of benchmarks/{os.path.basename(csv_path)}"}


#: The per-job costs of the time plans, each with its derivation (module docstring).
JOB_OVERHEADS_JSON = os.path.join(os.path.dirname(BENCHMARK_CSV), 'job-overheads-h200.json')


@functools.lru_cache(maxsize=4)
def job_overheads(path: str = JOB_OVERHEADS_JSON) -> Mapping | None:
    """``{name: value}`` of every committed per-job cost in ``path`` (``start_s``, ``compile_s_per_layer``,
    ``save_bytes_per_s``, ``load_bytes_per_s``, ``requeue_hold_s``, ``convert_*``, ``generate_*``; each one's unit,
    meaning and derivation are in the file) plus ``source`` (the file's base name); None when the file is missing.
    Read once per process (the dry run asks for every step's resources many times); read-only."""
    import json
    try:
        with open(path) as fh:
            raw = json.load(fh)
    except FileNotFoundError:
        return None
    out = {k: float(v['value']) for k, v in raw.items() if isinstance(v, dict) and 'value' in v}
    out['source'] = os.path.basename(path)
    return types.MappingProxyType(out)


def checkpoint_bytes(rc: Mapping) -> int:
    """Bytes of one training checkpoint of the run (all ranks together): the fp32 weights and two fp32 Adam moments
    of every trained parameter, 12 bytes each. A LoRA finetune's checkpoint holds its adapters only (composer's
    ``should_save_peft_only``): the frozen base is read from its source at every start, and by conversion."""
    trained = adapter_param_count(rc['arch'], rc['lora']) if rc.get('lora') else mpt_param_count(rc['arch'])['total']
    return int(12 * trained)


def train_overheads(rc: Mapping, *, nodes: int, tokens_per_s_per_gpu: float, overheads: Mapping) -> dict:
    """What a fresh training job of the run spends besides its training batches, in seconds: ``start``,
    ``compile`` (``train.compile`` on: ``compile_s_per_layer`` x blocks), ``saves`` (one per
    ``save_interval_batches`` and at the end: :func:`checkpoint_bytes` / ``nodes`` at ``save_bytes_per_s``, the nodes
    writing their shards at once), ``evals`` (one per ``eval_interval_batches``: ``eval_subset_batches`` x
    ``eval_microbatch_size`` sequences forward per GPU, a third of a training token's time; an unbounded subset
    counts 0), with the counts ``n_saves`` and ``n_evals``. A resumed job adds the checkpoint's read
    (``load_bytes_per_s``), not planned here."""
    t = rc['train']
    batches = int(t['max_duration_batches'])
    save_every = int(t.get('save_interval_batches') or batches)
    eval_every = int(t.get('eval_interval_batches') or 0)
    n_saves = -(-batches // max(save_every, 1))
    n_evals = batches // eval_every if eval_every > 0 else 0
    per_save = checkpoint_bytes(rc) / max(int(nodes), 1) / overheads['save_bytes_per_s']
    subset = int(t.get('eval_subset_batches') or 0)
    eval_tokens = max(subset, 0) * int(t.get('eval_microbatch_size') or t.get('microbatch_size') or 1) \
        * int(rc['data']['concat_tokens'])
    per_eval = eval_tokens / (3 * tokens_per_s_per_gpu) if tokens_per_s_per_gpu > 0 else 0.0
    compiled = t.get('compile') not in (None, False)
    return {'start': overheads['start_s'],
            'compile': overheads['compile_s_per_layer'] * int(rc['arch']['n_layers']) if compiled else 0.0,
            'saves': n_saves * per_save, 'n_saves': n_saves, 'per_save': per_save,
            'evals': n_evals * per_eval, 'n_evals': n_evals, 'per_eval': per_eval}


def convert_time(rc: Mapping, overheads: Mapping) -> dict:
    """Planned seconds of the run's ``convert`` job: ``convert_start_s`` + ``convert_s_per_param`` x parameters
    (reading the checkpoint's weights, the bf16 export and its verification reload). Returns ``{'seconds',
    'basis': text}``."""
    params = mpt_param_count(rc['arch'])['total']
    work = overheads['convert_s_per_param'] * params
    work_text = f"{work:.0f} s" if work >= 1 else "under 1 s"
    return {'seconds': overheads['convert_start_s'] + work,
            'basis': f"start {overheads['convert_start_s']:.0f} s + {human_count(params)} parameters {work_text} "
                     f"({overheads['source']})"}


def human_count(n: float) -> str:
    """A count (e.g. of parameters) with the unit that keeps 3 significant digits: ``530K``, ``1.32M``, ``6.9B``;
    below 1,000 the number itself."""
    for size, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


def convert_memory(rc: Mapping, overheads: Mapping) -> dict:
    """Planned peak host memory of the run's ``convert`` job, in GiB: the process (``convert_base_gib``) plus the
    larger of the bf16 export (2 bytes per parameter) and the verification reload that follows it
    (``convert_verify_bytes_per_param``: two fp32 models). Returns ``{'export_gb', 'verify_gb', 'total_gb'}``."""
    params = mpt_param_count(rc['arch'])['total']
    base = overheads['convert_base_gib']
    export = base + 2 * params / GB
    verify = base + overheads['convert_verify_bytes_per_param'] * params / GB
    return {'export_gb': export, 'verify_gb': verify, 'total_gb': max(export, verify)}


def train_time(rc: Mapping, *, nodes: int, gpus_per_node: int, gpu_type: str, basis: Mapping,
               activation_checkpointing: bool = False,
               peak_overrides: Mapping[str, float] | None = None,
               overheads: Mapping | None = None, time_limit_s: float | None = None) -> dict | None:
    """Projected wall time of a training's whole token budget (``max_duration_batches x global_batch_size x
    concat_tokens``) on ``nodes x gpus_per_node`` GPUs of ``gpu_type``.

    tokens/s per GPU = ``basis['mfu']`` x bf16 peak of ``gpu_type`` / the run's FLOPs per token, i.e. the
    benchmark's throughput scaled by the ratio of FLOPs per token (and of peaks when the GPU differs); x 3/4 with
    activation checkpointing (one more forward, 8 instead of 6 FLOPs per parameter and token); a LoRA finetune
    (``rc['lora']``) needs ``4 P + 12 n_layers d_model L`` FLOPs per token instead of ``6 P + ...``, its frozen base
    computing no weight gradients (``flops_per_token`` in the result stays the full count, the MFU convention).

    With ``overheads`` (:func:`job_overheads`) the job's start-up, compile, checkpoint saves and in-training
    evaluations (:func:`train_overheads`, result key ``overheads``) are added to ``seconds``. With ``time_limit_s``
    too (a Slurm job's limit), a training longer than one allocation is requeued: each requeue adds Slurm's hold
    (``requeue_hold_s``), a start, a compile and the read of the newest checkpoint (``load_bytes_per_s``), and
    ``allocations`` is how many allocations of the limit it takes (``n = ceil((T - r) / (L - r))`` for a total ``T``,
    a restart ``r`` and a limit ``L``; None when ``L <= r``: a restart alone outlasts the limit).

    Returns ``{'tokens', 'flops_per_token', 'tokens_per_s', 'seconds', 'days', 'basis': text}``, or None for a
    CPU job (no GPUs) or a GPU type without a known peak.
    """
    gpus = int(nodes) * int(gpus_per_node)
    peak = peak_flops_for_name(str(gpu_type).replace('-', ' '), 'bf16', peak_overrides)
    if gpus <= 0 or not peak:
        return None
    seq = int(rc['data']['concat_tokens'])
    fpt = flops_per_token(rc['arch'], seq)
    recompute = 4 / 3 if activation_checkpointing else 1.0   # the forward once more: 8 instead of 6 per parameter
    work = fpt * recompute   # FLOPs computed per token
    lora = 1.0
    if rc.get('lora'):  # no weight gradients of the frozen base: 4 (6 with recompute) instead of 6 (8) per parameter
        attention = 12.0 * int(rc['arch']['n_layers']) * int(rc['arch']['d_model']) * seq
        lora = ((fpt - attention) * (6 if activation_checkpointing else 4) / 6 + attention * recompute) / work
    tps_gpu = float(basis['mfu']) * peak / (work * lora)
    tokens = int(rc['train']['max_duration_batches']) * int(rc['train']['global_batch_size']) * seq
    seconds = tokens / (tps_gpu * gpus)
    med = f"median of {basis['repeats']} runs, " if int(basis.get('repeats') or 1) > 1 else ""
    source = basis.get('source') or f"run {basis['run_id']} of benchmarks/train-throughput.csv"
    rows_for = f" for {basis['card']}" if basis.get('card') else ""
    text = (f"projection: MFU {float(basis['mfu']):.3f} of {basis['model']} ({basis['variant']}, {med}"
            f"{basis['gpu']}, {source}, named by benchmarks/plan-basis.json{rows_for}) x {gpu_type} bf16 peak"
            + (", x 3/4 for activation recompute" if activation_checkpointing else "")
            + (f", LoRA: x {lora:.2f} the FLOPs (no weight gradients of the frozen base)" if rc.get('lora') else "")
            + "; no communication or restart costs")
    extra = None
    if overheads:
        extra = train_overheads(rc, nodes=int(nodes), tokens_per_s_per_gpu=tps_gpu, overheads=overheads)
        seconds += extra['start'] + extra['compile'] + extra['saves'] + extra['evals']
        text += (f"; + start {extra['start']:.0f} s, compile {extra['compile']:.0f} s, {extra['n_saves']} save(s) "
                 f"of {checkpoint_bytes(rc) / GB:.3g} GiB{' (LoRA: the adapters only)' if rc.get('lora') else ''} x "
                 f"{extra['per_save']:.0f} s, {extra['n_evals']} evaluation(s) x {extra['per_eval']:.0f} s "
                 f"({overheads['source']})")
        if time_limit_s and seconds > time_limit_s:
            restart = (overheads['requeue_hold_s'] + extra['start'] + extra['compile']
                       + checkpoint_bytes(rc) / max(int(nodes), 1) / overheads['load_bytes_per_s'])
            extra['restart'] = restart
            if time_limit_s <= restart:
                extra['allocations'] = None
                text += (f"; NO PROGRESS: a restart ({restart:.0f} s) outlasts the time limit ({time_limit_s / 60:.0f} "
                         f"min)")
            else:
                n = math.ceil((seconds - restart) / (time_limit_s - restart))
                seconds += (n - 1) * restart
                extra['allocations'] = n
                text = text.replace('no communication or restart costs', 'no communication costs')
                text += (f"; {n} allocations of the {time_limit_s / 3600:.3g} h limit, each requeue "
                         f"{restart:.0f} s (Slurm's hold {overheads['requeue_hold_s']:.0f} s + start, compile, "
                         f"checkpoint read)")
    return {'tokens': tokens, 'flops_per_token': fpt, 'tokens_per_s': tps_gpu * gpus, 'seconds': seconds,
            'days': seconds / 86400, 'basis': text, 'overheads': extra}


def human_time(seconds: float) -> str:
    """A projected duration in the unit that reads best: ``40 s``, ``12.5 minutes``, ``5.2 hours``, ``10.0 days``,
    ``8.1 months`` (30 days)."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} minutes"
    days = seconds / 86400
    if days < 2:
        return f"{seconds / 3600:.1f} hours"
    return f"{days:.1f} days" if days < 60 else f"{days:.0f} days = {days / 30:.1f} months"


def plan_line(step: str, run: str, plan: Mapping, capacity_gb: float | None, gpu_type: str,
              time: Mapping | None = None, note: str = "") -> str:
    """One line for the dry run: the step's per-GPU memory plan (and projected time) against the memory of the card
    ``gpu_type`` names (:attr:`llmpipe.plan.card.Card.label`); ``capacity_gb`` None: no card to plan for (the line
    says so, ``gpu_type`` saying why). ``note`` (e.g. :meth:`llmpipe.plan.card.Card.unknown_note`) ends the line."""
    if 'states_gb' in plan:
        parts = (f"states {plan['states_gb']:.1f} + fsdp buffers {plan['fsdp_buffers_gb']:.1f} + activations "
                 f"{plan['activations_gb']:.1f} + logits {plan['logits_gb']:.1f}; "
                 f"{plan['fsdp'] or 'no FSDP'} over {plan['world_size']} GPU(s) ({plan['nodes']} node(s) x "
                 f"{plan['gpus_per_node']}), microbatch "
                 f"{plan['microbatch_size']} x {plan['seq_len']}, activation checkpointing "
                 f"{'on' if plan['activation_checkpointing'] else 'off'}"
                 + ((f" (auto: {plan['without_checkpointing_gb']:.1f} GiB without it, off up to {AUTO_AC_SHARE:.0%} "
                     f"of the GPU)" if capacity_gb is not None else " (auto: no card's memory to decide by)")
                    if plan.get('without_checkpointing_gb') is not None else "")
                 + (f", LoRA: {plan['trained_params']:,} trained of {plan['params']:,} parameters"
                    if plan.get('lora') else ""))
    else:
        n = int(plan.get('gpus', 1))
        where = ('one GPU' if n == 1 else f"1 node x {n} GPUs, "
                 + ('device_map balanced' if step == 'generate' else 'FSDP FULL_SHARD'))
        buffers = f" + fsdp buffers {plan['fsdp_buffers_gb']:.1f}" if plan.get('fsdp_buffers_gb') else ''
        parts = (f"weights {plan['weights_gb']:.1f}{buffers} + KV cache {plan['kv_cache_gb']:.1f} + activations "
                 f"{plan['activations_gb']:.1f} + logits {plan['logits_gb']:.1f}; {where}")
    if capacity_gb is None:
        line = f"plan {step} {run}: {plan['total_gb']:.1f} GiB per GPU, planned for no card ({gpu_type}) = {parts}"
    else:
        share = plan['total_gb'] / capacity_gb
        mark = '' if share <= TIGHT else (' (tight)' if share <= 1 else (' (may not fit)' if share <= 1 + MARGIN
                                                                          else ' (DOES NOT FIT)'))
        line = (f"plan {step} {run}: {plan['total_gb']:.1f} GiB per GPU of {capacity_gb:.0f} GiB ({gpu_type}){mark} "
                f"= {parts}")
    if time:
        line += f"; time {human_time(time['seconds'])} ({time['basis']})"
    if note:
        line += f"; {note}"
    return line


def smallest_world_size(rc: Mapping, capacity_gb: float, *, gpus_per_node: int, max_nodes: int = 1024) -> dict | None:
    """The fewest GPUs on which :func:`train_memory` of run ``rc`` (its own settings; ``activation_checkpointing:
    auto`` decided for ``capacity_gb``) is at most ``capacity_gb``: 1 to ``gpus_per_node`` GPUs on one node, then
    whole nodes of ``gpus_per_node``, up to ``max_nodes``; only GPU counts the batch trains at (``global_batch_size``
    divides over them and ``microbatch_size`` divides the per-GPU batch, as
    :meth:`llmpipe.config.settings.RunSettings.batch_problem` requires). Returns ``{'nodes', 'gpus_per_node',
    'world_size', 'total_gb'}``, or None when none fits."""
    per_node = max(1, int(gpus_per_node))
    shapes = [(1, n) for n in range(1, per_node + 1)] + [(k, per_node) for k in range(2, int(max_nodes) + 1)]
    batch, micro = int(rc['train']['global_batch_size']), int(rc['train']['microbatch_size'])
    for nodes, gpn in shapes:
        per_gpu = batch // (nodes * gpn)
        if batch % (nodes * gpn) or (micro < per_gpu and per_gpu % micro):
            continue
        mem = train_memory(rc, nodes=nodes, gpus_per_node=gpn, capacity_gb=capacity_gb)
        if mem['total_gb'] <= capacity_gb:
            return {'nodes': nodes, 'gpus_per_node': gpn, 'world_size': nodes * gpn, 'total_gb': mem['total_gb']}
    return None


def check_fits(step: str, run: str, plan: Mapping, capacity_gb: float, gpu_type: str, where: str,
               rc: Mapping | None = None) -> None:
    """Refuse a step whose planned memory per GPU exceeds the GPU's by more than :data:`MARGIN`.

    Only fixes that can work are offered: activation checkpointing and a smaller microbatch only when the model
    states and FSDP buffers (what neither changes) fit the GPU; with ``rc`` (the run's merged settings) a training's
    "more GPUs" names the fewest that fit (:func:`smallest_world_size`, at the job's GPUs per node, at least 8).

    Raises:
        ConfigError: naming the step, the estimate, the GPU and the settings that would make it fit (``where``:
            the run's settings path, e.g. ``models.mpt-70b``).
    """
    need = plan['total_gb']
    if need <= capacity_gb * (1 + MARGIN):
        return
    head = (f"{where}: the {step} step of {run} needs about {need:.0f} GiB per GPU (llmpipe.plan.memory_time), more than the "
            f"{capacity_gb:.0f} GiB of one {gpu_type} GPU (gpu_type).")
    if 'states_gb' in plan:
        fixes = []
        floor = plan['states_gb'] + plan['fsdp_buffers_gb']   # what recompute and microbatch leave as they are
        if floor > capacity_gb:
            head += (f" Its model states and FSDP buffers alone take {floor:.0f} GiB per GPU over "
                     f"{plan['world_size']} GPU(s), so neither activation checkpointing nor a smaller microbatch "
                     f"can make it fit.")
        else:
            if not plan['activation_checkpointing'] and plan['fsdp']:
                fixes.append(f"turn on {where}.train.fsdp.activation_checkpointing (activations "
                             f"{plan['activations_gb']:.0f} GiB)")
            elif not plan['activation_checkpointing']:  # activation checkpointing comes with FSDP (llm-foundry)
                fixes.append(f"train under FSDP, which allows activation checkpointing: {where}.train.fsdp_min_params "
                             f"at most {plan['params']:,} (activations {plan['activations_gb']:.0f} GiB)")
            if plan['microbatch_size'] > 1:
                fixes.append(f"a smaller {where}.train.microbatch_size (now {plan['microbatch_size']})")
        fewest = (smallest_world_size(rc, capacity_gb, gpus_per_node=max(8, int(plan['gpus_per_node'])))
                  if rc is not None else None)
        if fewest is not None:
            fixes.append(f"more GPUs: at least {fewest['world_size']} ({where}.resources.nodes x gpus_per_node = "
                         f"{fewest['nodes']} x {fewest['gpus_per_node']}: {fewest['total_gb']:.0f} GiB per GPU; "
                         f"now {plan['world_size']}, model states {plan['states_gb']:.0f} GiB per GPU)")
        elif rc is None:
            fixes.append(f"more GPUs: {where}.resources.nodes or gpus_per_node (model states "
                         f"{plan['states_gb']:.0f} GiB per GPU over {plan['world_size']})")
        fixes.append("a GPU with more memory (gpu_type)")
        raise ConfigError(f"{head} Fix: {'; or '.join(fixes)}.")
    check_inference_fits(step, run, {'gpus': plan.get('gpus', 1), 'source': 'node', 'memory': plan}, capacity_gb,
                         gpu_type, where)


def check_inference_fits(step: str, run: str, placement: Mapping, capacity_gb: float, gpu_type: str,
                         where: str) -> None:
    """Refuse an inference placement whose per-GPU plan exceeds the GPU's memory by more than
    :data:`MARGIN`.

    Raises:
        ConfigError: naming the estimate, the GPU count and where it came from (``where``: the run's settings path,
            e.g. ``models.mpt-70b``), and the settings that would make it fit.
    """
    mem, n = placement['memory'], int(placement['gpus'])
    need = mem['total_gb']
    if need <= capacity_gb * (1 + MARGIN):
        return
    head = (f"{where}: the {step} step of {run} needs about {need:.0f} GiB per GPU over {n} GPU(s) "
            f"(llmpipe.plan.memory_time), more than the {capacity_gb:.0f} GiB of one {gpu_type} GPU (gpu_type).")
    setting = f"{where}.step_resources.{step}.gpus_per_node"
    if placement['source'] == 'override':
        raise ConfigError(f"{head} The {n} GPU(s) come from {setting}. Fix: raise {setting} (the weights, "
                          f"{mem['weights_gb'] * n:.0f} GiB in all, are split over the GPUs), or remove it to let "
                          f"the plan choose, or set gpu_type to a GPU with more memory"
                          + (", or lower eval.batch_size." if step == 'eval' else "."))
    batch = (f", or a smaller eval.batch_size (activations and logits {mem['activations_gb'] + mem['logits_gb']:.0f}"
             f" GiB per GPU)" if step == 'eval' else "")
    raise ConfigError(f"{head} Inference runs on one node at most, and {n} GPU(s) are all of the node's "
                      f"({where}.resources.gpus_per_node). Fix: a node with more GPUs ({setting}), or set gpu_type "
                      f"to a GPU with more memory (or gpu_memory_gb){batch}, or leave {step} of {run} out of the "
                      f"targets.")
