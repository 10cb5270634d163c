"""Speed-ups of the training step that plug into llm-foundry and composer without forking them.

Each was measured on one H200 with ``tools/bench_train_throughput.py`` (see benchmarks/README.md):

* :func:`register_fused_adamw` registers ``fused_adamw`` in llm-foundry's optimizer registry: the same update as
  composer's ``DecoupledAdamW`` (decoupled weight decay scaled by lr_t / lr_0) run by ``torch.optim.AdamW`` with
  ``fused=True`` on CUDA, instead of composer's per-parameter loop that synchronises with the GPU.
* :func:`dynamo_catalogue_fix` makes composer's ``compile_config`` (torch.compile) work with llm-foundry 0.22.
* :func:`compile_blocks` / the callback ``llmpipe_compile_blocks`` (train setting ``compile: blocks``) compile each
  transformer block in place instead of the whole model's forward.

The chunked fused linear + cross-entropy loss (train setting ``fused_loss``; the model ``mpt_causal_lm_fused_loss``
in llm-foundry's model registry) lives in :mod:`llmpipe.model.fused_loss`: per chunk of tokens ``z = h_c W^T``,
``loss += sum -log_softmax(z)[t]``, ``G = softmax(z) - onehot(t)``, ``dh_c = G W / n``, ``dW += G^T h_c / n``
(``n`` = non-ignored targets), so the full ``[tokens, vocab]`` logits never exist; the idea of Liger-Kernel's
``FusedLinearCrossEntropy`` (https://github.com/linkedin/Liger-Kernel), our own code. On one H200 it ran at the
same speed at the same microbatch and halved peak memory, which allowed 2x microbatch (benchmarks/README.md).
"""

from __future__ import annotations

from collections.abc import Mapping
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

    Cause of the ``InternalTorchDynamoError: KeyError: 0``: torch.compile traces
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


def compile_blocks(model: Any, **options: Any) -> int:
    """Compile every MPT transformer block of ``model`` in place (``nn.Module.compile``), as torchtitan does.

    Each MPT block found in ``model.modules()`` (composer wrapper, HF wrapper and PEFT wrappers included) gets
    ``block.compile(**options)``: its ``__call__`` runs a ``torch.compile``'d forward, while parameter names,
    ``state_dict`` keys and checkpoints stay those of the eager model (no ``_orig_mod`` prefix). Blocks are
    recognised by class name, ``MPTBlock``: llm-foundry's own class, and the copy in an exported checkpoint's
    remote code that a finetune loads with ``trust_remote_code``. Call it before FSDP/activation-checkpointing wrap the blocks; nothing is traced until
    the first forward. The blocks share one code object, so dynamo compiles one graph and reuses it for every
    block of the same shapes. Embedding, final norm and loss stay eager (the fused loss has its own chunk loop).

    Args:
        model: any ``nn.Module`` containing MPT blocks.
        options: ``torch.compile`` keyword arguments (``mode``, ``fullgraph``, ``dynamic``, ``backend``, ...).

    Returns:
        The number of blocks compiled.

    Raises:
        ValueError: ``model`` contains no MPT block (this setting applies to MPT models only).
    """
    dynamo_catalogue_fix()
    blocks = [m for m in model.modules() if type(m).__name__ == 'MPTBlock']
    if not blocks:
        raise ValueError(f"train.compile: blocks found no MPT transformer block in {type(model).__name__}; "
                         f"use compile: true (whole model) or false for this model.")
    for block in blocks:
        block.compile(**options)
    return len(blocks)


def register_compile_blocks() -> None:
    """Register the composer callback ``llmpipe_compile_blocks`` in llm-foundry's callbacks registry (idempotent).

    At ``Event.INIT`` (before composer wraps the model in FSDP/DDP and loads checkpoints) it calls
    :func:`compile_blocks` on ``state.model`` with the callback's keyword arguments as ``torch.compile`` options.
    The training step adds it for ``train.compile: blocks`` (:func:`llmpipe.config.runs.compile_settings`).
    """
    from composer.core import Callback, State
    from composer.loggers import Logger
    from llmfoundry.registry import callbacks

    if 'llmpipe_compile_blocks' in callbacks.get_all():
        return

    class CompileBlocks(Callback):
        """torch.compile each MPT transformer block in place at Event.INIT (:func:`compile_blocks`)."""

        def __init__(self, **options: Any) -> None:
            self.options = options

        def init(self, state: State, logger: Logger) -> None:
            compile_blocks(state.model, **self.options)

    callbacks.register('llmpipe_compile_blocks', func=CompileBlocks)


def apply_compile(cfg: dict, compile_settings: Mapping[str, Any] | None) -> None:
    """Put a run's compile settings (:attr:`llmpipe.config.settings.TrainSettings.compile`, parsed by
    :func:`llmpipe.config.runs.compile_settings`; None: eager) into llm-foundry config ``cfg``: composer's
    ``compile_config`` for the whole model, or the ``llmpipe_compile_blocks`` callback for scope ``blocks``; removes
    both first, so a config built for another run does not leak into this one."""
    cfg.pop("compile_config", None)
    cfg["callbacks"].pop("llmpipe_compile_blocks", None)
    if compile_settings is None:
        return
    if compile_settings["scope"] == "blocks":
        cfg["callbacks"]["llmpipe_compile_blocks"] = dict(compile_settings["options"])
    else:
        cfg["compile_config"] = dict(compile_settings["options"])
