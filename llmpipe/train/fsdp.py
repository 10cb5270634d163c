"""FSDP where llm-foundry would not use it: on one device, and on a host without a GPU.

llm-foundry's ``train`` drops ``fsdp_config`` when the world size is 1 ("FSDP is not applicable for single-GPU
training. Reverting to DDP", ``llmfoundry/command_utils/train.py``), but a large model on one GPU needs composer's
FSDP for sharded checkpoints and activation checkpointing. The ``llmpipe_single_device_fsdp`` callback gives the
trainer its FSDP config at ``Event.INIT``, before composer wraps the model (``Trainer._wrap_model_for_distributed``
runs after INIT and reads ``state.fsdp_config``), exactly as a multi-device run gets it.

The ``llmpipe_free_grads_before_eval`` callback (:data:`FREE_GRADS_CALLBACK`, added to every FSDP training by
:func:`llmpipe.train.pretrain.foundry_train_config`) sets the gradients to None before composer's in-training evaluation.
Contract: under FSDP mixed precision (``mixed_precision: PURE``) a forward sees bf16 views of the unsharded
parameters while the last optimizer step left fp32 sharded gradients on them; torch.compile's tracing of the eval
forward copies each parameter's gradient onto a fake tensor, which torch >= 2.9 refuses (``attempting to assign a
gradient with dtype 'float' to a tensor with grad_dtype 'BFloat16'``). Composer itself drops the gradients
(``zero_grad(set_to_none=True)``) before the next training batch, so nothing reads them in between; evaluation
also runs with that much less memory.

:func:`fsdp_on_cpu` lets composer's FSDP run without CUDA (the CPU tests of sharded checkpoints, gloo).
"""

from __future__ import annotations

CALLBACK_NAME = "llmpipe_single_device_fsdp"
#: The name of the callback that drops gradients before in-training evaluation (module docstring).
FREE_GRADS_CALLBACK = "llmpipe_free_grads_before_eval"


def fsdp_on_cpu() -> bool:
    """Let composer's FSDP run on a host without a GPU; return True when the host has none (and the patch is in
    place), False on a GPU host, which is left untouched.

    composer 0.32 passes ``device_id=torch.cuda.current_device()`` to FSDP whatever the device
    (``composer.distributed.dist_strategy.prepare_fsdp_module``); torch's FSDP itself runs on the CPU with
    ``device_id=torch.device("cpu")``. Without CUDA, ``torch.cuda.current_device`` is made to return that device
    in this process; nothing else changes.
    """
    import torch
    if torch.cuda.is_available():
        return False
    torch.cuda.current_device = lambda: torch.device("cpu")
    return True


def _build_callback_class():
    """Define the callback lazily so this module imports without composer (login node)."""
    from composer.core import Callback, Event, State
    from composer.loggers import Logger

    class SingleDeviceFSDP(Callback):
        """Set ``state.fsdp_config`` (composer's ``FSDPConfig`` from ``fsdp_config``, a dict of its fields) and a
        one-device mesh at ``Event.INIT`` of a world-size-1 training.

        Raises:
            RuntimeError: the world size is not 1 (llm-foundry passes FSDP through itself there).
        """

        def __init__(self, fsdp_config: dict):
            self.fsdp_config = dict(fsdp_config)

        def run_event(self, event: Event, state: State, logger: Logger) -> None:
            if event != Event.INIT:
                return
            from composer.utils import dist
            from composer.utils.parallelism import FSDPConfig
            from torch.distributed.device_mesh import init_device_mesh
            if dist.get_world_size() != 1:
                raise RuntimeError(f"{CALLBACK_NAME} is for world size 1, not {dist.get_world_size()}")
            cfg = FSDPConfig(**self.fsdp_config)
            device = "cuda" if state.device.name == "gpu" else "cpu"
            mesh = init_device_mesh(device, (1,), mesh_dim_names=("data_parallel_shard",))
            cfg.device_mesh = mesh
            state.fsdp_config = cfg
            state.device_mesh = mesh

    return SingleDeviceFSDP


def _build_free_grads_class():
    from composer.core import Callback, State
    from composer.loggers import Logger

    class FreeGradsBeforeEval(Callback):
        """``zero_grad(set_to_none=True)`` of every optimizer at ``Event.EVAL_BEFORE_ALL`` (module docstring)."""

        def eval_before_all(self, state: State, logger: Logger) -> None:
            for optimizer in state.optimizers or ():
                optimizer.zero_grad(set_to_none=True)

    return FreeGradsBeforeEval


def register() -> None:
    """Register the callbacks in llm-foundry's callbacks registry as ``llmpipe_single_device_fsdp`` and
    ``llmpipe_free_grads_before_eval``. Idempotent."""
    from llmfoundry.registry import callbacks
    if CALLBACK_NAME not in callbacks:
        callbacks.register(CALLBACK_NAME, func=_build_callback_class())
    if FREE_GRADS_CALLBACK not in callbacks:
        callbacks.register(FREE_GRADS_CALLBACK, func=_build_free_grads_class())
