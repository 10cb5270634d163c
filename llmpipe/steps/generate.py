"""Generation step (rule ``generate``): the exported model answers the configured prompts -> generate.json."""

from __future__ import annotations

import os

from llmpipe.config import step_resources
from llmpipe.steps.context import StepContext

#: Bump when a change in our code changes generate.json (reruns generation).
VERSION = 1

#: The ``generate:`` settings that determine the answers.
IDENTITY_KEYS = ("prompts", "max_new_tokens", "do_sample", "temperature", "top_p", "seed")


def generate_identity(config: dict, run: str) -> dict:
    """What determines generate.json besides the model (its input): prompts and sampling settings."""
    g = config["generate"]
    return {"step": "generate", "version": VERSION, **{k: g.get(k) for k in IDENTITY_KEYS}}


def generate_resources(config: dict, wildcards) -> dict:
    """The generation job: ``generate.resources`` (a run's ``step_resources.generate`` wins)."""
    return step_resources(config, "generate", wildcards.run)


def generate(ctx: StepContext) -> dict:
    """Rule ``generate``: the converted model answers the configured prompts -> generate.json."""
    from llmpipe.generate import generate as answer_prompts

    run = ctx.wildcards.run
    result = ctx.dispatch(answer_prompts, os.path.dirname(ctx.input[0]), ctx.config["generate"],
                          step=f"generate {run}")
    ctx.write_json(result)
    return {"generate": ctx.config["generate"], "resources": ctx.resources}
