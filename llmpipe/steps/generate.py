"""Generation step (rule ``generate``): the exported model answers the run's prompts -> generate.json.

A run's prompts and template are its own ``generate:`` section's (``models.<run>.generate``,
``finetunes.<run>.generate``, ``finetune_defaults.generate``) over the ``generate:`` section; a finetune without a
template of its own or a global one generates in its instruction set's format (:func:`generate_settings`).
A prompt too long for the model's context is truncated from the left and recorded in generate.json
(``generate.long_prompts: truncate``), or (``fail``) the step fails naming it; a prompt that cannot be answered
otherwise fails the step too. Either way the other prompts are answered first and written with the failed ones'
errors to ``generate.partial.json`` beside the output (:mod:`llmpipe.evaluation.generation`)."""

from __future__ import annotations

import os

from llmpipe.atomic import remove_if_exists
from llmpipe.config.runs import is_finetune, run_config, step_resources, written_at
from llmpipe.config.settings import ConfigError
from llmpipe.config.stage_settings import GenerateSettings
from llmpipe.data.instructions import PROMPT_FIELD, instruction_template
from llmpipe.steps.context import StepContext
from llmpipe.steps.registry import KEPT_GENERATION, register

#: Bump when a change in our code changes generate.json (reruns generation).
VERSION = 3

#: The ``generate:`` settings that determine the answers (``template``: the resolved text).
IDENTITY_KEYS = ("prompts", "template", "max_new_tokens", "do_sample", "temperature", "top_p", "seed", "long_prompts")


def generate_settings(config: dict, run: str) -> dict:
    """The generation settings of one run: the ``generate:`` section with the run's own ``generate:`` over it.

    ``prompts`` is the run's own list, else ``generate.prompts``. ``template`` is the first that is set of: the run's
    own, ``generate.template``, a finetune's instruction format (:func:`llmpipe.data.instructions.instruction_template`
    of its ``data.instructions`` set), and ``{prompt}`` (the prompt alone, as pretraining runs generate).

    Returns:
        The ``generate:`` settings with ``prompts`` and ``template`` (text with ``{prompt}``) resolved, and
        ``prompts_at`` / ``template_at``: the config path each comes from (``template_at``:
        ``instruction_sets.<name>`` for an instruction format, None for the prompt alone).

    Raises:
        ConfigError: an unknown run (:func:`llmpipe.config.runs.run_config`).
    """
    out = dict(config["generate"])
    rc = run_config(config, run)
    own = rc.get("generate") or {}
    out["prompts_at"] = "generate.prompts"
    if own.get("prompts") is not None:
        out["prompts"], out["prompts_at"] = own["prompts"], written_at(config, run, "generate.prompts")
    if own.get("template") is not None:
        out["template"], out["template_at"] = own["template"], written_at(config, run, "generate.template")
    elif out.get("template") is not None:
        out["template_at"] = "generate.template"
    elif is_finetune(config, run):
        name = rc["data"].get("instructions")
        out["template"] = instruction_template((config.get("instruction_sets") or {}).get(name) or {})
        out["template_at"] = f"instruction_sets.{name}"
    else:
        out["template"], out["template_at"] = PROMPT_FIELD, None
    return out


def run_generate_settings(config: dict, run: str) -> GenerateSettings:
    """The typed generation settings of one run (:func:`generate_settings` resolved, as
    :class:`llmpipe.config.stage_settings.GenerateSettings`): what the generation job takes.

    Raises:
        ConfigError: an unknown run (:func:`llmpipe.config.runs.run_config`).
        ValueError: an unknown ``generate.long_prompts`` (the schema refuses one first).
    """
    g = generate_settings(config, run)
    return GenerateSettings.from_section(g, prompts_at=g["prompts_at"], template_at=g.get("template_at"))


def generate_identity(config: dict, run: str) -> dict:
    """What determines generate.json besides the model (its input): the run's prompts, the template they are put
    in (:func:`generate_settings`) and the sampling settings."""
    g = generate_settings(config, run)
    return {"step": "generate", "version": VERSION, **{k: g.get(k) for k in IDENTITY_KEYS}}


def generate_resources(config: dict, wildcards) -> dict:
    """The generation job: ``generate.resources`` (a run's ``step_resources.generate`` wins)."""
    return step_resources(config, "generate", wildcards.run)


@register("generate", resources=generate_resources, where="generate.resources", plan="generate",
          kept=KEPT_GENERATION)
def generate(ctx: StepContext) -> dict:
    """Rule ``generate``: the converted model answers the run's prompts (:func:`generate_settings`) -> generate.json.

    Raises:
        ConfigError: a prompt that cannot be answered for its settings (too long for the context with
            ``generate.long_prompts: fail``, no tokens), each one named with the fix.
        RuntimeError: generating a prompt raised (each one named with its error; the traceback is in the job's log).
        In both cases the answered prompts' completions and the errors are in ``generate.partial.json`` beside the
        output, and generate.json is not written.
    """
    from llmpipe.evaluation.generation import generate as answer_prompts

    run = ctx.wildcards.run
    settings = run_generate_settings(ctx.config, run)
    result = ctx.dispatch(answer_prompts, os.path.dirname(ctx.input[0]), settings,
                          gpus=int(ctx.resources["gpus_per_node"]), step=f"generate {run}")
    for i, out in enumerate(result["outputs"]):
        if out.get("prompt_truncated"):
            ctx.log(f"{settings.prompts_at}[{i}] has {out['prompt_tokens']} tokens, more than fit the context of "
                    f"{result['context_tokens']} with the new tokens: its first "
                    f"{out['prompt_tokens'] - out['prompt_tokens_kept']} tokens were dropped.")
    failed = [out for out in result["outputs"] if "error" in out]
    partial = os.path.join(os.path.dirname(ctx.output[0]), "generate.partial.json")
    if failed:
        ctx.write_json(result, partial)
        answered = len(result["outputs"]) - len(failed)
        kind = RuntimeError if any("exception" in out for out in failed) else ConfigError
        raise kind("\n".join(out["error"] for out in failed) + f"\nThe other prompts' completions ({answered} of "
                   f"{len(result['outputs'])}) and these errors are in {partial}.")
    remove_if_exists(partial)  # a failed run's partial answers are stale now
    ctx.write_json(result)
    return {"generate": generate_settings(ctx.config, run), "resources": ctx.resources}
