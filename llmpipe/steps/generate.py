"""Generation step (rule ``generate``): the exported model answers the configured prompts -> generate.json.

A prompt too long for the model's context is truncated from the left and recorded in generate.json
(``generate.long_prompts: truncate``), or (``fail``) the step fails naming it, after writing the other prompts'
completions to ``generate.partial.json`` beside the output (:mod:`llmpipe.generate`)."""

from __future__ import annotations

import os

from llmpipe.atomic import remove_if_exists
from llmpipe.config import ConfigError, step_resources
from llmpipe.steps.context import StepContext

#: Bump when a change in our code changes generate.json (reruns generation).
VERSION = 2

#: The ``generate:`` settings that determine the answers.
IDENTITY_KEYS = ("prompts", "max_new_tokens", "do_sample", "temperature", "top_p", "seed", "long_prompts")


def generate_identity(config: dict, run: str) -> dict:
    """What determines generate.json besides the model (its input): prompts and sampling settings."""
    g = config["generate"]
    return {"step": "generate", "version": VERSION, **{k: g.get(k) for k in IDENTITY_KEYS}}


def generate_resources(config: dict, wildcards) -> dict:
    """The generation job: ``generate.resources`` (a run's ``step_resources.generate`` wins)."""
    return step_resources(config, "generate", wildcards.run)


def generate(ctx: StepContext) -> dict:
    """Rule ``generate``: the converted model answers the configured prompts -> generate.json.

    Raises:
        ConfigError: with ``generate.long_prompts: fail``, a prompt too long for the context (each one named, with
            the context length); the other prompts' completions are in ``generate.partial.json`` beside the output.
    """
    from llmpipe.generate import generate as answer_prompts

    run = ctx.wildcards.run
    result = ctx.dispatch(answer_prompts, os.path.dirname(ctx.input[0]), ctx.config["generate"],
                          gpus=int(ctx.resources["gpus_per_node"]), step=f"generate {run}")
    for i, out in enumerate(result["outputs"]):
        if out.get("prompt_truncated"):
            ctx.log(f"generate.prompts[{i}] has {out['prompt_tokens']} tokens, more than fit the context of "
                    f"{result['context_tokens']} with the new tokens: its first "
                    f"{out['prompt_tokens'] - out['prompt_tokens_kept']} tokens were dropped.")
    errors = [out["error"] for out in result["outputs"] if "error" in out]
    partial = os.path.join(os.path.dirname(ctx.output[0]), "generate.partial.json")
    if errors:
        ctx.write_json(result, partial)
        raise ConfigError("\n".join(errors) + f"\nThe other prompts' completions are in {partial}.")
    remove_if_exists(partial)  # a failed run's partial answers are stale now
    ctx.write_json(result)
    return {"generate": ctx.config["generate"], "resources": ctx.resources}
