"""Chunked fused linear + cross-entropy loss for MPT pretraining, plugged into llm-foundry through its registries.

Why: llm-foundry's ``torch_crossentropy`` path computes ``logits = h @ W.T`` for every token (65,536 x 50,368 for
MPT-125M at microbatch 32 and 2048 tokens: 6.6 GB in bf16), upcasts them to fp32 (13 GB), runs log-softmax + NLL,
and its backward makes more full-size fp32 copies. On the H200 that is ~20 ms of a 178 ms step and ~25 GB of memory
(benchmarks/README.md, "Training throughput").

What: :func:`linear_cross_entropy` computes the same loss without ever holding the full ``[N, V]`` logits. The
tokens are processed in chunks of ``chunk_size`` rows; for each chunk ``c`` (``h_c``: ``[C, d]``, ``t_c``: ``[C]``)::

    z     = h_c @ W.T                                   [C, V], in the matmul dtype (bf16 under amp_bf16)
    lsm   = log_softmax(z) in fp32                      log p(v | token)
    loss += sum_{i valid} -lsm[i, t_i]                  summed in fp32
    G     = exp(lsm) - onehot(t)                        = d(-log p[t]) / dz, in the matmul dtype
    dh_c  = (G @ W) * m / n                             [C, d]
    dW   += G.T @ (h_c * m)                             [V, d], accumulated in fp32; multiplied by 1 / n at the end

with ``m_i = 1`` for a valid target and 0 for ``ignore_index`` (-100), and ``n = max(1, sum m)``; the loss is
``sum / n``. That is exactly llm-foundry's ``compute_loss_from_logits`` with ``nn.CrossEntropyLoss(
ignore_index=-100, reduction='none')``: per-token losses summed over all tokens (ignored ones give 0) divided by
the number of non-ignored targets, and the plain sum (0) when every target is ignored. llm-foundry 0.22 has no
``sample_weighing_factor`` or other per-sample weights in this path, so there is nothing else to support.

The gradients are computed in the forward pass, chunk by chunk, while the chunk's logits exist (so the logits are
never recomputed); the backward only multiplies the saved ``dh`` and ``dW`` by the incoming scalar gradient. Peak
extra memory is one chunk of logits plus, for the ``torch``/``softmax`` kernels, its fp32 log-softmax
(``chunk_size x V x (2 + 4)`` bytes under bf16; the default chunk, 8,192 tokens, is ~1.5 GiB of fp32 at MPT's
vocabulary), plus ``dh`` ``[N, d]`` and ``dW`` ``[V, d]``. The three matmuls
are the ones the stock path runs (forward, grad input, grad weight): no extra FLOPs.

The per-chunk softmax, loss and gradient (everything between the first matmul and the other two) is one of
:data:`KERNELS`, chosen with ``kernel``:

* ``'torch'``: a log-softmax kernel reading the bf16 logits and writing fp32, then an exp writing the gradient into
  the logits' buffer, which PyTorch runs as an fp32 exp into a temporary plus a cast (the H200 profile of MPT-125M
  at microbatch 64: 25 + 15 + 20 ms of a 287 ms step, benchmarks/README.md).
* ``'softmax'``: the same log-softmax for the loss, and the gradient from one ``torch.softmax`` kernel over the
  bf16 logits instead of the exp and the cast.
* ``'compile'``: the per-chunk function through ``torch.compile`` (Inductor).
* ``'liger'``: Liger-Kernel's per-chunk cross-entropy primitive (``cross_entropy_loss_and_grad``, its Triton
  kernel: an online softmax that reads the logits twice and writes the gradient over them in the logits' dtype,
  with the loss and the target entry in fp32; the package ``liger-kernel``). Nothing of fp32 size ``[C, V]`` is
  written.

``'compile'`` and ``'liger'`` need CUDA; on other devices the chunk runs the ``'torch'`` path (same values).

Precision under autocast (amp_bf16): the matmuls run in the autocast dtype, like the stock ``F.linear``; softmax,
loss and the ``exp(lsm) - 1`` entry of the target run in fp32 as in the stock path (which upcasts before the loss).
The gradient rows are scaled by ``m / n`` after the matmuls instead of before (an extra rounding of the bf16 matmul
output), and ``dW`` sums per-chunk bf16 products in fp32. In fp32 it matches the stock path to float rounding
(tests/test_fused_loss.py).

The idea (compute the gradient inside the forward, chunk by chunk, so the logits never exist in full) is the one of
Liger-Kernel's ``FusedLinearCrossEntropy`` (LinkedIn, https://github.com/linkedin/Liger-Kernel; Hsu et al.,
"Liger Kernel: Efficient Triton Kernels for LLM Training", arXiv:2410.10989). The chunk loop, the matmuls, the
scaling and the llm-foundry integration are ours; with ``kernel='liger'`` the per-chunk softmax, loss and gradient
are the library's own kernel, called through its dispatcher (Liger's whole ``fused_linear_cross_entropy`` is not
used: it sizes chunks from ``V / d`` (~1,000 rows for MPT-125M), keeps ``dW`` in the weight's dtype unless told
otherwise, and reads the token count back from the GPU with ``.item()`` on every call).

How it plugs into llm-foundry (no file of llm-foundry is changed):

* :class:`ComposerMPTCausalLMFusedLoss`, registered as ``mpt_causal_lm_fused_loss`` in ``llmfoundry.registry.models``,
  subclasses ``ComposerMPTCausalLM``. Its ``model_class`` is :class:`FusedLossMPTForCausalLM` (an
  ``MPTForCausalLM`` whose ``forward`` takes one extra keyword, ``llmpipe_loss_targets``) and its tied embedding is
  a :class:`FusedLossEmbedding` (a ``SharedEmbedding`` whose ``forward`` can also return the fused loss).
  In training mode the composer model's ``forward`` passes the shifted labels; the HF model runs the transformer,
  then calls the embedding module with the final hidden states and the targets, and returns the loss
  (:class:`FusedLossOutput`); ``loss`` hands it on. Two details matter under FSDP (tested on two CPU ranks):
  the loss goes through the embedding *module* (its own FSDP unit: only inside its forward is the sharded weight
  gathered), and it is computed inside the root module's forward (so the backward starts at the root's output, as
  with the stock logits; a loss computed after the root forward returned lost the embedding's gradient under
  mixed precision). Under composer's torch.compile the fused loss runs eagerly (``torch.compiler.disable``: one
  graph break, at the end of the forward).
* In eval mode, in ``eval_forward``, for generation and when ``use_train_metrics`` is true (the metrics need the
  full logits), the model is the stock one: same forward, same logits, same loss.
* Refused with a ValueError naming the setting: ``loss_fn`` other than ``torch_crossentropy``, untied embeddings
  (``tie_word_embeddings: false``), ``logit_scale``, ``final_logit_softcapping``, MegaBlocks MoE FFNs.
* Checkpoints hold the same state dict as the stock class (the same parameter names), so
  :mod:`llmpipe.hf.export` exports them unchanged; composer's checkpoint metadata names the Hugging Face class
  ``llmpipe.model.fused_loss.FusedLossMPTForCausalLM``, which behaves as ``MPTForCausalLM`` outside training.
* The workflow selects it with the speed-only train setting ``fused_loss`` (:func:`llmpipe.train.pretrain.foundry_train_config`,
  only with ``train_metrics: false``).

Importing this module registers the model (idempotent); :func:`register` does the same explicitly.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from llmfoundry.layers_registry import ffns_with_megablocks
from llmfoundry.models.layers.custom_embedding import SharedEmbedding
from llmfoundry.models.mpt.modeling_mpt import ComposerMPTCausalLM, MPTForCausalLM, get_targets
from transformers.utils import ModelOutput

from llmpipe.config.settings import FUSED_LOSS_KERNELS

__all__ = [
    'FUSED_LOSS_MODEL_NAME',
    'ComposerMPTCausalLMFusedLoss',
    'FusedLossEmbedding',
    'FusedLossMPTForCausalLM',
    'FusedLossOutput',
    'KERNELS',
    'default_chunk_size',
    'linear_cross_entropy',
    'register',
]


#: The name of :class:`ComposerMPTCausalLMFusedLoss` in llm-foundry's ``models`` registry.
FUSED_LOSS_MODEL_NAME = 'mpt_causal_lm_fused_loss'

#: llm-foundry's ``CROSS_ENTROPY_IGNORE_INDEX``.
IGNORE_INDEX = -100

#: The per-chunk softmax/gradient implementations :func:`linear_cross_entropy` offers (module docstring).
KERNELS = FUSED_LOSS_KERNELS   # defined in llmpipe.config.settings: the config validates the setting without importing torch

#: Default rows (tokens) per chunk: measured on one H200 against 2,560 (benchmarks/README.md, "Changes tried"):
#: fewer chunk launches and casts; with torch.compile +2..6% at MPT-125M, +0.6..1.9% at 350M, +1.5% at 760M,
#: +1.4 GB peak memory at 125M (single runs).
_DEFAULT_CHUNK_ROWS = 8192
#: ... unless one chunk of fp32 log-probabilities would exceed this many elements (2**29: 2 GiB).
_MAX_CHUNK_ELEMENTS = 2**29


def default_chunk_size(vocab_size: int) -> int:
    """Rows (tokens) per chunk: 8,192, or fewer so that one chunk of fp32 log-probabilities stays within 2 GiB
    (``2**29 / vocab_size``, rounded down to a multiple of 256 when larger than 256, for the matmul tiles).
    E.g. 8,192 rows (1.54 GiB fp32) for MPT's vocabulary of 50,368 (8 chunks for 65,536 tokens), 3,328 for a
    152,064-token vocabulary."""
    rows = min(_DEFAULT_CHUNK_ROWS, max(1, _MAX_CHUNK_ELEMENTS // max(1, int(vocab_size))))
    return rows - rows % 256 if rows > 256 else rows


# ------------------------------------------------------------------------------------------ the math

def _chunk_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor,
                         need_grad: bool, softmax_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Loss sum and unscaled logits gradient of one chunk (eager; the tested path).

    Args:
        logits: ``[C, V]`` in the matmul dtype; overwritten with the gradient when ``need_grad`` (and not
            ``softmax_grad``).
        targets: ``[C]`` int64 in ``[0, V)`` (ignored rows already replaced by 0).
        valid: ``[C]`` bool, False for ignored rows.
        softmax_grad: compute the softmax with one ``torch.softmax`` kernel from the logits (fp32 inside, output
            in the logits' dtype, a new buffer) instead of ``exp`` of the fp32 log-probabilities written over the
            logits, which PyTorch runs as an fp32 exp into a temporary plus a cast (kernel ``'softmax'``). Same
            values up to the rounding of the result to the logits' dtype.

    Returns:
        ``(sum over valid rows of -log_softmax(logits)[i, t_i]`` as an fp32 scalar, ``G = softmax - onehot(t)``
        (onehot only on valid rows) in the logits' dtype, or None)``.
    """
    lsm = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    tgt = lsm.gather(1, targets[:, None]).squeeze(1)
    loss_sum = torch.where(valid, -tgt, torch.zeros_like(tgt)).sum()
    if not need_grad:
        return loss_sum, None
    if softmax_grad:
        del lsm  # before the new [C, V] buffer: peak is logits + gradient
        grad = torch.softmax(logits, dim=-1)
    else:
        grad = torch.exp(lsm, out=logits)  # softmax, written over the logits (no new [C, V] buffer)
        del lsm
    # the target entry in fp32 (exp(lsm_t) - 1), as the stock path computes softmax - onehot before any downcast
    grad.scatter_(1, targets[:, None], (tgt.exp() - valid.to(tgt.dtype)).to(grad.dtype)[:, None])
    return loss_sum, grad


def _chunk_loss_and_grad_functional(logits: torch.Tensor, targets: torch.Tensor,
                                    valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same values as :func:`_chunk_loss_and_grad` with ``need_grad=True``, written without ``out=`` and in-place
    ops so that torch.compile (Inductor) can fuse it into a reduction and one pointwise kernel."""
    lsm = torch.log_softmax(logits.float(), dim=-1)
    tgt = lsm.gather(1, targets[:, None]).squeeze(1)
    loss_sum = torch.where(valid, -tgt, torch.zeros_like(tgt)).sum()
    onehot = (torch.arange(logits.shape[1], device=logits.device)[None, :] == targets[:, None]) & valid[:, None]
    grad = (torch.exp(lsm) - onehot.to(lsm.dtype)).to(logits.dtype)
    return loss_sum, grad


def _chunk_loss_and_grad_liger(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                               need_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same values as :func:`_chunk_loss_and_grad` from Liger-Kernel's per-chunk cross-entropy (CUDA only).

    Args:
        logits: ``[C, V]`` contiguous CUDA tensor in the matmul dtype; overwritten with the gradient when
            ``need_grad``.
        targets: ``[C]`` int64 class ids, ``ignore_index`` for ignored rows (their gradient rows become 0).

    Liger's ``cross_entropy_loss_and_grad`` with ``reduction='sum'`` returns the per-row losses in fp32 and writes
    ``softmax - onehot`` (not divided by a token count; the target entry computed in fp32 before rounding) over the
    logits; ``n_non_ignore`` only scales ``'mean'``, so no count has to come back from the device.

    Raises:
        ImportError: liger-kernel is not installed (it is a dependency of this package).
    """
    import liger_kernel.functional  # noqa: F401  (declares where the op's implementations live)
    from liger_kernel.backends import dispatch
    loss_rows, _, _, _, grad = dispatch(
        'cross_entropy_loss_and_grad', logits, targets, None, int(ignore_index), 0.0, 0.0, 'sum', None,
        1, 1.0, 0.0, False, False, False, bool(need_grad), impl='nvidia-triton')
    return loss_rows.sum(), (grad if need_grad else None)


_COMPILED: dict[str, Callable] = {}


def _compiled_chunk_fn() -> Callable:
    if 'fn' not in _COMPILED:
        _COMPILED['fn'] = torch.compile(_chunk_loss_and_grad_functional, dynamic=False)
    return _COMPILED['fn']


class _LinearCrossEntropy(torch.autograd.Function):
    """Chunked linear + cross-entropy with the gradient computed in the forward (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                chunk_size: int, compute_dtype: torch.dtype, kernel: str, need_grad: bool) -> torch.Tensor:
        n_rows, _ = hidden.shape
        need_h = need_grad and ctx.needs_input_grad[0]
        need_w = need_grad and ctx.needs_input_grad[1]
        h = hidden.to(compute_dtype)
        w = weight.to(compute_dtype)
        valid = targets != ignore_index
        safe_targets = torch.where(valid, targets, torch.zeros_like(targets))
        count = valid.sum()
        inv_count = 1.0 / count.clamp(min=1).to(torch.float32)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n_rows, chunk_size):
            end = min(start + chunk_size, n_rows)
            h_c, t_c, v_c = h[start:end], safe_targets[start:end], valid[start:end]
            logits = torch.mm(h_c, w.t())
            if kernel == 'liger':
                part, grad = _chunk_loss_and_grad_liger(logits, targets[start:end], ignore_index, need_h or need_w)
            elif (need_h or need_w) and kernel == 'compile':
                part, grad = _compiled_chunk_fn()(logits, t_c, v_c)
            else:
                part, grad = _chunk_loss_and_grad(logits, t_c, v_c, need_h or need_w, kernel == 'softmax')
            loss_sum = loss_sum + part
            if grad is None:
                continue
            if need_h:
                scale = (v_c.to(torch.float32) * inv_count)[:, None]
                torch.mul(torch.mm(grad, w), scale, out=grad_h[start:end])
            if need_w:
                h_masked = h_c * v_c[:, None].to(h_c.dtype)
                if grad.dtype == torch.float32:
                    grad_w.addmm_(grad.t(), h_masked)
                else:
                    grad_w += torch.mm(grad.t(), h_masked)
            del logits, grad
        if grad_w is not None:
            grad_w = (grad_w * inv_count).to(weight.dtype)
        ctx.save_for_backward(grad_h, grad_w)
        # llm-foundry: losses.sum() / count, or losses.sum() (= 0) when every target is ignored
        return loss_sum / count.clamp(min=1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None
        gw = grad_w * grad_out.to(grad_w.dtype) if grad_w is not None else None
        return gh, gw, None, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         ignore_index: int = IGNORE_INDEX, chunk_size: int | None = None,
                         kernel: str = 'torch') -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets``, without materializing the logits.

    Equal to ``nn.CrossEntropyLoss(ignore_index=ignore_index, reduction='none')(hidden @ weight.T, targets)``
    summed and divided by the number of targets that are not ``ignore_index`` (the plain sum, 0, when all are
    ignored): llm-foundry's ``compute_loss_from_logits`` for MPT. Gradients w.r.t. ``hidden`` and ``weight`` are
    computed in this call (chunk by chunk) and returned by the backward, which only scales them.

    Under autocast the matmuls run in the autocast dtype (bf16 under composer's ``amp_bf16``), the softmax and
    the loss in fp32; gradients come back in the dtypes of ``hidden`` and ``weight``. Without autocast the matmuls
    run in the promoted dtype of ``hidden`` and ``weight``.

    Args:
        hidden: ``[N, d]`` final hidden states (floating point).
        weight: ``[V, d]`` unembedding weight (MPT: the tied token embedding).
        targets: ``[N]`` integer class ids in ``[0, V)`` or ``ignore_index``.
        ignore_index: targets with this value add nothing to the loss or the count.
        chunk_size: rows per chunk (tokens); None: :func:`default_chunk_size` of ``V``.
        kernel: the per-chunk softmax/gradient, one of :data:`KERNELS` (module docstring); ``'compile'`` and
            ``'liger'`` run on CUDA only, elsewhere the chunk runs ``'torch'``. The default here is the pure-PyTorch
            ``'torch'``; the workflow's config default is ``'liger'`` (``llmpipe.config.settings.FUSED_LOSS_DEFAULT_KERNEL``).

    Returns:
        A 0-dim fp32 tensor, the loss in nats per non-ignored token.

    Raises:
        ValueError: wrong shapes or dtypes, a chunk size that is not a positive integer, or an unknown
            ``kernel``.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f'linear_cross_entropy: hidden must be [N, d] and weight [V, d]; got '
                         f'{tuple(hidden.shape)} and {tuple(weight.shape)}')
    if targets.dim() != 1 or targets.shape[0] != hidden.shape[0]:
        raise ValueError(f'linear_cross_entropy: targets must be [N] with N = {hidden.shape[0]}; got '
                         f'{tuple(targets.shape)}')
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f'linear_cross_entropy: targets must be integer class ids, got {targets.dtype}')
    if chunk_size is None:
        chunk_size = default_chunk_size(weight.shape[0])
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f'linear_cross_entropy: chunk_size must be a positive integer (rows per chunk), '
                         f'got {chunk_size!r}')
    if kernel not in KERNELS:
        raise ValueError(f'linear_cross_entropy: kernel must be one of {KERNELS}, got {kernel!r}')
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(hidden.dtype, weight.dtype)
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if kernel in ('compile', 'liger') and device_type != 'cuda':
        kernel = 'torch'
    with torch.autocast(device_type, enabled=False):
        return _LinearCrossEntropy.apply(hidden, weight, targets.long().contiguous(), int(ignore_index),
                                         chunk_size, compute_dtype, kernel, need_grad)


# ------------------------------------------------------------------------------------------ llm-foundry classes

@dataclass
class FusedLossOutput(ModelOutput):
    """What the training forward of :class:`ComposerMPTCausalLMFusedLoss` returns: the loss (0-dim fp32, nats per
    non-ignored token), and no logits."""

    loss: torch.Tensor | None = None


class FusedLossEmbedding(SharedEmbedding):
    """llm-foundry's tied ``SharedEmbedding`` that can also compute the fused unembedding + loss.

    ``forward(input)`` embeds token ids and ``forward(input, True)`` returns logits, as in the parent;
    ``forward(hidden, True, loss_targets=targets)`` returns :func:`linear_cross_entropy` of ``hidden``
    (``[..., d]``) with this module's weight against ``targets`` (``[...]``, the same leading shape), with the
    chunk size and kernel set on the module (``fused_loss_chunk_size``, ``fused_loss_kernel``).
    """

    fused_loss_chunk_size: int | None = None
    fused_loss_kernel: str = 'torch'

    def forward(self, input: torch.Tensor, unembed: bool = False,
                loss_targets: torch.Tensor | None = None) -> torch.Tensor:
        if loss_targets is None:
            return super().forward(input, unembed)
        if not unembed:
            raise ValueError('FusedLossEmbedding: loss_targets needs unembed=True')
        return _fused_unembed_loss(input.reshape(-1, input.shape[-1]), self.weight, loss_targets.reshape(-1),
                                   self.fused_loss_chunk_size, self.fused_loss_kernel)


@torch.compiler.disable
def _fused_unembed_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                        chunk_size: int | None, kernel: str) -> torch.Tensor:
    # Run eagerly inside a torch.compile'd model forward (composer's compile_config): the chunk loop and the
    # autograd.Function stay out of the traced graph (one graph break, at the very end of the forward).
    return linear_cross_entropy(hidden, weight, targets, chunk_size=chunk_size, kernel=kernel)


class FusedLossMPTForCausalLM(MPTForCausalLM):
    """``MPTForCausalLM`` whose forward can return the fused loss instead of logits.

    With ``llmpipe_loss_targets`` (``[batch, seq]`` int64, already shifted, -100 = ignore) the forward runs the
    transformer, then the tied embedding's fused unembedding + cross-entropy, and returns a
    :class:`FusedLossOutput`; the logits are never formed. Without it the forward is the parent's. The tied
    embedding is a :class:`FusedLossEmbedding` (the same module and parameter, so the same state dict).

    The loss is computed inside this (root) module's forward on purpose: under FSDP the root's pre-backward hook
    resets the parameters' gradient bookkeeping when the gradient reaches the root's outputs, so a gradient
    produced by a module called after the root forward returned would be dropped (observed with FSDP mixed
    precision); as the root's output, the loss is where the backward starts.
    """

    def __init__(self, config: Any):
        super().__init__(config)
        wte = self.transformer.wte
        if type(wte) is SharedEmbedding:
            wte.__class__ = FusedLossEmbedding  # one more forward mode; nothing else changes

    def forward(self, input_ids: torch.LongTensor | None = None,
                past_key_values: list[tuple[torch.FloatTensor]] | None = None,
                attention_mask: torch.ByteTensor | None = None,
                sequence_id: torch.LongTensor | None = None,
                labels: torch.LongTensor | None = None,
                return_dict: bool | None = None,
                output_attentions: bool | None = None,
                output_hidden_states: bool | None = None,
                use_cache: bool | None = None,
                inputs_embeds: torch.FloatTensor | None = None,
                position_ids: torch.LongTensor | None = None,
                llmpipe_loss_targets: torch.Tensor | None = None) -> Any:
        if llmpipe_loss_targets is None:
            return super().forward(input_ids=input_ids, past_key_values=past_key_values,
                                   attention_mask=attention_mask, sequence_id=sequence_id, labels=labels,
                                   return_dict=return_dict, output_attentions=output_attentions,
                                   output_hidden_states=output_hidden_states, use_cache=use_cache,
                                   inputs_embeds=inputs_embeds, position_ids=position_ids)
        outputs = self.transformer(input_ids=input_ids, past_key_values=past_key_values,
                                   attention_mask=attention_mask, sequence_id=sequence_id, return_dict=True,
                                   use_cache=False, inputs_embeds=inputs_embeds, position_ids=position_ids)
        # through the embedding module: under FSDP its forward is where its (sharded) weight is gathered
        loss = self.transformer.wte(outputs.last_hidden_state, True, loss_targets=llmpipe_loss_targets)
        return FusedLossOutput(loss=loss)


class ComposerMPTCausalLMFusedLoss(ComposerMPTCausalLM):
    """llm-foundry's ``ComposerMPTCausalLM`` whose training loss is the chunked fused linear + cross-entropy.

    Registered as ``mpt_causal_lm_fused_loss``. Same constructor arguments as the parent, plus:

    Args:
        fused_loss_chunk_size: tokens per chunk (None: :func:`default_chunk_size` of the vocabulary).
        fused_loss_kernel: the per-chunk softmax/gradient, one of :data:`KERNELS` (module docstring).

    In training mode, with ``use_train_metrics`` false and labels in the batch, ``forward`` computes the loss
    (:func:`linear_cross_entropy`, the parent's loss value without the logits) and returns a
    :class:`FusedLossOutput`; ``loss`` returns it. Otherwise (eval mode, ``eval_forward``, generation, or
    ``use_train_metrics`` true, where composer needs the logits of the training forward; a warning says so)
    everything is the parent's.

    Raises:
        ValueError: for settings this loss does not compute (the message names the setting): ``loss_fn`` other
            than ``torch_crossentropy``, ``tie_word_embeddings: false``, ``logit_scale``,
            ``final_logit_softcapping``, a MegaBlocks ``ffn_config.ffn_type``, a bad chunk size or kernel.
    """

    def __init__(self, tokenizer: Any = None, use_train_metrics: bool | None = True,
                 additional_train_metrics: list | None = None,
                 loss_fn: str | dict | None = 'fused_crossentropy',
                 fused_loss_chunk_size: int | None = None, fused_loss_kernel: str = 'torch', **kwargs: Any):
        where = f'model {FUSED_LOSS_MODEL_NAME} (train setting fused_loss)'
        if loss_fn != 'torch_crossentropy':
            raise ValueError(f"{where}: loss_fn is {loss_fn!r}; the fused linear + cross-entropy computes "
                             f"llm-foundry's torch_crossentropy loss only. Fix: set model.loss_fn: "
                             f"torch_crossentropy (train.loss_fn), or fused_loss: false.")
        if fused_loss_chunk_size is not None and (isinstance(fused_loss_chunk_size, bool) or
                                                  not isinstance(fused_loss_chunk_size, int) or
                                                  fused_loss_chunk_size < 1):
            raise ValueError(f'{where}: fused_loss_chunk_size must be a positive integer (tokens per chunk) or '
                             f'null, got {fused_loss_chunk_size!r}.')
        if fused_loss_kernel not in KERNELS:
            raise ValueError(f'{where}: fused_loss_kernel must be one of {KERNELS}, got {fused_loss_kernel!r}.')
        if kwargs.get('tie_word_embeddings', True) is False:
            raise ValueError(f"{where}: tie_word_embeddings is false (a separate lm_head); the fused loss "
                             f"supports MPT's tied embedding only. Fix: fused_loss: false for this model.")
        for key in ('logit_scale', 'final_logit_softcapping'):
            if kwargs.get(key) is not None:
                raise ValueError(f'{where}: {key} is set ({kwargs[key]!r}); the fused loss does not scale or cap '
                                 f'logits. Fix: fused_loss: false for this model, or remove {key}.')
        ffn_type = (kwargs.get('ffn_config') or {}).get('ffn_type')
        if ffn_type is not None and ffn_type in set(ffns_with_megablocks.get_all()):
            raise ValueError(f'{where}: ffn_config.ffn_type {ffn_type!r} is a MegaBlocks MoE (its load-balancing '
                             f'loss is not wired into the fused path). Fix: fused_loss: false for this model.')
        super().__init__(tokenizer=tokenizer, use_train_metrics=use_train_metrics,
                         additional_train_metrics=additional_train_metrics, loss_fn=loss_fn, **kwargs)
        wte = self.model.transformer.wte
        if not isinstance(wte, FusedLossEmbedding) or self.model.lm_head is not None:
            raise ValueError(f"{where}: the model's unembedding is not llm-foundry's tied SharedEmbedding "
                             f'({type(wte).__name__}, lm_head {type(self.model.lm_head).__name__}); the fused '
                             f'loss cannot use it. Fix: fused_loss: false for this model.')
        wte.fused_loss_chunk_size = fused_loss_chunk_size
        wte.fused_loss_kernel = fused_loss_kernel
        #: True when training uses the fused loss (False: the train metrics need the logits -> stock path)
        self.fused_loss_active = not use_train_metrics
        if use_train_metrics:
            warnings.warn(f'{FUSED_LOSS_MODEL_NAME}: use_train_metrics is true and the train metrics need the full '
                          f'logits, so training runs the stock loss path (no speed-up). Set train_metrics: false '
                          f'to use the fused loss.')

    @property
    def model_class(self) -> type:
        return FusedLossMPTForCausalLM

    def forward(self, batch: MutableMapping) -> Any:
        if not (self.fused_loss_active and self.training) or batch.get('labels') is None:
            return super().forward(batch)
        labels = batch['labels']
        targets = get_targets(labels) if self.shift_labels else labels
        return self.model(input_ids=batch.get('input_ids', None),
                          attention_mask=batch.get('attention_mask', None),
                          sequence_id=batch.get('sequence_id', None),
                          inputs_embeds=batch.get('inputs_embeds', None),
                          position_ids=batch.get('position_ids', None),
                          llmpipe_loss_targets=targets)

    def loss(self, outputs: Any, batch: Mapping) -> dict | torch.Tensor:
        if isinstance(outputs, FusedLossOutput):
            return outputs.loss
        return super().loss(outputs, batch)

    def eval_forward(self, batch: Any, outputs: Any | None = None) -> Any:
        if isinstance(outputs, FusedLossOutput):  # a fused training output has no logits: compute them
            outputs = None
        return super().eval_forward(batch, outputs)


def register() -> None:
    """Register :class:`ComposerMPTCausalLMFusedLoss` as ``mpt_causal_lm_fused_loss`` in llm-foundry's ``models``
    registry (idempotent)."""
    from llmfoundry.registry import models
    if FUSED_LOSS_MODEL_NAME not in models.get_all():
        models.register(FUSED_LOSS_MODEL_NAME, func=ComposerMPTCausalLMFusedLoss)


register()
