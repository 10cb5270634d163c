"""Export a composer checkpoint of an MPT model to a Hugging Face model folder.

The folder holds ``config.json``, safetensors weights (bf16 by default: the optimizer state is dropped, so it is
much smaller than the training checkpoint), the tokenizer, and MPT's modelling code with llm-foundry's imports
flattened (llm-foundry's own ``edit_files_for_hf_compatibility``), so that
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` works without llm-foundry installed.
Attention implementations that exist only in our package (``sdpa``) are mapped back to llm-foundry's stock
``torch`` implementation in the exported config, as llm-foundry's own HF checkpointer does.
The tokenizer is saved for transformers' usual calls (:func:`save_export_tokenizer`): ``model(**tok(text))``,
``model.generate(**tok(texts, padding=True))`` and ``pipeline("text-generation", folder)``.
"""

from __future__ import annotations

import os
import shutil
import time

from llmpipe.atomic import atomic_write_json, read_json, umask_mode
from llmpipe.config.settings import RunSettings
from llmpipe.config.stage_settings import ConvertSettings
from llmpipe.dispatch import progress
from llmpipe.train.throughput import peak_host_rss_gib

#: attention implementations that the exported code knows; anything else is mapped to ``torch``.
STOCK_ATTN_IMPLS = ("torch", "flash")
#: What the exported tokenizer returns: MPT's forward takes no ``token_type_ids``.
MODEL_INPUT_NAMES = ("input_ids", "attention_mask")
#: MPT generates from left-padded batches only (its ``prepare_inputs_for_generation`` refuses right padding).
PADDING_SIDE = "left"


def mpt_config_dict(settings: RunSettings) -> dict:
    """The ``MPTConfig`` keyword arguments of a run (same model as :func:`llmpipe.train.pretrain.foundry_train_config`).

    Args:
        settings: the run's typed settings (:func:`llmpipe.config.runs.run_settings`).
    """
    from llmpipe.train.pretrain import FUSED_LOSS_MODEL_KEYS, foundry_train_config
    model = dict(foundry_train_config(settings, data_dir=None, save_folder=None, world_size=1, fsdp=False)["model"])
    model.pop("name")  # mpt_causal_lm or mpt_causal_lm_fused_loss: the same MPTForCausalLM weights
    for key in FUSED_LOSS_MODEL_KEYS:  # training-speed settings of the composer class, not of MPTConfig
        model.pop(key, None)
    model["init_device"] = "cpu"
    return model


def load_composer_weights(ckpt_path: str, dtype=None) -> dict:
    """Load the model weights of a composer checkpoint (a full file or a sharded folder) as an ``MPTForCausalLM``
    state dict in ``dtype`` (None: float32), without the optimizer state and without a process group
    (:func:`llmpipe.train.checkpoints.load_model_weights`).

    Raises:
        FileNotFoundError: the checkpoint is missing.
        KeyError: the file is not a composer checkpoint with ``state.model``.
    """
    import torch

    from llmpipe.train.checkpoints import load_model_weights
    return load_model_weights(ckpt_path, dtype or torch.float32)


def build_hf_model(settings: RunSettings, ckpt_path: str, dtype=None, merge_report: dict | None = None,
                   base_path: str | None = None):
    """Instantiate llm-foundry's ``MPTForCausalLM`` for a run and load the checkpoint's weights in ``dtype``
    (None: float32). The model is built on the meta device and takes the loaded tensors as its parameters, so the
    host holds one copy of the weights.

    A finetune's checkpoint holds an HF-wrapped model (``hf_causal_lm``): its config comes from the checkpoint
    and LoRA adapters are merged (:func:`llmpipe.train.finetune.build_finetuned_mpt`; ``merge_report``: a dict that
    receives the merge check of :func:`llmpipe.train.lora.merge_adapters`) into the base read from ``base_path``.

    Args:
        settings: the run's typed settings (:func:`llmpipe.config.runs.run_settings`).
        base_path: a finetune's base (:func:`llmpipe.train.finetune.base_model_path`); a LoRA checkpoint holds the
            adapters only, the base weights are read there.

    Raises:
        KeyError: the checkpoint's weights do not match ``models.<run>.arch``.
    """
    run = settings.name
    if settings.kind == "finetune":
        from llmpipe.train.finetune import build_finetuned_mpt
        return build_finetuned_mpt(ckpt_path, merge_report, base_path)  # full or sharded checkpoint; fp32
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    from llmpipe.train.pretrain import register_extensions
    register_extensions()  # the training config may name our SDPA attention class

    import torch
    kwargs = mpt_config_dict(settings)
    kwargs["init_device"] = "meta"
    mpt_cfg = MPTConfig(**kwargs)
    model = MPTForCausalLM(mpt_cfg)
    weights = load_composer_weights(ckpt_path, dtype)
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied to wte when absent
    if missing or unexpected:
        raise KeyError(f"checkpoint {ckpt_path} does not match models.{run}.arch: missing {missing[:5]}, "
                       f"unexpected {unexpected[:5]}")
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise KeyError(f"checkpoint {ckpt_path} has no value for {left[:5]} (models.{run}.arch)")
    model.tie_weights()
    model.config.init_device = "cpu"
    return model.to(dtype or torch.float32).eval()


def convert_checkpoint(settings: RunSettings, ckpt_path: str, tokenizer_dir: str, out_dir: str,
                       export_settings: ConvertSettings, verify: bool = True, base_path: str | None = None) -> dict:
    """Write the Hugging Face folder ``out_dir`` for a run's composer checkpoint; return its manifest.

    The folder is written aside and renamed into place, and ``manifest.json`` (the rule's output) is written
    last, after verification, so an interrupted export never looks complete.

    Args:
        settings: the run's typed settings (:func:`llmpipe.config.runs.run_settings`).
        ckpt_path: the final composer checkpoint.
        tokenizer_dir: the saved Hugging Face tokenizer folder (copied into the export).
        out_dir: the export folder (replaced when it exists).
        export_settings: the ``convert:`` settings: ``dtype`` (``bfloat16`` | ``float16`` | ``float32``) of the
            saved weights, and ``max_shard_size``, the largest safetensors file (transformers' ``save_pretrained``,
            e.g. ``5GB``); larger exports are split into ``model-0000k-of-0000n.safetensors`` with
            ``model.safetensors.index.json``.
        verify: reload the written folder through transformers alone and compare its logits with the source
            model on a fixed random input; the max abs difference is recorded in the manifest.
        base_path: a finetune's base (:func:`llmpipe.train.finetune.base_model_path`): a LoRA finetune's
            checkpoint holds the adapters only, merged into the base weights read there.

    The checkpoint may be full or sharded (FSDP): only the model weights are read, without a process group or
    a GPU, straight into ``dtype`` (:func:`llmpipe.train.checkpoints.load_model_weights`), so the peak host memory
    before verification is about one ``dtype`` copy of the weights; the manifest records it
    (``peak_rss_gib_export``, the process's peak resident set, interpreter and libraries included) beside the
    weights' size (``weights_gib``) and the time. A LoRA finetune's adapters are merged into the exported weights;
    ``lora`` in the manifest holds the merge check (:func:`llmpipe.train.lora.merge_adapters`) and where the base
    weights came from (``base_weights``). The tokenizer is the run's
    with a pad token and left padding (:func:`save_export_tokenizer`; ``tokenizer`` in the manifest).

    Raises:
        ValueError: a tokenizer that would grow when given its pad token.
    """
    import torch
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
    from llmfoundry.utils.huggingface_hub_utils import edit_files_for_hf_compatibility

    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    dtype, max_shard_size = export_settings.dtype, export_settings.max_shard_size
    t0 = time.time()
    run = settings.name
    lora_report: dict = {}
    progress.update(0, 3, "part", task="load the checkpoint's weights", force=True)   # the step's console line
    model = build_hf_model(settings, ckpt_path, dtypes[dtype],
                           merge_report=lora_report if settings.lora is not None else None, base_path=base_path)
    from llmpipe.model.attention import stock_attn_config
    model.config.attn_config = stock_attn_config(model.config.attn_config)  # sdpa_* class -> stock class
    if model.config.attn_config.get("attn_impl") not in STOCK_ATTN_IMPLS:
        model.config.attn_config["attn_impl"] = "torch"
    model.config.init_device = "cpu"
    # written aside and renamed into place; the name must be a valid module name for transformers' remote code
    tmp = os.path.join(os.path.dirname(os.path.abspath(out_dir)), "_export_tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    MPTConfig.register_for_auto_class()
    MPTForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    export = model.to(dtypes[dtype])
    export.config.torch_dtype = dtypes[dtype]
    progress.update(1, 3, "part", task="write safetensors", force=True)
    tokenizer = save_export_tokenizer(tokenizer_dir, tmp)
    # transformers' pipeline() loads a remote-code model's tokenizer only when its config names the class
    export.config.tokenizer_class = tokenizer["class"]
    # generate() without pad/eos arguments stops at EOS and pads batches with the tokenizer's pad token
    # (generation_config.json); None where the tokenizer has none
    export.generation_config.pad_token_id = tokenizer["pad_token_id"]
    export.generation_config.eos_token_id = tokenizer["eos_token_id"]
    export.save_pretrained(tmp, safe_serialization=True, max_shard_size=max_shard_size)
    edit_files_for_hf_compatibility(tmp)
    state_tied_embeddings(tmp, bool(getattr(export.config, "tie_word_embeddings", True)))
    give_umask_modes(tmp)
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)

    from llmpipe.train.checkpoints import checkpoint_bytes, is_sharded
    manifest = {
        "run": run,
        "source_checkpoint": os.path.abspath(ckpt_path),
        "source_checkpoint_bytes": checkpoint_bytes(ckpt_path),
        "source_checkpoint_sharded": is_sharded(ckpt_path),
        "dtype": dtype,
        "attn_impl": export.config.attn_config["attn_impl"],
        "attn_type": export.config.attn_config.get("attn_type", "multihead_attention"),
        "n_params": int(sum(p.numel() for p in model.parameters())),
        "bytes": int(sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))),
        "weights_gib": round(sum(p.numel() * p.element_size() for p in export.parameters()) / 2**30, 4),
        "max_shard_size": max_shard_size,
        "tokenizer": tokenizer,
        "safetensors_files": sorted(f for f in os.listdir(out_dir) if f.endswith(".safetensors")),
        "peak_rss_gib_export": round(peak_host_rss_gib(), 3),
        "export_seconds": round(time.time() - t0, 2),
        "seconds": None,
    }
    if lora_report:  # LoRA: merged by peft, checked against the adapter-applied model (llmpipe.train.lora.merge_adapters)
        manifest["lora"] = lora_report
    del model, export
    if verify:
        progress.update(2, 3, "part", task="verify: reload and compare logits", force=True)
        reference = build_hf_model(settings, ckpt_path, base_path=base_path)
        manifest["verify_max_abs_logit_diff"] = verify_export(out_dir, reference, dtype)
        manifest["peak_rss_gib_with_verify"] = round(peak_host_rss_gib(), 3)
    manifest["seconds"] = round(time.time() - t0, 2)
    atomic_write_json(os.path.join(out_dir, "manifest.json"), manifest)  # last: the folder is complete now
    progress.update(3, 3, "part", task="done", force=True)
    return manifest


def save_export_tokenizer(tokenizer_dir: str, out_dir: str) -> dict:
    """Save the tokenizer of ``tokenizer_dir`` into the export ``out_dir`` for transformers' usual calls.

    Its pad token is its own, else its EOS token, a token it has: no token is added and the embeddings keep their
    size, and padded positions are masked by ``attention_mask``, so no score changes. It pads on the left
    (:data:`PADDING_SIDE`) and returns :data:`MODEL_INPUT_NAMES` only. The three are init arguments of the
    tokenizer, which ``save_pretrained`` writes to ``tokenizer_config.json``.

    Returns:
        ``{"class", "pad_token", "pad_token_id", "eos_token_id", "padding_side", "model_input_names"}`` of the saved
        tokenizer
        (``class``: the ``tokenizer_class`` of its ``tokenizer_config.json``, for the model's config).

    Raises:
        ValueError: the tokenizer has more tokens after the change (the model's embeddings would not cover them).
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    size = len(tok)
    kwargs = {"padding_side": PADDING_SIDE, "model_input_names": list(MODEL_INPUT_NAMES)}
    if tok.pad_token is None and tok.eos_token is not None:
        kwargs["pad_token"] = tok.eos_token
    tok = AutoTokenizer.from_pretrained(tokenizer_dir, **kwargs)
    if len(tok) != size:
        raise ValueError(f"the tokenizer {tokenizer_dir} grew from {size} to {len(tok)} tokens when given its pad "
                         f"token {kwargs.get('pad_token')!r}; the exported model has no embedding for the new one")
    tok.save_pretrained(out_dir)
    saved = read_json(os.path.join(out_dir, "tokenizer_config.json"), {}) or {}
    return {"class": saved.get("tokenizer_class") or type(tok).__name__, "pad_token": tok.pad_token,
            "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id, "padding_side": tok.padding_side,
            "model_input_names": list(tok.model_input_names)}


def state_tied_embeddings(folder: str, tied: bool) -> None:
    """Write ``tie_word_embeddings`` into the export's ``config.json`` explicitly.

    transformers' ``save_pretrained`` leaves out values equal to ``PretrainedConfig``'s defaults, and
    ``tie_word_embeddings: true`` is one, so a loader that does not run MPT's own code (which ties the output layer to
    ``transformer.wte`` and saves no ``lm_head`` tensor) could not know the embeddings are tied.
    """
    import json

    path = os.path.join(folder, "config.json")
    with open(path) as fh:
        cfg = json.load(fh)
    cfg["tie_word_embeddings"] = bool(tied)
    atomic_write_json(path, cfg)


def give_umask_modes(folder: str) -> None:
    """Give every file under ``folder`` the mode a normally created file gets (0666 less the umask; folders 0777 less
    the umask). safetensors' ``save_file`` creates the weights with mode 0600 whatever the umask, so on a shared
    cluster nobody else could load the model while its tokenizer files were readable."""
    for root, dirs, files in os.walk(folder):
        os.chmod(root, umask_mode(0o777))
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, umask_mode(0o666))


def verify_export(folder: str, reference, dtype: str, seq_len: int = 16, seed: int = 0) -> float:
    """Max abs difference between the logits of the exported folder and ``reference`` on a random input.

    The export is loaded with ``transformers.AutoModelForCausalLM(..., trust_remote_code=True)`` (its own copied
    modelling code, not llm-foundry's classes) and run in fp32 on the CPU, as is the reference model (cast to
    the export dtype and back, so only the export's own error is measured).
    """
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, torch_dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    vocab = reference.config.vocab_size
    ids = torch.randint(0, vocab, (2, min(seq_len, reference.config.max_seq_len)), generator=gen)
    ref = reference.to({"bfloat16": torch.bfloat16, "float16": torch.float16,
                        "float32": torch.float32}[dtype]).float()
    with torch.no_grad():
        a = hf(input_ids=ids).logits
        b = ref(input_ids=ids).logits
    return float((a - b).abs().max())
