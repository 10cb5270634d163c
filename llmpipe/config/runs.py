"""Experiment configuration: a run's merged settings, its resources, and the checks across settings.

This module is imported by the Snakefile on the login node, so it must stay light: no torch, no
transformers, no llm-foundry. Everything here works on plain dicts: the workflow config after
:func:`llmpipe.config.schema.prepare` (keys and types checked against ``schemas/config.schema.yaml``) and Snakemake's
``validate`` (the settings' defaults filled in). The checks here are those across settings (batch divisibility,
sequence lengths, vocabulary sizes, named corpora and tokenizers).

Vocabulary used throughout the project:

* **corpus** – a set of ``json.gz`` files in C4's layout (``corpora:`` in the config).
* **dataset** – a corpus tokenized with one tokenizer and concatenated to ``concat_tokens``; stored under
  ``results/data/{corpus}/{tokenizer}/concat{concat_tokens}/`` so that every model with the same data shares it.
* **run** – one training run; its outputs live in ``results/{run}/``. A pretraining run is named after its
  model (``mpt-1b``).
* **identity** – the settings that determine what a step produces, plus the step's version (built by each step
  module of :mod:`llmpipe.steps`, made text by :mod:`llmpipe.config.identity`). Snakemake stores a step's ``params`` and
  reruns the step when they change; settings marked ``x-speed-only`` in the schema never are part of it.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Iterable

from llmpipe.config.schema import check_named_arguments, closest, deep_merge, node_at, speed_only_keys
from llmpipe.config.settings import (
    FUSED_LOSS_DEFAULT_KERNEL,
    FUSED_LOSS_KERNELS,
    ConfigError,
    Resources,
    RunSettings,
    written_at,
)
from llmpipe.train.fp8 import check_fp8, fp8_settings
from llmpipe.train.lora import check_lora

#: Keys under a model's ``train:`` that only change speed or placement (``x-speed-only`` in the schema's ``train``);
#: they are never part of identity.
SPEED_ONLY_TRAIN_KEYS = speed_only_keys("train")

#: Names that cannot be run names because they are folders of their own under results/.
RESERVED_RUN_NAMES = frozenset({"data", "tokenizers", "report", "scaling", "bench", "logs", "tracking"})


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
    merged = deep_merge(config.get("model_defaults", {}), models[run] or {})
    merged["name"] = run
    return merged


def world_size(resources: dict) -> int:
    """Number of training processes (ranks) for a step's resources.

    One task per GPU on GPU nodes (``gpus_per_node``); on CPU-only nodes ``tasks_per_node`` (default 1).
    """
    return Resources.from_dict(resources).devices()


def validate_run(config: dict, run: str, node_counts: Iterable[int] = (), counts_where: str | None = None) -> dict:
    """Check one run's settings before anything is scheduled; return the merged run config (:func:`run_config`).

    Checks: the name is free, the model exists, its sections and keys, its corpus and tokenizer, the shard format
    for its sample length, the per-value train settings (``fused_loss``, ``compile``, ``attn_impl``, ``fp8``: :func:`llmpipe.train.fp8.check_fp8`), and the
    cross-field checks of :meth:`llmpipe.config.settings.RunSettings.check` (the batch at every node count: the run's
    own, a finetune's ``node_counts`` and ``node_counts`` given here, e.g. a scaling study's, named by
    ``counts_where`` in the fix). A finetune goes to :func:`validate_finetune`. :func:`run_settings` gives the
    typed settings instead.

    Raises:
        ConfigError: naming the first wrong setting and how to fix it.
    """
    return _validated(config, run, node_counts, counts_where)[0]


def run_settings(config: dict, run: str, node_counts: Iterable[int] = (), counts_where: str | None = None
                 ) -> RunSettings:
    """The typed settings of one run (:class:`llmpipe.config.settings.RunSettings`), checked as :func:`validate_run`
    checks them (same arguments).

    Raises:
        ConfigError: naming the first wrong setting and how to fix it.
    """
    return _validated(config, run, node_counts, counts_where)[1]


def _validated(config: dict, run: str, node_counts: Iterable[int], counts_where: str | None
               ) -> tuple[dict, RunSettings]:
    """:func:`validate_run`'s checks; returns the merged run config and its typed settings."""
    if run in RESERVED_RUN_NAMES:
        raise ConfigError(f"{run!r} cannot be a run name: results/{run}/ is used by the workflow itself. "
                          f"Fix: rename the model.")
    if is_finetune(config, run):
        return _validated_finetune(config, run, node_counts, counts_where)
    where = f"models.{run}"
    rc = run_config(config, run)
    data, train = rc["data"], rc["train"]

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
    rs = RunSettings.from_run_config(rc, tokenizer=tcfg, written_at=functools.partial(written_at, config, run),
                                     parsed=_parsed_train(train, f"{where}.train")).check(node_counts, counts_where)
    validate_data_prep(config, rs.data.concat_tokens, f"{where}.data.concat_tokens")
    check_named_arguments(train, functools.partial(written_at, config, run))
    check_fp8(train, f"{where}.train", rs.resources.gpus_per_node, rs.resources.at("gpus_per_node"))
    return rc, rs


def _parsed_train(train: dict, where: str) -> dict:
    """The ``train`` values :class:`llmpipe.config.settings.TrainSettings` takes parsed (``compile``, ``fused_loss``,
    ``fp8``: each one's settings function, which raises its ConfigError) or filled (``loss_fn``: the schema's
    ``x-default`` when not written)."""
    loss_fn = train["loss_fn"] if "loss_fn" in train else node_at("#/$defs/train")["properties"]["loss_fn"][
        "x-default"]
    return {"compile": compile_settings(train, where), "fused_loss": fused_loss_settings(train, where),
            "fp8": fp8_settings(train, where), "loss_fn": loss_fn}


def compile_settings(train: dict, where: str = "train") -> dict | None:
    """The torch.compile settings of a run's ``train`` section.

    ``compile`` is ``false``/``null`` (eager), ``true`` (composer's ``compile_config: {}``: ``torch.compile`` of the
    whole model's forward, after the distributed wrapping), ``blocks`` (each MPT transformer block compiled in place
    with ``nn.Module.compile`` before FSDP wraps it; embedding, final norm and loss stay eager:
    :func:`llmpipe.train.speedups.compile_blocks`), or a mapping of ``torch.compile`` keyword arguments with an optional
    ``scope: model | blocks`` (default ``model``), e.g. ``{scope: blocks, mode: max-autotune-no-cudagraphs}``; an
    empty mapping is ``true``. The arguments are checked here, at plan time, against ``torch.compile``'s signature
    (keys ``mode``, ``fullgraph``, ``dynamic``, ``backend``, ``options``, ``disable``; ``mode`` one of torch's four;
    ``mode`` and ``options`` not both).

    Returns:
        None when off, else ``{"scope": "model" | "blocks", "options": dict}`` (``options``: torch.compile kwargs).

    Raises:
        ConfigError: any other value, naming ``{where}.compile`` (or the offending key under it).
    """
    value = train.get("compile")  # not written: eager
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


#: ``torch.compile`` keyword arguments a ``train.compile`` mapping may set (torch 2.7's signature, less ``model``).
_COMPILE_KWARGS = ("mode", "fullgraph", "dynamic", "backend", "options", "disable")
#: ``torch.compile``'s modes (torch 2.7).
_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def fused_loss_settings(train: dict, where: str = "train") -> dict | None:
    """The fused linear + cross-entropy settings of a run's ``train`` section (:mod:`llmpipe.model.fused_loss`).

    ``fused_loss`` is ``false``/``null`` (off), ``true`` (on, default chunk and kernel), or a mapping with
    ``chunk_size`` (tokens per chunk, a positive integer or null for the default) and ``kernel`` (the per-chunk
    softmax/gradient, one of :data:`FUSED_LOSS_KERNELS`; default :data:`FUSED_LOSS_DEFAULT_KERNEL`; see
    :mod:`llmpipe.model.fused_loss`). Values given with ``snakemake --config`` arrive typed (:func:`llmpipe.config.schema.coerce`).

    Returns:
        None when off, else ``{"chunk_size": int | None, "kernel": str}``.

    Raises:
        ConfigError: any other value, naming ``{where}.fused_loss``; the keys ``compile`` and ``softmax_grad`` of
            earlier versions name the ``kernel`` value that replaced them.
    """
    value = train.get("fused_loss")  # not written: off
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
            on = [k for k in old if value[k] not in (False, None)]
            fix = (f"remove {' and '.join(old)} and set kernel: {meant[on[0]]}" if on else
                   f"remove {' and '.join(old)} (kernel left out means {FUSED_LOSS_DEFAULT_KERNEL})")
            raise ConfigError(f"{where}.fused_loss.{old[0]} was replaced by {where}.fused_loss.kernel "
                              f"({' | '.join(FUSED_LOSS_KERNELS)}). Fix: {fix}.")
        unknown = sorted(set(value) - {"chunk_size", "kernel"})
        if unknown:
            raise ConfigError(f"{where}.fused_loss.{unknown[0]} is not a fused_loss setting; it takes chunk_size and "
                              f"kernel. Fix: remove it.")
        chunk = value.get("chunk_size")
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
        from llmpipe.data.corpus import c4_filename

        for split, key in (("train", "train_files"), ("validation", "val_files")):
            want = [os.path.join(os.path.expanduser(d), c4_filename(c.get("subset", "en"), split, i))
                    for i in range(int(c.get(key) or 0))]
            missing = [p for p in want if not os.path.isfile(p)]
            if missing:
                raise ConfigError(f"{where}.local_dir lacks {len(missing)} of the {len(want)} {split} files "
                                  f"{where}.{key} asks for, e.g. {missing[0]}. Fix: copy them into the mirror, or "
                                  f"lower {where}.{key} to what it has.")
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
    elif src == "local" and not os.path.isdir(os.path.expanduser(t["name"])):
        raise ConfigError(f"{where}.name: {os.path.abspath(os.path.expanduser(t['name']))} is not a folder but "
                          f"source is local. Fix: point it at a folder with tokenizer.json / tokenizer_config.json "
                          f"(written by save_pretrained), or use source: hub with a repo id.")
    eos = t.get("eos_text")
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
    comp = dp.get("compression")
    if comp not in STREAMING_COMPRESSIONS:
        raise ConfigError(f"data_prep.compression is {comp!r}, which mosaicml-streaming cannot read. Fix: use "
                          f"zstd (default), zstd:1 .. zstd:22, gz, gz:0 .. gz:9, bz2, br, snappy, or null.")
    raw = dp.get("size_limit", 1 << 26)
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




def step_resources(config: dict, step: str, run: str | None = None) -> dict:
    """Resources of one step: ``nodes, gpus_per_node, tasks_per_node, cpus_per_task, mem_gb, time_min``.

    Training uses ``models.<run>.resources``; other steps use their own section (``convert.resources`` ...)
    overlaid with ``models.<run>.step_resources.<step>`` when given. A finetune's training (step ``train``)
    uses ``finetunes.<run>.resources`` over ``finetune_defaults.resources``, and its other steps
    ``finetunes.<run>.step_resources.<step>``. Every value but ``tasks_per_node`` is read as the validated config
    has it (each section's defaults are the schema's); ``tasks_per_node`` is one per GPU on GPU nodes, else the
    value written (1 when none is).

    Raises:
        KeyError: ``step`` has no resources of its own, or a config not checked by :func:`llmpipe.config.schema.check`
            (a section without its schema defaults).
    """
    if step == "train":
        res = dict(run_config(config, run)["resources"])
    elif step == "data":
        res = dict(config.get("data_resources", {}))
    else:
        res = dict(config[step].get("resources", {}))
        if run is not None:
            res.update((_run_section(config, run).get("step_resources") or {}).get(step) or {})
    missing = [k for k in ("nodes", "gpus_per_node", "cpus_per_task", "mem_gb", "time_min") if k not in res]
    if missing:
        raise KeyError(f"the resources of step {step} have no {', '.join(missing)}: the config was not validated "
                       f"(llmpipe.config.schema.check fills each section's defaults)")
    if step == "convert" and run is not None and not float(res["mem_gb"] or 0):
        res["mem_gb"] = convert_mem_gb(config, run)
    placed = inference_plan(config, step, run) if step in ("eval", "generate") and run is not None else None
    if placed is not None:  # llmpipe.plan.inference_placement: one GPU, or the node's GPUs for a model too large for one
        res["gpus_per_node"] = placed["gpus"]
    res["tasks_per_node"] = int(res["gpus_per_node"]) if int(res["gpus_per_node"]) > 0 else int(
        res.get("tasks_per_node", 1) or 1)
    if placed is not None and step == "generate":
        res["tasks_per_node"] = 1  # one process places the model across the job's GPUs (device_map)
    return res


def convert_mem_gb(config: dict, run: str) -> int:
    """The host memory a ``convert`` job asks for when its ``mem_gb`` is 0: the plan's peak
    (:func:`llmpipe.plan.memory_time.convert_memory`) plus 10%, in whole GB; 0 (Slurm decides) for a run without ``arch`` or
    without the plan's constants."""
    from llmpipe.plan import memory_time as plan
    rc = run_config(config, run)
    overheads = plan.job_overheads()
    if "d_model" not in (rc.get("arch") or {}) or not overheads:
        return 0
    return int(-(-plan.convert_memory(rc, overheads)["total_gb"] * 1.1 // 1))


def inference_plan(config: dict, step: str, run: str) -> dict | None:
    """The GPUs of the ``eval`` or ``generate`` job of ``run`` and its per-GPU memory plan there
    (:func:`llmpipe.plan.inference_placement.plan_gpus`): the run's ``step_resources.<step>.gpus_per_node`` when set, else
    the step section's GPUs for a model that fits one GPU of ``gpu_type``, else the GPUs of one node of the run
    (``resources.gpus_per_node``).

    Returns None for a step on CPU (``gpus_per_node: 0``), without ``gpu_type`` or a card to plan for
    (:func:`gpu_card`), or for a model without ``arch`` (a hub base): those keep their configured resources.
    """
    section = dict(config[step].get("resources", {}))
    override = (_run_section(config, run).get("step_resources") or {}).get(step) or {}
    gpus = int((override["gpus_per_node"] if "gpus_per_node" in override else section["gpus_per_node"]) or 0)
    if gpus <= 0 or not config.get("gpu_type") or gpu_type(config) is None:
        return None
    rc = run_config(config, run)
    if "d_model" not in (rc.get("arch") or {}):
        return None
    node = int(rc["resources"]["gpus_per_node"] or 0)
    if override.get("gpus_per_node") is not None and node and int(override["gpus_per_node"]) > node:
        where = section_path(config, run)
        raise ConfigError(f"{where}.step_resources.{step}.gpus_per_node is {override['gpus_per_node']}, more than "
                          f"the {node} GPUs of one node of {run} ({where}.resources.gpus_per_node): inference runs "
                          f"on one node. Fix: at most {node}.")
    from llmpipe.plan import inference_placement
    return inference_placement.plan_gpus(
        rc, step, capacity_gb=gpu_memory(config),
        section_gpus=int(section["gpus_per_node"] or 0), node_gpus=node, requested=override.get("gpus_per_node"),
        batch_size=int(config["eval"]["batch_size"]) if step == "eval" else 1,
        shared_prefix=step == "eval" and config["eval"]["icl_batches"] == "shared_prefix")


def gpu_card(config: dict):
    """The card the plans are for (:class:`llmpipe.plan.card.Card`): the config's ``gpu_type``, or with ``auto`` the
    GPU this machine's nvidia-smi reports (:func:`llmpipe.plan.card.config_card`); its ``gpu_type`` is None where
    there is none.

    Raises:
        ConfigError: an unknown configured ``gpu_type`` (naming the known ones), or ``auto`` on the Slurm executor.
    """
    from llmpipe.plan import card
    return card.config_card(config)


def gpu_type(config: dict) -> str | None:
    """The GPU type the plans are for: :func:`gpu_card`'s key (``auto`` resolved), None without a GPU."""
    return gpu_card(config).gpu_type


def gpu_memory(config: dict) -> float | None:
    """One GPU's memory in GiB for :func:`gpu_card` (the config's ``gpu_memory_gb`` first, then
    :data:`llmpipe.plan.memory_time.GPU_MEMORY_GB`; nvidia-smi's figure for a detected card neither knows), None
    without a GPU.

    Raises:
        ConfigError: as :func:`gpu_card`.
    """
    return gpu_card(config).memory_gb


def tokens_per_run(config: dict, run: str) -> int:
    """Training tokens of a run = max_duration_batches x global_batch_size x concat_tokens."""
    rc = run_config(config, run)
    return int(rc["train"]["max_duration_batches"]) * int(rc["train"]["global_batch_size"]) * int(
        rc["data"]["concat_tokens"])


# ------------------------------------------------------------------------------------------------ finetuning
# A finetune (``finetunes.<run>``, over ``finetune_defaults``) starts from a base model, either one of our own
# runs (``base: {run: mpt-tiny}``: its Hugging Face export results/mpt-tiny/hf) or hub weights
# (``base: {hub: mosaicml/mpt-7b}``), and trains on an instruction set (``instruction_sets.<name>``: prompt and
# response columns) with llm-foundry's finetuning dataloader. Its results live in results/<run>/ like a
# pretraining run's, and run_config() gives it the same keys (data, arch, train, resources), so the shared
# steps (convert, generate, train.json's summary with MFU) work unchanged.

#: Keys under a finetune's ``data:`` that only change speed (``x-speed-only`` in the schema's ``finetune_data``, e.g.
#: padding trimmed per batch); never identity.
SPEED_ONLY_FINETUNE_DATA_KEYS = speed_only_keys("finetune_data")

#: Sources of an instruction set: written by the project, read from the hub, or a local folder in the hub's layout.
INSTRUCTION_SOURCES = ("builtin", "hub", "local")


def is_finetune(config: dict, run: str) -> bool:
    """True when ``run`` is a finetune (a key of ``finetunes:``), False for a pretraining run."""
    return run in (config.get("finetunes") or {})


def section_path(config: dict, run: str) -> str:
    """The config section a run is written in: ``finetunes.<run>`` or ``models.<run>`` (for error messages)."""
    return f"{'finetunes' if is_finetune(config, run) else 'models'}.{run}"


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
    ``generate`` is the finetune's own generation settings (``finetune_defaults`` overlaid with ``finetunes[run]``;
    :func:`llmpipe.steps.generate.generate_settings` puts them over the ``generate:`` section).

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
    seq = data.get("max_seq_len") or arch.get("max_seq_len")  # None: a hub base without arch, refused by the checks
    data["concat_tokens"] = None if seq is None else int(seq)
    return {
        "name": run,
        "kind": "finetune",
        "base": base,
        "data": data,
        "arch": arch,
        "train": deep_merge(md.get("train", {}), ft.get("train")),
        "resources": deep_merge(md.get("resources", {}), ft.get("resources")),
        "lora": ft.get("lora") or None,
        "node_counts": [int(n) for n in (ft.get("node_counts") or [])],
        "step_resources": ft.get("step_resources") or {},
        "generate": ft.get("generate") or {},
    }


def validate_instruction_set(config: dict, name: str, used_at: str | None = None) -> dict:
    """Check an instruction set (``instruction_sets.<name>``); return it. ``used_at``: the setting that names it
    (``finetunes.<run>.data.instructions``), named when the set is unknown, with the closest known name.

    Raises:
        ConfigError: naming the setting and the fix.
    """
    sets = config.get("instruction_sets") or {}
    if name is None and used_at:
        raise ConfigError(f"{used_at} is not set. Fix: set it to an instruction set ({', '.join(sorted(sets))}).")
    if name not in sets:
        close = closest(str(name), sets) if name is not None else None
        what = f"{used_at} is {name!r}, which" if used_at else f"instruction set {name!r}"
        meant, fix = (f"did you mean {close}? ", f"set it to {close}") if close else ("", "pick a known one")
        raise ConfigError(f"{what} is not defined under `instruction_sets:`; {meant}Known: {', '.join(sorted(sets))}. "
                          f"Fix: {fix} or add it to `instruction_sets:`.")
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


def validate_finetune(config: dict, run: str, node_counts: Iterable[int] = (), counts_where: str | None = None
                      ) -> dict:
    """Check one finetune's settings before anything is scheduled; return the merged run config.

    Checks: the name is free, the base (one of our runs, or a hub id), the instruction set, the tokenizer and the
    ICL corpus exist; then the typed settings (:class:`llmpipe.config.settings.RunSettings`: ``max_seq_len`` fits the
    base, the architecture is known (for MFU), the LoRA settings, and ``global_batch_size`` divides by the number
    of devices and the microbatch at the configured node count **and at every node count in** ``node_counts``
    (a scaling study runs the same finetune at each of them) and in the ``node_counts`` argument.

    Raises:
        ConfigError: naming the first wrong setting and how to fix it.
    """
    return _validated_finetune(config, run, node_counts, counts_where)[0]


def _validated_finetune(config: dict, run: str, node_counts: Iterable[int], counts_where: str | None
                        ) -> tuple[dict, RunSettings]:
    """:func:`validate_finetune`'s checks; returns the merged run config and its typed settings."""
    where = f"finetunes.{run}"
    if run in (config.get("models") or {}):
        raise ConfigError(f"{run!r} is both a model under `models:` and a finetune under `finetunes:`; "
                          f"results/{run}/ can hold only one. Fix: rename the finetune.")
    rc = finetune_run_config(config, run)
    data, train = rc["data"], rc["train"]
    hub = (rc.get("base") or {}).get("hub")
    if isinstance(hub, str) and hub.startswith(("/", "./", "../", "~")) and not os.path.isdir(os.path.expanduser(hub)):
        raise ConfigError(f"{written_at(config, run, 'base.hub')} is the folder {hub}, which does not exist. Fix: "
                          f"point it at a folder holding a Hugging Face model (config.json, weights), or give a hub "
                          f"repo id (e.g. mosaicml/mpt-7b).")
    validate_instruction_set(config, data.get("instructions"), written_at(config, run, "data.instructions"))
    tok = data.get("tokenizer")
    tokenizers = config.get("tokenizers", {})
    if tok not in tokenizers:
        raise ConfigError(f"{where}.data.tokenizer is {tok!r}, which is not defined under `tokenizers:` (known: "
                          f"{', '.join(sorted(tokenizers))}). Fix: name the base model's tokenizer (hub MPT models "
                          f"use gpt-neox-20b).")
    tcfg = validate_tokenizer(config, tok)
    corpus = data["icl_corpus"]
    if corpus not in config.get("corpora", {}):
        raise ConfigError(f"{where}.data.icl_corpus is {corpus!r}, which is not defined under `corpora:`. "
                          f"Fix: name the corpus the ICL tasks are built from.")
    validate_corpus(config, corpus)
    rs = RunSettings.from_run_config(rc, tokenizer=tcfg, written_at=functools.partial(written_at, config, run),
                                     parsed=_parsed_train(train, f"{where}.train")).check(node_counts, counts_where)
    check_named_arguments(train, functools.partial(written_at, config, run))
    check_fp8(train, f"{where}.train", rs.resources.gpus_per_node, rs.resources.at("gpus_per_node"))
    check_lora(rc.get("lora"), rc["arch"], written_at(config, run, "lora"))  # target modules exist in the model
    return rc, rs
