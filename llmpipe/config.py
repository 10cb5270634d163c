"""Experiment configuration: merging, validation and step identity.

This module is imported by the Snakefile on the login node, so it must stay light: no torch, no
transformers, no llm-foundry. Everything here works on plain dicts loaded from ``config/config.yaml``.

Vocabulary used throughout the project:

* **corpus** – a set of ``json.gz`` files in C4's layout (``corpora:`` in the config).
* **dataset** – a corpus tokenized with one tokenizer and concatenated to ``concat_tokens``; stored under
  ``results/data/{corpus}/{tokenizer}/concat{concat_tokens}/`` so that every model with the same data shares it.
* **run** – one training run; its outputs live in ``results/{run}/``. A pretraining run is named after its
  model (``mpt-1b``).
* **identity** – the settings that determine what a step produces, plus an explicit per-step version number.
  Snakemake stores a step's ``params`` and reruns the step when they change, so only identity goes into
  params; settings that change speed or placement (microbatch, attention implementation, nodes, FSDP, compile,
  dataloader workers, checkpoints kept) never do.
"""

from __future__ import annotations

import copy
import json
import math
import os
from typing import Any

#: Bump a step's version when a change in our code changes what that step produces. The version is part of
#: the step's identity (its Snakemake params), so bumping it reruns that step and everything after it.
STEP_VERSIONS = {
    "corpus": 1,
    "tokenizer": 1,
    "mds": 1,
    "verify": 1,
    "icl_tasks": 1,
    "train": 1,
    "convert": 1,
    "generate": 1,
    "eval": 1,
}

#: Keys under a model's ``train:`` that only change speed or placement; they are never part of identity.
SPEED_ONLY_TRAIN_KEYS = frozenset({
    "microbatch_size",
    "eval_microbatch_size",
    "attn_impl",
    "fsdp",
    "compile",
    "num_workers",
    "save_interval_batches",
    "checkpoints_to_keep",
    "log_interval_batches",
    "eval_interval_batches",
    "eval_subset_batches",
    "fused_optimizer",
    "train_metrics",
})

#: Names that cannot be run names because they are folders of their own under results/.
RESERVED_RUN_NAMES = frozenset({"data", "tokenizers", "report", "scaling", "bench", "logs"})


class ConfigError(ValueError):
    """A setting in the experiment configuration is wrong; the message names the setting and the fix."""


def deep_merge(base: dict, override: dict | None) -> dict:
    """Return a new dict: ``base`` updated recursively with ``override``.

    Nested dicts merge key by key; any other value in ``override`` (lists included) replaces the base value.
    ``None`` as an override value replaces too (``fsdp: null`` turns FSDP off).
    """
    out = copy.deepcopy(base)
    for key, value in (override or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def canonical(obj: Any) -> str:
    """Serialize ``obj`` to a canonical JSON string (sorted keys, no whitespace).

    Used for step identity: reformatting the YAML (comments, key order) gives the same string.
    """
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def known_runs(config: dict) -> list[str]:
    """Names of all runs defined in the config: every model (pretraining) and every finetune."""
    return sorted(set(config.get("models", {})) | set(config.get("finetunes", {}) or {}))


def run_config(config: dict, run: str) -> dict:
    """The fully merged settings of one run: ``model_defaults`` overlaid with ``models[run]``.

    Returns a dict with keys ``data``, ``arch``, ``train``, ``resources`` and ``name``.

    Raises:
        ConfigError: ``run`` is not a model in ``models:`` (the message lists the known ones).
    """
    models = config.get("models", {})
    if run not in models:
        raise ConfigError(
            f"unknown model or run {run!r}: known ones are {', '.join(sorted(models))}. "
            f"Fix: use one of those names in the target (results/<run>/eval.json), or add "
            f"`models: {{{run}: {{arch: ...}}}}` to your config file.")
    merged = deep_merge(config.get("model_defaults", {}), models[run] or {})
    merged["name"] = run
    return merged


def dataset_dir(config: dict, run: str) -> str:
    """The dataset folder a run trains on: ``{results}/data/{corpus}/{tokenizer}/concat{N}``."""
    data = run_config(config, run)["data"]
    return os.path.join(config["results_dir"], "data", data["corpus"], data["tokenizer"],
                        f"concat{data['concat_tokens']}")


def world_size(resources: dict) -> int:
    """Number of training processes (ranks) for a step's resources.

    One task per GPU on GPU nodes (``gpus_per_node``); on CPU-only nodes ``tasks_per_node`` (default 1).
    """
    nodes = int(resources.get("nodes", 1))
    gpus = int(resources.get("gpus_per_node", 0) or 0)
    per_node = gpus if gpus > 0 else int(resources.get("tasks_per_node", 1) or 1)
    return nodes * per_node


def validate_run(config: dict, run: str) -> dict:
    """Check one run's settings before anything is scheduled; return the merged run config.

    Checks: the model exists, its corpus and tokenizer exist, ``global_batch_size`` divides by the world size
    and by the microbatch, ``concat_tokens <= max_seq_len``, ``d_model`` divides by ``n_heads``, a trained
    tokenizer's vocabulary fits the model's ``vocab_size``, and the tokenizer has an EOS text.

    Raises:
        ConfigError: naming the first wrong setting and how to fix it.
    """
    if run in RESERVED_RUN_NAMES:
        raise ConfigError(f"{run!r} cannot be a run name: results/{run}/ is used by the workflow itself. "
                          f"Fix: rename the model.")
    rc = run_config(config, run)
    where = f"models.{run}"
    data, arch, train = rc["data"], rc["arch"], rc["train"]

    corpus = data.get("corpus")
    corpora = config.get("corpora", {})
    if corpus not in corpora:
        raise ConfigError(f"{where}.data.corpus is {corpus!r}, which is not defined under `corpora:` "
                          f"(known: {', '.join(sorted(corpora))}). Fix: add it to `corpora:` or pick a known one.")
    validate_corpus(config, corpus)

    tok = data.get("tokenizer")
    tokenizers = config.get("tokenizers", {})
    if tok not in tokenizers:
        raise ConfigError(f"{where}.data.tokenizer is {tok!r}, which is not defined under `tokenizers:` "
                          f"(known: {', '.join(sorted(tokenizers))}). Fix: add it or pick a known one.")
    tcfg = validate_tokenizer(config, tok)
    if tcfg["source"] == "train" and int(tcfg["vocab_size"]) > int(arch["vocab_size"]):
        raise ConfigError(f"tokenizers.{tok}.vocab_size ({tcfg['vocab_size']}) exceeds {where}.arch.vocab_size "
                          f"({arch['vocab_size']}). Fix: raise the model's vocab_size or lower the tokenizer's.")

    concat = int(data["concat_tokens"])
    if concat > int(arch["max_seq_len"]):
        raise ConfigError(f"{where}.data.concat_tokens ({concat}) is larger than {where}.arch.max_seq_len "
                          f"({arch['max_seq_len']}): samples would not fit the model. Fix: lower concat_tokens "
                          f"or raise max_seq_len.")
    if concat < 2:
        raise ConfigError(f"{where}.data.concat_tokens must be at least 2, got {concat}.")

    for key in ("d_model", "n_heads", "n_layers"):
        if key not in arch:
            raise ConfigError(f"{where}.arch.{key} is missing. Fix: set it (see the published MPT sizes in "
                              f"config/config.yaml).")
    if int(arch["d_model"]) % int(arch["n_heads"]):
        raise ConfigError(f"{where}.arch.d_model ({arch['d_model']}) does not divide by n_heads "
                          f"({arch['n_heads']}). Fix: choose n_heads that divides d_model.")

    res = rc["resources"]
    ws = world_size(res)
    gbs = int(train["global_batch_size"])
    if gbs % ws:
        raise ConfigError(
            f"{where}.train.global_batch_size ({gbs}) is not divisible by the number of devices ({ws} = "
            f"{res.get('nodes', 1)} nodes x {res.get('gpus_per_node') or res.get('tasks_per_node', 1)} per node). "
            f"Fix: make global_batch_size a multiple of {ws}, or change {where}.resources.")
    per_device = gbs // ws
    mb = int(train["microbatch_size"])
    if mb <= 0:
        raise ConfigError(f"{where}.train.microbatch_size must be positive, got {mb}.")
    if per_device % mb and mb < per_device:
        raise ConfigError(f"{where}.train.microbatch_size ({mb}) does not divide the per-device batch "
                          f"({per_device} = {gbs} / {ws} devices). Fix: pick a divisor of {per_device}.")
    if int(train["max_duration_batches"]) <= 0:
        raise ConfigError(f"{where}.train.max_duration_batches must be positive.")
    return rc


def validate_corpus(config: dict, corpus: str) -> dict:
    """Check a corpus definition; return it. Raises ConfigError naming the setting and the fix."""
    c = config["corpora"][corpus]
    where = f"corpora.{corpus}"
    src = c.get("source")
    if src not in ("builtin", "hub", "local"):
        raise ConfigError(f"{where}.source is {src!r}; it must be builtin, hub or local.")
    if src == "local":
        d = c.get("local_dir")
        if not d:
            raise ConfigError(f"{where}.local_dir is not set but source is local. Fix: set it to a folder "
                              f"with the hub's layout ({c.get('subset', 'en')}/c4-train.00000-of-01024.json.gz ...).")
        if not os.path.isdir(os.path.join(d, c.get("subset", "en"))):
            raise ConfigError(f"{where}.local_dir: {os.path.join(d, c.get('subset', 'en'))} does not exist. "
                              f"Fix: point local_dir at a C4 mirror, or use source: hub.")
    for key in ("train_files", "val_files"):
        if int(c.get(key, 0)) < 1:
            raise ConfigError(f"{where}.{key} must be at least 1, got {c.get(key)!r}.")
    return c


def validate_tokenizer(config: dict, tok: str) -> dict:
    """Check a tokenizer definition; return it. Raises ConfigError naming the setting and the fix."""
    t = config["tokenizers"][tok]
    where = f"tokenizers.{tok}"
    src = t.get("source")
    if src not in ("hub", "local", "train"):
        raise ConfigError(f"{where}.source is {src!r}; it must be hub, local or train.")
    if src == "train":
        if t.get("corpus") not in config.get("corpora", {}):
            raise ConfigError(f"{where}.corpus is {t.get('corpus')!r}, not a corpus under `corpora:`.")
        if int(t.get("vocab_size", 0)) < 256:
            raise ConfigError(f"{where}.vocab_size must be at least 256 for a trained BPE tokenizer.")
    elif not t.get("name"):
        raise ConfigError(f"{where}.name is not set. Fix: a hub repo id (source: hub) or a folder (source: local).")
    if not t.get("eos_text"):
        raise ConfigError(f"{where}.eos_text is empty: documents could not be separated when concatenating. "
                          f"Fix: set eos_text to the tokenizer's end-of-text token, e.g. \"<|endoftext|>\".")
    return t


# ------------------------------------------------------------------------------------------------ identity

def _identity(step: str, **parts: Any) -> str:
    return canonical({"step": step, "version": STEP_VERSIONS[step], **parts})


def corpus_identity(config: dict, corpus: str) -> str:
    """What determines a corpus' raw files: source, repo, subset, which files. (Not retries or mirror path.)"""
    c = config["corpora"][corpus]
    keep = {k: c.get(k) for k in ("source", "repo_id", "revision", "subset", "train_files", "val_files")}
    return _identity("corpus", **keep)


def tokenizer_identity(config: dict, tok: str) -> str:
    """What determines a tokenizer: its source and name, or its training corpus and vocabulary size."""
    t = config["tokenizers"][tok]
    keep = {k: t.get(k) for k in ("source", "name", "corpus", "vocab_size", "eos_text")}
    if t.get("source") == "train":
        keep["corpus_identity"] = corpus_identity(config, t["corpus"])
    return _identity("tokenizer", **keep)


def mds_identity(config: dict, corpus: str, tok: str, concat: int) -> str:
    """What determines an MDS dataset: corpus, tokenizer, concat length and shard format."""
    dp = config.get("data_prep", {})
    return _identity("mds", corpus=corpus_identity(config, corpus), tokenizer=tokenizer_identity(config, tok),
                     concat_tokens=int(concat), compression=dp.get("compression"))


def train_identity(config: dict, run: str) -> str:
    """What determines a trained model: architecture, data, optimizer, steps, global batch, seed, precision.

    Keys in :data:`SPEED_ONLY_TRAIN_KEYS`, the resources and the attention implementation are left out.
    """
    rc = run_config(config, run)
    train = {k: v for k, v in rc["train"].items() if k not in SPEED_ONLY_TRAIN_KEYS}
    d = rc["data"]
    return _identity("train", arch=rc["arch"], train=train,
                     data=mds_identity(config, d["corpus"], d["tokenizer"], d["concat_tokens"]))


def convert_identity(config: dict, run: str) -> str:
    """What determines the exported Hugging Face model: the trained model and the export dtype."""
    return _identity("convert", dtype=config["convert"]["dtype"])


def generate_identity(config: dict, run: str) -> str:
    """What determines generate.json: prompts and sampling settings."""
    g = config["generate"]
    return _identity("generate", **{k: g.get(k) for k in ("prompts", "max_new_tokens", "do_sample",
                                                           "temperature", "top_p", "seed")})


def eval_identity(config: dict, run: str) -> str:
    """What determines eval.json: eval-only settings (val batches, batch size, ICL tasks)."""
    e = config["eval"]
    return _identity("eval", val_batches=e.get("val_batches"), batch_size=e.get("batch_size"),
                     icl_tasks=e.get("icl_tasks"))


def step_resources(config: dict, step: str, run: str | None = None) -> dict:
    """Resources of one step: ``nodes, gpus_per_node, tasks_per_node, cpus_per_task, mem_gb, time_min``.

    Training uses ``models.<run>.resources``; other steps use their own section (``convert.resources`` ...)
    overlaid with ``models.<run>.step_resources.<step>`` when given.
    """
    if step == "train":
        res = dict(run_config(config, run)["resources"])
    elif step == "data":
        res = dict(config.get("data_resources", {}))
    else:
        res = dict(config[step].get("resources", {}))
        if run is not None:
            over = (config.get("models", {}).get(run, {}) or {}).get("step_resources", {}).get(step)
            res.update(over or {})
    res.setdefault("nodes", 1)
    res.setdefault("gpus_per_node", 0)
    res.setdefault("cpus_per_task", 1)
    res.setdefault("mem_gb", 0)
    res.setdefault("time_min", 60)
    res["tasks_per_node"] = int(res["gpus_per_node"]) if int(res["gpus_per_node"]) > 0 else int(
        res.get("tasks_per_node", 1) or 1)
    return res


def tokens_per_run(config: dict, run: str) -> int:
    """Training tokens of a run = max_duration_batches x global_batch_size x concat_tokens."""
    rc = run_config(config, run)
    return int(rc["train"]["max_duration_batches"]) * int(rc["train"]["global_batch_size"]) * int(
        rc["data"]["concat_tokens"])


def ln_vocab(vocab_size: int) -> float:
    """ln(V): the loss of a uniform guess over V tokens, in nats."""
    return math.log(vocab_size)
