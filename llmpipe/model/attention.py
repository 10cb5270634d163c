"""Attention on PyTorch's ``scaled_dot_product_attention`` (SDPA), plugged into llm-foundry through its registries.

llm-foundry 0.22.0 ships two attention implementations: ``flash`` (needs the flash-attn package, which cannot be
installed here) and ``torch`` (:func:`llmfoundry.models.layers.attention.scaled_multihead_dot_product_attention`,
which materializes the ``(batch, heads, seq, seq)`` score matrix, a causal mask and a softmax copy in every
layer). This module adds a third one that computes the same function with one fused SDPA kernel (FlashAttention-2,
memory-efficient or cuDNN attention on a GPU, whichever PyTorch picks), without forking llm-foundry:

* :func:`sdpa_attention` has the signature of llm-foundry's ``scaled_multihead_dot_product_attention`` and is
  registered as ``'sdpa'`` in ``llmfoundry.layers_registry.attention_implementations``. It keeps the ``torch``
  implementation's KV-cache layout (keys ``(b, h_kv, d, s)``, values ``(b, h_kv, s, d)``), so it is a drop-in for
  ``attn_impl: torch`` everywhere MPT uses that path (bias shapes, generation, checkpoints).
* MPT's config validation accepts only ``attn_impl`` ``torch`` or ``flash`` (``MPTConfig._validate_config``), and
  ``attn_bias_shape``/``build_attn_bias`` raise for any other name, so a model cannot say ``attn_impl: sdpa``.
  Instead the model keeps ``attn_impl: torch`` and picks one of the attention *classes* registered here in
  ``llmfoundry.layers_registry.attention_classes``: ``sdpa_multihead_attention``, ``sdpa_grouped_query_attention``
  and ``sdpa_multiquery_attention``. They are llm-foundry's own classes with :func:`sdpa_attention` as their
  attention function. :func:`mpt_attn_config` writes that ``attn_config``; :func:`stock_attn_config` turns it back
  into a stock one (for a Hugging Face export that must load without this package).
* :class:`DropFullAttentionMask`, registered as ``drop_full_attention_mask`` in ``llmfoundry.registry.callbacks``:
  llm-foundry's pretraining collator always sends an ``attention_mask`` of ones, and MPT's ``torch`` path turns
  it into an additive bias in every layer, which keeps SDPA off its fastest (mask-free causal) kernel. The
  callback removes the mask from a training batch when every entry is 1, checked on the CPU before the batch
  moves to the GPU (no device sync). The computed function does not change: an all-ones mask masks nothing.

What runs where (see :func:`sdpa_attention`): causal self-attention with no bias and no padding mask runs SDPA's
``is_causal=True`` kernel with no mask tensor at all. ALiBi, sequence-id (packed documents) and key-padding masks
arrive as ``attn_bias``/``key_padding_mask``; they are combined into one additive float mask (finite minimum, like
the reference, so a fully masked row gives the same uniform average instead of NaN) and passed to SDPA.
``needs_weights``, ``attn_logit_softcapping`` and ``sliding_window_size`` fall back to the reference function.

Importing this module registers everything (idempotent); :func:`register` does the same explicitly, e.g. from a
training process that only has the config (llm-foundry's train config can also import it via ``code_paths``).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    'SDPA_ATTN_TYPES',
    'DropFullAttentionMask',
    'mpt_attn_config',
    'register',
    'sdpa_attention',
    'set_sdpa_backend',
    'stock_attn_config',
    'use_sdpa',
]

#: Stock llm-foundry attention class -> the SDPA class registered here.
SDPA_ATTN_TYPES = {
    'multihead_attention': 'sdpa_multihead_attention',
    'grouped_query_attention': 'sdpa_grouped_query_attention',
    'multiquery_attention': 'sdpa_multiquery_attention',
}

_TORCH_VERSION = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2])
#: SDPA's ``enable_gqa`` (grouped-query attention without repeating K/V) exists from torch 2.5, ``scale`` from 2.1.
_SDPA_HAS_GQA = _TORCH_VERSION >= (2, 5)
_SDPA_HAS_SCALE = _TORCH_VERSION >= (2, 1)

def _reference():
    from llmfoundry.models.layers.attention import scaled_multihead_dot_product_attention
    return scaled_multihead_dot_product_attention


def set_sdpa_backend(name: str | None) -> None:
    """Restrict PyTorch's SDPA to one fused backend for this process (``torch.backends.cuda.enable_*_sdp``).

    Args:
        name: ``'cudnn'`` (cuDNN attention), ``'flash'`` (FlashAttention-2), ``'efficient'`` (memory-efficient
            attention), each with the math backend left on as the fallback for inputs the fused kernel refuses;
            ``'math'`` alone; or ``None``/``'auto'``: every backend on, PyTorch chooses (its default).

    Raises:
        ValueError: unknown name.

    Process-global flags rather than a context manager inside :func:`sdpa_attention`, so that torch.compile traces
    nothing extra. The environment variable ``LLMPIPE_SDPA_BACKEND`` applies a name at import.
    """
    key = (name or 'auto').strip().lower()
    flags = {
        'auto': dict(flash=True, mem_efficient=True, cudnn=True, math=True),
        'cudnn': dict(flash=False, mem_efficient=False, cudnn=True, math=True),
        'flash': dict(flash=True, mem_efficient=False, cudnn=False, math=True),
        'efficient': dict(flash=False, mem_efficient=True, cudnn=False, math=True),
        'math': dict(flash=False, mem_efficient=False, cudnn=False, math=True),
    }
    if key not in flags:
        raise ValueError(f'unknown SDPA backend {name!r}; known: {sorted(flags)}')
    b = torch.backends.cuda
    b.enable_flash_sdp(flags[key]['flash'])
    b.enable_mem_efficient_sdp(flags[key]['mem_efficient'])
    if hasattr(b, 'enable_cudnn_sdp'):
        b.enable_cudnn_sdp(flags[key]['cudnn'])
    b.enable_math_sdp(flags[key]['math'])


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(b, h_kv, s, d) -> (b, h_kv * n_rep, s, d), each kv head repeated n_rep times in a row (as llm-foundry)."""
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    n_heads: int,
    kv_n_heads: int,
    past_key_value: tuple[torch.Tensor, torch.Tensor] | None = None,
    softmax_scale: float | None = None,
    attn_bias: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    training: bool = False,
    needs_weights: bool = False,
    attn_logit_softcapping: float | None = None,
    sliding_window_size: int = -1,
) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """Multi-head attention through ``torch.nn.functional.scaled_dot_product_attention``.

    Same signature, inputs, outputs and KV-cache layout as llm-foundry's
    ``scaled_multihead_dot_product_attention`` (the ``attn_impl: torch`` reference), which it matches to float
    rounding (see tests/test_attention.py).

    Args:
        query: ``(b, s_q, n_heads * d)``.
        key, value: ``(b, s_k, kv_n_heads * d)`` (new tokens only when a cache is given).
        n_heads: query heads. kv_n_heads: key/value heads; ``n_heads % kv_n_heads == 0`` (GQA/MQA when smaller).
        past_key_value: ``None`` (no cache: returns ``None``), ``()`` (start a cache) or ``(k, v)`` with
            ``k: (b, kv_n_heads, d, s_past)`` and ``v: (b, kv_n_heads, s_past, d)``.
        softmax_scale: multiplies ``q @ k^T``; default ``1 / sqrt(d)``.
        attn_bias: additive bias broadcastable to ``(b, n_heads, s_q, s_k)`` after taking its last ``s_q`` rows
            and ``s_k`` columns (ALiBi, sequence-id and padding masks, as MPT's ``torch`` path builds it;
            masked entries hold a very negative finite value).
        key_padding_mask: bool ``(b, s_k)``, ``True`` = attend.
        is_causal: causal masking, aligned to the bottom right when ``s_q != s_k`` (ignored when ``s_q == 1``).
        dropout_p: attention dropout probability, applied only when ``training``.
        needs_weights: return the attention probabilities; computed by the reference implementation.
        attn_logit_softcapping, sliding_window_size: computed by the reference implementation when set.

    Returns:
        ``(out, weights, past_key_value)``: ``out`` is ``(b, s_q, n_heads * d)`` in ``value``'s dtype;
        ``weights`` is ``None`` unless ``needs_weights``; ``past_key_value`` is the updated cache or ``None``.

    Raises:
        RuntimeError: ``attn_bias`` does not broadcast to the score shape (same message as the reference).
        ValueError: ``n_heads`` is not a multiple of ``kv_n_heads``.

    Notes:
        A float ``attn_bias`` is cast to the query dtype (SDPA requires it), with its minimum clamped to that
        dtype's finite minimum; under bf16 autocast an ALiBi bias is therefore rounded to bf16 before it is added,
        where the reference adds it in float32.
    """
    if needs_weights or attn_logit_softcapping is not None or sliding_window_size != -1:
        return _reference()(
            query, key, value, n_heads, kv_n_heads,
            past_key_value=past_key_value, softmax_scale=softmax_scale, attn_bias=attn_bias,
            key_padding_mask=key_padding_mask, is_causal=is_causal, dropout_p=dropout_p, training=training,
            needs_weights=needs_weights, attn_logit_softcapping=attn_logit_softcapping,
            sliding_window_size=sliding_window_size,
        )
    if n_heads % kv_n_heads:
        raise ValueError(f'n_heads ({n_heads}) must be a multiple of kv_n_heads ({kv_n_heads}).')

    b, s_q = query.shape[:2]
    d = query.shape[-1] // n_heads
    q = query.view(b, s_q, n_heads, d).transpose(1, 2)                       # (b, h, s_q, d)
    k = key.view(b, key.shape[1], kv_n_heads, d).transpose(1, 2)             # (b, h_kv, s, d)
    v = value.view(b, value.shape[1], kv_n_heads, d).transpose(1, 2)         # (b, h_kv, s, d)

    if past_key_value is not None:
        # The reference's cache layout: keys (b, h_kv, d, s), values (b, h_kv, s, d).
        k_cache = k.transpose(2, 3)
        if len(past_key_value) != 0:
            k_cache = torch.cat([past_key_value[0], k_cache], dim=3)
            v = torch.cat([past_key_value[1], v], dim=2)
        past_key_value = (k_cache, v)
        k = k_cache.transpose(2, 3).contiguous()
    s_k = k.shape[2]

    if softmax_scale is None:
        softmax_scale = 1 / math.sqrt(d)
    p = dropout_p if training else 0.0

    causal = bool(is_causal) and s_q != 1
    explicit = attn_bias is not None or key_padding_mask is not None or (causal and s_q != s_k)

    mask = None
    if explicit:
        dtype = q.dtype
        min_val = torch.finfo(dtype).min
        if attn_bias is not None:
            _s_q = max(0, attn_bias.size(2) - s_q)
            _s_k = max(0, attn_bias.size(3) - s_k)
            attn_bias = attn_bias[:, :, _s_q:, _s_k:]
            if (attn_bias.size(-1) != 1 and attn_bias.size(-1) != s_k) or (
                    attn_bias.size(-2) != 1 and attn_bias.size(-2) != s_q):
                raise RuntimeError(
                    f'attn_bias (shape: {attn_bias.shape}) is expected to broadcast to shape: '
                    f'{(b, n_heads, s_q, s_k)}.')
            mask = attn_bias.to(dtype).clamp(min=min_val)
        else:
            mask = q.new_zeros((1, 1, 1, 1))
        blocked = None                                                         # bool, True = may not attend
        if key_padding_mask is not None:
            blocked = ~key_padding_mask.view(b, 1, 1, s_k)
        if causal:
            s = max(s_q, s_k)
            future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)[-s_q:, -s_k:]
            future = future.view(1, 1, s_q, s_k)
            blocked = future if blocked is None else (blocked | future)
        if blocked is not None:
            mask = torch.where(blocked, torch.tensor(min_val, dtype=dtype, device=q.device), mask)
        causal = False

    n_rep = n_heads // kv_n_heads
    kwargs: dict[str, Any] = {'dropout_p': p, 'is_causal': causal}
    if _SDPA_HAS_SCALE:
        kwargs['scale'] = softmax_scale
    elif softmax_scale != 1 / math.sqrt(d):
        q = q * (softmax_scale * math.sqrt(d))
    if n_rep > 1:
        if _SDPA_HAS_GQA and mask is None:
            kwargs['enable_gqa'] = True
        else:
            k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)

    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)   # (b, h, s_q, d)
    out = out.transpose(1, 2).reshape(b, s_q, n_heads * d)
    return out, None, past_key_value


# ------------------------------------------------------------------------------------------- model plumbing

def _sdpa_class(base: type, name: str) -> type:
    """A subclass of llm-foundry attention class ``base`` whose attention function is :func:`sdpa_attention`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        impl = kwargs.get('attn_impl', 'torch')
        if impl != 'torch':
            raise ValueError(
                f"attn_type {name!r} needs attn_impl 'torch' (it replaces the torch path's attention function "
                f'with SDPA and keeps its bias and cache layout), got attn_impl={impl!r}. Fix: use '
                f"llmpipe.model.attention.mpt_attn_config(attn_config, 'sdpa').")
        kwargs['attn_impl'] = 'torch'
        base.__init__(self, *args, **kwargs)
        self.attn_fn = sdpa_attention

    return type(name, (base,), {
        '__init__': __init__,
        '__doc__': f'llm-foundry ``{base.__name__}`` computing attention with :func:`sdpa_attention`.',
        '__module__': __name__,
    })


def _build_classes() -> dict[str, type]:
    from llmfoundry.models.layers.attention import (
        GroupedQueryAttention,
        MultiheadAttention,
        MultiQueryAttention,
    )
    bases = {
        'multihead_attention': MultiheadAttention,
        'grouped_query_attention': GroupedQueryAttention,
        'multiquery_attention': MultiQueryAttention,
    }
    return {SDPA_ATTN_TYPES[k]: _sdpa_class(v, 'Sdpa' + v.__name__) for k, v in bases.items()}


def _drop_full_attention_mask_class() -> type:
    from composer.core import Callback

    class DropFullAttentionMask(Callback):
        """Composer callback: remove a training batch's ``attention_mask`` when it is all ones.

        Runs at ``Event.AFTER_DATALOADER``, when the batch is still on the CPU (Composer moves each microbatch to
        the device later), so the check costs no device synchronization. Without a mask, MPT's ``torch`` path
        passes no bias to attention and :func:`sdpa_attention` runs the mask-free causal kernel. A batch with any
        padding keeps its mask. Registered in llm-foundry's callback registry as ``drop_full_attention_mask``.
        """

        def __init__(self) -> None:
            self.dropped = 0
            self.kept = 0

        def after_dataloader(self, state: Any, logger: Any) -> None:
            batch = state.batch
            if not isinstance(batch, dict) or batch.get('attention_mask') is None:
                return
            mask = batch['attention_mask']
            if mask.device.type == 'cpu' and bool(mask.all()):
                batch = dict(batch)
                del batch['attention_mask']
                state.batch = batch
                self.dropped += 1
            else:
                self.kept += 1

    DropFullAttentionMask.__module__ = __name__
    return DropFullAttentionMask


_CLASSES: dict[str, type] = {}
DropFullAttentionMask: Any = None


def register() -> None:
    """Register ``'sdpa'`` (attention function), the ``sdpa_*`` attention classes and the
    ``drop_full_attention_mask`` callback in llm-foundry's registries. Idempotent; also run on import.

    Raises:
        ImportError: llm-foundry or composer is not installed.
    """
    global DropFullAttentionMask
    from llmfoundry.layers_registry import attention_classes, attention_implementations
    from llmfoundry.registry import callbacks

    if attention_implementations.get_all().get('sdpa') is not sdpa_attention:
        attention_implementations.register('sdpa', func=sdpa_attention)
    if not _CLASSES:
        _CLASSES.update(_build_classes())
    for name, cls in _CLASSES.items():
        if attention_classes.get_all().get(name) is not cls:
            attention_classes.register_class(name, func=cls)
    if DropFullAttentionMask is None:
        DropFullAttentionMask = _drop_full_attention_mask_class()
    if callbacks.get_all().get('drop_full_attention_mask') is not DropFullAttentionMask:
        callbacks.register_class('drop_full_attention_mask', func=DropFullAttentionMask)


def mpt_attn_config(attn_config: dict | None, attn_impl: str) -> dict:
    """The MPT ``attn_config`` that runs the project's ``attn_impl`` choice.

    Args:
        attn_config: MPT attention settings (may be ``None``); not modified.
        attn_impl: ``'sdpa'`` (this module), ``'torch'`` or ``'flash'`` (llm-foundry's own).

    Returns:
        A new dict. For ``'sdpa'``: ``attn_impl: 'torch'`` and ``attn_type`` mapped to its ``sdpa_*`` class
        (``multihead_attention`` when unset). Otherwise ``attn_impl`` set and ``attn_type`` mapped back to stock.

    Raises:
        ValueError: unknown ``attn_impl``, or an ``attn_type`` without an SDPA class.
    """
    cfg = dict(attn_config or {})
    if attn_impl == 'sdpa':
        t = cfg.get('attn_type', 'multihead_attention')
        if t not in SDPA_ATTN_TYPES and t not in SDPA_ATTN_TYPES.values():
            raise ValueError(f'attn_type {t!r} has no SDPA version; known: {sorted(SDPA_ATTN_TYPES)}.')
        cfg['attn_type'] = SDPA_ATTN_TYPES.get(t, t)
        cfg['attn_impl'] = 'torch'
        return cfg
    if attn_impl not in ('torch', 'flash'):
        raise ValueError(f"attn_impl must be 'sdpa', 'torch' or 'flash', got {attn_impl!r}.")
    cfg = stock_attn_config(cfg)
    cfg['attn_impl'] = attn_impl
    return cfg


def stock_attn_config(attn_config: dict | None) -> dict:
    """``attn_config`` with any ``sdpa_*`` attention class replaced by llm-foundry's stock one (same weights,
    same function), so that an exported Hugging Face config loads without this package. Returns a new dict."""
    cfg = dict(attn_config or {})
    back = {v: k for k, v in SDPA_ATTN_TYPES.items()}
    if cfg.get('attn_type') in back:
        cfg['attn_type'] = back[cfg['attn_type']]
    return cfg


def use_sdpa(model: torch.nn.Module) -> int:
    """Switch every llm-foundry attention module of an already built ``model`` that uses ``attn_impl: torch`` to
    :func:`sdpa_attention` (e.g. a model loaded from a stock Hugging Face checkpoint for generation).

    An export loaded with ``trust_remote_code`` runs its own copy of llm-foundry's layers
    (``transformers_modules.<folder>.attention``), whose classes are not llm-foundry's, and once such a copy is
    imported, llm-foundry's registry builds that copy's classes in this process too. So a module counts by the name of
    llm-foundry's base class anywhere in its class hierarchy (``GroupedQueryAttention``, which ``MultiheadAttention``
    and ``MultiQueryAttention`` subclass), not by ``isinstance``.

    Returns:
        The number of attention modules switched.
    """
    n = 0
    for m in model.modules():
        if any(c.__name__ == 'GroupedQueryAttention' for c in type(m).__mro__) and m.attn_impl == 'torch':
            m.attn_fn = sdpa_attention
            n += 1
    return n


register()
if os.environ.get('LLMPIPE_SDPA_BACKEND'):
    set_sdpa_backend(os.environ['LLMPIPE_SDPA_BACKEND'])
