"""Model FLOPs utilization (MFU): peak FLOP/s per accelerator, model FLOPs per token, and their ratio.

MFU = achieved model FLOP/s per device / the device's dense peak FLOP/s for the training dtype. Model FLOPs follow
llm-foundry's own count (``ComposerMPTCausalLM.flops_per_batch`` in ``llmfoundry/models/mpt/modeling_mpt.py``,
0.22.0), so our figures compare with MosaicML's published MFU tables:

    flops_per_batch = 3 * (2 * P * L + n_layers * 2 * 2 * d_model * L**2) * batch_size

with ``P`` the parameters llm-foundry counts as active (``mpt_get_active_params``: all parameters, minus the
token embedding when it is not tied to the output layer, since a lookup is not a matmul), ``L`` the sequence
length and the factor 3 for forward + backward (backward ~ 2x forward). Attention FLOPs are counted for the full
``L x L`` score matrix (no halving for the causal mask). Per token: ``6 P + 12 n_layers d_model L``.

This module imports without torch (the Snakefile and the report import it); only :func:`detect_peak_flops` touches
torch, inside the function.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    'PEAK_FLOPS',
    'detect_peak_flops',
    'flops_per_token',
    'mfu',
    'mpt_param_count',
    'peak_flops_for_name',
]

T = 1e12

#: Dense (no 2:4 sparsity) peak tensor-core FLOP/s per device, by dtype. Keys are matched as case-insensitive
#: substrings of ``torch.cuda.get_device_name()``; the first match in this order wins, so more specific names come
#: first. 'fp32' is the plain (non-tensor-core) rate; 'tf32' the tensor-core float32 mode.
#: Sources (vendor datasheets; where a datasheet gives only 'with sparsity' figures they are halved):
PEAK_FLOPS: dict[str, dict[str, float]] = {
    # NVIDIA H200 NVL (PCIe card): BF16/FP16 1,671 TFLOPS with sparsity -> 835.5 dense; FP8 3,341 sparse;
    # TF32 835 sparse; FP32 60. https://www.nvidia.com/en-us/data-center/h200/ (H200 NVL column).
    'h200 nvl': {'bf16': 835.5 * T, 'fp16': 835.5 * T, 'fp8': 1670.5 * T, 'tf32': 417.5 * T, 'fp32': 60 * T},
    # NVIDIA H200 SXM (named plainly 'NVIDIA H200'): BF16/FP16 1,979 TFLOPS with sparsity -> 989.5 dense;
    # FP8 3,958 sparse; TF32 989 sparse; FP32 67. https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM).
    'h200': {'bf16': 989.5 * T, 'fp16': 989.5 * T, 'fp8': 1979 * T, 'tf32': 494.5 * T, 'fp32': 67 * T},
    # NVIDIA H100 NVL: BF16 1,671 sparse -> 835.5 dense; FP32 60.
    # https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet (H100 datasheet).
    'h100 nvl': {'bf16': 835.5 * T, 'fp16': 835.5 * T, 'fp8': 1670.5 * T, 'tf32': 417.5 * T, 'fp32': 60 * T},
    # NVIDIA H100 PCIe: BF16/FP16 1,513 TFLOPS sparse -> 756.5 dense; FP8 3,026 sparse; TF32 756 sparse;
    # FP32 51. Same H100 datasheet (H100 PCIe column). Device name 'NVIDIA H100 PCIe'.
    'h100 pcie': {'bf16': 756.5 * T, 'fp16': 756.5 * T, 'fp8': 1513 * T, 'tf32': 378 * T, 'fp32': 51 * T},
    # NVIDIA H100 SXM5 (device name 'NVIDIA H100 80GB HBM3'): BF16/FP16 1,979 TFLOPS sparse -> 989.5 dense;
    # FP8 3,958 sparse; TF32 989 sparse; FP32 67. Same H100 datasheet (H100 SXM column).
    'h100': {'bf16': 989.5 * T, 'fp16': 989.5 * T, 'fp8': 1979 * T, 'tf32': 494.5 * T, 'fp32': 67 * T},
    # NVIDIA A100 40GB and 80GB (SXM4 and PCIe alike): BF16/FP16 312 TFLOPS dense (624 sparse), TF32 156,
    # FP32 19.5. https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/
    # nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf . Names 'NVIDIA A100-SXM4-80GB', 'NVIDIA A100-PCIE-40GB'.
    'a100': {'bf16': 312 * T, 'fp16': 312 * T, 'tf32': 156 * T, 'fp32': 19.5 * T},
    # NVIDIA B200 (HGX B200, 1,000 W): per GPU FP16/BF16 4.5 PFLOPS with sparsity -> 2.25 dense; FP8 9 sparse
    # -> 4.5 dense; TF32 2.2 sparse -> 1.1 dense; FP32 75. https://www.nvidia.com/en-us/data-center/hgx/
    # (HGX B200 specifications, 'individual Blackwell GPU' rows; the page footnotes the sparsity).
    'b200': {'bf16': 2250 * T, 'fp16': 2250 * T, 'fp8': 4500 * T, 'tf32': 1100 * T, 'fp32': 75 * T},
    # NVIDIA L40S: BF16/FP16 362.05 TFLOPS dense (733 sparse), FP8 733 dense, TF32 183 dense, FP32 91.6.
    # https://www.nvidia.com/en-us/data-center/l40s/ (L40S datasheet).
    'l40s': {'bf16': 362.05 * T, 'fp16': 362.05 * T, 'fp8': 733 * T, 'tf32': 183 * T, 'fp32': 91.6 * T},
    # AMD Instinct MI300X: FP16/BF16 1,307.4 TFLOPS dense (2,614.9 sparse), FP8 2,614.9 dense, TF32 653.7,
    # FP32 163.4 (matrix). https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/
    # amd-instinct-mi300x-data-sheet.pdf . ROCm PyTorch names it 'AMD Instinct MI300X'.
    'mi300x': {'bf16': 1307.4 * T, 'fp16': 1307.4 * T, 'fp8': 2614.9 * T, 'tf32': 653.7 * T, 'fp32': 163.4 * T},
}

#: Training ``precision`` (Composer) -> the dtype whose peak bounds it.
_PRECISION_DTYPE = {
    'amp_bf16': 'bf16', 'bf16': 'bf16', 'bfloat16': 'bf16',
    'amp_fp16': 'fp16', 'fp16': 'fp16', 'float16': 'fp16',
    'amp_fp8': 'fp8', 'fp8': 'fp8',
    'fp32': 'fp32', 'float32': 'fp32', 'tf32': 'tf32',
}


def _dtype_key(dtype: str) -> str:
    key = _PRECISION_DTYPE.get(str(dtype).lower())
    if key is None:
        raise ValueError(f'unknown dtype or precision {dtype!r}; known: {sorted(_PRECISION_DTYPE)}')
    return key


def peak_flops_for_name(
    device_name: str,
    dtype: str = 'bf16',
    overrides: Mapping[str, float] | None = None,
) -> float | None:
    """Dense peak FLOP/s of the device called ``device_name`` for ``dtype``, or ``None`` if unknown.

    Args:
        device_name: what ``torch.cuda.get_device_name()`` returns, e.g. ``'NVIDIA H100 80GB HBM3'``.
        dtype: ``bf16``, ``fp16``, ``fp8``, ``tf32``, ``fp32`` or a Composer precision (``amp_bf16``...).
        overrides: config ``gpu_peak_flops``: ``{substring: FLOP/s}``; checked first (case-insensitive
            substring of the name), its value is used for any dtype.

    Returns:
        FLOP/s (float), or ``None`` when no table entry or override matches (or the table has no figure for that
        dtype on that device).

    Raises:
        ValueError: unknown ``dtype``.
    """
    key = _dtype_key(dtype)
    name = (device_name or '').lower()
    for sub, flops in (overrides or {}).items():
        if str(sub).lower() in name:
            return float(flops)
    for sub, table in PEAK_FLOPS.items():
        if sub in name:
            return table.get(key)
    return None


def detect_peak_flops(
    dtype: str = 'bf16',
    overrides: Mapping[str, float] | None = None,
    device: int | None = None,
) -> float | None:
    """Dense peak FLOP/s of this process's accelerator (``torch.cuda.get_device_name(device)``) for ``dtype``.

    Returns ``None`` on a machine without CUDA/ROCm devices (so CPU runs report no MFU) or for an unknown device.
    See :func:`peak_flops_for_name` for ``dtype`` and ``overrides`` (config key ``gpu_peak_flops``).
    """
    import torch  # only here: the module itself must import without torch

    if not torch.cuda.is_available():
        return None
    return peak_flops_for_name(torch.cuda.get_device_name(device), dtype, overrides)


def mpt_param_count(arch: Mapping) -> dict[str, int]:
    """Parameters of an llm-foundry MPT model, from its architecture settings (no torch).

    Args:
        arch: ``d_model``, ``n_layers``, ``n_heads``, ``vocab_size``, ``max_seq_len``; optional
            ``expansion_ratio`` (4), ``no_bias`` (False), ``learned_pos_emb`` (True; off with
            ``attn_config.alibi`` or ``rope``, as MPTConfig does), ``tie_word_embeddings`` (True),
            ``kv_n_heads`` or ``n_kv_heads`` (= ``n_heads``; or ``attn_config.kv_n_heads`` with
            ``attn_type: grouped_query_attention``). Defaults are MPTConfig's. The FFN is MPT's ``mptmlp``
            (hidden ``int(expansion_ratio * d_model)``), norms have a bias unless ``no_bias``.

    Returns:
        ``{'total': all parameters, 'embedding': token embedding (vocab x d_model), 'positional': learned
        position embedding, 'non_embedding': total - embedding - positional, 'active': what llm-foundry's
        ``mpt_get_active_params`` counts for FLOPs (total, minus the token embedding only when untied)}``.
    """
    d = int(arch['d_model'])
    n_layers = int(arch['n_layers'])
    n_heads = int(arch['n_heads'])
    vocab = int(arch['vocab_size'])
    msl = int(arch['max_seq_len'])
    hidden = int(float(arch.get('expansion_ratio', 4)) * d)
    bias = not bool(arch.get('no_bias', False))
    attn_cfg = arch.get('attn_config') or {}
    attn_type = str(attn_cfg.get('attn_type', 'multihead_attention'))
    kv_written = arch.get('kv_n_heads') if arch.get('kv_n_heads') is not None else arch.get('n_kv_heads')
    if kv_written is not None:   # MPT config.json's kv_n_heads, or our arch.n_kv_heads
        kv_heads = int(kv_written)
    elif attn_type.endswith('grouped_query_attention'):
        kv_heads = int(attn_cfg['kv_n_heads'])
    elif attn_type.endswith('multiquery_attention'):
        kv_heads = 1
    else:
        kv_heads = n_heads
    head_dim = d // n_heads
    qkv_out = d + 2 * kv_heads * head_dim
    norm = d * (2 if bias else 1)
    per_block = (
        norm                                        # norm_1
        + d * qkv_out + (qkv_out if bias else 0)    # Wqkv
        + d * d + (d if bias else 0)                # out_proj
        + norm                                      # norm_2
        + d * hidden + (hidden if bias else 0)      # ffn.up_proj
        + hidden * d + (d if bias else 0)           # ffn.down_proj
    )
    embedding = vocab * d
    # MPTConfig turns learned positions off when ALiBi or RoPE is on.
    learned = arch.get('learned_pos_emb', True) and not attn_cfg.get('alibi') and not attn_cfg.get('rope')
    positional = msl * d if learned else 0
    tied = arch.get('tie_word_embeddings', True)
    lm_head = 0 if tied else vocab * d
    total = embedding + positional + n_layers * per_block + norm + lm_head
    return {
        'total': total,
        'embedding': embedding,
        'positional': positional,
        'non_embedding': total - embedding - positional,
        'active': total if tied else total - embedding,
    }


def flops_per_token(arch: Mapping, seq_len: int | None = None) -> float:
    """Training FLOPs per token (forward + backward) by llm-foundry's formula.

    ``6 * P_active + 12 * n_layers * d_model * seq_len``: ``P_active`` from :func:`mpt_param_count`; the second
    term is the attention score and weighted-sum matmuls (``2 * 2 * d_model * seq_len`` per token and layer
    forward, times 3). Equals ``ComposerMPTCausalLM.flops_per_batch(batch) / (batch_size * seq_len)``.

    Args:
        arch: see :func:`mpt_param_count`.
        seq_len: tokens per sequence (default ``arch['max_seq_len']``).

    Returns:
        FLOPs per token (float).
    """
    L = int(seq_len if seq_len is not None else arch['max_seq_len'])
    p = mpt_param_count(arch)['active']
    return 6.0 * p + 12.0 * int(arch['n_layers']) * int(arch['d_model']) * L


def mfu(tokens_per_s_per_device: float, flops_per_token_: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilization: ``tokens/s per device * FLOPs per token / peak FLOP/s``, a fraction in [0, 1]
    for real runs; ``None`` when the peak is unknown (CPU, unlisted device).

    Args:
        tokens_per_s_per_device: training throughput of one device (tokens/s).
        flops_per_token_: from :func:`flops_per_token` (FLOPs).
        peak_flops: from :func:`detect_peak_flops` (FLOP/s) or ``None``.

    Raises:
        ValueError: a negative throughput or a non-positive peak.
    """
    if peak_flops is None:
        return None
    if peak_flops <= 0:
        raise ValueError(f'peak_flops must be positive, got {peak_flops!r}')
    if tokens_per_s_per_device < 0:
        raise ValueError(f'tokens_per_s_per_device must be >= 0, got {tokens_per_s_per_device!r}')
    return tokens_per_s_per_device * flops_per_token_ / peak_flops
