"""LoRA finetunes: the settings, the modules they adapt, their size, and the merge of trained adapters.

A finetune's ``lora:`` (``{r, alpha, dropout, target_modules}``) becomes llm-foundry's ``peft_config`` for its
``hf_causal_lm`` model (:func:`peft_config`; llm-foundry builds the adapters with ``peft.get_peft_model``). Which
modules get adapters follows peft's own rule for a list of names (``peft.tuners.tuners_utils.
check_target_module_exists``): a module matches a name when its full name equals it or ends with ``.<name>``. The
dry run applies that rule to the linear layers of the MPT model the ``arch`` describes (:func:`mpt_linear_modules`),
so a name that adapts nothing, or adapts something that is not a linear layer, stops the dry run
(:func:`check_lora`) instead of a job at the head of the queue; the same table gives the adapters' size for the
memory plan (:func:`adapter_param_count`).

A LoRA finetune's checkpoints hold the adapters only (composer's ``should_save_peft_only``, set in
:func:`llmpipe.train.finetune.foundry_finetune_config`): their fp32 weights and two Adam moments, 12 bytes per adapter
parameter (:func:`llmpipe.plan.memory_time.checkpoint_bytes`). Conversion reads the base from the finetune's base
(:func:`llmpipe.train.finetune.load_base_mpt`), merges the adapters with peft's ``merge_and_unload``
(:func:`merge_adapters`) and checks the merge on a fixed input: the merged model's logits equal the adapter-applied
model's (within :data:`MERGE_TOLERANCE`), and how far both are from the base model's is recorded (zero means the
adapters learned nothing).

Imports nothing heavy at import time (the Snakefile imports it through :mod:`llmpipe.config.runs`); torch and peft only
inside :func:`merge_adapters`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmpipe.config.schema import node_at
from llmpipe.config.settings import ConfigError, LoraSettings

__all__ = ["MERGE_TOLERANCE", "adapter_param_count", "check_lora", "lora_settings", "merge_adapters",
           "mpt_linear_modules", "peft_config", "target_matches"]

#: Largest max abs logit difference (fp32, relative to the largest logit, at least 1) between the merged model and
#: the model with its adapters applied: merging is ``W + B @ A * alpha / r``, exact up to fp32 rounding.
MERGE_TOLERANCE = 1e-4


def mpt_linear_modules(arch: Mapping) -> dict[str, tuple[int, int]]:
    """The linear layers of an llm-foundry MPT model (``MPTForCausalLM``, as exported and as on the hub), by full
    module name: ``{'transformer.blocks.0.attn.Wqkv': (in_features, out_features), ...}``.

    Per block: ``attn.Wqkv`` (``attn.Wq``, ``attn.Wk``, ``attn.Wv`` with ``attn_config.fused_qkv: false``),
    ``attn.out_proj``, ``ffn.up_proj``, ``ffn.down_proj`` (and ``ffn.gate_proj`` for ``ffn_config.ffn_type:
    mptglu``); the FFN's hidden size is ``expansion_ratio x d_model`` and K/V have ``kv_n_heads`` heads, as in
    :func:`llmpipe.model.mfu.mpt_param_count`. Tied embeddings (MPT's default) mean there is no separate ``lm_head``.

    Args:
        arch: the run's ``arch`` settings (``d_model``, ``n_heads``, ``n_layers``; optional ``expansion_ratio``,
            ``attn_config``, ``ffn_config``, ``kv_n_heads``/``n_kv_heads``).
    """
    d, n_heads, n_layers = int(arch["d_model"]), int(arch["n_heads"]), int(arch["n_layers"])
    attn = arch.get("attn_config") or {}
    attn_type = str(attn.get("attn_type", "multihead_attention"))
    kv = arch.get("kv_n_heads") if arch.get("kv_n_heads") is not None else arch.get("n_kv_heads")
    if kv is None:
        kv = attn.get("kv_n_heads") if attn_type.endswith("grouped_query_attention") else (
            1 if attn_type.endswith("multiquery_attention") else n_heads)
    kv_dim = int(kv) * (d // n_heads)
    hidden = int(float(arch.get("expansion_ratio", 4)) * d)
    block: dict[str, tuple[int, int]] = {}
    if attn.get("fused_qkv", True):
        block["attn.Wqkv"] = (d, d + 2 * kv_dim)
    else:
        block.update({"attn.Wq": (d, d), "attn.Wk": (d, kv_dim), "attn.Wv": (d, kv_dim)})
    block["attn.out_proj"] = (d, d)
    block["ffn.up_proj"] = (d, hidden)
    if (arch.get("ffn_config") or {}).get("ffn_type") == "mptglu":
        block["ffn.gate_proj"] = (d, hidden)
    block["ffn.down_proj"] = (hidden, d)
    return {f"transformer.blocks.{i}.{name}": shape for i in range(n_layers) for name, shape in block.items()}


#: Leaf names of MPT modules that are not linear layers: peft would adapt the embedding (which MPT also calls to
#: unembed) or refuse the rest.
_NOT_LINEAR = frozenset({"transformer", "wte", "wpe", "emb_drop", "blocks", "norm_1", "attn", "norm_2", "ffn", "act",
                         "resid_attn_dropout", "resid_ffn_dropout", "norm_f"})


def target_matches(module: str, target: str) -> bool:
    """peft's rule for one name of a ``target_modules`` list: the module's full name equals ``target`` or ends with
    ``.<target>``."""
    return module == target or module.endswith(f".{target}")


def check_lora(lora: Mapping | None, arch: Mapping, where: str) -> None:
    """Check a finetune's LoRA settings against the MPT model its ``arch`` describes (the dry run calls this).

    Raises:
        ConfigError: ``{where}.target_modules`` names something that matches no linear layer of the model (a typo,
            or a norm/embedding), naming the setting and the names that do exist.
    """
    if not lora:
        return
    names = sorted({n.split(".", 3)[3] for n in mpt_linear_modules(arch)})  # attn.Wqkv, ffn.up_proj, ...
    leaves = sorted({n.rsplit(".", 1)[1] for n in names})
    modules = list(mpt_linear_modules(arch))
    for target in lora["target_modules"]:
        if any(target_matches(m, target) for m in modules):
            continue
        why = "is not a linear layer" if str(target).rsplit(".", 1)[-1] in _NOT_LINEAR else "matches no module"
        raise ConfigError(f"{where}.target_modules names {target!r}, which {why} of the MPT model "
                          f"(peft matches a module whose name equals it or ends with '.{target}'). Fix: use the "
                          f"linear layers' names: {', '.join(leaves)} (or with their parent: {', '.join(names)}).")


def lora_settings(lora: Mapping | LoraSettings | None) -> dict | None:
    """The LoRA settings a finetune trains with, defaults filled in: ``{'r', 'alpha' (default 2 x r), 'dropout'
    (default: the schema's ``x-default``, 0), 'target_modules' (sorted, unique)}``; None without LoRA. These are the finetune's identity (the
    order of ``target_modules`` and a default written out change nothing) and llm-foundry's ``peft_config``.
    ``lora``: the ``lora:`` mapping as written (identity) or the typed :class:`llmpipe.config.settings.LoraSettings`."""
    if isinstance(lora, LoraSettings):
        lora = {"r": lora.r, "alpha": lora.alpha, "dropout": lora.dropout, "target_modules": lora.target_modules}
    if not lora:
        return None
    r = int(lora["r"])
    alpha, dropout = lora.get("alpha"), lora.get("dropout")
    if dropout is None:  # not written: the schema's x-default
        dropout = node_at("#/$defs/finetune")["properties"]["lora"]["properties"]["dropout"]["x-default"]
    return {"r": r, "alpha": float(2 * r if alpha is None else alpha), "dropout": float(dropout),
            "target_modules": sorted(set(lora["target_modules"]))}


def peft_config(lora: Mapping | LoraSettings) -> dict:
    """llm-foundry's ``model.peft_config`` (keyword arguments of ``peft.LoraConfig``) for a finetune's ``lora``."""
    s = lora_settings(lora)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": s["r"], "lora_alpha": s["alpha"],
            "lora_dropout": s["dropout"], "target_modules": s["target_modules"]}


def adapter_param_count(arch: Mapping, lora: Mapping | None) -> int:
    """Trainable parameters of the adapters: ``r x (in_features + out_features)`` (A is r x in, B out x r) for every
    linear layer that ``target_modules`` matches (:func:`mpt_linear_modules`); 0 without LoRA."""
    if not lora:
        return 0
    r, targets = int(lora["r"]), list(lora["target_modules"])
    return sum(r * (i + o) for m, (i, o) in mpt_linear_modules(arch).items()
               if any(target_matches(m, t) for t in targets))


def merge_adapters(model, model_state: Mapping[str, Any], peft_config_dict: Mapping, *, source: str,
                   report: dict | None = None, seq_len: int = 16, seed: int = 0, adapters_only: bool = False):
    """Load a LoRA finetune's weights into ``model`` and merge the adapters into the base weights with peft.

    ``model`` is the base architecture (an ``MPTForCausalLM``, fp32); peft wraps it with the checkpoint's adapter
    config (``peft.get_peft_config``, as composer reads it), takes the checkpoint's weights (``model_state``: keys
    ``[model.]base_model.model.<module>...``), and ``merge_and_unload`` folds ``B @ A x alpha / r`` into each
    adapted weight. With ``adapters_only`` the checkpoint holds the adapters alone (composer's
    ``should_save_peft_only``) and ``model`` already holds the base weights (read from the finetune's base); every
    adapter weight must still be in ``model_state``. With ``report`` (a dict, filled in place) the merge is checked on a fixed random input of 2 x
    ``seq_len`` tokens, in eval mode (no dropout): ``merge_max_abs_logit_diff`` (merged vs adapters applied) and
    ``adapter_max_abs_logit_delta`` (adapters applied vs disabled, i.e. vs the base), beside ``adapter_params``,
    ``adapted_modules`` and the settings.

    Returns:
        The merged plain model (no peft wrapper), eval mode.

    Raises:
        KeyError: the weights do not match the model with its adapters (names the first missing/unexpected keys).
        ValueError: the merged model's logits differ from the adapter-applied model's by more than
            :data:`MERGE_TOLERANCE` (relative to the largest logit).
    """
    import peft
    import torch

    cfg = peft.get_peft_config(dict(peft_config_dict))
    wrapped = peft.get_peft_model(model, cfg)
    sd = {k[len("model."):] if k.startswith("model.") else k: v for k, v in model_state.items()}
    missing, unexpected = wrapped.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight")  # tied to wte
               and (".lora_" in k or not adapters_only)]  # adapters only: the base weights are model's own
    if missing or unexpected:
        raise KeyError(f"checkpoint {source}: its weights do not match the MPT model with its LoRA adapters: missing "
                       f"{missing[:5]}, unexpected {unexpected[:5]}")
    wrapped.eval()
    if report is None:
        return wrapped.merge_and_unload().eval()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, min(seq_len, model.config.max_seq_len)), generator=gen)
    adapted_names = [n for n, m in wrapped.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    n_adapter = sum(p.numel() for n, p in wrapped.named_parameters() if ".lora_" in n)
    with torch.no_grad():
        adapted = wrapped(input_ids=ids).logits
        with wrapped.disable_adapter():
            base = wrapped(input_ids=ids).logits
        merged_model = wrapped.merge_and_unload().eval()
        merged = merged_model(input_ids=ids).logits
    diff = float((merged - adapted).abs().max())
    scale = max(1.0, float(adapted.abs().max()))
    report.update({
        "r": int(cfg.r), "alpha": float(cfg.lora_alpha), "dropout": float(cfg.lora_dropout),
        "target_modules": sorted(cfg.target_modules), "adapted_modules": len(adapted_names),
        "adapter_params": int(n_adapter), "merge": f"peft {peft.__version__} merge_and_unload",
        "merge_max_abs_logit_diff": diff, "adapter_max_abs_logit_delta": float((adapted - base).abs().max()),
        "max_abs_logit": scale,
    })
    if diff > MERGE_TOLERANCE * scale:
        raise ValueError(f"checkpoint {source}: the merged model's logits differ from the adapter-applied model's by "
                         f"{diff:.3g} (tolerance {MERGE_TOLERANCE} x {scale:.3g}); the export would not be the model "
                         f"that was trained.")
    return merged_model
