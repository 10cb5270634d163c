"""FSDP where llm-foundry would not use it: on one device, and on a host without a GPU.

llm-foundry's ``train`` drops ``fsdp_config`` when the world size is 1 ("FSDP is not applicable for single-GPU
training. Reverting to DDP", ``llmfoundry/command_utils/train.py``), but a large model on one GPU needs composer's
FSDP for sharded checkpoints and activation checkpointing. The ``llmpipe_single_device_fsdp`` callback gives the
trainer its FSDP config at ``Event.INIT``, before composer wraps the model (``Trainer._wrap_model_for_distributed``
runs after INIT and reads ``state.fsdp_config``), exactly as a multi-device run gets it.

:func:`fsdp_on_cpu` lets composer's FSDP run without CUDA (the CPU tests of sharded checkpoints, gloo).
"""

from __future__ import annotations

CALLBACK_NAME = "llmpipe_single_device_fsdp"


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


def register() -> None:
    """Register the callback in llm-foundry's callbacks registry as ``llmpipe_single_device_fsdp``. Idempotent."""
    from llmfoundry.registry import callbacks
    if CALLBACK_NAME not in callbacks:
        callbacks.register(CALLBACK_NAME, func=_build_callback_class())
