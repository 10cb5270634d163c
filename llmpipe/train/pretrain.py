"""Pretraining through llm-foundry's own train entry point, configured from our YAML.

:func:`foundry_train_config` turns one run's merged settings (:func:`llmpipe.config.runs.run_config`) into the config dict
that ``llmfoundry.command_utils.train`` takes. :class:`TrainTask` is what the dispatch module runs in every task (one
per GPU): it exports submitit's torch.distributed environment, picks the newest complete checkpoint to resume from,
calls llm-foundry, and on rank 0 writes ``train.json``.

Checkpoints live in ``results/{run}/checkpoints/<identity key>/`` (:mod:`llmpipe.train.checkpoints` owns the layout,
the completion markers and retention) and never rely on symlinks: composer's ``latest-rank0.pt`` symlink is switched
off by :class:`RunMonitor` (shared drives such as CIFS mounts refuse symlinks). With FSDP (every multi-device
training, and from ``train.fsdp_min_params`` parameters on one device) each rank writes its shard of a sharded
checkpoint (PyTorch distributed checkpoint), which resumes on any world size. When Slurm signals the end of the
allocation (``--signal=USR2@...``, preemption or time limit), training saves a checkpoint at the next batch boundary
on all ranks and only then lets submitit requeue the job, which resumes from it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import tempfile
import time
from typing import Any

from llmpipe.atomic import read_json
from llmpipe.config.runs import world_size
from llmpipe.config.settings import RunSettings
from llmpipe.dispatch.rendezvous import export_dist_env
from llmpipe.train import checkpoints as ckpt
from llmpipe.train import throughput, tracking
from llmpipe.train.fp8 import apply_fp8
from llmpipe.train.fsdp import CALLBACK_NAME, FREE_GRADS_CALLBACK
from llmpipe.train.speedups import apply_compile

log = logging.getLogger("llmpipe.train.pretrain")

_PENDING_SIGNAL: list = []  # (signum, frame, previous handler) set by our USR2 handler

#: Model keys that only :class:`llmpipe.model.fused_loss.ComposerMPTCausalLMFusedLoss` takes (not ``MPTConfig``).
FUSED_LOSS_MODEL_KEYS = ("fused_loss_chunk_size", "fused_loss_kernel")


# ------------------------------------------------------------------------------------------- config

def uses_fsdp(settings: RunSettings, world_size: int, sharded_resume: bool = False) -> bool:
    """Whether a training runs under FSDP (and so saves sharded checkpoints): on more than one device always; on
    one device when the model has at least ``train.fsdp_min_params`` parameters (:func:`llmpipe.model.mfu.mpt_param_count`
    of the run's ``arch``; None: never) or when it resumes from a sharded checkpoint."""
    if world_size > 1 or sharded_resume:
        return True
    threshold = settings.train.fsdp_min_params
    if threshold is None:
        return False
    from llmpipe.model.mfu import mpt_param_count
    return mpt_param_count(settings.arch.as_dict())["total"] >= float(threshold)


def foundry_train_config(settings: RunSettings, *, data_dir: str | None, save_folder: str | None, world_size: int,
                         tokenizer_dir: str | None = None, tokenizer_name: str | None = None,
                         fsdp: bool | None = None) -> dict:
    """Build the llm-foundry train config (the dict ``llmfoundry.command_utils.train`` takes) for one run.

    Args:
        settings: the run's typed settings (:func:`llmpipe.config.runs.run_settings`); a finetune's errors name
            ``finetunes.<run>``.
        data_dir: the MDS dataset folder with ``train/`` and ``val/`` (None: caller sets the loaders).
        save_folder: checkpoint folder (None: no checkpoints).
        world_size: number of ranks; used to split the global batch.
        tokenizer_dir: a folder with a saved Hugging Face tokenizer (wins over ``tokenizer_name``).
        tokenizer_name: the hub name of the run's tokenizer (``tokenizers.<data.tokenizer>.name``; may be None),
            used when ``tokenizer_dir`` is None.
        fsdp: train under FSDP with sharded checkpoints (None: :func:`uses_fsdp`).

    Returns:
        A plain dict; keys follow llm-foundry's ``TrainConfig``. Checkpoint retention is ours
        (:func:`llmpipe.train.checkpoints.prune_checkpoints` counts every job's saves), so composer keeps all.
    """
    run = settings.name
    if fsdp is None:
        fsdp = uses_fsdp(settings, world_size)
    arch, train = settings.arch, settings.train
    seq = settings.data.concat_tokens
    opt = train.optimizer.foundry_config()
    model = {
        "name": "mpt_causal_lm",
        "init_device": "meta" if fsdp and world_size > 1 else "cpu",
        "d_model": arch.d_model,
        "n_heads": arch.n_heads,
        "n_layers": arch.n_layers,
        "expansion_ratio": arch.expansion_ratio,
        "max_seq_len": arch.max_seq_len,
        "vocab_size": arch.vocab_size,
        "no_bias": arch.no_bias,
        "norm_type": arch.norm_type,
        "attn_config": dict(arch.attn_config),
        "loss_fn": train.loss_fn,
        "use_train_metrics": train.train_metrics,
    }
    if arch.n_kv_heads is not None and not arch.kv_in_attn_config:
        model["attn_config"]["attn_type"] = "grouped_query_attention"  # written as arch.n_kv_heads
        model["attn_config"]["kv_n_heads"] = arch.n_kv_heads
    # our SDPA attention is an llm-foundry attention class selected through attn_type (see llmpipe.model.attention)
    model["attn_config"] = _attn_config(model["attn_config"], train.attn_impl)
    if train.fused_loss is not None and not train.train_metrics:
        # chunked linear + cross-entropy without the full logits (llmpipe.model.fused_loss); the train metrics need the
        # logits, so with train_metrics on the stock model trains as before
        model["name"] = _fused_loss_model_name()
        model["fused_loss_chunk_size"] = train.fused_loss["chunk_size"]
        model["fused_loss_kernel"] = train.fused_loss["kernel"]
    tok_name = tokenizer_dir or tokenizer_name

    def loader(split: str, shuffle: bool, drop_last: bool) -> dict:
        out = {"name": "text",
               "dataset": {"local": data_dir, "split": split, "shuffle": shuffle, "max_seq_len": seq,
                           "shuffle_seed": train.seed},
               "drop_last": drop_last, "num_workers": train.num_workers}
        if train.num_workers == 0:  # torch refuses prefetching without worker processes
            out.update(prefetch_factor=None, persistent_workers=False)
        return out

    if train.fused_optimizer and opt["name"] == "decoupled_adamw":
        opt["name"] = "fused_adamw"  # same update, torch's fused kernel (llmpipe.train.speedups)
    gbs = train.global_batch_size
    per_device = gbs // world_size
    cfg: dict[str, Any] = {
        "run_name": run,
        "seed": train.seed,
        "max_seq_len": seq,
        "model": model,
        "tokenizer": {"name": tok_name, "kwargs": {"model_max_length": seq}},
        "optimizer": opt,
        "scheduler": train.scheduler.foundry_config(),
        "algorithms": {"gradient_clipping": {"clipping_type": "norm",
                                             "clipping_threshold": float(train.grad_clip_norm)}},
        "max_duration": f"{train.max_duration_batches}ba",
        "eval_interval": f"{train.eval_interval_batches}ba",
        "eval_first": False,
        "eval_subset_num_batches": train.eval_subset_batches,
        "global_train_batch_size": gbs,
        "device_train_microbatch_size": min(train.microbatch_size, per_device),
        "device_eval_batch_size": train.eval_microbatch_size,
        "precision": train.precision,
        "progress_bar": False,
        "log_to_console": True,
        "console_log_interval": f"{train.log_interval_batches}ba",
        "python_log_level": "info",
        "dist_timeout": 600,
        "callbacks": {"llmpipe_run_monitor": {
            "log_interval": train.log_interval_batches,
            "checkpoints_to_keep": train.checkpoints_to_keep,
            "earlier_identities_to_keep": train.earlier_identities_to_keep},
                      "drop_full_attention_mask": {}},
        "loggers": {},
        "autoresume": False,
        "save_overwrite": True,
    }
    if data_dir is not None:
        cfg["train_loader"] = loader("train", True, True)
        cfg["eval_loader"] = loader("val", False, False)
    if fsdp:
        fsdp_cfg = {"sharding_strategy": "FULL_SHARD", "mixed_precision": "PURE",
                    "activation_checkpointing": False, "activation_checkpointing_reentrant": False,
                    "activation_cpu_offload": False, "limit_all_gathers": True,
                    "state_dict_type": "sharded", **(train.fsdp or {})}
        # auto is the memory plan's to decide for the job's GPUs (llmpipe.plan.memory_time.resolve_activation_checkpointing,
        # the training step does); left unresolved it recomputes, the side that fits
        fsdp_cfg["activation_checkpointing"] = fsdp_cfg["activation_checkpointing"] in (True, "auto")
        cfg["callbacks"][FREE_GRADS_CALLBACK] = {}  # before in-training evaluation (llmpipe.train.fsdp)
        if world_size > 1:
            cfg["fsdp_config"] = fsdp_cfg
        else:  # llm-foundry drops fsdp_config at world size 1; llmpipe.train.fsdp's callback hands it to composer
            cfg["callbacks"][CALLBACK_NAME] = {"fsdp_config": fsdp_cfg}
    apply_compile(cfg, train.compile)  # llmpipe.train.speedups
    apply_fp8(cfg, train.fp8, train.where)  # llmpipe.train.fp8: the llmpipe_fp8 callback, first of all
    if save_folder is not None:
        cfg["save_folder"] = save_folder
        cfg["save_interval"] = f"{train.save_interval_batches}ba"
        cfg["save_num_checkpoints_to_keep"] = -1
    return cfg


def batch_layout(global_batch: int, world_size: int, microbatch_asked: int, microbatch: int) -> str:
    """One log line saying how a global batch is split (samples, not tokens), e.g. ``global batch 256 = 8 devices
    x 32 per device, microbatch 32 (train.microbatch_size 64 is above the per-device batch: capped)``; the
    training step caps the microbatch at the per-device batch (:func:`foundry_train_config`)."""
    per_device = global_batch // max(world_size, 1)
    line = (f"global batch {global_batch} = {world_size} device(s) x {per_device} per device, microbatch "
            f"{microbatch} ({per_device // max(microbatch, 1)} gradient accumulation step(s))")
    if microbatch_asked > microbatch:
        line += f"; train.microbatch_size {microbatch_asked} is above the per-device batch: capped at {microbatch}"
    return line


def _attn_config(attn_config: dict, attn_impl: str) -> dict:
    # llmpipe.model.attention imports torch; keep this module importable on the login node
    from llmpipe.model.attention import mpt_attn_config
    return mpt_attn_config(attn_config, attn_impl)


def _fused_loss_model_name() -> str:
    # llmpipe.model.fused_loss imports torch and llm-foundry and registers the model on import
    from llmpipe.model.fused_loss import FUSED_LOSS_MODEL_NAME
    return FUSED_LOSS_MODEL_NAME


def register_extensions(compile_enabled: bool = False) -> None:
    """Register everything our train config names in llm-foundry's registries (SDPA attention classes, the callbacks
    ``drop_full_attention_mask``, ``llmpipe_run_monitor``, ``llmpipe_fp8`` and :mod:`llmpipe.train.fsdp`'s two, the
    ``fused_adamw`` optimizer, the ``mpt_causal_lm_fused_loss`` model), per-job streaming shared-memory names
    (:mod:`llmpipe.train.shm_names`); with torch.compile, :func:`llmpipe.train.speedups.dynamo_catalogue_fix`. Idempotent."""
    import llmpipe.model.attention as attention
    import llmpipe.model.fused_loss as fused_loss
    import llmpipe.train.fsdp as fsdp
    from llmpipe.train import fp8, shm_names, speedups
    shm_names.per_job_prefixes()  # concurrent jobs on one node never pick the same streaming shared-memory names
    attention.register()
    fused_loss.register()
    fp8.register()
    speedups.register_fused_adamw()
    speedups.register_compile_blocks()
    fsdp.register()
    register()
    if compile_enabled:
        speedups.dynamo_catalogue_fix()


# ------------------------------------------------------------------------------------------- the callback

def _build_monitor_class():
    """Define :class:`RunMonitor` lazily so this module imports without composer (login node)."""
    from composer.core import Callback, State
    from composer.loggers import Logger

    class RunMonitor(Callback):
        """Records the loss curve and throughput, disables checkpoint symlinks, marks complete checkpoints and
        saves a checkpoint when Slurm signals the end of the allocation.

        Writes ``{save_folder}/train_log.jsonl`` (one JSON line per ``log_interval`` batches: batch, loss,
        tokens, elapsed seconds) and prints a step-log line (:func:`llmpipe.train.throughput.report`) on rank 0, and
        times every batch for the steady-state figures (:mod:`llmpipe.train.throughput`). After each save, rank 0 writes
        the checkpoint's ``.complete`` marker and applies retention (:func:`llmpipe.train.checkpoints.prune_checkpoints`
        with ``checkpoints_to_keep``, then :func:`llmpipe.train.checkpoints.prune_earlier_identities`).
        """

        def __init__(self, log_interval: int = 10, signal_check_interval: int = 1, checkpoints_to_keep: int = 2,
                     earlier_identities_to_keep: int = 1, flops_per_token=None, peak_flops=None, world_size=1):
            self.log_interval = int(log_interval)
            self.checkpoints_to_keep = int(checkpoints_to_keep)
            self.earlier_identities_to_keep = int(earlier_identities_to_keep)
            self.signal_check_interval = max(1, int(signal_check_interval))
            self.records: list[dict] = []
            self.first_loss: float | None = None
            self.last_loss: float | None = None
            self.t_fit_start = None
            self.start_batch = 0
            self.start_tokens = 0
            self.batches_this_job = 0
            self.log_path = None
            self.save_seconds: list[float] = []  # wall time of each save composer made in this job (not the last)
            self.final_batch: int | None = None  # the training's duration in batches (None: not given in batches)
            self._saved = 0
            self._t_batch_end = None
            self.timer_args = {"flops_per_token": flops_per_token, "peak_flops": peak_flops, "world_size": world_size}

        def _savers(self, state: State):
            from composer.callbacks import CheckpointSaver
            return [cb for cb in state.callbacks if isinstance(cb, CheckpointSaver)]

        def _save_folder(self, state: State) -> str:
            savers = self._savers(state)
            return str(savers[0].folder) if savers and savers[0].folder else "."

        def init(self, state: State, logger: Logger) -> None:
            for saver in self._savers(state):
                saver.latest_filename = None  # no symlinks: resume finds the newest checkpoint itself

        def fit_start(self, state: State, logger: Logger) -> None:
            import torch
            self.t_fit_start = time.time()
            self.start_batch = int(state.timestamp.batch)
            self.start_tokens = int(state.timestamp.token)
            self.final_batch = throughput.total_batches(state)
            self.timer = throughput.start(state, **self.timer_args)
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            savers = self._savers(state)
            if savers and savers[0].folder:
                self.log_path = os.path.join(os.path.abspath(savers[0].folder), "train_log.jsonl")
            self._install_signal_handler()

        def _install_signal_handler(self) -> None:
            """Defer submitit's USR2 handler to the next batch boundary (after a checkpoint is saved)."""
            _PENDING_SIGNAL.clear()   # a signal is of the allocation it came in, never of an earlier fit's
            try:
                previous = signal.getsignal(signal.SIGUSR2)
            except ValueError:
                return

            def handler(signum, frame):
                print(f"llmpipe: caught signal {signum}; checkpointing at the next batch boundary", flush=True)
                _PENDING_SIGNAL.append((signum, frame, previous))

            try:
                signal.signal(signal.SIGUSR2, handler)
            except ValueError:  # not in the main thread (tests)
                pass

        def batch_start(self, state: State, logger: Logger) -> None:
            # the gap since the last batch ended holds composer's save of that batch (saves and evaluations are
            # configured on different batches), so a new entry in saved_checkpoints times its save
            saved = sum(len(s.saved_checkpoints) for s in self._savers(state))
            if self._t_batch_end is not None and saved > self._saved:
                self.save_seconds.append(round(time.time() - self._t_batch_end, 3))
                self.timer.exclude()
            self._saved = saved

        def batch_end(self, state: State, logger: Logger) -> None:
            from composer.utils import dist
            self._t_batch_end = time.time()
            self.batches_this_job += 1
            batch = int(state.timestamp.batch)
            throughput.batch_end(self.timer, state)
            loss = state.loss
            if isinstance(loss, dict):
                loss = loss.get("total", next(iter(loss.values())))
            try:
                loss_v = float(loss.detach().float().mean().item()) if hasattr(loss, "detach") else float(loss)
            except Exception:  # noqa: BLE001 - loss may be unavailable on some batches
                loss_v = None
            if loss_v is not None:
                if self.first_loss is None:
                    self.first_loss = loss_v
                self.last_loss = loss_v
            if batch % self.log_interval == 0 or batch == 1 or batch == self.final_batch:
                rec = {"batch": batch, "loss": loss_v, "tokens": int(state.timestamp.token),
                       "elapsed_s": round(time.time() - self.t_fit_start, 3)}
                self.records.append(rec)
                if dist.get_global_rank() == 0 and self.log_path:
                    with open(self.log_path, "a") as fh:
                        fh.write(json.dumps(rec) + "\n")
                throughput.report(self.timer, loss_v, logger, dist.get_global_rank())
            self._maybe_checkpoint_and_requeue(state, logger)

        def _maybe_checkpoint_and_requeue(self, state: State, logger: Logger) -> None:
            import torch
            from composer.utils import dist
            if self.final_batch is not None and int(state.timestamp.batch) >= self.final_batch:
                # every rank is at the same batch, so all of them take this branch: the training ends here, its
                # final save and result follow; a requeued job would find a finished training to resume
                self._finish_despite_signal(state)
                return
            # ranks agree on the flag every `signal_check_interval` batches (default: every batch; the loss read
            # above already syncs with the device, and a 70B batch can outlast Slurm's USR2 warning)
            if dist.get_world_size() > 1 and int(state.timestamp.batch) % self.signal_check_interval:
                return
            flag = torch.tensor([1 if _PENDING_SIGNAL else 0], dtype=torch.int32)
            if dist.get_world_size() > 1:
                if torch.cuda.is_available():
                    flag = flag.cuda()
                dist.all_reduce(flag, reduce_operation="MAX")
            if int(flag.item()) == 0:
                return
            print(f"llmpipe: saving checkpoint at batch {int(state.timestamp.batch)} before requeue", flush=True)
            for saver in self._savers(state):
                saver._save_checkpoint(state, logger)
            self.batch_checkpoint(state, logger)
            dist.barrier()
            if _PENDING_SIGNAL:
                signum, frame, previous = _PENDING_SIGNAL[-1]
                if callable(previous):
                    previous(signum, frame)  # submitit: pickle checkpoint(), scontrol requeue, exit
            # ranks that did not get the signal wait here to be requeued by Slurm with the job, or end
            from llmpipe.dispatch.requeue import wait_to_be_requeued
            wait_to_be_requeued(rank=dist.get_global_rank())

        def _finish_despite_signal(self, state: State) -> None:
            """Drop a pending end-of-allocation signal once the final batch has trained: the job saves the final
            checkpoint and returns its result instead of requeueing (a signal during the final save comes here
            from :meth:`fit_end`)."""
            if not _PENDING_SIGNAL:
                return
            signum = _PENDING_SIGNAL[-1][0]
            _PENDING_SIGNAL.clear()
            print(f"llmpipe: signal {signum} came after the final batch {int(state.timestamp.batch)} had trained: "
                  f"saving the final checkpoint and the result instead of requeueing", flush=True)

        def batch_checkpoint(self, state: State, logger: Logger) -> None:
            from composer.utils import dist
            if dist.get_global_rank() != 0:
                return
            folder = self._save_folder(state)
            marked = False
            for saver in self._savers(state):
                if saver.saved_checkpoints:
                    path = saver.saved_checkpoints[-1]
                    if ckpt.checkpoint_batch(os.path.dirname(path)) is not None:
                        path = os.path.dirname(path)  # a sharded checkpoint: rank 0's shard file in its folder
                    if os.path.exists(path) and not os.path.exists(path + ckpt.MARKER):
                        ckpt.mark_complete(path, int(state.timestamp.batch))
                        marked = True
            if marked:
                ckpt.prune_checkpoints(folder, self.checkpoints_to_keep)
                ckpt.prune_earlier_identities(os.path.dirname(folder), folder, self.earlier_identities_to_keep)

        def eval_before_all(self, state: State, logger: Logger) -> None:
            self.timer.exclude()

        def fit_end(self, state: State, logger: Logger) -> None:
            self._finish_despite_signal(state)
            logger.log_metrics({f"llmpipe/{k}": v for k, v in self.timer.steady().items() if isinstance(v, float)})
            self.batch_checkpoint(state, logger)

    return RunMonitor


def register() -> None:
    """Register :class:`RunMonitor` in llm-foundry's callbacks registry as ``llmpipe_run_monitor``."""
    from llmfoundry.registry import callbacks
    if "llmpipe_run_monitor" not in callbacks:
        callbacks.register("llmpipe_run_monitor", func=_build_monitor_class())


# ------------------------------------------------------------------------------------------- the task

class TrainTask:
    """The training step as submitit runs it in every task; checkpointable for preemption and requeue.

    Calling it trains (resuming from the newest complete checkpoint) and returns the train.json dict on rank 0.
    ``checkpoint()`` is what submitit calls when Slurm signals the end: the job is requeued with the same task,
    which resumes from the checkpoint :class:`RunMonitor` saved just before.

    Holds plain values only (submitit pickles the task). Args:
        settings: the run's typed settings (:func:`llmpipe.config.runs.run_settings`; its ``fsdp``
            ``activation_checkpointing`` resolved by :func:`llmpipe.plan.memory_time.resolve_activation_checkpointing`).
        data_dir: the MDS dataset folder (a finetune: the prepared instruction set).
        tokenizer_dir: the saved Hugging Face tokenizer folder.
        run_dir: ``results/<run>``; checkpoints go to its ``checkpoints/``.
        identity: the training identity (canonical JSON text) written to the checkpoint folder.
        resources: the job's resources (:func:`llmpipe.config.runs.step_resources` of step ``train``).
        peak_flops_table: the config's ``gpu_peak_flops`` (device name -> peak FLOP/s by precision) or None,
            for MFU (:func:`llmpipe.model.mfu.detect_peak_flops`).
    The step sets ``tracking`` (:func:`llmpipe.train.tracking.settings`, None: off) after construction.
    """
    tracking = None

    def __init__(self, settings: RunSettings, data_dir: str, tokenizer_dir: str, run_dir: str, identity: str, *,
                 resources: dict, peak_flops_table: dict | None = None):
        # absolute paths: every task runs in a node-private scratch folder (see __call__)
        self.submit_dir = os.getcwd()
        self.settings, self.run, self.data_dir = settings, settings.name, os.path.abspath(data_dir)
        self.tokenizer_dir, self.run_dir = os.path.abspath(tokenizer_dir), os.path.abspath(run_dir)
        self.identity = identity
        self.resources = dict(resources)
        self.peak_flops_table = peak_flops_table

    def checkpoint_folder(self) -> str:
        """This training's checkpoint folder: ``<run_dir>/checkpoints/<identity key>``
        (:func:`llmpipe.train.checkpoints.identity_folder`)."""
        return ckpt.identity_folder(os.path.join(self.run_dir, "checkpoints"), self.identity)

    def checkpoint(self, *args: Any, **kwargs: Any):
        from llmpipe.dispatch.requeue import resubmission  # counts allocations without progress (requeue_cap)
        ckpts = ckpt.complete_checkpoints(self.checkpoint_folder())
        return resubmission(self, ckpts[-1][0] if ckpts else 0)

    def before_start(self) -> None:
        """Checks and environment set-up before anything is built (a subclass hook)."""

    def build_config(self, save_folder: str, world_size: int, fsdp: bool) -> dict:
        """The llm-foundry train config of this task (a subclass hook; finetuning builds its own)."""
        return foundry_train_config(self.settings, data_dir=self.data_dir, save_folder=save_folder,
                                    world_size=world_size, tokenizer_dir=self.tokenizer_dir, fsdp=fsdp)

    def check_resume(self, resume: str) -> None:
        """Check the checkpoint ``resume`` before composer loads it (a subclass hook; a LoRA finetune's load is not
        strict)."""

    def describe(self) -> str:
        """What this task trains, for the log line of every rank."""
        return f"run {self.run}"

    def finish_result(self, result: dict) -> dict:
        """Add task-specific fields to the train.json record (a subclass hook)."""
        return result

    def recovery_fields(self) -> dict:
        """The train.json fields known without training (run, nodes, devices, global batch, sequence length, FLOPs
        per token and :meth:`finish_result`'s), for a final checkpoint whose job ended before writing its record
        (:func:`llmpipe.train.checkpoints.recovered_result`). Imports no torch (the submitting machine calls it)."""
        from llmpipe.model import mfu as mfu_mod
        s = self.settings
        return self.finish_result({
            "run": self.run, "nodes": int(self.resources.get("nodes", 1)), "devices": world_size(self.resources),
            "global_batch_size": s.train.global_batch_size, "concat_tokens": s.data.concat_tokens,
            "flops_per_token": mfu_mod.flops_per_token(s.arch.as_dict(), s.data.concat_tokens)})

    def plan_resume(self, save_folder: str) -> dict:
        """Rank 0's start-up, before any other rank reads the folder: prepare this identity's checkpoint folder,
        pick the newest loadable checkpoint (damaged ones moved aside) and cut the loss log back to it.

        Returns ``{"resume": path or None, "done": the finished record or None}``; errors are returned as
        ``{"error": message}`` so every rank can raise them."""
        try:
            ckpt.prepare_identity_folder(os.path.dirname(save_folder), self.identity)
            resume = ckpt.loadable_checkpoint(save_folder)
        except (OSError, RuntimeError) as exc:
            return {"error": str(exc)}
        max_batches = self.settings.train.max_duration_batches
        try:  # a final checkpoint without its record gets one here: composer refuses to train past the duration
            done = ckpt.finished_result(save_folder, resume, max_batches, self.recovery_fields(), self.submit_dir)
        except OSError as exc:
            return {"error": str(exc)}
        if done is None:
            ckpt.cut_loss_log(os.path.join(save_folder, "train_log.jsonl"),
                              ckpt.checkpoint_batch(resume) if resume else 0)
        return {"resume": resume, "done": done}

    def __call__(self) -> dict | None:
        self.before_start()
        dist_env = export_dist_env()
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        register_extensions(self.settings.train.compile is not None)
        from llmfoundry.command_utils import train
        from omegaconf import OmegaConf

        save_folder = self.checkpoint_folder()
        rank = int(dist_env["rank"])
        # every rank waits for rank 0's plan: a shared file is simplest before torch.distributed is up; the token
        # tells this allocation's plan from a requeued allocation's
        token = f"{dist_env.get('job_id', os.getpid())}:{os.environ.get('SLURM_RESTART_COUNT', '0')}"
        plan_path = os.path.join(save_folder, ".start")
        if rank == 0:
            plan = {"token": token, **self.plan_resume(save_folder)}
            from llmpipe.atomic import atomic_write_json
            atomic_write_json(plan_path, plan)
        else:
            plan = _wait_for_plan(plan_path, token)
        if plan.get("error"):
            raise RuntimeError(f"{self.describe()}: {plan['error']}")
        resume, done = plan["resume"], plan["done"]
        if done is not None:
            # training already reached its last step (the job ended after the final checkpoint but before Snakemake
            # recorded train.json): nothing to redo, composer is not started.
            how = ("its record recovered from the checkpoint and the loss log" if done.get("recovered")
                   else "reusing its result")
            print(f"llmpipe: rank {rank}: training already complete at {resume}; {how}", flush=True)
            return done if rank == 0 else None
        res = self.resources
        ws = int(dist_env["world_size"])
        sharded = bool(resume) and ckpt.is_sharded(resume)
        fsdp = self.uses_fsdp(ws, sharded)
        if resume and not sharded and fsdp:
            raise RuntimeError(ckpt.resume_mismatch(resume, self.describe()))
        cfg = self.build_config(save_folder, ws, fsdp)
        monitor_args = throughput.monitor_args(self.settings, ws, self.peak_flops_table)
        cfg["callbacks"]["llmpipe_run_monitor"].update(monitor_args)
        tracking.apply(cfg, self.tracking, save_folder, rank, self.run, os.path.basename(save_folder))
        if fsdp:
            from llmpipe.train.fsdp import fsdp_on_cpu
            if fsdp_on_cpu():  # no GPU (the CPU test of sharded checkpoints): every rank builds its model on the CPU
                cfg["model"]["init_device"] = "cpu"
        if resume:
            self.check_resume(resume)
            cfg["load_path"] = resume
            print(f"llmpipe: rank {rank} resuming from {resume}", flush=True)
        print(f"llmpipe: rank {rank}/{ws} on {dist_env.get('hostname', 'localhost')} "
              f"(node rank {dist_env.get('node_rank', 0)}, master {dist_env.get('master_addr', 'local')}); "
              f"{self.describe()}, expected devices {world_size(res)}", flush=True)
        if rank == 0:
            print("llmpipe: " + batch_layout(int(cfg["global_train_batch_size"]), ws,
                                             self.settings.train.microbatch_size,
                                             int(cfg["device_train_microbatch_size"]))
                  + ("; FSDP, sharded checkpoints" if fsdp else "; full checkpoints"), flush=True)
        t0 = time.time()
        # llm-foundry's node signal files are written into the working folder by local rank 0 and awaited by the
        # other local ranks: run the tasks of one node in one private scratch folder, never the shared submit folder
        cwd = os.getcwd()
        scratch = os.path.join(tempfile.gettempdir(), f"llmpipe-{self.run}-{token.replace(':', '-')}-"
                                                      f"node{dist_env.get('node_rank', 0)}")
        os.makedirs(scratch, exist_ok=True)
        os.chdir(scratch)
        try:
            trainer = train(OmegaConf.create(cfg))
            wall = time.time() - t0
            monitor = next(cb for cb in trainer.state.callbacks if type(cb).__name__ == "RunMonitor")
            result = summarize(self.settings, trainer, monitor, wall, ws, save_folder, resume,
                               nodes=int(res["nodes"]), peak_flops_table=self.peak_flops_table)
            fcfg = trainer.state.fsdp_config  # what composer ran with (recompute only exists under FSDP)
            result["fsdp"], result["activation_checkpointing"] = fsdp, bool(fcfg and fcfg.activation_checkpointing)
            trainer.close()
        finally:
            os.chdir(cwd)
        if int(dist_env.get("local_rank", 0)) == 0:
            shutil.rmtree(scratch, ignore_errors=True)
        for key in ("final_checkpoint", "resumed_from", "train_log"):
            if result.get(key):  # relative to the workflow's folder (when inside it), like the paths Snakemake sees
                path = os.path.abspath(result[key])
                if path.startswith(self.submit_dir.rstrip(os.sep) + os.sep):
                    result[key] = os.path.relpath(path, self.submit_dir)
        result = self.finish_result(result)
        if rank == 0:
            ckpt.write_result(save_folder, result)
            return result
        return None

    def uses_fsdp(self, world_size: int, sharded_resume: bool) -> bool:
        """Whether this task trains under FSDP (a subclass hook; :func:`uses_fsdp`)."""
        return uses_fsdp(self.settings, world_size, sharded_resume)


def _wait_for_plan(path: str, token: str, timeout_s: float = 900) -> dict:
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        plan = read_json(path)
        if plan is not None and plan.get("token") == token:
            return plan
        time.sleep(0.5)
    raise TimeoutError(f"{path} did not appear within {timeout_s} s (rank 0 could not prepare checkpoints)")


def summarize(settings: RunSettings, trainer, monitor, wall_s: float, ws: int, save_folder: str,
              resumed_from: str | None, *,
              nodes: int, peak_flops_table: dict | None = None) -> dict:
    """Build the train.json record from a finished trainer.

    Args:
        settings: the run's typed settings (:func:`llmpipe.config.runs.run_settings`).
        trainer, monitor: the finished composer trainer and its :class:`RunMonitor`; ``ws``: ranks (devices).
        wall_s: seconds the training call took (fallback for the fit time); ``nodes``: the job's node count.
        save_folder, resumed_from: the checkpoint folder; the checkpoint this job resumed from, or None.
        peak_flops_table: the config's ``gpu_peak_flops`` or None (:func:`llmpipe.model.mfu.detect_peak_flops`).

    Throughput counts only batches trained by this job (a resumed job does not take credit for earlier ones).
    MFU = tokens/s per device x model FLOPs per token / peak FLOP/s of the device (None on CPU or an unknown
    GPU); FLOPs per token follow llm-foundry's ``flops_per_batch`` (see :mod:`llmpipe.model.mfu`).
    """
    import torch

    from llmpipe.model import mfu as mfu_mod

    run = settings.name
    state = trainer.state
    steps = int(state.timestamp.batch)
    tokens = int(state.timestamp.token)
    tokens_this_job = tokens - monitor.start_tokens
    fit_s = time.time() - monitor.t_fit_start if monitor.t_fit_start else wall_s
    tps = tokens_this_job / fit_s if fit_s > 0 else None
    precision = settings.train.precision
    peak = mfu_mod.detect_peak_flops(precision, peak_flops_table)
    fpt = mfu_mod.flops_per_token(settings.arch.as_dict(), settings.data.concat_tokens)
    mfu = mfu_mod.mfu(tps / ws, fpt, peak) if (tps and peak) else None
    final = ckpt.newest_checkpoint(save_folder)
    if torch.cuda.is_available():
        mem = torch.cuda.max_memory_allocated() / 2**30
        device = torch.cuda.get_device_name()
    else:
        mem = None
        device = "cpu"
    return {
        "run": run,
        "steps": steps,
        "tokens": tokens,
        "wall_clock_s": round(wall_s, 2),
        "tokens_per_s": round(tps, 1) if tps else None,
        "tokens_per_s_per_device": round(tps / ws, 1) if tps else None,
        "mfu": round(mfu, 4) if mfu is not None else None,
        "flops_per_token": fpt,
        "peak_flops_per_device": peak,
        "peak_memory_per_device_gib": round(mem, 3) if mem is not None else None,
        "peak_host_rss_gib": round(throughput.peak_host_rss_gib(), 3),
        "device": device, **monitor.timer.steady(),
        "nodes": int(nodes),
        "devices": ws,
        "global_batch_size": settings.train.global_batch_size,
        "concat_tokens": settings.data.concat_tokens,
        "first_train_loss": monitor.first_loss if monitor.start_batch == 0 else _first_logged_loss(save_folder),
        "final_train_loss": monitor.last_loss,
        "resumed_from": resumed_from,
        "batches_this_job": monitor.batches_this_job,
        "final_checkpoint": final,
        "checkpoint_size_bytes": ckpt.checkpoint_bytes(final) if final else None,
        "train_log": monitor.log_path,
        "checkpoint_save_s": monitor.save_seconds,
    }


def _first_logged_loss(save_folder: str) -> float | None:
    path = os.path.join(os.path.abspath(save_folder), "train_log.jsonl")
    try:
        with open(path) as fh:
            return json.loads(fh.readline())["loss"]
    except (OSError, ValueError, KeyError):
        return None


__all__ = ["foundry_train_config", "uses_fsdp", "TrainTask", "register", "summarize"]
