"""Typed settings of the stages after training: export (``convert:``), generation (``generate:``) and evaluation
(``eval:``).

Each is a frozen dataclass built from its section of the validated workflow config (:func:`llmpipe.config.schema.check`
fills every schema default, so each key is read as written; a default lives only in
``schemas/config.schema.yaml`` or ``config/config.yaml``). Values are kept as the config writes them (``1`` stays
an int where a float is allowed): generate.json records them, and identity texts are built from the same values.
The dataclasses hold no torch object and pickle, so a step hands them to its job (:func:`llmpipe.dispatch.jobs.run_step`).
No import of :mod:`llmpipe.config.runs` here (it has no need of these, and the steps build them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmpipe.config.settings import ConfigError

#: ``generate.long_prompts``: what happens to a prompt too long for the context.
LONG_PROMPT_MODES = ("truncate", "fail")

#: ``convert.dtype``: the export's weight types.
EXPORT_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True, kw_only=True, slots=True)
class ConvertSettings:
    """The Hugging Face export (``convert:``)."""

    #: Data type of the exported weights: one of :data:`EXPORT_DTYPES` (``convert.dtype``).
    dtype: str
    #: Largest safetensors file, a number and a unit (``5GB``; transformers' ``save_pretrained`` max_shard_size).
    max_shard_size: str

    def __post_init__(self) -> None:
        if self.dtype not in EXPORT_DTYPES:
            raise ConfigError(f"convert.dtype is {self.dtype!r}; it must be one of {', '.join(EXPORT_DTYPES)}. "
                              f"Fix: set convert.dtype to one of them (bf16 keeps the training's precision).")

    @classmethod
    def from_section(cls, section: Mapping[str, Any]) -> ConvertSettings:
        """From the validated ``convert:`` section.

        Raises:
            KeyError: the section lacks ``dtype`` or ``max_shard_size`` (an unvalidated config).
            ConfigError: an unknown dtype.
        """
        return cls(dtype=section["dtype"], max_shard_size=section["max_shard_size"])


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerateSettings:
    """One run's generation (the ``generate:`` section with the run's own ``generate:`` over it, its prompts and
    template resolved: :func:`llmpipe.steps.generate.generate_settings`)."""

    #: The prompts, one completion each (an item that is not text is recorded as not answered).
    prompts: tuple[Any, ...]
    #: Text with ``{prompt}`` where the prompt goes; what the model continues.
    template: str
    #: New tokens per prompt at most (>= 1).
    max_new_tokens: int
    #: Sample (``temperature``, ``top_p``) instead of greedy decoding.
    do_sample: bool
    #: Sampling temperature (> 0; with ``do_sample``).
    temperature: float
    #: Nucleus sampling probability mass (0 < top_p <= 1; with ``do_sample``).
    top_p: float
    #: ``torch.manual_seed`` before generating.
    seed: int
    #: A prompt too long for the context: ``truncate`` (its first tokens dropped) or ``fail`` (not answered).
    long_prompts: str
    #: Config path of the prompts, named in messages (``finetunes.<run>.generate.prompts``).
    prompts_at: str = "generate.prompts"
    #: Config path of the template (``instruction_sets.<name>`` for an instruction format); None: the prompt alone.
    template_at: str | None = None

    def __post_init__(self) -> None:
        if self.long_prompts not in LONG_PROMPT_MODES:
            raise ConfigError(f"generate.long_prompts is {self.long_prompts!r}; it must be one of "
                              f"{', '.join(LONG_PROMPT_MODES)}. Fix: set generate.long_prompts to one of them.")

    @classmethod
    def from_section(cls, section: Mapping[str, Any], *, prompts_at: str = "generate.prompts",
                     template_at: str | None = None) -> GenerateSettings:
        """From a resolved ``generate:`` mapping (the validated section's keys, ``template`` the text to use);
        ``prompts_at`` and ``template_at`` name where the prompts and template are written. Other keys
        (``resources``, ``earlier_identities_to_keep``) are not generation settings and are left out.

        Raises:
            KeyError: a generation key is missing (an unvalidated config).
            ConfigError: an unknown ``long_prompts``.
        """
        return cls(prompts=tuple(section["prompts"] or ()), template=section["template"],
                   max_new_tokens=section["max_new_tokens"], do_sample=section["do_sample"],
                   temperature=section["temperature"], top_p=section["top_p"], seed=section["seed"],
                   long_prompts=section["long_prompts"],
                   prompts_at=prompts_at, template_at=template_at)

    def record(self) -> dict:
        """The sampling settings and template as generate.json's ``settings`` records them (no prompts: each
        output names its own)."""
        return {"max_new_tokens": self.max_new_tokens, "do_sample": self.do_sample, "temperature": self.temperature,
                "top_p": self.top_p, "seed": self.seed, "long_prompts": self.long_prompts, "template": self.template}


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalSettings:
    """The evaluation's own settings (``eval:``; the ICL suite is the run's, :func:`llmpipe.evaluation.suites.run_suite`)."""

    #: Held-out batches scored over all processes; -1: every batch of the split.
    val_batches: int
    #: Evaluation batch size per device (sequences).
    batch_size: int
    #: ICL batching: ``trimmed`` (:mod:`llmpipe.evaluation.icl_batches`), ``padded`` (llm-foundry's as they are) or
    #: ``shared_prefix`` (:mod:`llmpipe.evaluation.shared_prefix`).
    icl_batches: str

    def __post_init__(self) -> None:
        from llmpipe.evaluation.icl_batches import ICL_BATCHES

        if self.icl_batches not in ICL_BATCHES:
            raise ConfigError(f"eval.icl_batches must be one of {', '.join(ICL_BATCHES)}, got "
                              f"{self.icl_batches!r}. Fix: set eval.icl_batches: shared_prefix (the default), trimmed "
                              f"or padded.")
        if self.batch_size < 1:
            raise ConfigError(f"eval.batch_size must be at least 1, got {self.batch_size}. Fix: set eval.batch_size "
                              f"to a positive number of sequences per device.")
        if self.val_batches != -1 and self.val_batches < 1:
            raise ConfigError(f"eval.val_batches must be -1 (every batch) or >= 1, got {self.val_batches}. Fix: set "
                              f"eval.val_batches to -1 or a positive number of batches.")

    @classmethod
    def from_section(cls, section: Mapping[str, Any]) -> EvalSettings:
        """From the validated ``eval:`` section.

        Raises:
            KeyError: the section lacks ``val_batches``, ``batch_size`` or ``icl_batches`` (an unvalidated config).
            ConfigError: a value out of range.
        """
        return cls(val_batches=int(section["val_batches"]), batch_size=int(section["batch_size"]),
                   icl_batches=str(section["icl_batches"]))
