"""Supervised finetuning through llm-foundry: config, the task every rank runs, evaluation, and export.

A finetune (``finetunes:`` in the config, see :func:`llmpipe.config.runs.finetune_run_config`) starts from Hugging Face
weights through llm-foundry's ``hf_causal_lm`` model: hub weights (``mosaicml/mpt-7b``) or one of our own exports
(``results/mpt-tiny/hf``), and trains on a prepared instruction set (:mod:`llmpipe.data.instructions`) through
llm-foundry's ``finetuning`` dataloader (prompt tokens masked out of the loss, ``decoder_only_format``, optional
packing). LoRA is llm-foundry's ``peft_config`` (:mod:`llmpipe.train.lora`) and needs the ``peft`` package; a LoRA
finetune's checkpoints hold only what training changes, the adapters and their optimizer state (composer's
``should_save_peft_only``): the frozen base is built from its source (``base_path``) at every start, a resume
included, and conversion reads it there again (:func:`build_finetuned_mpt`).

Everything after training is shared with pretraining: ``train.json`` has the same fields (via
:func:`llmpipe.train.pretrain.summarize`, MFU included), conversion writes ``results/<run>/hf`` (the checkpoint holds an
HF-wrapped model: :func:`build_finetuned_mpt` reads the model config stored in the checkpoint and merges LoRA
adapters with peft), generation is the shared step, and :func:`evaluate_finetune` reports loss, perplexity and token
accuracy on the response tokens of the held-out split plus the ICL tasks.

This module imports nothing heavy at import time (the Snakefile's login node must not need torch).
"""

from __future__ import annotations

import copy
import importlib.util
import os
from typing import Any

from llmpipe.config.settings import ConfigError, RunSettings
from llmpipe.config.stage_settings import EvalSettings
from llmpipe.data.instructions import SPLIT_FILES
from llmpipe.train.lora import lora_settings, merge_adapters, peft_config
from llmpipe.train.pretrain import TrainTask, foundry_train_config

#: Attention implementations a Hugging Face MPT (hub code or our export) knows; ours (sdpa) map to ``torch``.
HF_ATTN_IMPLS = ("torch", "flash", "triton")


# ------------------------------------------------------------------------------------------- checks

def require_peft(settings: RunSettings) -> None:
    """Raise a clear error when the finetune uses LoRA and the ``peft`` package is not installed.

    Args:
        settings: the finetune's typed settings (:func:`llmpipe.config.runs.run_settings`).

    Raises:
        ConfigError: ``finetunes.<run>.lora`` is set but ``import peft`` would fail (names ``pip install peft``).
    """
    run = settings.name
    if settings.lora is not None and importlib.util.find_spec("peft") is None:
        raise ConfigError(
            f"finetunes.{run}.lora is set, but the `peft` package is not installed in this environment "
            f"(llm-foundry's LoRA support needs it). Fix: `pip install peft` (the version envs/requirements.lock pins; "
            f"`make install` installs it) in the environment the jobs run in, or set finetunes.{run}.lora: null for "
            f"full finetuning.")


def base_model_path(settings: RunSettings, *, results_dir: str) -> str:
    """Where the finetune's starting weights are: ``{results_dir}/<base run>/hf`` (absolute) or the hub repo id.

    Args:
        settings: the finetune's typed settings (:func:`llmpipe.config.runs.run_settings`; ``base`` is set).
        results_dir: the workflow's results folder (config ``results_dir``).
    """
    base = settings.base
    if base.run:
        return os.path.abspath(os.path.join(results_dir, base.run, "hf"))
    return base.hub


# ------------------------------------------------------------------------------------------- config

def foundry_finetune_config(settings: RunSettings, *, instructions_dir: str | None, base_path: str,
                            save_folder: str | None, world_size: int, tokenizer_dir: str | None = None,
                            tokenizer_name: str | None = None, fsdp: bool | None = None) -> dict:
    """Build the llm-foundry train config (``llmfoundry.command_utils.train``'s dict) for one finetune.

    Optimizer, scheduler, batch sizes, precision, FSDP, checkpointing and our run monitor are the pretraining
    config's (:func:`llmpipe.train.pretrain.foundry_train_config`); the model is ``hf_causal_lm`` from ``base_path`` and
    the loaders are llm-foundry's ``finetuning`` loaders over the prepared instruction set.

    Args:
        settings: the finetune's typed settings (:func:`llmpipe.config.runs.run_settings`).
        instructions_dir: the prepared instruction set (``results/data/instructions/<name>``; its ``data/``
            holds ``train.jsonl`` and ``test.jsonl``), or None to leave the loaders out.
        base_path: a local Hugging Face folder or a hub repo id.
        save_folder: checkpoint folder (None: no checkpoints).
        world_size: number of ranks; used to split the global batch.
        tokenizer_dir: a folder with a saved tokenizer (wins over ``tokenizer_name``).
        tokenizer_name: the hub name of the run's tokenizer (``tokenizers.<data.tokenizer>.name``; may be None),
            used when ``tokenizer_dir`` is None.
        fsdp: train under FSDP with sharded checkpoints (None: :func:`llmpipe.train.pretrain.uses_fsdp`).

    Returns:
        A plain dict; keys follow llm-foundry's ``TrainConfig``.
    """
    seq = settings.data.concat_tokens
    cfg = foundry_train_config(settings, data_dir=None, save_folder=save_folder, world_size=world_size,
                               tokenizer_dir=tokenizer_dir, tokenizer_name=tokenizer_name, fsdp=fsdp)
    packing = settings.data.packing_ratio
    fsdp_on = "fsdp_config" in cfg  # more than one device (one device: FSDP through llmpipe.train.fsdp's callback)
    attn_impl = settings.train.attn_impl
    overrides: dict[str, Any] = {
        "attn_config": {"attn_impl": attn_impl if attn_impl in HF_ATTN_IMPLS else "torch",
                        "attn_uses_sequence_id": packing is not None},
        "max_seq_len": seq,
    }
    model: dict[str, Any] = {
        "name": "hf_causal_lm",
        "pretrained": True,
        "pretrained_model_name_or_path": base_path,
        "trust_remote_code": True,
        "use_auth_token": False,
        # multi-GPU: rank 0 loads the weights, the others start empty and FSDP broadcasts (sync_module_states)
        "init_device": "mixed" if fsdp_on else "cpu",
        "use_train_metrics": settings.train.train_metrics,
        "config_overrides": overrides,
    }
    if settings.lora is not None:
        model["peft_config"] = peft_config(settings.lora)  # llm-foundry builds the adapters with peft.get_peft_model
        # checkpoints hold what training changes: the adapters (their optimizer state is theirs alone); the frozen
        # base is built from base_path at every start, a resume included, and conversion reads it there again
        model["should_save_peft_only"] = True
        # a resume loads the adapters over the base built from base_path; composer's strict load would miss the
        # base's keys (FinetuneTask.check_resume checks that the checkpoint holds every adapter weight instead)
        cfg["load_strict_model_weights"] = False
    cfg["model"] = model
    cfg["max_seq_len"] = seq
    cfg["tokenizer"] = {"name": tokenizer_dir or tokenizer_name,
                        "kwargs": {"model_max_length": seq}}
    # padding is real in finetuning batches: keep the attention mask (no drop_full_attention_mask callback)
    cfg["callbacks"] = {k: v for k, v in cfg["callbacks"].items() if k != "drop_full_attention_mask"}
    if "fsdp_config" in cfg:
        cfg["fsdp_config"]["sync_module_states"] = True
    if instructions_dir is not None:
        cfg["train_loader"] = finetuning_loader(settings, instructions_dir, "train")
        cfg["eval_loader"] = finetuning_loader(settings, instructions_dir, "test")
    return cfg


def finetuning_loader(settings: RunSettings, instructions_dir: str, split: str) -> dict:
    """llm-foundry ``finetuning`` loader config over a prepared instruction set's ``train`` or ``test`` split.

    Prompt/response rows (``decoder_only_format``: the loss covers the response tokens only), ``max_seq_len``,
    ``allow_pad_trimming`` and ``packing_ratio`` from ``finetunes.<run>.data``. The train split is shuffled and
    drops its last partial batch; the held-out split keeps every row in order.

    Args:
        settings: the finetune's typed settings (:func:`llmpipe.config.runs.run_settings`).
        instructions_dir: the prepared instruction set (its ``data/`` holds ``train.jsonl`` and ``test.jsonl``).
        split: ``train`` or ``test``.
    """
    data, workers = settings.data, settings.train.num_workers
    train_split = split == "train"
    ds: dict[str, Any] = {
        "hf_name": os.path.join(os.path.abspath(instructions_dir), "data"),
        "split": split,
        "max_seq_len": data.concat_tokens,
        "decoder_only_format": True,
        "allow_pad_trimming": bool(data.allow_pad_trimming),
        "shuffle": train_split,
    }
    if data.packing_ratio is not None:
        ds["packing_ratio"] = data.packing_ratio
    out = {"name": "finetuning", "dataset": ds, "drop_last": train_split, "num_workers": workers,
           "pin_memory": False, "timeout": 0}
    if workers == 0:  # torch refuses prefetching without worker processes
        out.update(prefetch_factor=None, persistent_workers=False)
    else:
        out.update(prefetch_factor=2, persistent_workers=True)
    return out


def build_dataloader(settings: RunSettings, instructions_dir: str, split: str, tokenizer_dir: str,
                     device_batch_size: int | None = None):
    """Build llm-foundry's finetuning dataloader for a finetune's split, in this process (one rank).

    What training builds on every rank, usable on its own: the data check of the 7B/30B finetunes runs it on a
    few stand-in rows. Returns composer's ``DataSpec`` (``.dataloader`` yields ``input_ids``, ``attention_mask``,
    ``labels`` with prompt tokens set to -100), batches of ``device_batch_size`` rows (default
    ``train.microbatch_size``) of ``data.concat_tokens`` tokens.

    Args:
        settings: the finetune's typed settings (:func:`llmpipe.config.runs.run_settings`).
    """
    from llmfoundry.data.finetuning import build_finetuning_dataloader
    from llmfoundry.utils.builders import build_tokenizer

    seq = settings.data.concat_tokens
    tok = build_tokenizer(tokenizer_dir, {"model_max_length": seq})
    loader = copy.deepcopy(finetuning_loader(settings, instructions_dir, split))
    loader.pop("name")
    bs = device_batch_size or settings.train.microbatch_size
    return build_finetuning_dataloader(tokenizer=tok, device_batch_size=bs, **loader)


# ------------------------------------------------------------------------------------------- the task

class FinetuneTask(TrainTask):
    """The finetuning step as submitit runs it in every task (one per GPU); checkpointable like pretraining.

    Resumes from the newest complete checkpoint of the same identity, trains, and returns the train.json dict
    (:func:`llmpipe.train.pretrain.summarize`) on rank 0. Arguments as :class:`llmpipe.train.pretrain.TrainTask`'s, with the
    prepared instruction set for the data and ``base_path`` (:func:`base_model_path`) for the starting weights.
    """

    def __init__(self, settings: RunSettings, instructions_dir: str, tokenizer_dir: str, run_dir: str,
                 identity: str, base_path: str, *, resources: dict, peak_flops_table: dict | None = None):
        super().__init__(settings, instructions_dir, tokenizer_dir, run_dir, identity, resources=resources,
                         peak_flops_table=peak_flops_table)
        self.base_path = os.path.abspath(base_path) if os.path.isdir(base_path) else base_path

    def before_start(self) -> None:
        require_peft(self.settings)
        os.environ.setdefault("MAX_NUM_PROC", "1")  # llm-foundry tokenizes with cpu_count - 8 processes

    def build_config(self, save_folder: str, world_size: int, fsdp: bool) -> dict:
        return foundry_finetune_config(self.settings, instructions_dir=self.data_dir,
                                       base_path=self.base_path, save_folder=save_folder, world_size=world_size,
                                       tokenizer_dir=self.tokenizer_dir, fsdp=fsdp)

    def describe(self) -> str:
        return f"finetuning {self.run} from {self.base_path}"

    def check_resume(self, resume: str) -> None:
        """A LoRA finetune resumes with a non-strict load (the checkpoint holds the adapters only): check here that
        ``resume`` holds every adapter weight (their parameter count, :func:`llmpipe.train.lora.adapter_param_count`).

        Raises:
            RuntimeError: the checkpoint holds another number of adapter parameters; names the folder to move away.
        """
        if self.settings.lora is None:
            return
        import math

        from llmpipe.train.checkpoints import model_weight_names
        from llmpipe.train.lora import adapter_param_count
        held = sum(math.prod(shape) for name, (shape, _) in model_weight_names(resume).items() if ".lora_" in name)
        want = adapter_param_count(self.settings.arch.as_dict(), lora_settings(self.settings.lora))
        if held != want:
            raise RuntimeError(f"{self.describe()}: the checkpoint {resume} holds {held:,} adapter parameters, the "
                               f"LoRA settings make {want:,}; move the checkpoint folder {os.path.dirname(resume)} "
                               f"away to train from scratch.")

    def finish_result(self, result: dict) -> dict:
        result["kind"] = "finetune"
        result["base"] = self.base_path if not os.path.isabs(self.base_path) else os.path.relpath(
            self.base_path, self.submit_dir)
        result["lora"] = lora_settings(self.settings.lora)
        return result


# ------------------------------------------------------------------------------------------- evaluation

def evaluate_finetune(settings: RunSettings, model_dir: str, instructions_dir: str, icl_files: dict[str, str], *,
                      eval_settings: EvalSettings, suite: dict) -> dict:
    """Evaluate a finetune's Hugging Face export on its held-out split and the ICL tasks; return eval.json.

    The shared evaluation (:func:`llmpipe.evaluation.icl_eval.evaluate`: ICL tasks, metrics, record) with llm-foundry's
    ``finetuning`` loader over the held-out ``test.jsonl`` instead of an MDS val split: prompt tokens are masked,
    so loss (nats per token), perplexity and token accuracy are over the response tokens only.

    Args:
        settings: the finetune's typed settings (:func:`llmpipe.config.runs.run_settings`).
        model_dir: the finetune's Hugging Face export.
        instructions_dir: the prepared instruction set (its held-out ``test`` split is used).
        icl_files: ICL task label -> jsonl path.
        eval_settings: the ``eval:`` settings (``batch_size``, ``val_batches``).
        suite: the run's ICL suite (as :func:`llmpipe.evaluation.icl_eval.evaluate` takes it).

    Returns:
        pretraining's eval.json keys (``val``: loss, perplexity, token_accuracy; ``icl``; ``metrics`` ...), with
        ``kind: finetune`` and ``val.split: test``, ``val.token_scope: response`` (``val.tokens`` counts the
        response tokens scored, an integer as in every run).
    """
    from llmpipe.evaluation.icl_eval import evaluate

    os.environ.setdefault("MAX_NUM_PROC", "1")  # llm-foundry tokenizes with cpu_count - 8 processes
    loader = finetuning_loader(settings, instructions_dir, "test")
    loader.update(num_workers=0, prefetch_factor=None, persistent_workers=False)
    result = evaluate(settings, model_dir, None, icl_files, eval_settings=eval_settings, eval_loader=loader,
                      suite=suite)
    result["kind"] = "finetune"
    result["val"].update(split="test", token_scope="response")
    return result


# ------------------------------------------------------------------------------------------- export

#: keys of a saved Hugging Face config that are not MPTConfig arguments
_HF_ONLY_KEYS = ("architectures", "auto_map", "model_type", "transformers_version", "torch_dtype", "_name_or_path",
                 "use_cache", "attn_implementation", "_attn_implementation_autoset")


def composer_hf_metadata(state: dict) -> dict:
    """The Hugging Face metadata composer stored in a checkpoint of an HF-wrapped model (``hf_causal_lm``):
    ``{"config": <config.json dict>, "peft_config": <adapter_config.json dict> or None}``.

    Raises:
        KeyError: the checkpoint has no Hugging Face metadata (not an ``hf_causal_lm`` checkpoint).
    """
    try:
        hf = state["state"]["integrations"]["huggingface"]["model"]
    except KeyError as exc:
        raise KeyError("the checkpoint has no state.integrations.huggingface: it was not written by an "
                       "hf_causal_lm finetune") from exc
    return {"config": hf["config"]["content"], "peft_config": (hf.get("peft_config") or {}).get("content")}


def hf_weights(model_sd: dict) -> dict:
    """``state.model`` of a full finetune's ``hf_causal_lm`` checkpoint as a plain MPT state dict: keys
    ``model.<hf key>`` become ``<hf key>``.

    Raises:
        KeyError: the weights hold LoRA adapters (those are merged by :func:`llmpipe.train.lora.merge_adapters`).
    """
    out = {}
    for key, value in model_sd.items():
        k = key[len("model."):] if key.startswith("model.") else key
        if ".lora_" in k or k.startswith("base_model."):
            raise KeyError(f"{key} is a weight of a LoRA model: merge it with llmpipe.train.lora.merge_adapters")
        out[k] = value
    return out


def adapters_only(model_sd: dict) -> bool:
    """Whether ``state.model`` of a LoRA finetune's checkpoint holds only the adapters (every key has ``.lora_``;
    composer's ``should_save_peft_only``), not the frozen base weights beside them (checkpoints written before LoRA
    checkpoints held the adapters only)."""
    return bool(model_sd) and all(".lora_" in k for k in model_sd)


def load_base_mpt(base_path: str, mpt_config, *, source: str):
    """llm-foundry's ``MPTForCausalLM`` with ``mpt_config`` (the architecture stored in the finetune's checkpoint)
    and the base's weights in fp32, read from ``base_path`` as the finetune read them at its start (llm-foundry's
    ``hf_causal_lm``: ``from_pretrained`` of a local Hugging Face folder or a hub repo id, fp32 master weights).

    Raises:
        FileNotFoundError: ``base_path`` names a local folder that does not exist.
        KeyError: the base's weights do not match the architecture (names the first missing/unexpected keys).
    """
    import torch
    from llmfoundry.models.mpt import MPTForCausalLM

    if os.path.isabs(base_path) and not os.path.isdir(base_path):
        raise FileNotFoundError(f"{source}: the finetune's base {base_path} does not exist; a LoRA checkpoint holds "
                                f"the adapters only, so conversion reads the base there. Rebuild the base's export "
                                f"(snakemake {os.path.join(base_path, 'manifest.json')}) and rerun.")
    model, info = MPTForCausalLM.from_pretrained(base_path, config=mpt_config, torch_dtype=torch.float32,
                                                 output_loading_info=True)
    missing = [k for k in info["missing_keys"] if not k.endswith("lm_head.weight")]  # tied to wte
    if missing or info["unexpected_keys"] or info.get("mismatched_keys"):
        raise KeyError(f"{source}: the base {base_path} does not match the model stored in the checkpoint: missing "
                       f"{missing[:5]}, unexpected {info['unexpected_keys'][:5]}, mismatched "
                       f"{info.get('mismatched_keys', [])[:5]}")
    return model


def build_finetuned_mpt(ckpt_path: str, merge_report: dict | None = None, base_path: str | None = None):
    """Instantiate llm-foundry's ``MPTForCausalLM`` from a finetune's composer checkpoint (a full file or an FSDP
    sharded folder; fp32, eval mode).

    The architecture is the model config stored in the checkpoint (the base's own config.json, with the
    finetune's overrides), so hub and own bases convert alike. LoRA adapters (the checkpoint's ``peft_config``) are
    merged by peft (:func:`llmpipe.train.lora.merge_adapters`) into the base weights: read from ``base_path``
    (:func:`load_base_mpt`) when the checkpoint holds the adapters only (:func:`adapters_only`), else the frozen
    weights the checkpoint holds. With ``merge_report`` (a dict, filled in place) the merge is checked against the
    adapter-applied model and its figures recorded there (``base_weights``: where the base weights came from).

    Args:
        base_path: the finetune's base (:func:`base_model_path`: a local Hugging Face folder or a hub repo id);
            needed for a LoRA checkpoint of the adapters only.

    Raises:
        FileNotFoundError: the checkpoint is missing, or the base folder of a LoRA checkpoint.
        KeyError: not an ``hf_causal_lm`` checkpoint, or its weights (or the base's) do not match its config.
        ValueError: the base is not an MPT model, the merged model does not reproduce the adapter-applied one, or
            a LoRA checkpoint of the adapters only is given no ``base_path``.
    """
    import torch
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    if not os.path.exists(ckpt_path):
        raise FileNotFoundError(f"composer checkpoint {ckpt_path} does not exist; rerun the finetune "
                                f"(snakemake --forcerun finetune ...)")
    from llmpipe.train.checkpoints import is_sharded, load_model_weights, load_objects
    if is_sharded(ckpt_path):  # FSDP: weights and the HF metadata from the distributed checkpoint, no optimizer state
        state = {"state": {**load_objects(ckpt_path, "state.integrations").get("state", {}),
                           "model": load_model_weights(ckpt_path, torch.float32, strip_wrapper=False)}}
    else:
        state = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    meta = composer_hf_metadata(state)
    hf_cfg = dict(meta["config"])
    if hf_cfg.get("model_type") != "mpt":
        raise ValueError(f"{ckpt_path}: the finetuned model is a {hf_cfg.get('model_type')!r} model; only MPT "
                         f"bases are exported by llmpipe.hf.export.")
    kwargs = {k: v for k, v in hf_cfg.items() if k not in _HF_ONLY_KEYS}
    kwargs["init_device"] = "cpu"
    model_sd = state["state"]["model"]
    if meta["peft_config"] and adapters_only(model_sd):
        if not base_path:
            raise ValueError(f"{ckpt_path} holds the LoRA adapters only; give the finetune's base (base_path) to "
                             f"merge them into")
        model = load_base_mpt(base_path, MPTConfig(**kwargs), source=ckpt_path)
        if merge_report is not None:
            merge_report["base_weights"] = base_path
        return merge_adapters(model, model_sd, meta["peft_config"], source=ckpt_path, report=merge_report,
                              adapters_only=True).float().eval()
    model = MPTForCausalLM(MPTConfig(**kwargs))
    if meta["peft_config"]:
        if merge_report is not None:
            merge_report["base_weights"] = "checkpoint"
        return merge_adapters(model, model_sd, meta["peft_config"], source=ckpt_path,
                              report=merge_report).float().eval()
    sd = hf_weights(model_sd)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight")]
    if missing or unexpected:
        raise KeyError(f"checkpoint {ckpt_path} does not match its stored MPT config: missing {missing[:5]}, "
                       f"unexpected {unexpected[:5]}")
    return model.float().eval()


__all__ = ["foundry_finetune_config", "finetuning_loader", "build_dataloader", "FinetuneTask", "evaluate_finetune",
           "build_finetuned_mpt", "load_base_mpt", "adapters_only", "hf_weights", "composer_hf_metadata",
           "require_peft", "base_model_path", "SPLIT_FILES"]
