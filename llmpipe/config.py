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
import functools
import json
import math
import os
from typing import Any, Sequence

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
    "fused_loss",
})

#: Every key a model's or finetune's ``train:`` may have: the speed-only ones plus those that define the run.
KNOWN_TRAIN_KEYS = SPEED_ONLY_TRAIN_KEYS | frozenset({
    "global_batch_size",
    "max_duration_batches",
    "precision",
    "optimizer",
    "scheduler",
    "seed",
    "grad_clip_norm",
    "loss_fn",
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

    Returns a dict with keys ``data``, ``arch``, ``train``, ``resources`` and ``name``. For a finetune
    (``finetunes[run]``) see :func:`finetune_run_config`: the same keys (plus ``kind``, ``base``, ``lora``).

    Raises:
        ConfigError: ``run`` is not a model in ``models:`` (the message lists the known ones).
    """
    if is_finetune(config, run):
        return finetune_run_config(config, run)
    models = config.get("models", {})
    if run not in models:
        raise ConfigError(
            f"unknown model or run {run!r}: known ones are {', '.join(known_runs(config))}. "
            f"Fix: use one of those names in the target (results/<run>/eval.json), or add "
            f"`models: {{{run}: {{arch: ...}}}}` (or `finetunes: {{{run}: ...}}`) to your config file.")
    merged = _yaml_scalars(deep_merge(config.get("model_defaults", {}), models[run] or {}))
    merged["name"] = run
    return merged


def _yaml_scalars(tree: Any) -> Any:
    """``tree`` with every ``'true'``/``'false'``/``'null'`` string read as YAML would (``snakemake --config``
    hands nested values over as strings, so ``train: {compile: false}`` arrives as ``'False'``)."""
    if isinstance(tree, dict):
        return {k: _yaml_scalars(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_yaml_scalars(v) for v in tree]
    return _yaml_scalar(tree)


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
    if is_finetune(config, run):
        return validate_finetune(config, run)
    where = f"models.{run}"
    check_run_sections(config, run)
    rc = run_config(config, run)
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
    validate_data_prep(config, concat, f"{where}.data.concat_tokens")

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
    fused_loss_settings(train, f"{where}.train")
    compile_settings(train, f"{where}.train")
    check_attn_impl(train, f"{where}.train")
    return rc


def refuse_unknown_keys(given: dict, known: Sequence[str], where: str, what: str, also: str = "") -> None:
    """Raise ConfigError for the first key of ``given`` (sorted) not in ``known``: ``{where}.{key} is not a
    {what}; did you mean <closest known key>? Known ones: ...`` followed by ``also``."""
    import difflib

    for key in sorted(set(given) - set(known)):
        close = difflib.get_close_matches(key, list(known), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(f"{where}.{key} is not a {what}; {hint}Known ones: {', '.join(known)}.{also}")


#: The sections of ``model_defaults`` that runs read (``step_resources`` are per run, or ``finetune_defaults``).
MODEL_DEFAULTS_KEYS = ("arch", "data", "resources", "train")
#: Sections of a run that must be mappings when given (null would replace the defaults with nothing).
RUN_MAPPING_SECTIONS = ("arch", "data", "resources", "train")


def _run_sources(config: dict, run: str) -> list[tuple[str, Any]]:
    """Where a run's settings are written, highest priority first: ``(config path, section)``; a pretraining run
    reads ``models.<run>`` over ``model_defaults``, a finetune ``finetunes.<run>`` over ``finetune_defaults`` over
    ``model_defaults`` (:func:`finetune_run_config`)."""
    if is_finetune(config, run):
        return [(f"finetunes.{run}", (config.get("finetunes") or {}).get(run)),
                ("finetune_defaults", config.get("finetune_defaults")), ("model_defaults", config.get("model_defaults"))]
    return [(f"models.{run}", (config.get("models") or {}).get(run)), ("model_defaults", config.get("model_defaults"))]


def check_run_sections(config: dict, run: str) -> None:
    """Check a run's settings where they are written (the run's own section and the defaults it inherits), so that
    an error names the line to fix: an unknown section (``resource:``), a section that is not a mapping
    (``train: null``), an unknown key under ``train:`` (and, for pretraining, ``arch:`` / ``data:``) or
    ``resources:`` (with its ``slurm:``), and an unknown step under ``step_resources:``.

    Raises:
        ConfigError: naming the config path of the first wrong key and the closest known one.
    """
    finetune = is_finetune(config, run)
    for where, sec in _run_sources(config, run):
        if _yaml_scalar(sec) is None:
            continue
        if not isinstance(sec, dict):
            raise ConfigError(f"{where} is {sec!r}; it must be a mapping of sections (train, resources, ...). "
                              f"Fix: give its sections as in config/config.yaml.")
        defaults = where == "model_defaults"
        known = MODEL_DEFAULTS_KEYS if defaults else FINETUNE_RUN_KEYS if where.startswith("finetune") \
            else PRETRAIN_RUN_KEYS
        what = "section of model_defaults" if defaults else "section of a finetune" if where.startswith("finetune") \
            else "section of a model"
        refuse_unknown_keys(sec, known, where, what, " (A misspelled section would be ignored, e.g. its node count.)")
        for sub in RUN_MAPPING_SECTIONS:
            if sub in sec and not isinstance(sec[sub], dict):
                raise ConfigError(f"{where}.{sub} is {sec[sub]!r}; it must be a mapping. Fix: remove it (the "
                                  f"defaults apply) or give its keys, e.g. {sub}: {{key: value}}.")
        refuse_unknown_keys(sec.get("train") or {}, sorted(KNOWN_TRAIN_KEYS), f"{where}.train", "train setting")
        if not finetune:  # a finetune's data and arch are its own kind (instructions; the hub model's shape)
            refuse_unknown_keys(sec.get("data") or {}, PRETRAIN_DATA_KEYS, f"{where}.data",
                                "data setting of a pretraining run")
            refuse_unknown_keys(sec.get("arch") or {}, PRETRAIN_ARCH_KEYS, f"{where}.arch",
                                "model setting the training step passes to MPT",
                                " Other MPTConfig settings are not passed on; see llmpipe.train.foundry_train_config.")
        if "resources" in sec:
            check_resource_keys(sec["resources"], f"{where}.resources")
        if not defaults:
            check_step_resource_steps(sec, where)


#: Top-level sections besides those of ``config/config.yaml``: Slurm site settings (``config/slurm-site.yaml``).
EXTRA_TOP_LEVEL_KEYS = ("slurm",)


@functools.lru_cache(maxsize=4)
def _defaults(defaults_file: str) -> dict:
    """``config/config.yaml`` parsed once per process (:func:`check_top_level_keys` and :func:`check_section_keys`
    both read it at the start of every Snakemake run); read only."""
    import yaml

    with open(defaults_file) as f:
        return yaml.safe_load(f) or {}


def check_top_level_keys(config: dict, defaults_file: str) -> None:
    """Raise ConfigError for a top-level key of the merged workflow config that nothing reads (e.g.
    ``model_default:`` from a ``--configfile`` or ``--config``: its settings would be dropped silently), naming
    the closest known one. Known: the sections of ``defaults_file`` (``config/config.yaml``) and
    :data:`EXTRA_TOP_LEVEL_KEYS`."""
    known = sorted(set(_defaults(defaults_file)) | set(EXTRA_TOP_LEVEL_KEYS))
    refuse_unknown_keys(config, known, "config", "top-level section of the workflow config",
                        " (Its settings would be ignored.)")


#: Settings sections whose keys are checked one by one (:func:`check_section_keys`) against those of
#: ``config/config.yaml``. (Sections of named entries - corpora, tokenizers, models, finetunes, instruction_sets,
#: gpu_peak_flops - are checked where each entry is read.)
CHECKED_SECTIONS = ("data_prep", "convert", "generate", "eval", "dispatch", "allreduce", "scaling", "report")
#: Of those, the ones whose defaults live only in ``config/config.yaml`` (the others have code defaults, e.g.
#: :data:`llmpipe.report.DEFAULTS`): null there would drop the defaults, so it is an error.
REQUIRED_SECTIONS = ("convert", "data_prep", "dispatch", "eval", "generate")
#: The keys of one entry of ``eval.icl_tasks`` (read by llmpipe.data.icl and llmpipe.evaluate).
ICL_TASK_KEYS = ("kind", "label", "num_fewshot", "num_items", "seed")
#: The keys of ``allreduce.gate`` (llmpipe.allreduce).
ALLREDUCE_GATE_KEYS = ("min_busbw_gbps", "size_bytes")
#: Steps whose resources a model or finetune may override under ``step_resources:``.
STEP_RESOURCE_STEPS = ("convert", "eval", "generate")


def check_section_keys(config: dict, defaults_file: str) -> None:
    """Raise ConfigError for a settings section that is not a mapping, or a key in it that nothing reads, e.g.
    ``eval: {val_batchs: 3}`` or ``slurm: {partiton: gpu}`` (the value would be ignored silently and the default
    used), naming the closest known key. Checks :data:`CHECKED_SECTIONS` against ``defaults_file``
    (``config/config.yaml``), ``report.projection`` likewise, ``eval.icl_tasks`` (a list; each entry against
    :data:`ICL_TASK_KEYS`), ``allreduce.gate`` against :data:`ALLREDUCE_GATE_KEYS`, and ``slurm`` and
    ``slurm.container`` against :data:`llmpipe.slurm.DEFAULTS` (a step's ``resources.slurm`` is checked with its
    resources, :func:`check_resource_keys`).

    ``snakemake --config 'report=null'`` hands over the string ``'null'``: for the sections whose defaults live in
    code (all but :data:`REQUIRED_SECTIONS`) and for ``allreduce.gate`` it is set to None here, in ``config``,
    so that the defaults apply as they do for a YAML null.
    """
    defaults = _defaults(defaults_file)
    also = " (Its value would be ignored.)"
    for sec in CHECKED_SECTIONS + ("slurm",):
        if sec not in config:
            continue
        given = config[sec]
        if _yaml_scalar(given) is None and sec not in REQUIRED_SECTIONS:
            config[sec] = None  # an empty section: the defaults (llmpipe.report/scaling/allreduce/slurm) apply
            continue
        if not isinstance(given, dict):
            src = "config/slurm-site.yaml" if sec == "slurm" else "config/config.yaml"
            raise ConfigError(f"`{sec}:` is {given!r}; it must be a mapping of settings. Fix: remove it (the "
                              f"defaults apply) or give its keys as in {src}, e.g. {sec}: {{key: value}}.")
        if sec == "slurm":
            check_slurm_keys(given, "slurm")
            continue
        refuse_unknown_keys(given, sorted(defaults.get(sec) or {}), sec, f"setting of `{sec}:`", also)
    report = config.get("report") or {}
    if "projection" in report:
        if not isinstance(report["projection"], dict):
            raise ConfigError(f"report.projection is {report['projection']!r}; it must be a mapping, e.g. "
                              f"{{nodes: [1, 8, 64]}} (see config/config.yaml).")
        refuse_unknown_keys(report["projection"], sorted(defaults["report"]["projection"]), "report.projection",
                            "setting of `report.projection:`", also)
    allreduce = config.get("allreduce") or {}
    if "gate" in allreduce:
        if _yaml_scalar(allreduce["gate"]) is None:
            allreduce["gate"] = None
        elif not isinstance(allreduce["gate"], dict):
            raise ConfigError(f"allreduce.gate is {allreduce['gate']!r}; it must be null (no gate) or a mapping, "
                              f"e.g. {{size_bytes: 1073741824, min_busbw_gbps: 100}}.")
        else:
            refuse_unknown_keys(allreduce["gate"], ALLREDUCE_GATE_KEYS, "allreduce.gate",
                                "setting of the all-reduce gate", also)
    ev = config.get("eval") or {}
    if "icl_tasks" in ev:
        if not isinstance(ev["icl_tasks"], list):
            raise ConfigError(f"eval.icl_tasks is {ev['icl_tasks']!r}; it must be a list of tasks ([] for none), "
                              f"as in config/config.yaml.")
        for i, task in enumerate(ev["icl_tasks"]):
            if not isinstance(task, dict):
                raise ConfigError(f"eval.icl_tasks[{i}] is {task!r}; it must be a mapping with "
                                  f"{', '.join(ICL_TASK_KEYS)}.")
            refuse_unknown_keys(task, ICL_TASK_KEYS, f"eval.icl_tasks[{i}]", "setting of an ICL task", also)


def check_slurm_keys(site: dict, where: str) -> None:
    """Raise ConfigError for a key of Slurm site settings (``slurm:`` or a step's ``resources.slurm``) or of their
    ``container:`` that :data:`llmpipe.slurm.DEFAULTS` does not have, naming ``where`` and the closest key."""
    from llmpipe.slurm import DEFAULTS as SLURM_DEFAULTS

    also = " (Its value would be ignored.)"
    refuse_unknown_keys(site, sorted(SLURM_DEFAULTS), where, "Slurm site setting (config/slurm-site.yaml)", also)
    container = site.get("container")
    if _yaml_scalar(container) is not None and not isinstance(container, dict):
        raise ConfigError(f"{where}.container is {container!r}; it must be null (no container) or a mapping, e.g. "
                          f"{{type: pyxis, image: ...}} (config/slurm-site.yaml).")
    if isinstance(container, dict):
        refuse_unknown_keys(site["container"], sorted(SLURM_DEFAULTS["container"]), f"{where}.container",
                            "container setting (config/slurm-site.yaml)", also)


#: Sections of an entry under ``models:`` and under ``finetunes:``.
PRETRAIN_RUN_KEYS = ("arch", "data", "resources", "step_resources", "train")
FINETUNE_RUN_KEYS = ("arch", "base", "data", "lora", "node_counts", "resources", "step_resources", "train")
#: ``data`` keys of a pretraining run (finetunes have their own, :func:`validate_finetune`).
PRETRAIN_DATA_KEYS = ("concat_tokens", "corpus", "tokenizer")
#: ``arch`` keys :func:`llmpipe.train.foundry_train_config` passes to llm-foundry's MPT (a key outside these would be
#: silently ignored by training while, e.g., the MFU formula read it).
PRETRAIN_ARCH_KEYS = ("attn_config", "d_model", "expansion_ratio", "max_seq_len", "n_heads", "n_kv_heads", "n_layers",
                      "no_bias", "norm_type", "vocab_size")


#: ``train.attn_impl`` values: ours (llmpipe.attention, PyTorch SDPA) and llm-foundry's two.
ATTN_IMPLS = ("sdpa", "torch", "flash")


def check_attn_impl(train: dict, where: str = "train") -> None:
    """Raise ConfigError (naming ``{where}.attn_impl`` and the choices) unless it is one of :data:`ATTN_IMPLS`
    (missing means llm-foundry's ``torch``). Checked at plan time: the job itself would only fail when it built
    the model."""
    value = train.get("attn_impl", "torch")
    if value not in ATTN_IMPLS:
        raise ConfigError(f"{where}.attn_impl is {value!r}; it must be one of {', '.join(ATTN_IMPLS)} (sdpa: PyTorch "
                          f"scaled_dot_product_attention through llmpipe.attention, the fast default; flash needs "
                          f"flash-attn installed).")


def compile_settings(train: dict, where: str = "train") -> dict | None:
    """The torch.compile settings of a run's ``train`` section.

    ``compile`` is ``false``/``null`` (eager), ``true`` (composer's ``compile_config: {}``: ``torch.compile`` of the
    whole model's forward, after the distributed wrapping), ``blocks`` (each MPT transformer block compiled in place
    with ``nn.Module.compile`` before FSDP wraps it; embedding, final norm and loss stay eager:
    :func:`llmpipe.speedups.compile_blocks`), or a mapping of ``torch.compile`` keyword arguments with an optional
    ``scope: model | blocks`` (default ``model``), e.g. ``{scope: blocks, mode: max-autotune-no-cudagraphs}``; an
    empty mapping is ``true``. The arguments are checked here, at plan time, against ``torch.compile``'s signature
    (keys ``mode``, ``fullgraph``, ``dynamic``, ``backend``, ``options``, ``disable``; ``mode`` one of torch's four;
    ``mode`` and ``options`` not both).

    Returns:
        None when off, else ``{"scope": "model" | "blocks", "options": dict}`` (``options``: torch.compile kwargs).

    Raises:
        ConfigError: any other value, naming ``{where}.compile`` (or the offending key under it).
    """
    value = train.get("compile", False)
    if value is None or value is False:
        return None
    if value is True:
        return {"scope": "model", "options": {}}
    if isinstance(value, str) and value.strip().lower() in ("blocks", "model"):
        return {"scope": value.strip().lower(), "options": {}}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}.compile is {value!r}; it must be false, true (whole model through composer), "
                          f"'blocks' (each transformer block), or a mapping of torch.compile arguments with an "
                          f"optional scope: model | blocks.")
    options = dict(value)
    scope = options.pop("scope", None)
    scope = "model" if scope is None else str(scope).strip().lower()
    if scope not in ("model", "blocks"):
        raise ConfigError(f"{where}.compile.scope must be 'model' or 'blocks', got {value.get('scope')!r}.")
    unknown = sorted(set(options) - set(_COMPILE_KWARGS))
    if unknown:
        raise ConfigError(f"{where}.compile has unknown key(s) {', '.join(map(repr, unknown))}; torch.compile takes "
                          f"{', '.join(_COMPILE_KWARGS)} (plus our scope: model | blocks).")
    for key in ("fullgraph", "dynamic", "disable"):
        if key in options and options[key] is not None and not isinstance(options[key], bool):
            raise ConfigError(f"{where}.compile.{key} must be true, false or null, got {options[key]!r}.")
    if "mode" in options and options["mode"] is not None and options["mode"] not in _COMPILE_MODES:
        raise ConfigError(f"{where}.compile.mode is {options['mode']!r}; torch.compile's modes are "
                          f"{', '.join(_COMPILE_MODES)}.")
    if "backend" in options and not isinstance(options["backend"], str):
        raise ConfigError(f"{where}.compile.backend must be a backend name (e.g. inductor), got "
                          f"{options['backend']!r}.")
    if "options" in options and options["options"] is not None and not isinstance(options["options"], dict):
        raise ConfigError(f"{where}.compile.options must be a mapping of Inductor settings, got "
                          f"{options['options']!r}.")
    if options.get("mode") is not None and options.get("options") is not None:
        raise ConfigError(f"{where}.compile sets both mode and options; torch.compile takes one of them. Fix: drop "
                          f"one (mode names a preset of options).")
    return {"scope": scope, "options": options}


#: ``train.fused_loss.kernel`` values (``llmpipe.fused_loss.KERNELS`` is this tuple; see that module for each one).
FUSED_LOSS_KERNELS = ("torch", "softmax", "compile", "liger")
#: The kernel of ``fused_loss: true`` and of a mapping without ``kernel``.
FUSED_LOSS_DEFAULT_KERNEL = "liger"

#: ``torch.compile`` keyword arguments a ``train.compile`` mapping may set (torch 2.7's signature, less ``model``).
_COMPILE_KWARGS = ("mode", "fullgraph", "dynamic", "backend", "options", "disable")
#: ``torch.compile``'s modes (torch 2.7).
_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def fused_loss_settings(train: dict, where: str = "train") -> dict | None:
    """The fused linear + cross-entropy settings of a run's ``train`` section (:mod:`llmpipe.fused_loss`).

    ``fused_loss`` is ``false``/``null`` (off), ``true`` (on, default chunk and kernel), or a mapping with
    ``chunk_size`` (tokens per chunk, a positive integer or null for the default) and ``kernel`` (the per-chunk
    softmax/gradient, one of :data:`FUSED_LOSS_KERNELS`; default :data:`FUSED_LOSS_DEFAULT_KERNEL`; see
    :mod:`llmpipe.fused_loss`). ``train`` comes from :func:`run_config`, which already reads ``'True'``/``'null'``
    strings from ``snakemake --config`` as YAML; a ``chunk_size`` given as a digit string (``'4096'``) is read as
    that number.

    Returns:
        None when off, else ``{"chunk_size": int | None, "kernel": str}``.

    Raises:
        ConfigError: any other value, naming ``{where}.fused_loss``; the keys ``compile`` and ``softmax_grad`` of
            earlier versions name the ``kernel`` value that replaced them.
    """
    value = train.get("fused_loss", False)
    if value is None or value is False:
        return None
    if value is True:
        return {"chunk_size": None, "kernel": FUSED_LOSS_DEFAULT_KERNEL}
    if isinstance(value, str) and value in FUSED_LOSS_KERNELS:
        raise ConfigError(f"{where}.fused_loss is {value!r}; a kernel goes under the mapping. Fix: "
                          f"fused_loss: {{kernel: {value}}}.")
    if isinstance(value, dict):
        old = [k for k in ("softmax_grad", "compile") if k in value]
        if old:
            meant = {"softmax_grad": "softmax", "compile": "compile"}
            on = [k for k in old if _yaml_scalar(value[k]) not in (False, None)]
            fix = (f"remove {' and '.join(old)} and set kernel: {meant[on[0]]}" if on else
                   f"remove {' and '.join(old)} (kernel left out means {FUSED_LOSS_DEFAULT_KERNEL})")
            raise ConfigError(f"{where}.fused_loss.{old[0]} was replaced by {where}.fused_loss.kernel "
                              f"({' | '.join(FUSED_LOSS_KERNELS)}). Fix: {fix}.")
        refuse_unknown_keys(value, ("chunk_size", "kernel"), f"{where}.fused_loss", "fused_loss setting")
        chunk = value.get("chunk_size")
        if isinstance(chunk, str) and chunk.strip().isdigit():
            chunk = int(chunk)
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ConfigError(f"{where}.fused_loss.chunk_size must be a positive integer (tokens per chunk) or "
                              f"null (default: 8192, fewer if one chunk's fp32 logits would exceed 2 GiB), got {chunk!r}.")
        kernel = value.get("kernel")
        if kernel is None:
            kernel = FUSED_LOSS_DEFAULT_KERNEL
        if kernel not in FUSED_LOSS_KERNELS:
            raise ConfigError(f"{where}.fused_loss.kernel is {kernel!r}; it must be one of "
                              f"{', '.join(FUSED_LOSS_KERNELS)} (null: {FUSED_LOSS_DEFAULT_KERNEL}).")
        return {"chunk_size": chunk, "kernel": kernel}
    raise ConfigError(f"{where}.fused_loss is {value!r}; it must be true, false, or a mapping "
                      f"{{chunk_size: <tokens or null>, kernel: <{'|'.join(FUSED_LOSS_KERNELS)}>}}.")


def _yaml_scalar(value: Any) -> Any:
    """``'true'``/``'false'``/``'null'`` (any case; how ``snakemake --config`` passes nested values) as YAML
    reads them; anything else unchanged."""
    if isinstance(value, str):
        low = value.strip().lower()
        if low in ("true", "false"):
            return low == "true"
        if low in ("null", "none", "~", ""):
            return None
    return value


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
    eos = _yaml_scalar(t.get("eos_text"))  # `--config` hands a null over as the string 'null'
    if eos is not None and not isinstance(eos, str):
        raise ConfigError(f"{where}.eos_text is {eos!r}; it must be the tokenizer's end-of-text text, e.g. "
                          f"\"<|endoftext|>\".")
    if not eos:
        raise ConfigError(f"{where}.eos_text is empty ({t.get('eos_text')!r}): documents could not be separated "
                          f"when concatenating. "
                          f"Fix: set eos_text to the tokenizer's end-of-text token, e.g. \"<|endoftext|>\".")
    return t


def validate_data_prep(config: dict, concat: int, concat_where: str = "concat_tokens") -> dict:
    """Check ``data_prep`` for datasets of ``concat`` tokens per sample.

    Returns:
        The shard settings as the writers take them: ``{"compression": str | None, "size_limit": int | None}``
        (``size_limit`` None = one shard per unit).

    Raises:
        ConfigError: ``compression`` is not a value mosaicml-streaming accepts (exact spelling, e.g. ``zstd`` or
            ``zstd:7``), or ``size_limit`` is not an integer number of bytes in [0, 2**32) that holds one sample
            (0 = one shard per unit).
    """
    from llmpipe.data.mds_writer import MAX_SHARD_BYTES, STREAMING_COMPRESSIONS

    dp = config.get("data_prep") or {}
    comp = _yaml_scalar(dp.get("compression"))
    if comp not in STREAMING_COMPRESSIONS:
        raise ConfigError(f"data_prep.compression is {comp!r}, which mosaicml-streaming cannot read. Fix: use "
                          f"zstd (default), zstd:1 .. zstd:22, gz, gz:0 .. gz:9, bz2, br, snappy, or null.")
    raw = _yaml_scalar(dp.get("size_limit", 1 << 26))
    try:
        size_limit = int(raw or 0)
        if isinstance(raw, float) or isinstance(raw, bool):
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigError(f"data_prep.size_limit is {raw!r}; it must be a number of bytes (e.g. 67108864 for "
                          f"64 MiB), or 0 for one shard per unit.") from None
    if not 0 <= size_limit <= MAX_SHARD_BYTES:
        raise ConfigError(f"data_prep.size_limit ({size_limit}) must be in 0 .. {MAX_SHARD_BYTES} bytes (MDS shards "
                          f"store uint32 offsets). Fix: use 67108864 (64 MiB, the default).")
    if size_limit and size_limit < 4 * int(concat) + 1024:
        raise ConfigError(f"data_prep.size_limit ({size_limit} bytes per MDS shard) cannot hold one sample of "
                          f"{concat_where}={concat} int32 ids ({4 * int(concat)} bytes + headers). Fix: "
                          f"raise data_prep.size_limit (default 67108864) or set it to 0 (one shard per unit).")
    return {"compression": comp, "size_limit": size_limit or None}


#: The keys a step's resources may have (what llmpipe.dispatch and llmpipe.slurm read; ``slurm``: per-step Slurm
#: site settings, docs/slurm.md).
RESOURCE_KEYS = ("nodes", "gpus_per_node", "tasks_per_node", "cpus_per_task", "mem_gb", "time_min", "slurm")


def check_step_resource_steps(run_section: dict, where: str) -> None:
    """Raise ConfigError for a step name under a run's ``step_resources:`` that has no resources of its own
    (e.g. ``evals:``; its override would be ignored), naming the closest of :data:`STEP_RESOURCE_STEPS`; and check
    each override's keys (:func:`check_resource_keys`)."""
    steps = _yaml_scalar(run_section.get("step_resources"))
    if steps is None:
        return
    if not isinstance(steps, dict):
        raise ConfigError(f"{where}.step_resources is {steps!r}; it must map steps ({', '.join(STEP_RESOURCE_STEPS)}) "
                          f"to resources, e.g. step_resources: {{eval: {{gpus_per_node: 0}}}}.")
    refuse_unknown_keys(steps, STEP_RESOURCE_STEPS, f"{where}.step_resources", "step with its own resources",
                        " (Training's resources are the run's own `resources:`.)")
    for step, over in steps.items():
        over = _yaml_scalar(over)
        if over is not None and not isinstance(over, dict):
            raise ConfigError(f"{where}.step_resources.{step} is {over!r}; it must be a mapping of resources, "
                              f"e.g. {{gpus_per_node: 0, cpus_per_task: 2}}.")
        check_resource_keys(over or {}, f"{where}.step_resources.{step}")


def check_resource_keys(res: dict, where: str) -> None:
    """Raise ConfigError for a resources key that nothing reads (a typo such as ``gpus_per_nodes: 8`` would be
    ignored and the job would get the default, e.g. no GPU), naming the key, the closest known one and where Slurm
    site settings go instead; and for an unknown key of its per-step Slurm settings (``slurm:``)."""
    if not isinstance(res, dict):
        raise ConfigError(f"{where} is {res!r}; it must be a mapping, e.g. {{nodes: 1, gpus_per_node: 8}}.")
    refuse_unknown_keys(res, RESOURCE_KEYS, where, "resource setting",
                        f" Slurm site settings (partition, account, qos, constraint, ...) go under slurm:, for all "
                        f"steps or for this step alone as {where}.slurm (docs/slurm.md).")
    if isinstance(res.get("slurm"), dict):
        check_slurm_keys(res["slurm"], f"{where}.slurm")


def step_resources(config: dict, step: str, run: str | None = None) -> dict:
    """Resources of one step: ``nodes, gpus_per_node, tasks_per_node, cpus_per_task, mem_gb, time_min``.

    Training uses ``models.<run>.resources``; other steps use their own section (``convert.resources`` ...)
    overlaid with ``models.<run>.step_resources.<step>`` when given. A finetune's training (step ``train``)
    uses ``finetunes.<run>.resources`` over ``finetune_defaults.resources``, and its other steps
    ``finetunes.<run>.step_resources.<step>``.

    Raises:
        ConfigError: a key outside :data:`RESOURCE_KEYS` (:func:`check_resource_keys`), naming where it is.
    """
    sect = None if run is None else f"{'finetunes' if is_finetune(config, run) else 'models'}.{run}"
    if step == "train":
        res = dict(run_config(config, run)["resources"])
        check_resource_keys(res, f"{sect}.resources")
    elif step == "data":
        res = dict(config.get("data_resources", {}))
        check_resource_keys(res, "data_resources")
    else:
        res = dict(config[step].get("resources", {}))
        check_resource_keys(res, f"{step}.resources")
        if run is not None:
            steps = _yaml_scalar(_run_section(config, run).get("step_resources")) or {}
            over = _yaml_scalar(steps.get(step)) if isinstance(steps, dict) else None
            check_resource_keys(over or {}, f"{sect}.step_resources.{step}")
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


# ------------------------------------------------------------------------------------------------ finetuning
# A finetune (``finetunes.<run>``, over ``finetune_defaults``) starts from a base model, either one of our own
# runs (``base: {run: mpt-tiny}``: its Hugging Face export results/mpt-tiny/hf) or hub weights
# (``base: {hub: mosaicml/mpt-7b}``), and trains on an instruction set (``instruction_sets.<name>``: prompt and
# response columns) with llm-foundry's finetuning dataloader. Its results live in results/<run>/ like a
# pretraining run's, and run_config() gives it the same keys (data, arch, train, resources), so the shared
# steps (convert, generate, train.json's summary with MFU) work unchanged.

#: Keys under a finetune's ``data:`` that only change speed (padding trimmed per batch); never identity.
SPEED_ONLY_FINETUNE_DATA_KEYS = frozenset({"allow_pad_trimming"})

#: Sources of an instruction set: written by the project, read from the hub, or a local folder in the hub's layout.
INSTRUCTION_SOURCES = ("builtin", "hub", "local")


def is_finetune(config: dict, run: str) -> bool:
    """True when ``run`` is a finetune (a key of ``finetunes:``), False for a pretraining run."""
    return run in (config.get("finetunes") or {})


def _run_section(config: dict, run: str) -> dict:
    """The run's own config section: ``models[run]``, or ``finetune_defaults`` overlaid with ``finetunes[run]``."""
    if is_finetune(config, run):
        return deep_merge(config.get("finetune_defaults") or {}, config["finetunes"][run] or {})
    return (config.get("models", {}) or {}).get(run, {}) or {}


def finetune_run_config(config: dict, run: str) -> dict:
    """The fully merged settings of one finetune, in the shape of :func:`run_config`.

    ``train`` and ``resources`` are ``model_defaults`` overlaid with ``finetune_defaults`` and ``finetunes[run]``.
    ``arch`` is the base run's architecture (``base: {run: ...}``) or, for hub weights, ``model_defaults.arch``
    overlaid with the finetune's ``arch`` (it must describe the hub model: it is used for MFU and checks only;
    the weights and their config come from the hub). ``data`` holds the finetune's data settings plus, for the
    shared steps, ``tokenizer`` (default: the base run's), ``corpus`` (the corpus of the ICL tasks: ``icl_corpus``,
    default the base run's corpus) and ``concat_tokens`` (= ``max_seq_len``, the sequence length used for MFU).

    Raises:
        ConfigError: the base names an unknown run, or names both or neither of ``run`` and ``hub``.
    """
    ft = _run_section(config, run)
    where = f"finetunes.{run}"
    md = config.get("model_defaults", {}) or {}
    base = {k: v for k, v in (ft.get("base") or {}).items() if v is not None}
    if bool(base.get("run")) == bool(base.get("hub")):
        raise ConfigError(f"{where}.base must name exactly one of `run` (one of our models, e.g. "
                          f"{{run: mpt-tiny}}) or `hub` (a hub repo id, e.g. {{hub: mosaicml/mpt-7b}}); got {base}. "
                          f"Fix: set one of them.")
    data = dict(ft.get("data") or {})
    if base.get("run"):
        models = config.get("models", {}) or {}
        if base["run"] not in models:
            raise ConfigError(f"{where}.base.run is {base['run']!r}, which is not a model under `models:` "
                              f"(known: {', '.join(sorted(models))}). Fix: name a pretraining run, or use "
                              f"base: {{hub: <repo id>}}.")
        brc = run_config(config, base["run"])
        arch = copy.deepcopy(brc["arch"])
        data["tokenizer"] = data.get("tokenizer") or brc["data"]["tokenizer"]
        data["icl_corpus"] = data.get("icl_corpus") or brc["data"]["corpus"]
    else:
        arch = deep_merge(md.get("arch", {}), ft.get("arch"))
        data["icl_corpus"] = data.get("icl_corpus") or (md.get("data") or {}).get("corpus")
    data["corpus"] = data["icl_corpus"]
    data["concat_tokens"] = int(data.get("max_seq_len") or arch.get("max_seq_len", 2048))
    return {
        "name": run,
        "kind": "finetune",
        "base": base,
        "data": data,
        "arch": arch,
        "train": _yaml_scalars(deep_merge(md.get("train", {}), ft.get("train"))),
        "resources": _yaml_scalars(deep_merge(md.get("resources", {}), ft.get("resources"))),
        "lora": _yaml_scalars(ft.get("lora")) or None,
        "node_counts": [int(n) for n in (ft.get("node_counts") or [])],
        "step_resources": ft.get("step_resources") or {},
    }


def validate_instruction_set(config: dict, name: str) -> dict:
    """Check an instruction set (``instruction_sets.<name>``); return it. Raises ConfigError naming the fix."""
    sets = config.get("instruction_sets") or {}
    if name not in sets:
        raise ConfigError(f"instruction set {name!r} is not defined under `instruction_sets:` (known: "
                          f"{', '.join(sorted(sets))}). Fix: add it or pick a known one.")
    s = sets[name] or {}
    where = f"instruction_sets.{name}"
    src = s.get("source")
    if src not in INSTRUCTION_SOURCES:
        raise ConfigError(f"{where}.source is {src!r}; it must be one of {', '.join(INSTRUCTION_SOURCES)}.")
    if src == "hub" and not s.get("hf_name"):
        raise ConfigError(f"{where}.hf_name is not set but source is hub. Fix: a hub dataset id such as "
                          f"mosaicml/dolly_hhrlhf.")
    if src == "local":
        d = s.get("local_dir")
        if not d or not os.path.isdir(d):
            raise ConfigError(f"{where}.local_dir ({d!r}) is not a folder but source is local. Fix: point it at a "
                              f"copy of the dataset in the hub's layout (e.g. data/train-00000-of-00001.parquet), "
                              f"or use source: hub.")
    if src in ("hub", "local"):
        cols = s.get("columns") or {}
        if not cols.get("prompt") or not cols.get("response"):
            raise ConfigError(f"{where}.columns must name the dataset's prompt and response columns, e.g. "
                              f"{{prompt: prompt, response: response}}; got {cols!r}.")
    return s


def validate_finetune(config: dict, run: str) -> dict:
    """Check one finetune's settings before anything is scheduled; return the merged run config.

    Checks: the name is free, the base (one of our runs, or a hub id), the instruction set, the tokenizer and the
    ICL corpus exist; ``max_seq_len`` fits the base; the architecture is known (for MFU); the LoRA settings; and
    that ``global_batch_size`` divides by the number of devices and the microbatch at the configured node count
    **and at every node count in** ``node_counts`` (a scaling study runs the same finetune at each of them).

    Raises:
        ConfigError: naming the first wrong setting and how to fix it.
    """
    where = f"finetunes.{run}"
    check_run_sections(config, run)
    if run in (config.get("models") or {}):
        raise ConfigError(f"{run!r} is both a model under `models:` and a finetune under `finetunes:`; "
                          f"results/{run}/ can hold only one. Fix: rename the finetune.")
    rc = finetune_run_config(config, run)
    data, arch, train, res = rc["data"], rc["arch"], rc["train"], rc["resources"]
    validate_instruction_set(config, data.get("instructions"))
    tok = data.get("tokenizer")
    tokenizers = config.get("tokenizers", {})
    if tok not in tokenizers:
        raise ConfigError(f"{where}.data.tokenizer is {tok!r}, which is not defined under `tokenizers:` (known: "
                          f"{', '.join(sorted(tokenizers))}). Fix: name the base model's tokenizer (hub MPT models "
                          f"use gpt-neox-20b).")
    validate_tokenizer(config, tok)
    corpus = data["icl_corpus"]
    if corpus not in config.get("corpora", {}):
        raise ConfigError(f"{where}.data.icl_corpus is {corpus!r}, which is not defined under `corpora:`. "
                          f"Fix: name the corpus the ICL tasks are built from.")
    validate_corpus(config, corpus)
    for key in ("d_model", "n_heads", "n_layers", "vocab_size", "max_seq_len"):
        if key not in arch:
            raise ConfigError(f"{where}.arch.{key} is missing: for hub weights, arch must describe the hub model "
                              f"(used for MFU). Fix: copy it from the model's config.json.")
    seq = int(data["concat_tokens"])
    if seq > int(arch["max_seq_len"]):
        raise ConfigError(f"{where}.data.max_seq_len ({seq}) is larger than the base model's max_seq_len "
                          f"({arch['max_seq_len']}). Fix: lower max_seq_len.")
    pr = data.get("packing_ratio")
    if pr is not None and pr != "auto" and (not isinstance(pr, (int, float)) or float(pr) < 1):
        raise ConfigError(f"{where}.data.packing_ratio is {pr!r}; it must be null, 'auto' or a number >= 1.")
    rev = rc["base"].get("revision")
    if rc["base"].get("hub") and rev not in (None, "main"):
        raise ConfigError(f"{where}.base.revision is {rev!r}, but llm-foundry's hf_causal_lm loads a hub model's main "
                          f"revision only. Fix: download that revision (huggingface-cli download --revision ...) and "
                          f"set base.hub to the local folder, or use revision: main.")
    lora = rc["lora"]
    if lora is not None:
        if not isinstance(lora, dict) or int(lora.get("r", 0)) <= 0 or not lora.get("target_modules"):
            raise ConfigError(f"{where}.lora must be null or {{r: 8, alpha: 16, dropout: 0.05, target_modules: "
                              f"[Wqkv]}} with r > 0 and at least one target module; got {lora!r}.")
    if int(train["max_duration_batches"]) <= 0:
        raise ConfigError(f"{where}.train.max_duration_batches must be positive.")
    gbs = int(train["global_batch_size"])
    mb = int(train["microbatch_size"])
    if mb <= 0:
        raise ConfigError(f"{where}.train.microbatch_size must be positive, got {mb}.")
    per_node = world_size(dict(res, nodes=1))
    counts = sorted({int(res.get("nodes", 1))} | set(rc["node_counts"]))
    for nodes in counts:
        ws = nodes * per_node
        kind = "GPUs" if int(res.get("gpus_per_node", 0) or 0) > 0 else "tasks"
        if gbs % ws:
            raise ConfigError(
                f"{where}.train.global_batch_size ({gbs}) is not divisible by the number of {kind} at {nodes} "
                f"node(s) ({ws} = {nodes} x {per_node} per node); global_train_batch_size must split evenly over "
                f"the devices at every node count of this finetune ({', '.join(map(str, counts))}). Fix: make "
                f"global_batch_size a multiple of {_lcm([n * per_node for n in counts])}, or change "
                f"{where}.resources.nodes / node_counts.")
        per_device = gbs // ws
        if per_device % mb and mb < per_device:
            raise ConfigError(f"{where}.train.microbatch_size ({mb}) does not divide the per-device batch at "
                              f"{nodes} node(s) ({per_device} = {gbs} / {ws}). Fix: pick a divisor of {per_device}.")
    compile_settings(train, f"{where}.train")
    check_attn_impl(train, f"{where}.train")
    return rc


def _lcm(values: list[int]) -> int:
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out
