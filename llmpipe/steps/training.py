"""Training steps: pretraining (rule ``train``) and supervised finetuning (rule ``finetune``).

Both dispatch one job of ``nodes x tasks_per_node`` ranks running :class:`llmpipe.train.pretrain.TrainTask` (or
:class:`llmpipe.train.finetune.FinetuneTask`) and write ``train.json`` from rank 0's result. The identity functions say
what determines a trained model; speed-only settings (:data:`llmpipe.config.runs.SPEED_ONLY_TRAIN_KEYS`,
:data:`llmpipe.config.runs.SPEED_ONLY_FINETUNE_DATA_KEYS`), resources and node counts are never part of it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from llmpipe.config.runs import (
    SPEED_ONLY_FINETUNE_DATA_KEYS,
    SPEED_ONLY_TRAIN_KEYS,
    gpu_memory,
    is_finetune,
    run_config,
    run_settings,
    step_resources,
    world_size,
)
from llmpipe.config.settings import RunSettings
from llmpipe.dispatch import job_failures
from llmpipe.dispatch import jobs as dispatch
from llmpipe.dispatch import lease
from llmpipe.dispatch.slurm import site_config
from llmpipe.plan import memory_time as plan
from llmpipe.steps.context import StepContext, read_json
from llmpipe.steps.convert import weights_identity
from llmpipe.steps.prepare import instructions_identity, mds_identity, tokenizer_identity
from llmpipe.steps.registry import register
from llmpipe.train import checkpoints as ckpt
from llmpipe.train.fp8 import fp8_settings
from llmpipe.train.lora import lora_settings
from llmpipe.train.tracking import settings as tracking_settings

#: Bump when a change in our code changes the trained model (reruns training and everything after it).
VERSIONS = {"train": 1, "finetune": 1}


# ------------------------------------------------------------------------------------------- identity

def train_identity(config: dict, run: str) -> dict:
    """What determines a trained model: architecture, data, optimizer, steps, global batch, seed, precision, FP8.

    A finetune's is :func:`finetune_identity`. Keys in :data:`llmpipe.config.runs.SPEED_ONLY_TRAIN_KEYS`, the
    resources and the attention implementation are left out.
    """
    if is_finetune(config, run):
        return finetune_identity(config, run)
    rc = run_config(config, run)
    train = _train_identity(rc["train"])
    d = rc["data"]
    return {"step": "train", "version": VERSIONS["train"], "arch": rc["arch"], "train": train,
            "data": mds_identity(config, d["corpus"], d["tokenizer"], d["concat_tokens"])}


def finetune_identity(config: dict, run: str) -> dict:
    """What determines a finetuned model: the base model (for our runs: the base's training and export
    identity, so retraining the base reruns the finetune), the instruction set, the tokenizer, the data settings,
    the optimizer, steps, global batch, seed, precision and LoRA settings.

    Speed-only keys, resources and node counts are left out; so is ``arch`` for hub bases (it describes the hub
    model; it does not change it).
    """
    rc = run_config(config, run)
    base = rc["base"]
    if base.get("run"):
        base_id = {"run": base["run"], "train": train_identity(config, base["run"]),
                   "convert": weights_identity(config, base["run"])}   # the weights, not the export's other files
    else:
        base_id = {"hub": base["hub"], "revision": base.get("revision")}
    d = rc["data"]
    data = {k: v for k, v in d.items()
            if k not in SPEED_ONLY_FINETUNE_DATA_KEYS and k not in ("corpus", "icl_corpus", "concat_tokens")}
    data["instructions"] = instructions_identity(config, d["instructions"])
    data["tokenizer"] = tokenizer_identity(config, d["tokenizer"])
    train = _train_identity(rc["train"])
    return {"step": "finetune", "version": VERSIONS["finetune"], "base": base_id, "data": data, "train": train,
            "lora": lora_settings(rc["lora"])}


def _train_identity(train: dict) -> dict:
    """The identity part of a ``train`` section: no speed-only key; ``fp8`` only when on, and then as its settings
    (:func:`llmpipe.train.fp8.fp8_settings`), so ``fp8: false``, ``null`` or left out name the same bf16 training and
    ``true``, ``tensorwise`` and ``{recipe: tensorwise}`` the same FP8 one."""
    out = {k: v for k, v in train.items() if k not in SPEED_ONLY_TRAIN_KEYS and k != "fp8"}
    fp8 = fp8_settings(train)
    if fp8 is not None:
        out["fp8"] = fp8
    return out


# ------------------------------------------------------------------------------------------- shared by training rules

def training_resources(config: dict, wildcards) -> dict:
    """The job of a training rule: ``models.<run>.resources`` (``finetunes.<run>.resources``)."""
    return step_resources(config, "train", wildcards.run)


def check_vocab_fits(tok_manifest: dict, settings: RunSettings) -> None:
    """Raise ValueError (naming the setting and the fix) when the tokenizer (its prepared ``manifest.json``) has
    more tokens than the model's embedding."""
    if int(tok_manifest["vocab_size"]) > settings.arch.vocab_size:
        raise ValueError(f"the tokenizer {settings.data.tokenizer} has {tok_manifest['vocab_size']} tokens but "
                         f"{settings.arch.at('vocab_size')} is {settings.arch.vocab_size}. Fix: raise vocab_size.")


def check_all_steps(result: dict | None, settings: RunSettings, label: str) -> None:
    """Raise RuntimeError unless a training ``result`` reached ``train.max_duration_batches`` steps."""
    want = settings.train.max_duration_batches
    if result is None or result.get("steps") != want:
        raise RuntimeError(f"{label}: training ended at step {None if result is None else result.get('steps')} "
                           f"instead of {want}")


def training_task(ctx: StepContext, config: dict, run: str, settings: RunSettings):
    """The task a training rule (``train``, ``finetune``, ``scaling_train``) dispatches for ``run``.

    A finetune gets :class:`llmpipe.train.finetune.FinetuneTask` (instruction set ``ctx.input.instructions``, its base
    model; ``peft`` is checked first when LoRA is on), a pretraining run :class:`llmpipe.train.pretrain.TrainTask` (the MDS
    dataset beside ``ctx.input.data``; the tokenizer must fit the model's vocabulary). Both write into the folder
    of ``ctx.output[0]`` under the identity ``ctx.params.identity``.

    The task gets the run's typed settings (``fsdp.activation_checkpointing: auto`` resolved by the memory plan
    for the job's GPUs), the job's resources and ``gpu_peak_flops`` as plain values; this is the one place that
    reads them from the workflow config. ``task.tracking`` is the ``tracking`` section
    (:func:`llmpipe.train.tracking.settings`; its ConfigError for a missing logger package comes before any job).

    Args:
        config: the config the training sees (a scaling study's differs from ``ctx.config`` in its nodes).
        settings: ``run_settings(config, run)`` (:func:`llmpipe.config.runs.run_settings`).

    Raises:
        ValueError / ConfigError: the tokenizer does not fit, or LoRA is on without ``peft`` (before any job waits
            in a queue).
    """
    run_dir = os.path.dirname(ctx.output[0])
    tok_dir = os.path.dirname(ctx.input.tokenizer)
    job = {"resources": step_resources(config, "train", run), "peak_flops_table": config.get("gpu_peak_flops")}
    res = job["resources"]  # activation_checkpointing: auto -> the memory plan's choice for these GPUs
    settings = plan.resolve_settings(settings, run_config(config, run), nodes=int(res["nodes"]),
                                     gpus_per_node=int(res["gpus_per_node"]), capacity_gb=gpu_memory(config))
    if is_finetune(config, run):
        from llmpipe.train.finetune import FinetuneTask, base_model_path, require_peft
        require_peft(settings)
        task = FinetuneTask(settings, os.path.dirname(ctx.input.instructions), tok_dir, run_dir,
                            ctx.params.identity, base_model_path(settings, results_dir=config["results_dir"]), **job)
    else:
        from llmpipe.train.pretrain import TrainTask
        check_vocab_fits(read_json(ctx.input.tokenizer), settings)
        task = TrainTask(settings, os.path.join(os.path.dirname(ctx.input.data), "mds"), tok_dir, run_dir,
                         ctx.params.identity, **job)
    # allocations without progress a training may have before it fails (llmpipe.dispatch.requeue)
    task.requeue_cap = int(site_config(config, job["resources"])["max_requeue_timeouts"])
    task.tracking = tracking_settings(config)  # llmpipe.train.tracking: None when off; outside the identity
    return task


def finished_training(ctx: StepContext, settings: RunSettings, label: str, task=None) -> dict | None:
    """The recorded result when the training of ``ctx.output[0]``'s folder already finished under this identity
    (:func:`llmpipe.train.checkpoints.recorded_result`), else None.

    A finished training is never trained again: a forced rerun, a lost train.json, or the one re-plan after an
    upgrade changed the identity's text form returns its record without a job (no queue wait for its nodes), and
    its ``identity.json`` is rewritten in the current form. With ``task`` (the training's
    :class:`llmpipe.train.pretrain.TrainTask`), a complete final checkpoint whose job ended before writing its record
    gets one rebuilt from the checkpoint and the loss log (:func:`llmpipe.train.checkpoints.recovered_result`), also
    without a job.
    """
    checkpoints_dir = os.path.join(os.path.dirname(ctx.output[0]), "checkpoints")
    recover = task.recovery_fields() if task is not None else None
    result = ckpt.recorded_result(checkpoints_dir, ctx.params.identity, settings.train.max_duration_batches,
                                  recover, task.submit_dir if task is not None else None)
    if result is not None:
        ckpt.prepare_identity_folder(checkpoints_dir, ctx.params.identity)
        how = ("its record rebuilt from the final checkpoint and the loss log (the job that trained the last batches "
               "ended before writing it; time, throughput and memory figures are null)" if result.get("recovered")
               else "reusing its result")
        ctx.log(f"{label}: training already complete at {result.get('final_checkpoint')}; {how}, no job submitted")
    return result


def check_resumable(task, label: str) -> None:
    """Raise RuntimeError before a job waits in a queue when the newest complete checkpoint of this training is a
    full (unsharded) one and the job would train under FSDP, which cannot resume from it
    (:func:`llmpipe.train.checkpoints.resume_mismatch` names the world size it needs). Sharded checkpoints resume on any
    world size."""
    newest = ckpt.newest_checkpoint(task.checkpoint_folder())
    if newest and not ckpt.is_sharded(newest) and task.uses_fsdp(world_size(task.resources), False):
        raise RuntimeError(ckpt.resume_mismatch(newest, label))


def checkpoint_progress(folder: str) -> str:
    """The training's progress for the rule log when Slurm requeues it: its newest complete checkpoint's batch
    (where the next allocation resumes), or that it has none yet. ``folder``: the identity's checkpoint folder."""
    batch = newest_batch(folder)
    return f"resumes from the checkpoint at batch {batch}" if batch else "no checkpoint yet: starts over"


def newest_batch(folder: str) -> int:
    """The batch of the newest complete checkpoint in the identity's checkpoint folder ``folder``; 0 when none."""
    ckpts = ckpt.complete_checkpoints(folder)
    return ckpts[-1][0] if ckpts else 0


def storage_cause(exc: dispatch.StepFailed, config: dict, run: str, folder: str,
                  statvfs: Callable[[str], Any] = os.statvfs) -> str | None:
    """The headline of a training job that failed for want of space (:func:`llmpipe.dispatch.job_failures.out_of_space`):
    the free bytes of the identity's checkpoint folder ``folder`` and of ``results_dir`` against the save's planned
    size (:func:`llmpipe.plan.memory_time.checkpoint_bytes` of the run), and the newest complete checkpoint, which a
    failed save leaves untouched (checkpoints are complete only once their marker is written). None when the failure
    is not that."""
    batch = newest_batch(folder) if os.path.isdir(folder) else 0
    kept = (f"the checkpoint at batch {batch} is untouched" if batch else "there is no earlier complete checkpoint")
    places = [("checkpoint folder", folder), ("results_dir", config["results_dir"])]
    return job_failures.out_of_space(str(exc), places, plan.checkpoint_bytes(run_config(config, run)), kept, statvfs)


def _train_run(ctx: StepContext, label: str) -> dict:
    run = ctx.wildcards.run
    settings = run_settings(ctx.config, run)
    task = training_task(ctx, ctx.config, run, settings)  # checks peft and the vocabulary before a job waits
    folder = task.checkpoint_folder()
    # one live trainer per identity folder (llmpipe.dispatch.lease): wait for one this step did not submit, never start a second
    with lease.Lease(folder, lambda line: dispatch.say(f"{label} {run}: {line}", ctx.log_file),
                     except_job=dispatch.recorded_job_id(ctx.config, ctx.key)) as held:
        result = finished_training(ctx, settings, f"{label} {run}", task)
        if result is None:
            check_resumable(task, f"{label} {run}")
            try:
                result = ctx.dispatch(task, step=f"{label} {run}", on_job=held.hand_over,
                                      progress=functools.partial(checkpoint_progress, folder),
                                      resume_batch=functools.partial(newest_batch, folder))
            except dispatch.StepFailed as exc:
                cause = storage_cause(exc, ctx.config, run, folder)
                if cause is None:
                    raise
                raise exc.renamed(cause) from exc
    check_all_steps(result, settings, f"{label} {run}")
    ctx.write_json(result)
    return {"run": run_config(ctx.config, run), "resources": ctx.resources}  # the provenance record


# ------------------------------------------------------------------------------------------- steps

@register("train", resources=training_resources, where="models.{run}.resources", plan="train")
def train(ctx: StepContext) -> dict:
    """Rule ``train``: pretrain one run on ``nodes x tasks_per_node`` ranks; write train.json from rank 0."""
    return _train_run(ctx, "train")


@register("finetune", resources=training_resources, where="finetunes.{run}.resources", plan="train")
def finetune(ctx: StepContext) -> dict:
    """Rule ``finetune``: finetune on ``nodes x tasks_per_node`` ranks; write train.json from rank 0."""
    return _train_run(ctx, "finetune")
