"""Typed settings of one run (pretraining or finetune) and their cross-field checks.

A :class:`RunSettings` is built once from a run's merged settings (the dict :func:`llmpipe.config.runs.run_config`
returns; :func:`llmpipe.config.runs.run_settings` builds and checks it from the workflow config). Each part checks its
own values when it is built (``__post_init__``); :meth:`RunSettings.check` holds the checks that span parts: the
global batch splits over the devices at every node count the run trains at, the microbatch divides the per-device
batch, ``concat_tokens`` fits ``max_seq_len``, a trained tokenizer's vocabulary fits the model. Pretraining,
finetuning and the node-scaling study (:func:`llmpipe.bench.scaling_study.check_study`, with its own node counts) all use this
one implementation.

Every error is a :class:`ConfigError` naming the setting's full config path (``models.mpt-tiny.train.microbatch_size``)
and the fix. The checks run while the DAG is built (the dry run, on the login node): no torch here, and no import of
:mod:`llmpipe.config.runs` (which imports this module).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

RUN_KINDS = ("pretrain", "finetune")
#: ``train.fused_loss.kernel`` values (``llmpipe.model.fused_loss.KERNELS`` is this tuple; see that module for each one).
FUSED_LOSS_KERNELS = ("torch", "softmax", "compile", "liger")
#: The kernel of ``fused_loss: true`` and of a mapping without ``kernel``.
FUSED_LOSS_DEFAULT_KERNEL = "liger"


class ConfigError(ValueError):
    """A setting in the experiment configuration is wrong; the message names the setting and the fix.

    ``setting`` is the setting's path (a tuple of keys and list indexes) when the error is about one value of the
    config as written (a schema error), else None."""

    def __init__(self, message: str, setting: tuple | None = None):
        super().__init__(message)
        self.setting = setting


def lcm(values: Iterable[int]) -> int:
    """Least common multiple of positive integers (1 for none)."""
    out = 1
    for v in values:
        out = out * int(v) // math.gcd(out, int(v))
    return out


def written_at(config: Mapping, run: str, key: str) -> str:
    """The config path where the value of ``key`` of a run's merged settings is written.

    ``key`` is dotted as in :func:`llmpipe.config.runs.run_config`'s dict (``train.global_batch_size``,
    ``resources.gpus_per_node``). A model's value comes from ``models.<run>`` or else ``model_defaults``; a
    finetune's from ``finetunes.<run>``, ``finetune_defaults`` or (``train``, ``resources``, a hub base's ``arch``)
    ``model_defaults``; the ``arch``, ``data.tokenizer`` and ``data.corpus`` of a finetune of one of our runs
    (``base.run``) from that run's sections. A value written nowhere (left to a default) is named in the run's own
    section, where a user sets it.

    Returns:
        A dotted path, e.g. ``model_defaults.resources.gpus_per_node``.
    """
    parts = key.split(".")

    def has(section: Any, value: bool = False) -> bool:
        """``key`` is written in ``section``: a null too, as :func:`llmpipe.config.runs.deep_merge` takes it (with
        ``value``: not null)."""
        for part in parts:
            if not isinstance(section, Mapping) or part not in section:
                return False
            section = section[part]
        return section is not None or not value

    md = config.get("model_defaults") or {}
    if run in (config.get("finetunes") or {}):
        ft = (config.get("finetunes") or {}).get(run) or {}
        fd = config.get("finetune_defaults") or {}
        base = ft.get("base") if isinstance(ft.get("base"), Mapping) else {}
        base_run = base["run"] if "run" in base else ((fd.get("base") or {}).get("run"))
        candidates = [(f"finetunes.{run}", ft), ("finetune_defaults", fd)]
        if base_run in (config.get("models") or {}) and base_run != run:
            if parts[0] == "arch":
                return written_at(config, base_run, key)
            if key in ("data.tokenizer", "data.corpus", "data.icl_corpus") and not any(
                    has(s, value=True) for _, s in candidates):
                return written_at(config, base_run, "data.tokenizer" if key == "data.tokenizer" else "data.corpus")
        if parts[0] in ("train", "resources", "arch"):
            candidates.append(("model_defaults", md))
    else:
        candidates = [(f"models.{run}", (config.get("models") or {}).get(run) or {}), ("model_defaults", md)]
    return next((f"{prefix}.{key}" for prefix, section in candidates if has(section)), f"{candidates[0][0]}.{key}")


def check_unique_labels(config: Mapping) -> None:
    """Raise ConfigError when two of ``eval.icl_tasks`` have the same ``label`` (each label is a file,
    results/data/<corpus>/icl/<label>.jsonl, and a key of eval.json), naming both indices."""
    tasks = (config.get("eval") or {}).get("icl_tasks") or []
    seen: dict[str, int] = {}
    for i, task in enumerate(tasks):
        label = task.get("label") if isinstance(task, Mapping) else None
        if label is None:
            continue
        if label in seen:
            raise ConfigError(f"eval.icl_tasks[{seen[label]}] and eval.icl_tasks[{i}] have the same label "
                              f"{label!r}; each task writes results/data/<corpus>/icl/<label>.jsonl. Fix: give "
                              f"eval.icl_tasks[{i}].label another name.")
        seen[label] = i


def whole(value: Any, path: str) -> int:
    """``value`` as an int (``'8'`` and ``8.0`` too, as ``int()`` reads them; not ``true``).

    Raises:
        ConfigError: naming ``path`` when the value is missing or not a whole number.
    """
    if value is None:
        raise ConfigError(f"{path} is missing. Fix: set it to a whole number.")
    try:
        out = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{path} is {value!r}; it must be a whole number.") from None
    if isinstance(value, bool) or isinstance(value, float) and value != out:
        raise ConfigError(f"{path} is {value!r}; it must be a whole number.")
    return out


def _origins() -> Any:
    """A dataclass field: config path where each value is written, by field name (``{"nodes":
    "model_defaults.resources.nodes"}``); a field not listed is at ``{where}.<field>``."""
    return field(default_factory=dict, compare=False, repr=False)


def _at(part: Any, key: str) -> str:
    return part.origins.get(key) or f"{part.where}.{key}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Resources:
    """The training step's placement (a run's ``resources:``): how many processes train, one per device."""

    #: Config path of the section, for messages (``models.mpt-1b.resources``).
    where: str = field(default="resources", compare=False, repr=False)
    #: Where each value is written when not in :attr:`where` (``model_defaults.resources.gpus_per_node``).
    origins: Mapping[str, str] = _origins()
    #: Machines the training runs on (``resources.nodes``, >= 1).
    nodes: int = 1
    #: GPUs per machine (``resources.gpus_per_node``); 0 = CPU-only nodes.
    gpus_per_node: int = 0
    #: Processes per machine on CPU-only nodes (``resources.tasks_per_node``); one per GPU otherwise.
    tasks_per_node: int = 1

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ConfigError(f"{self.at('nodes')} must be at least 1, got {self.nodes}.")
        if self.gpus_per_node < 0:
            raise ConfigError(f"{self.at('gpus_per_node')} must be 0 (CPU) or more, got {self.gpus_per_node}.")
        if self.tasks_per_node < 1:
            raise ConfigError(f"{self.at('tasks_per_node')} must be at least 1, got {self.tasks_per_node}.")

    def at(self, key: str) -> str:
        """The config path where the value of ``key`` (a field name) is written."""
        return _at(self, key)

    @classmethod
    def from_dict(cls, res: Mapping, where: str = "resources", origins: Mapping[str, str] | None = None
                  ) -> Resources:
        """From a resources mapping; missing keys take the defaults above (``null`` gpus/tasks too). ``origins``:
        where each value is written, by key, when not under ``where``.

        Raises:
            ConfigError: a value that is not a whole number, or out of range, naming where it is written.
        """
        origins = dict(origins or {})
        at = {k: origins.get(k) or f"{where}.{k}" for k in ("nodes", "gpus_per_node", "tasks_per_node")}
        gpus, tasks = res.get("gpus_per_node"), res.get("tasks_per_node")
        return cls(where=where, origins=origins, nodes=whole(res.get("nodes", 1), at["nodes"]),
                   gpus_per_node=whole(gpus or 0, at["gpus_per_node"]),
                   tasks_per_node=whole(tasks or 1, at["tasks_per_node"]))

    @property
    def per_node(self) -> int:
        """Training processes per machine: one per GPU on GPU nodes, else ``tasks_per_node``."""
        return self.gpus_per_node if self.gpus_per_node > 0 else self.tasks_per_node

    @property
    def per_node_key(self) -> str:
        """The field that sets :attr:`per_node`: ``gpus_per_node`` on GPU nodes, else ``tasks_per_node``."""
        return "gpus_per_node" if self.gpus_per_node > 0 else "tasks_per_node"

    @property
    def device_kind(self) -> str:
        """What a process runs on, for messages: ``GPUs`` or ``tasks``."""
        return "GPUs" if self.gpus_per_node > 0 else "tasks"

    def devices(self, nodes: int | None = None) -> int:
        """Training processes (ranks, the world size) at ``nodes`` machines (default: :attr:`nodes`)."""
        return (self.nodes if nodes is None else int(nodes)) * self.per_node


@dataclass(frozen=True, kw_only=True, slots=True)
class DataSettings:
    """What a run trains on (a run's ``data:``)."""

    where: str = field(default="data", compare=False, repr=False)
    #: Where each value is written when not in :attr:`where` (``concat_tokens``: where ``concat_key`` is written).
    origins: Mapping[str, str] = _origins()
    #: Corpus under ``corpora:`` (pretraining) or the corpus the ICL tasks come from (a finetune's ``icl_corpus``).
    corpus: str | None = None
    #: Tokenizer under ``tokenizers:``.
    tokenizer: str | None = None
    #: Tokens per training sample: ``data.concat_tokens`` of a pretraining run, ``data.max_seq_len`` of a finetune.
    concat_tokens: int
    #: Config key of :attr:`concat_tokens` under ``data:``, for messages.
    concat_key: str = field(default="concat_tokens", compare=False, repr=False)
    #: Instruction set under ``instruction_sets:`` (finetunes only).
    instructions: str | None = None
    #: llm-foundry's on-the-fly packing (finetunes only): None (off), ``'auto'`` or a number >= 1.
    packing_ratio: float | str | None = None
    #: Padding trimmed per batch (a finetune's ``data.allow_pad_trimming``; None for pretraining, which has none).
    allow_pad_trimming: bool | None = None

    def __post_init__(self) -> None:
        if self.concat_tokens < 2:
            raise ConfigError(f"{self.at('concat_tokens')} must be at least 2, got {self.concat_tokens}.")
        pr = self.packing_ratio
        if pr is not None and pr != "auto" and (isinstance(pr, bool) or not isinstance(pr, (int, float))
                                                 or float(pr) < 1):
            raise ConfigError(f"{self.at('packing_ratio')} is {pr!r}; it must be null, 'auto' or a number >= 1.")

    def at(self, key: str) -> str:
        """The config path where the value of ``key`` (a field name) is written."""
        if key == "concat_tokens" and key not in self.origins:
            return f"{self.where}.{self.concat_key}"
        return _at(self, key)


#: The ``arch:`` keys every run must have (the shape the MFU formula and the checks read).
ARCH_REQUIRED = ("d_model", "n_heads", "n_layers", "vocab_size", "max_seq_len")


@dataclass(frozen=True, kw_only=True, slots=True)
class ArchSettings:
    """The model's shape (a run's ``arch:``; a finetune's base model's)."""

    #: Config path of the section the shape is written in (``models.mpt-tiny.arch`` also for a finetune of it).
    where: str = field(default="arch", compare=False, repr=False)
    #: Where each value is written when not in :attr:`where` (``model_defaults.arch.vocab_size``).
    origins: Mapping[str, str] = _origins()
    d_model: int
    n_heads: int
    n_layers: int
    #: Token ids the embedding holds; a tokenizer's vocabulary must fit.
    vocab_size: int
    #: Longest sequence the model takes, in tokens.
    max_seq_len: int
    #: Key/value heads of grouped-query attention (``n_kv_heads``, else ``attn_config.kv_n_heads``); None: n_heads.
    n_kv_heads: int | None = None
    #: Whether :attr:`n_kv_heads` is ``attn_config.kv_n_heads``: llm-foundry's own key, which counts only under its
    #: ``attn_type`` (grouped-query); ``arch.n_kv_heads`` turns grouped-query attention on by itself.
    kv_in_attn_config: bool = False
    #: MLP width / d_model (``arch.expansion_ratio``).
    expansion_ratio: float
    #: No bias terms in linear layers and norms (``arch.no_bias``).
    no_bias: bool
    #: MPT's norm (``arch.norm_type``).
    norm_type: str
    #: llm-foundry's MPT ``attn_config`` as written (``arch.attn_config``; empty when not written).
    attn_config: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key in ARCH_REQUIRED:
            if getattr(self, key) < 1:
                raise ConfigError(f"{self.at(key)} must be positive, got {getattr(self, key)}.")
        if self.d_model % self.n_heads:
            heads = "" if self.at("n_heads") == f"{self.where}.n_heads" else f", {self.at('n_heads')}"
            raise ConfigError(f"{self.at('d_model')} ({self.d_model}) does not divide by n_heads ({self.n_heads}"
                              f"{heads}). Fix: choose n_heads that divides d_model.")
        kv = self.n_kv_heads
        if kv is not None and (kv < 1 or kv > self.n_heads or self.n_heads % kv):
            raise ConfigError(f"{self.at('n_kv_heads')} is {kv}; MPT shares each key/value head among a whole number "
                              f"of the {self.n_heads} query heads ({self.at('n_heads')}). Fix: pick a divisor of "
                              f"{self.n_heads}.")

    def at(self, key: str) -> str:
        """The config path where the value of ``key`` (a field name) is written."""
        return _at(self, key)

    def as_dict(self) -> dict[str, Any]:
        """The shape as an ``arch:`` mapping (:mod:`llmpipe.model.mfu`'s and :mod:`llmpipe.plan.memory_time`'s input): every field,
        ``n_kv_heads`` only when written as ``arch.n_kv_heads``, ``attn_config`` a copy (its ``kv_n_heads`` counts
        as MPT counts it: under a grouped-query ``attn_type`` only)."""
        out = {k: getattr(self, k) for k in (*ARCH_REQUIRED, "expansion_ratio", "no_bias", "norm_type")}
        out["attn_config"] = dict(self.attn_config)
        if self.n_kv_heads is not None and not self.kv_in_attn_config:
            out["n_kv_heads"] = self.n_kv_heads
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerSettings:
    """llm-foundry's optimizer (``train.optimizer``): its registry name and its class's keyword arguments."""

    name: str
    #: Keyword arguments of the optimizer class (``lr``, ``betas``, ...), checked against its signature at plan time.
    kwargs: Mapping[str, Any]

    def foundry_config(self) -> dict[str, Any]:
        """``{name, **kwargs}``: llm-foundry's ``optimizer`` config."""
        return {"name": self.name, **self.kwargs}


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerSettings:
    """llm-foundry's learning-rate scheduler (``train.scheduler``)."""

    name: str
    #: Warmup length in batches (``scheduler.t_warmup_batches``).
    t_warmup_batches: int
    #: Other keyword arguments of the scheduler (``alpha_f``, ``t_max``, ...).
    kwargs: Mapping[str, Any]

    def foundry_config(self) -> dict[str, Any]:
        """llm-foundry's ``scheduler`` config: ``{name, t_warmup: '<N>ba', **kwargs}``."""
        return {"name": self.name, "t_warmup": f"{self.t_warmup_batches}ba", **self.kwargs}


#: ``train:`` keys copied as written into :class:`TrainSettings` fields of the same name (every one is in
#: ``model_defaults.train`` of config/config.yaml, which every run inherits); the schema's ``train`` says what each
#: means.
TRAIN_FIELDS = ("seed", "precision", "grad_clip_norm", "eval_microbatch_size", "attn_impl", "fsdp", "num_workers",
                "save_interval_batches", "checkpoints_to_keep", "earlier_identities_to_keep", "fsdp_min_params",
                "log_interval_batches", "eval_interval_batches", "eval_subset_batches", "fused_optimizer",
                "train_metrics")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainSettings:
    """The batch and length of training (part of a run's ``train:``; the rest is read where it is used)."""

    where: str = field(default="train", compare=False, repr=False)
    #: Where each value is written when not in :attr:`where` (``model_defaults.train.microbatch_size``).
    origins: Mapping[str, str] = _origins()
    #: Samples per optimizer step over all devices.
    global_batch_size: int
    #: Samples per forward/backward on one device (speed only); divides the per-device batch.
    microbatch_size: int
    #: Optimizer steps of the training.
    max_duration_batches: int
    #: The schedule's length (``scheduler.t_max``, composer's time string); None: the training's (``1dur``).
    t_max: str | None = None
    # The rest of ``train:``, as the schema's ``train`` describes each key.
    seed: int
    precision: str
    optimizer: OptimizerSettings
    scheduler: SchedulerSettings
    grad_clip_norm: float
    #: llm-foundry's loss (``train.loss_fn``; the schema's ``x-default`` when not written).
    loss_fn: str
    eval_microbatch_size: int
    attn_impl: str
    #: composer's FSDP settings (None: composer's defaults).
    fsdp: Mapping[str, Any] | None
    #: :func:`llmpipe.config.runs.compile_settings` of ``train.compile`` (None: eager).
    compile: Mapping[str, Any] | None
    #: :func:`llmpipe.config.runs.fused_loss_settings` of ``train.fused_loss`` (None: off).
    fused_loss: Mapping[str, Any] | None
    #: :func:`llmpipe.train.fp8.fp8_settings` of ``train.fp8`` (None: off).
    fp8: Mapping[str, Any] | None
    num_workers: int
    save_interval_batches: int
    checkpoints_to_keep: int
    earlier_identities_to_keep: int
    fsdp_min_params: float | None
    log_interval_batches: int
    eval_interval_batches: int
    eval_subset_batches: int
    fused_optimizer: bool
    train_metrics: bool

    def __post_init__(self) -> None:
        for key in ("max_duration_batches", "microbatch_size", "global_batch_size"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{self.at(key)} must be positive, got {getattr(self, key)}.")
        self.check_schedule_length()

    def check_schedule_length(self) -> None:
        """Raise ConfigError when ``t_max`` (in ``ba`` or ``dur``) ends before the training: composer's warmup
        schedulers refuse it at their first step (``_raise_if_max_duration_exceeds_t_max``). Epochs are not
        compared (their length in batches is known only to the job)."""
        m = re.fullmatch(r"\s*(\d+\.?\d*|\.\d+)\s*(ba|dur)\s*", str(self.t_max or ""), re.I)
        if not m:
            return
        value, unit = float(m.group(1)), m.group(2).lower()
        if value < (self.max_duration_batches if unit == "ba" else 1):
            raise ConfigError(f"{self.at('t_max')} is {self.t_max!r}, so the learning-rate schedule would end before "
                              f"the training's {self.max_duration_batches} batches ({self.at('max_duration_batches')})"
                              f", which composer refuses. Fix: set it to at least {self.max_duration_batches}ba or "
                              f"1dur, or remove it (1dur).")

    def at(self, key: str) -> str:
        """The config path where the value of ``key`` (a field name) is written."""
        return _at(self, key)


@dataclass(frozen=True, kw_only=True, slots=True)
class BaseModel:
    """Where a finetune starts (``finetunes.<run>.base``): one of our runs, or hub weights."""

    where: str = field(default="base", compare=False, repr=False)
    #: A pretraining run under ``models:`` (its Hugging Face export).
    run: str | None = None
    #: A hub repo id or a local folder in the hub's layout.
    hub: str | None = None
    #: The hub revision; llm-foundry loads ``main`` only.
    revision: str | None = None

    def __post_init__(self) -> None:
        if bool(self.run) == bool(self.hub):
            raise ConfigError(f"{self.where} must name exactly one of `run` (one of our models, e.g. "
                              f"{{run: mpt-tiny}}) or `hub` (a hub repo id, e.g. {{hub: mosaicml/mpt-7b}}); got "
                              f"run={self.run!r}, hub={self.hub!r}. Fix: set one of them.")
        if self.hub and self.revision not in (None, "main"):
            raise ConfigError(f"{self.where}.revision is {self.revision!r}, but llm-foundry's hf_causal_lm loads a "
                              f"hub model's main revision only. Fix: download that revision (huggingface-cli download "
                              f"--revision ...) and set base.hub to the local folder, or use revision: main.")


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraSettings:
    """Low-rank adapters of a finetune (``finetunes.<run>.lora``; llm-foundry's ``peft_config``)."""

    #: Rank of the adapters (> 0).
    r: int
    #: Modules that get adapters, e.g. ``("Wqkv",)`` (at least one).
    target_modules: tuple[str, ...]
    alpha: float | None = None
    dropout: float | None = None

    @classmethod
    def from_value(cls, value: Any, where: str) -> LoraSettings | None:
        """From ``lora:`` (None = off).

        Raises:
            ConfigError: not a mapping, ``r`` not positive, or no target module, naming ``where``.
        """
        if value is None:
            return None
        wrong = ConfigError(f"{where} must be null or {{r: 8, alpha: 16, dropout: 0.05, target_modules: [Wqkv]}} "
                            f"with r > 0 and at least one target module; got {value!r}.")
        if not isinstance(value, Mapping) or not value.get("target_modules"):
            raise wrong
        try:
            r = int(value.get("r", 0))
        except (TypeError, ValueError):
            raise wrong from None
        if r <= 0:
            raise wrong
        modules = value["target_modules"]
        return cls(r=r, target_modules=(modules,) if isinstance(modules, str) else tuple(modules),
                   alpha=value.get("alpha"), dropout=value.get("dropout"))


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSettings:
    """One run's settings, typed: built by :meth:`from_run_config`, checked by :meth:`check`."""

    #: The run's name: its folder results/<name>/ and its key under ``models:`` or ``finetunes:``.
    name: str
    kind: Literal["pretrain", "finetune"] = "pretrain"
    data: DataSettings
    arch: ArchSettings
    train: TrainSettings
    resources: Resources
    #: Other node counts the run trains at (a finetune's ``node_counts``, for its scaling study); sorted, unique.
    node_counts: tuple[int, ...] = ()
    #: The finetune's starting point (None for pretraining).
    base: BaseModel | None = None
    #: The finetune's adapters (None: full finetuning, and always for pretraining).
    lora: LoraSettings | None = None
    #: A trained tokenizer's vocabulary (``tokenizers.<name>.vocab_size``); None when it is known only once the
    #: tokenizer is fetched (hub or local: :meth:`check_vocab` then checks its manifest).
    tokenizer_vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in RUN_KINDS:
            raise ConfigError(f"{self.where} has kind {self.kind!r}; it must be one of {', '.join(RUN_KINDS)}.")
        bad = [n for n in self.node_counts if n < 1]
        if bad:
            raise ConfigError(f"{self.where}.node_counts must list node counts >= 1, got {list(self.node_counts)}.")

    @property
    def where(self) -> str:
        """The run's config section: ``models.<name>`` or ``finetunes.<name>``."""
        return f"{'finetunes' if self.kind == 'finetune' else 'models'}.{self.name}"

    @classmethod
    def from_run_config(cls, rc: Mapping, tokenizer: Mapping | None = None,
                        written_at: Callable[[str], str] | None = None, *, parsed: Mapping[str, Any]
                        ) -> RunSettings:
        """Build from a run's merged settings (:func:`llmpipe.config.runs.run_config`'s dict: ``name``, ``data``,
        ``arch``, ``train``, ``resources``; a finetune's also ``kind``, ``base``, ``lora``, ``node_counts``).

        ``tokenizer`` is the run's entry under ``tokenizers:``; a trained one (``source: train``) gives
        :attr:`tokenizer_vocab_size`. ``written_at`` maps a dotted key of ``rc`` (``train.global_batch_size``) to
        the config path where its value is written (:func:`llmpipe.config.runs.written_at`: the run's own section,
        ``finetune_defaults`` or ``model_defaults``); messages name that path. Without it every value is named in
        the run's own section (a finetune's ``arch`` in its base run's). ``parsed`` holds the ``train`` values
        :mod:`llmpipe.config.runs` parses or fills (``compile``, ``fused_loss``, ``fp8``, ``loss_fn``: the
        :class:`TrainSettings` fields of those names). Every other key is read as written: the validated config has
        each one (schema defaults filled, ``model_defaults`` / ``finetune_defaults`` inherited). Only each part's
        own checks run here; call :meth:`check` for the rest.

        Raises:
            ConfigError: a missing or wrong value, naming its config path.
        """
        name = str(rc["name"])
        kind = "finetune" if rc.get("kind") == "finetune" else "pretrain"
        where = f"{'finetunes' if kind == 'finetune' else 'models'}.{name}"
        data, arch, train = rc.get("data") or {}, rc.get("arch") or {}, rc.get("train") or {}
        base = None
        arch_where = f"{where}.arch"
        if kind == "finetune":
            b = rc.get("base") or {}
            base = BaseModel(where=f"{where}.base", run=b.get("run"), hub=b.get("hub"), revision=b.get("revision"))
            if base.run:
                arch_where = f"models.{base.run}.arch"
        concat_key = "max_seq_len" if kind == "finetune" else "concat_tokens"
        sections = {"data": f"{where}.data", "arch": arch_where, "train": f"{where}.train",
                    "resources": f"{where}.resources"}

        def at(section: str, key: str) -> str:
            return written_at(f"{section}.{key}") if written_at else f"{sections[section]}.{key}"

        def origins(section: str, keys: Iterable[str], fields: Mapping[str, str] | None = None) -> dict[str, str]:
            fields = fields or {}
            return {fields.get(k, k): at(section, k) for k in keys}

        for key in ARCH_REQUIRED:
            if key not in arch or arch[key] is None:
                if base is not None and base.hub:
                    raise ConfigError(f"{at('arch', key)} is missing: for hub weights, arch must describe the hub "
                                      f"model (used for MFU). Fix: copy it from the model's config.json.")
                raise ConfigError(f"{at('arch', key)} is missing. Fix: set it (see the published MPT sizes in "
                                  f"config/config.yaml).")
        vocab = None
        if tokenizer is not None and tokenizer.get("source") == "train":
            vocab = whole(tokenizer.get("vocab_size"), f"tokenizers.{data.get('tokenizer')}.vocab_size")
        data_at = origins("data", ("corpus", "tokenizer", concat_key, "instructions", "packing_ratio"),
                          {concat_key: "concat_tokens"})
        kv_key = "n_kv_heads" if arch.get("n_kv_heads") is not None else "attn_config.kv_n_heads"
        kv = arch["n_kv_heads"] if kv_key == "n_kv_heads" else (arch.get("attn_config") or {}).get("kv_n_heads")
        arch_at = {**origins("arch", ARCH_REQUIRED), "n_kv_heads": at("arch", kv_key)}
        train_keys = ("global_batch_size", "microbatch_size", "max_duration_batches")
        train_at = {**origins("train", train_keys), "t_max": at("train", "scheduler.t_max")}
        sched = dict(train["scheduler"])
        optimizer = OptimizerSettings(name=train["optimizer"]["name"],
                                      kwargs={k: v for k, v in train["optimizer"].items() if k != "name"})
        scheduler = SchedulerSettings(name=sched.pop("name"), t_warmup_batches=int(sched.pop("t_warmup_batches")),
                                      kwargs=sched)
        return cls(
            name=name, kind=kind, base=base, tokenizer_vocab_size=vocab,
            data=DataSettings(where=sections["data"], origins=data_at, corpus=data.get("corpus"),
                              tokenizer=data.get("tokenizer"),
                              concat_tokens=whole(data.get("concat_tokens"), data_at["concat_tokens"]),
                              concat_key=concat_key, instructions=data.get("instructions"),
                              packing_ratio=data.get("packing_ratio"),
                              allow_pad_trimming=data.get("allow_pad_trimming")),
            arch=ArchSettings(where=arch_where, origins=arch_at, n_kv_heads=None if kv is None else whole(
                kv, arch_at["n_kv_heads"]), kv_in_attn_config=kv_key != "n_kv_heads", expansion_ratio=arch["expansion_ratio"], no_bias=bool(arch["no_bias"]),
                norm_type=arch["norm_type"], attn_config=dict(arch.get("attn_config") or {}),
                **{k: whole(arch[k], arch_at[k]) for k in ARCH_REQUIRED}),
            train=TrainSettings(where=sections["train"], origins=train_at, t_max=scheduler.kwargs.get("t_max"),
                                optimizer=optimizer, scheduler=scheduler,
                                **{k: parsed[k] for k in ("compile", "fused_loss", "fp8", "loss_fn")},
                                **{k: train[k] for k in TRAIN_FIELDS},
                                **{k: whole(train.get(k), train_at[k]) for k in train_keys}),
            resources=Resources.from_dict(rc.get("resources") or {}, sections["resources"],
                                          origins("resources", ("nodes", "gpus_per_node", "tasks_per_node"))),
            node_counts=tuple(sorted({whole(n, f"{where}.node_counts") for n in rc.get("node_counts") or ()})),
            lora=LoraSettings.from_value(rc.get("lora"), f"{where}.lora"),
        )

    # ------------------------------------------------------------------------------------------ checks

    def check(self, node_counts: Iterable[int] = (), counts_where: str | None = None) -> RunSettings:
        """The cross-field checks; returns ``self``.

        ``concat_tokens`` (a finetune's ``max_seq_len``) fits the model's ``max_seq_len``; a trained tokenizer's
        vocabulary fits ``arch.vocab_size``; the global batch splits over the devices, and the microbatch divides
        the per-device batch, at every node count in :meth:`node_counts_to_check` (``node_counts``: more counts,
        e.g. a scaling study's, named by ``counts_where`` in the fix).

        Raises:
            ConfigError: the first failing check; for the batch, every node count where it fails.
        """
        d, a = self.data, self.arch
        if d.concat_tokens > a.max_seq_len:
            if self.kind == "finetune":
                raise ConfigError(f"{d.at('concat_tokens')} ({d.concat_tokens}) is larger than the base model's "
                                  f"max_seq_len ({a.max_seq_len}, {a.at('max_seq_len')}). Fix: lower max_seq_len.")
            raise ConfigError(f"{d.at('concat_tokens')} ({d.concat_tokens}) is larger than {a.at('max_seq_len')} "
                              f"({a.max_seq_len}): samples would not fit the model. Fix: lower concat_tokens or "
                              f"raise max_seq_len.")
        if self.tokenizer_vocab_size is not None:
            self.check_vocab(self.tokenizer_vocab_size, f"tokenizers.{d.tokenizer}.vocab_size")
        self.check_batch(node_counts, counts_where)
        return self

    def check_vocab(self, vocab_size: int, source: str) -> None:
        """Raise ConfigError unless a tokenizer of ``vocab_size`` tokens fits the model's embedding.

        ``source`` says where the tokenizer's size comes from: its config path (``tokenizers.<name>.vocab_size``)
        before it is trained, or its manifest once it is prepared.
        """
        if int(vocab_size) > self.arch.vocab_size:
            raise ConfigError(f"{source} ({int(vocab_size)}) exceeds {self.arch.at('vocab_size')} "
                              f"({self.arch.vocab_size}): the tokenizer {self.data.tokenizer} has more tokens than "
                              f"the model's embedding. Fix: raise the model's vocab_size or lower the tokenizer's.")

    def resource_at(self, key: str) -> str:
        """Where ``resources.<key>`` is written (the run's section when its :class:`Resources` has no path)."""
        r = self.resources
        if key not in r.origins and r.where == "resources":
            return f"{self.where}.resources.{key}"
        return r.at(key)

    def node_counts_to_check(self, node_counts: Iterable[int] = ()) -> list[int]:
        """Every node count the run trains at: ``resources.nodes``, :attr:`node_counts`, and ``node_counts``."""
        return sorted({self.resources.nodes, *self.node_counts, *(int(n) for n in node_counts)})

    def batch_problem(self, nodes: int) -> str | None:
        """Why the batch cannot train at ``nodes`` nodes (the setting, its value and the device count), or None."""
        t, r = self.train, self.resources
        ws = r.devices(nodes)
        if t.global_batch_size % ws:
            return (f"{t.at('global_batch_size')} ({t.global_batch_size}) is not divisible by the number of "
                    f"{r.device_kind} at {nodes} node(s) ({ws} = {nodes} x {r.per_node} per node)")
        per_device = t.global_batch_size // ws
        if per_device % t.microbatch_size and t.microbatch_size < per_device:
            return (f"{t.at('microbatch_size')} ({t.microbatch_size}) does not divide the per-device batch at "
                    f"{nodes} node(s) ({per_device} = {t.global_batch_size} / {ws} {r.device_kind})")
        return None

    def check_batch(self, node_counts: Iterable[int] = (), counts_where: str | None = None) -> None:
        """Raise ConfigError unless the batch trains at every node count (:meth:`node_counts_to_check`).

        The message lists each failing count (``at N node(s): ...``) and the fix: a global batch that is a multiple
        of every count's devices, a microbatch that divides every per-device batch, or other node counts
        (``counts_where``, else the run's ``resources.nodes`` / ``node_counts``).
        """
        counts = self.node_counts_to_check(node_counts)
        problems = {n: p for n in counts if (p := self.batch_problem(n))}
        if not problems:
            return
        t, r = self.train, self.resources
        devices = lcm(r.devices(n) for n in counts)
        if any(t.global_batch_size % r.devices(n) for n in problems):
            what = f"make global_batch_size a multiple of {devices}"
        else:  # the largest smaller microbatch that fits every count (1 always does)
            per_device = [t.global_batch_size // r.devices(n) for n in counts]
            fits = max(m for m in range(1, t.microbatch_size)
                       if all(b % m == 0 or m >= b for b in per_device))
            what = (f"pick a microbatch_size that divides the per-device batch ({', '.join(map(str, per_device))}), "
                    f"e.g. {fits}")
        # what can change: the node counts (as written) and the devices per node (where it is written)
        change = [counts_where] if counts_where else [f"{self.resource_at('nodes')} ({r.nodes})"]
        if self.node_counts or (self.kind == "finetune" and not counts_where):
            change.append(f"{self.where}.node_counts")
        change.append(f"{self.resource_at(r.per_node_key)} ({r.per_node})")
        fix = f"Fix: {what}, or change {', '.join(change[:-1])} or {change[-1]}."
        if len(counts) == 1:
            raise ConfigError(f"{problems[counts[0]]}. {fix}")
        lines = "\n".join(f"  at {n} node(s): {p}" for n, p in problems.items())
        raise ConfigError(f"the batch of {self.where} must split evenly over the devices at every node count it "
                          f"trains at ({', '.join(map(str, counts))}), but it does not:\n{lines}\n{fix}")
