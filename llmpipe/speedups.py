"""Speed-ups of the training step that plug into llm-foundry and composer without forking them.

Each was measured on one H200 with ``scripts/bench_train_throughput.py`` (see benchmarks/README.md):

* :func:`register_fused_adamw` registers ``fused_adamw`` in llm-foundry's optimizer registry: the same update as
  composer's ``DecoupledAdamW`` (decoupled weight decay scaled by lr_t / lr_0) run by ``torch.optim.AdamW`` with
  ``fused=True`` on CUDA, instead of composer's per-parameter loop that synchronises with the GPU.
* :func:`dynamo_catalogue_fix` makes composer's ``compile_config`` (torch.compile) work with llm-foundry 0.22.

The chunked fused linear + cross-entropy loss (train setting ``fused_loss``; the model ``mpt_causal_lm_fused_loss``
in llm-foundry's model registry) lives in :mod:`llmpipe.fused_loss`: per chunk of tokens ``z = h_c W^T``,
``loss += sum -log_softmax(z)[t]``, ``G = softmax(z) - onehot(t)``, ``dh_c = G W / n``, ``dW += G^T h_c / n``
(``n`` = non-ignored targets), so the full ``[tokens, vocab]`` logits never exist; the idea of Liger-Kernel's
``FusedLinearCrossEntropy`` (https://github.com/linkedin/Liger-Kernel), our own code. On one H200 it ran at the
same speed at the same microbatch and halved peak memory, which allowed 2x microbatch (benchmarks/README.md, #10).
"""

from __future__ import annotations

from typing import Any


def register_fused_adamw() -> None:
    """Register ``fused_adamw`` in llm-foundry's optimizer registry: torch.optim.AdamW(fused=True) with Composer's
    decoupled weight decay (decay = lr_t / lr_0 * weight_decay, i.e. torch's ``weight_decay = wd / lr_0``)."""
    import torch
    from llmfoundry.registry import optimizers

    if 'fused_adamw' in optimizers.get_all():
        return

    class FusedAdamW(torch.optim.AdamW):
        """torch.optim.AdamW(fused=True on CUDA) with Composer DecoupledAdamW's weight-decay convention."""

        def __init__(self, params: Any, lr: float = 1e-3, betas: Any = (0.9, 0.95), eps: float = 1e-8,
                     weight_decay: float = 0.0, **kw: Any) -> None:
            super().__init__(params, lr=lr, betas=tuple(betas), eps=eps,
                             weight_decay=(weight_decay / lr) if lr else 0.0, fused=torch.cuda.is_available())

    optimizers.register('fused_adamw', func=FusedAdamW)


def dynamo_catalogue_fix() -> None:
    """Make composer's ``compile_config`` work with llm-foundry 0.22 on Python 3.12 (idempotent).

    Cause of the ``InternalTorchDynamoError: KeyError: 0`` (see benchmarks/README.md): torch.compile traces
    ``ComposerMPTCausalLM.forward``/``loss``, which test ``ffn_type in ffns_with_megablocks``; that is a catalogue
    ``Registry``, whose ``__contains__`` reads the module global ``catalogue.AVAILABLE_ENTRY_POINTS``, a stdlib
    ``importlib.metadata.EntryPoints``. On Python 3.12 that class is a tuple whose ``__getitem__`` takes an entry-point
    *name*; dynamo guards it like a tuple, by index (``AVAILABLE_ENTRY_POINTS[0]``), and the guard raises KeyError(0).
    Fix: give modeling_mpt a frozenset snapshot of that registry's names (the only registry consulted in the
    traced code; same answer), and make any other catalogue membership test run eagerly (a graph break, not an
    error).
    """
    import catalogue
    import torch
    from llmfoundry.layers_registry import ffns_with_megablocks
    from llmfoundry.models.mpt import modeling_mpt

    if not isinstance(modeling_mpt.ffns_with_megablocks, frozenset):
        modeling_mpt.ffns_with_megablocks = frozenset(ffns_with_megablocks.get_all())
    if not getattr(catalogue.Registry.__contains__, '_llmpipe_eager', False):
        wrapped = torch.compiler.disable(catalogue.Registry.__contains__)
        wrapped._llmpipe_eager = True
        catalogue.Registry.__contains__ = wrapped
