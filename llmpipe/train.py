"""Pretraining through llm-foundry's own train entry point, configured from our YAML.

:func:`foundry_train_config` turns one run's merged settings (:func:`llmpipe.config.run_config`) into the config dict that
``llmfoundry.command_utils.train`` takes. :class:`TrainTask` is what the dispatch module runs in every task
(one per GPU): it exports the torch.distributed environment from submitit, picks the newest complete checkpoint
to resume from, calls llm-foundry, and on rank 0 writes ``train.json``.

Checkpoints live in ``results/{run}/checkpoints/`` and never rely on symlinks: composer's ``latest-rank0.pt``
symlink is switched off by :class:`RunMonitor` (shared drives such as CIFS mounts refuse symlinks, and the
run would die at its first checkpoint). A checkpoint counts only once its ``.complete`` marker is written after the save returned, so
a checkpoint half-written by a killed job is never resumed from. When Slurm signals the end of the allocation
(``--signal=USR2@...``, preemption or time limit), training saves a checkpoint at the next batch boundary on all
ranks and only then lets submitit requeue the job, which resumes from it.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
import signal
import tempfile
import time
from typing import Any

from llmpipe.config import compile_settings, fused_loss_settings, world_size
from llmpipe.fp8 import apply_fp8
from llmpipe.identity import same_identity

log = logging.getLogger("llmpipe.train")

_CKPT_RE = re.compile(r"ep(\d+)-ba(\d+)-rank0\.pt$")
_PENDING_SIGNAL: list = []  # (signum, frame, previous handler) set by our USR2 handler

#: Model keys that only :class:`llmpipe.fused_loss.ComposerMPTCausalLMFusedLoss` takes (not ``MPTConfig``).
FUSED_LOSS_MODEL_KEYS = ("fused_loss_chunk_size", "fused_loss_kernel")


# ------------------------------------------------------------------------------------------- config

def foundry_train_config(rc: dict, *, data_dir: str | None, save_folder: str | None, world_size: int,
                         tokenizer_dir: str | None = None, tokenizer_name: str | None = None) -> dict:
    """Build the llm-foundry train config (the dict ``llmfoundry.command_utils.train`` takes) for one run.

    Args:
        rc: the run's merged settings (:func:`llmpipe.config.run_config`: ``name``, ``data``, ``arch``,
            ``train``; ``kind: finetune`` for a finetune, whose errors then name ``finetunes.<run>``).
        data_dir: the MDS dataset folder with ``train/`` and ``val/`` (None: caller sets the loaders).
        save_folder: checkpoint folder (None: no checkpoints).
        world_size: number of ranks; used to split the global batch.
        tokenizer_dir: a folder with a saved Hugging Face tokenizer (wins over ``tokenizer_name``).
        tokenizer_name: the hub name of the run's tokenizer (``tokenizers.<data.tokenizer>.name``; may be None),
            used when ``tokenizer_dir`` is None.

    Returns:
        A plain dict; keys follow llm-foundry's ``TrainConfig``.
    """
    run = rc["name"]
    arch, train, data = rc["arch"], rc["train"], rc["data"]
    seq = int(data["concat_tokens"])
    opt = dict(train["optimizer"])
    sched = dict(train["scheduler"])
    sched_cfg = {"name": sched.pop("name"), "t_warmup": f"{int(sched.pop('t_warmup_batches'))}ba", **sched}
    model = {
        "name": "mpt_causal_lm",
        "init_device": "meta" if train.get("fsdp") and world_size > 1 else "cpu",
        "d_model": int(arch["d_model"]),
        "n_heads": int(arch["n_heads"]),
        "n_layers": int(arch["n_layers"]),
        "expansion_ratio": arch.get("expansion_ratio", 4),
        "max_seq_len": int(arch["max_seq_len"]),
        "vocab_size": int(arch["vocab_size"]),
        "no_bias": bool(arch.get("no_bias", True)),
        "norm_type": arch.get("norm_type", "low_precision_layernorm"),
        "attn_config": dict(arch.get("attn_config") or {}),
        "loss_fn": train.get("loss_fn", "torch_crossentropy"),
        "use_train_metrics": bool(train.get("train_metrics", True)),
    }
    if "n_kv_heads" in arch:
        model["attn_config"]["attn_type"] = "grouped_query_attention"
        model["attn_config"]["kv_n_heads"] = int(arch["n_kv_heads"])
    # our SDPA attention is an llm-foundry attention class selected through attn_type (see llmpipe.attention)
    model["attn_config"] = _attn_config(model["attn_config"], train.get("attn_impl", "torch"))
    fused = fused_loss_settings(train, f"models.{run}.train")
    if fused is not None and not model["use_train_metrics"]:
        # chunked linear + cross-entropy without the full logits (llmpipe.fused_loss); the train metrics need the
        # logits, so with train_metrics on the stock model trains as before
        model["name"] = _fused_loss_model_name()
        model["fused_loss_chunk_size"] = fused["chunk_size"]
        model["fused_loss_kernel"] = fused["kernel"]
    tok_name = tokenizer_dir or tokenizer_name

    def loader(split: str, shuffle: bool, drop_last: bool) -> dict:
        workers = int(train.get("num_workers", 0))
        out = {"name": "text",
               "dataset": {"local": data_dir, "split": split, "shuffle": shuffle, "max_seq_len": seq,
                           "shuffle_seed": int(train["seed"])},
               "drop_last": drop_last, "num_workers": workers}
        if workers == 0:  # torch refuses prefetching without worker processes
            out.update(prefetch_factor=None, persistent_workers=False)
        return out

    if train.get("fused_optimizer") and opt.get("name") == "decoupled_adamw":
        opt["name"] = "fused_adamw"  # same update, torch's fused kernel (llmpipe.speedups)
    gbs = int(train["global_batch_size"])
    per_device = gbs // world_size
    cfg: dict[str, Any] = {
        "run_name": run,
        "seed": int(train["seed"]),
        "max_seq_len": seq,
        "model": model,
        "tokenizer": {"name": tok_name, "kwargs": {"model_max_length": seq}},
        "optimizer": opt,
        "scheduler": sched_cfg,
        "algorithms": {"gradient_clipping": {"clipping_type": "norm",
                                             "clipping_threshold": float(train["grad_clip_norm"])}},
        "max_duration": f"{int(train['max_duration_batches'])}ba",
        "eval_interval": f"{int(train['eval_interval_batches'])}ba",
        "eval_first": False,
        "eval_subset_num_batches": int(train.get("eval_subset_batches", -1)),
        "global_train_batch_size": gbs,
        "device_train_microbatch_size": min(int(train["microbatch_size"]), per_device),
        "device_eval_batch_size": int(train.get("eval_microbatch_size", train["microbatch_size"])),
        "precision": train["precision"],
        "progress_bar": False,
        "log_to_console": True,
        "console_log_interval": f"{int(train.get('log_interval_batches', 10))}ba",
        "python_log_level": "info",
        "dist_timeout": 600,
        "callbacks": {"llmpipe_run_monitor": {"log_interval": int(train.get("log_interval_batches", 10))},
                      "drop_full_attention_mask": {}},
        "loggers": {},
        "autoresume": False,
        "save_overwrite": True,
    }
    if data_dir is not None:
        cfg["train_loader"] = loader("train", True, True)
        cfg["eval_loader"] = loader("val", False, False)
    fsdp = train.get("fsdp")
    if fsdp and world_size > 1:
        cfg["fsdp_config"] = {"sharding_strategy": "FULL_SHARD", "mixed_precision": "PURE",
                              "activation_checkpointing": False, "activation_checkpointing_reentrant": False,
                              "activation_cpu_offload": False, "limit_all_gathers": True, **fsdp}
    where = f"{'finetunes' if rc.get('kind') == 'finetune' else 'models'}.{run}.train"
    apply_compile(cfg, train, where)
    apply_fp8(cfg, train, where)  # llmpipe.fp8: the llmpipe_fp8 callback, first of all
    if save_folder is not None:
        cfg["save_folder"] = save_folder
        cfg["save_interval"] = f"{int(train['save_interval_batches'])}ba"
        cfg["save_num_checkpoints_to_keep"] = int(train.get("checkpoints_to_keep", 2))
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


def apply_compile(cfg: dict, train: dict, where: str) -> None:
    """Put the train setting ``compile`` (:func:`llmpipe.config.compile_settings`) into llm-foundry config ``cfg``:
    composer's ``compile_config`` for the whole model, or the ``llmpipe_compile_blocks`` callback for
    ``compile: blocks``; removes both first, so a config built for another run does not leak into this one."""
    cfg.pop("compile_config", None)
    cfg["callbacks"].pop("llmpipe_compile_blocks", None)
    settings = compile_settings(train, where)
    if settings is None:
        return
    if settings["scope"] == "blocks":
        cfg["callbacks"]["llmpipe_compile_blocks"] = dict(settings["options"])
    else:
        cfg["compile_config"] = dict(settings["options"])


def _attn_config(attn_config: dict, attn_impl: str) -> dict:
    # llmpipe.attention imports torch; keep this module importable on the login node
    from llmpipe.attention import mpt_attn_config
    return mpt_attn_config(attn_config, attn_impl)


def _fused_loss_model_name() -> str:
    # llmpipe.fused_loss imports torch and llm-foundry and registers the model on import
    from llmpipe.fused_loss import FUSED_LOSS_MODEL_NAME
    return FUSED_LOSS_MODEL_NAME


def register_extensions(compile_enabled: bool = False) -> None:
    """Register everything our train config names in llm-foundry's registries (SDPA attention classes, the
    ``drop_full_attention_mask``, ``llmpipe_run_monitor`` and ``llmpipe_fp8`` callbacks, the ``fused_adamw``
    optimizer, the ``mpt_causal_lm_fused_loss`` model) and, when torch.compile is on, apply
    :func:`llmpipe.speedups.dynamo_catalogue_fix`. Idempotent."""
    import llmpipe.attention as attention
    import llmpipe.fused_loss as fused_loss
    from llmpipe import fp8, speedups
    attention.register()
    fused_loss.register()
    fp8.register()
    speedups.register_fused_adamw()
    speedups.register_compile_blocks()
    register()
    if compile_enabled:
        speedups.dynamo_catalogue_fix()


# ------------------------------------------------------------------------------------------- checkpoints

def complete_checkpoints(save_folder: str) -> list[tuple[int, str]]:
    """Checkpoints in ``save_folder`` whose ``.complete`` marker exists, as ``(batch, path)`` sorted by batch.

    A checkpoint file without its marker (a save interrupted by a kill) is ignored.
    """
    found = []
    for path in glob.glob(os.path.join(save_folder, "ep*-ba*-rank0.pt")):
        m = _CKPT_RE.search(path)
        if m and os.path.exists(path + ".complete"):
            found.append((int(m.group(2)), path))
    return sorted(found)


def newest_checkpoint(save_folder: str) -> str | None:
    """Path of the newest complete checkpoint in ``save_folder`` (by batch number), or None."""
    ckpts = complete_checkpoints(save_folder)
    return ckpts[-1][1] if ckpts else None


def clear_save_folder(save_folder: str) -> None:
    """Delete everything in ``save_folder`` (checkpoints, markers, identity); the folder itself stays."""
    for p in glob.glob(os.path.join(save_folder, "*")):
        if os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            os.remove(p)


def prepare_save_folder(save_folder: str, identity: str) -> None:
    """Make ``save_folder`` hold only checkpoints of this training identity, and write ``identity`` to its
    ``identity.json``.

    Checkpoints of another identity (the architecture, data or optimizer changed) are removed so they are never
    resumed from; leftover incomplete checkpoint files (no ``.complete`` marker) are removed too. Identities are
    compared by meaning (:func:`llmpipe.identity.same_identity`): a folder whose ``identity.json`` holds the same
    identity in another text form (key order, or the legacy form with nested identities as JSON text) keeps its
    checkpoints, and its ``identity.json`` is rewritten in the form given.
    """
    os.makedirs(save_folder, exist_ok=True)
    ident_path = os.path.join(save_folder, "identity.json")
    if os.path.exists(ident_path):
        with open(ident_path) as fh:
            old = fh.read()
        if not same_identity(old, identity):
            log.warning("training settings changed since the checkpoints in %s were saved: removing them",
                        save_folder)
            clear_save_folder(save_folder)
    for path in glob.glob(os.path.join(save_folder, "ep*-ba*-rank*.pt")):
        rank0 = re.sub(r"-rank\d+\.pt$", "-rank0.pt", path)
        if not os.path.exists(rank0 + ".complete"):
            os.remove(path)
    for path in glob.glob(os.path.join(save_folder, "*.complete")):
        if not os.path.exists(path[: -len(".complete")]):
            os.remove(path)
    tmp = ident_path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(identity)
    os.replace(tmp, ident_path)


# ------------------------------------------------------------------------------------------- the callback

def _build_monitor_class():
    """Define :class:`RunMonitor` lazily so this module imports without composer (login node)."""
    from composer.core import Callback, State
    from composer.loggers import Logger

    class RunMonitor(Callback):
        """Records the loss curve and throughput, disables checkpoint symlinks, marks complete checkpoints and
        saves a checkpoint when Slurm signals the end of the allocation.

        Writes ``{save_folder}/../train_log.jsonl`` (one JSON line per ``log_interval`` batches: batch, loss,
        tokens, elapsed seconds) on rank 0.
        """

        def __init__(self, log_interval: int = 10, signal_check_interval: int = 1):
            self.log_interval = int(log_interval)
            self.signal_check_interval = max(1, int(signal_check_interval))
            self.records: list[dict] = []
            self.first_loss: float | None = None
            self.last_loss: float | None = None
            self.t_fit_start = None
            self.start_batch = 0
            self.start_tokens = 0
            self.batches_this_job = 0
            self.log_path = None

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
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            savers = self._savers(state)
            if savers and savers[0].folder:
                self.log_path = os.path.join(os.path.dirname(os.path.abspath(savers[0].folder)),
                                             "train_log.jsonl")
            self._install_signal_handler()

        def _install_signal_handler(self) -> None:
            """Defer submitit's USR2 handler to the next batch boundary (after a checkpoint is saved)."""
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

        def batch_end(self, state: State, logger: Logger) -> None:
            from composer.utils import dist
            self.batches_this_job += 1
            batch = int(state.timestamp.batch)
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
            if batch % self.log_interval == 0 or batch == 1:
                rec = {"batch": batch, "loss": loss_v, "tokens": int(state.timestamp.token),
                       "elapsed_s": round(time.time() - self.t_fit_start, 3)}
                self.records.append(rec)
                if dist.get_global_rank() == 0 and self.log_path:
                    with open(self.log_path, "a") as fh:
                        fh.write(json.dumps(rec) + "\n")
            self._maybe_checkpoint_and_requeue(state, logger)

        def _maybe_checkpoint_and_requeue(self, state: State, logger: Logger) -> None:
            from composer.utils import dist
            import torch
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
            # ranks that did not get the signal wait here to be requeued by Slurm with the job
            while True:
                time.sleep(5)

        def batch_checkpoint(self, state: State, logger: Logger) -> None:
            from composer.utils import dist
            if dist.get_global_rank() != 0:
                return
            for marker in glob.glob(os.path.join(self._save_folder(state), "*.complete")):
                if not os.path.exists(marker[: -len(".complete")]):
                    os.remove(marker)  # composer removed the checkpoint (checkpoints_to_keep)
            for saver in self._savers(state):
                if saver.saved_checkpoints:
                    path = saver.saved_checkpoints[-1]
                    if os.path.exists(path) and not os.path.exists(path + ".complete"):
                        with open(path + ".complete", "w") as fh:
                            fh.write(str(int(state.timestamp.batch)))

        def fit_end(self, state: State, logger: Logger) -> None:
            self.batch_checkpoint(state, logger)

    return RunMonitor


def register() -> None:
    """Register :class:`RunMonitor` in llm-foundry's callbacks registry as ``llmpipe_run_monitor``."""
    from llmfoundry.registry import callbacks
    if "llmpipe_run_monitor" not in callbacks:
        callbacks.register("llmpipe_run_monitor", func=_build_monitor_class())


# ------------------------------------------------------------------------------------------- the task

def export_dist_env() -> dict:
    """Set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR, MASTER_PORT from submitit.

    Uses ``submitit.helpers.TorchDistributedEnvironment`` inside a submitit job; outside one (debug executor)
    sets a single-process environment. Returns the values set.
    """
    import submitit
    try:
        env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        job = submitit.JobEnvironment()
        os.environ["NODE_RANK"] = str(job.node)
        os.environ["LOCAL_WORLD_SIZE"] = str(env.local_world_size)
        out = {"rank": env.rank, "world_size": env.world_size, "local_rank": env.local_rank,
               "local_world_size": env.local_world_size, "node_rank": job.node,
               "master_addr": env.master_addr, "master_port": env.master_port, "hostname": job.hostname,
               "job_id": job.job_id}
    except RuntimeError:  # not inside a submitit job
        for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                     "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
            os.environ.setdefault(k, v)
        out = {"rank": 0, "world_size": 1, "local_rank": 0, "local_world_size": 1, "node_rank": 0}
    return out


class TrainTask:
    """The training step as submitit runs it in every task; checkpointable for preemption and requeue.

    Calling it trains (resuming from the newest complete checkpoint) and returns the train.json dict on rank 0.
    ``checkpoint()`` is what submitit calls when Slurm signals the end: the job is requeued with the same task,
    which resumes from the checkpoint :class:`RunMonitor` saved just before.

    Holds plain values only (submitit pickles the task). Args:
        rc: the run's merged settings (:func:`llmpipe.config.run_config`).
        data_dir: the MDS dataset folder (a finetune: the prepared instruction set).
        tokenizer_dir: the saved Hugging Face tokenizer folder.
        run_dir: ``results/<run>``; checkpoints go to its ``checkpoints/``.
        identity: the training identity (canonical JSON text) written to the checkpoint folder.
        resources: the job's resources (:func:`llmpipe.config.step_resources` of step ``train``).
        peak_flops_table: the config's ``gpu_peak_flops`` (device name -> peak FLOP/s by precision) or None,
            for MFU (:func:`llmpipe.mfu.detect_peak_flops`).
    """

    def __init__(self, rc: dict, data_dir: str, tokenizer_dir: str, run_dir: str, identity: str, *,
                 resources: dict, peak_flops_table: dict | None = None):
        # absolute paths: every task runs in a node-private scratch folder (see __call__)
        self.submit_dir = os.getcwd()
        self.rc, self.run, self.data_dir = rc, rc["name"], os.path.abspath(data_dir)
        self.tokenizer_dir, self.run_dir = os.path.abspath(tokenizer_dir), os.path.abspath(run_dir)
        self.identity = identity
        self.resources = dict(resources)
        self.peak_flops_table = peak_flops_table

    def checkpoint(self, *args: Any, **kwargs: Any):
        import submitit
        return submitit.helpers.DelayedSubmission(self)

    def before_start(self) -> None:
        """Checks and environment set-up before anything is built (a subclass hook)."""

    def build_config(self, save_folder: str, world_size: int) -> dict:
        """The llm-foundry train config of this task (a subclass hook; finetuning builds its own)."""
        return foundry_train_config(self.rc, data_dir=self.data_dir, save_folder=save_folder,
                                    world_size=world_size, tokenizer_dir=self.tokenizer_dir)

    def describe(self) -> str:
        """What this task trains, for the log line of every rank."""
        return f"run {self.run}"

    def finish_result(self, result: dict) -> dict:
        """Add task-specific fields to the train.json record (a subclass hook)."""
        return result

    def __call__(self) -> dict | None:
        self.before_start()
        dist_env = export_dist_env()
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        register_extensions(compile_settings(self.rc["train"]) is not None)
        from llmfoundry.command_utils import train
        from omegaconf import OmegaConf

        save_folder = os.path.join(self.run_dir, "checkpoints")
        rank = int(dist_env["rank"])
        if rank == 0:
            prepare_save_folder(save_folder, self.identity)
        res = self.resources
        ws = int(dist_env["world_size"])
        cfg = self.build_config(save_folder, ws)
        # every rank waits until rank 0 cleaned the folder: a shared file is simplest before dist is up
        _wait_for_file(os.path.join(save_folder, "identity.json"), self.identity)
        resume = newest_checkpoint(save_folder)
        max_batches = int(self.rc["train"]["max_duration_batches"])
        done = finished_result(save_folder, resume, max_batches)
        if done is not None:
            # training already reached its last step (the job ended after the final checkpoint but before Snakemake
            # recorded train.json): nothing to redo. Delete results/{run}/checkpoints to retrain from scratch.
            print(f"llmpipe: rank {rank}: training already complete at {resume}; reusing its result", flush=True)
            return done if rank == 0 else None
        if resume is not None and _CKPT_RE.search(resume) and int(_CKPT_RE.search(resume).group(2)) >= max_batches:
            print(f"llmpipe: rank {rank}: {resume} is the final step but its result record is missing; "
                  f"training again from scratch", flush=True)
            if rank == 0:
                clear_save_folder(save_folder)
                prepare_save_folder(save_folder, self.identity)
            resume = None
        if rank == 0 and resume is None:
            log_path = os.path.join(self.run_dir, "train_log.jsonl")
            if os.path.exists(log_path):
                os.remove(log_path)  # a fresh start: the old loss curve belongs to another training
        if resume:
            cfg["load_path"] = resume
            print(f"llmpipe: rank {rank} resuming from {resume}", flush=True)
        print(f"llmpipe: rank {rank}/{ws} on {dist_env.get('hostname', 'localhost')} "
              f"(node rank {dist_env.get('node_rank', 0)}, master {dist_env.get('master_addr', 'local')}); "
              f"{self.describe()}, expected devices {world_size(res)}", flush=True)
        if rank == 0:
            print("llmpipe: " + batch_layout(int(cfg["global_train_batch_size"]), ws,
                                             int(self.rc["train"]["microbatch_size"]),
                                             int(cfg["device_train_microbatch_size"])), flush=True)
        t0 = time.time()
        # llm-foundry writes signal files named after rank 0 into the working folder; with a shared working folder
        # the local-rank-0 task of every node would remove the same file. Run each task in a private scratch folder.
        cwd = os.getcwd()
        scratch = tempfile.mkdtemp(prefix=f"llmpipe-{self.run}-rank{rank}-")
        os.chdir(scratch)
        try:
            trainer = train(OmegaConf.create(cfg))
            wall = time.time() - t0
            monitor = next(cb for cb in trainer.state.callbacks if type(cb).__name__ == "RunMonitor")
            result = summarize(self.rc, trainer, monitor, wall, ws, save_folder, resume,
                               nodes=int(res["nodes"]), peak_flops_table=self.peak_flops_table)
            trainer.close()
        finally:
            os.chdir(cwd)
            shutil.rmtree(scratch, ignore_errors=True)
        for key in ("final_checkpoint", "resumed_from", "train_log"):
            if result.get(key):  # relative to the workflow's folder (when inside it), like the paths Snakemake sees
                path = os.path.abspath(result[key])
                if path.startswith(self.submit_dir.rstrip(os.sep) + os.sep):
                    result[key] = os.path.relpath(path, self.submit_dir)
        result = self.finish_result(result)
        if rank == 0:
            _write_result_record(save_folder, result)
        if rank == 0:
            return result
        return None


def _write_result_record(save_folder: str, result: dict) -> None:
    from llmpipe.atomic import atomic_write_json
    atomic_write_json(os.path.join(save_folder, "result.json"), result)


def finished_result(save_folder: str, newest: str | None, max_batches: int) -> dict | None:
    """The train.json record saved in ``save_folder`` (``result.json``) when ``newest`` (the newest complete
    checkpoint) is the final step (batch ``max_batches`` or later) and is the record's final checkpoint; else None.

    A training whose record this returns is finished: a rerun (forced, or after its train.json was lost or its
    identity text changed form) returns the record instead of training again."""
    if newest is None:
        return None
    m = _CKPT_RE.search(newest)
    if not m or int(m.group(2)) < max_batches:
        return None
    try:
        with open(os.path.join(save_folder, "result.json")) as fh:
            rec = json.load(fh)
    except (OSError, ValueError):
        return None
    if os.path.basename(rec.get("final_checkpoint") or "") != os.path.basename(newest):
        return None
    return rec


def recorded_result(save_folder: str, identity: str, max_batches: int) -> dict | None:
    """The train.json record of a finished training of ``identity`` in ``save_folder``, or None.

    Finished: ``identity.json`` holds the same identity (:func:`llmpipe.identity.same_identity`: any text form)
    and :func:`finished_result` returns the record for the newest complete checkpoint. Only reads; light enough
    for the submitting machine, so a rerun of a finished training needs no job (:mod:`llmpipe.steps.train`).
    """
    try:
        with open(os.path.join(save_folder, "identity.json")) as fh:
            if not same_identity(fh.read(), identity):
                return None
    except OSError:
        return None
    return finished_result(save_folder, newest_checkpoint(save_folder), max_batches)


def _wait_for_file(path: str, content: str, timeout_s: float = 600) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        try:
            with open(path) as fh:
                if fh.read() == content:
                    return
        except FileNotFoundError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{path} did not appear within {timeout_s} s (rank 0 could not prepare checkpoints)")


def summarize(rc: dict, trainer, monitor, wall_s: float, ws: int, save_folder: str, resumed_from: str | None, *,
              nodes: int, peak_flops_table: dict | None = None) -> dict:
    """Build the train.json record from a finished trainer.

    Args:
        rc: the run's merged settings (:func:`llmpipe.config.run_config`).
        trainer, monitor: the finished composer trainer and its :class:`RunMonitor`; ``ws``: ranks (devices).
        wall_s: seconds the training call took (fallback for the fit time); ``nodes``: the job's node count.
        save_folder, resumed_from: the checkpoint folder; the checkpoint this job resumed from, or None.
        peak_flops_table: the config's ``gpu_peak_flops`` or None (:func:`llmpipe.mfu.detect_peak_flops`).

    Throughput counts only batches trained by this job (a resumed job does not take credit for earlier ones).
    MFU = tokens/s per device x model FLOPs per token / peak FLOP/s of the device (None on CPU or an unknown
    GPU); FLOPs per token follow llm-foundry's ``flops_per_batch`` (see :mod:`llmpipe.mfu`).
    """
    import torch
    from llmpipe import mfu as mfu_mod

    run = rc["name"]
    state = trainer.state
    steps = int(state.timestamp.batch)
    tokens = int(state.timestamp.token)
    tokens_this_job = tokens - monitor.start_tokens
    fit_s = time.time() - monitor.t_fit_start if monitor.t_fit_start else wall_s
    tps = tokens_this_job / fit_s if fit_s > 0 else None
    precision = rc["train"]["precision"]
    peak = mfu_mod.detect_peak_flops(precision, peak_flops_table)
    fpt = mfu_mod.flops_per_token(rc["arch"], int(rc["data"]["concat_tokens"]))
    mfu = mfu_mod.mfu(tps / ws, fpt, peak) if (tps and peak) else None
    final = newest_checkpoint(save_folder)
    if torch.cuda.is_available():
        mem = torch.cuda.max_memory_allocated() / 2**30
        device = torch.cuda.get_device_name()
    else:
        mem = None
        device = "cpu"
    import resource
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
        "peak_host_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
        "device": device,
        "nodes": int(nodes),
        "devices": ws,
        "global_batch_size": int(rc["train"]["global_batch_size"]),
        "concat_tokens": int(rc["data"]["concat_tokens"]),
        "first_train_loss": monitor.first_loss if monitor.start_batch == 0 else _first_logged_loss(save_folder),
        "final_train_loss": monitor.last_loss,
        "resumed_from": resumed_from,
        "batches_this_job": monitor.batches_this_job,
        "final_checkpoint": final,
        "checkpoint_size_bytes": os.path.getsize(final) if final else None,
        "train_log": monitor.log_path,
    }


def _first_logged_loss(save_folder: str) -> float | None:
    path = os.path.join(os.path.dirname(os.path.abspath(save_folder)), "train_log.jsonl")
    try:
        with open(path) as fh:
            return json.loads(fh.readline())["loss"]
    except (OSError, ValueError, KeyError):
        return None


__all__ = ["foundry_train_config", "TrainTask", "newest_checkpoint", "complete_checkpoints",
           "prepare_save_folder", "clear_save_folder", "finished_result", "recorded_result", "register", "summarize"]
