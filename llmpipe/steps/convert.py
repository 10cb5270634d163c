"""Export step (rule ``convert``): the final composer checkpoint -> a Hugging Face folder ``results/<run>/hf``."""

from __future__ import annotations

import os

from llmpipe.config.runs import run_settings, step_resources
from llmpipe.config.stage_settings import ConvertSettings
from llmpipe.steps.context import StepContext, read_json
from llmpipe.steps.registry import KEPT_EXPORT, register

#: Bump when a change in our code changes the exported folder (reruns conversion and everything after it).
VERSION = 3

#: Bump when a change in our code changes the exported *weights*; a finetune of one of our runs names this one in
#: its identity (:func:`weights_identity`), so a change of the export's other files (its tokenizer settings, version
#: 3) reconverts the base but does not retrain its finetunes.
WEIGHTS_VERSION = 2


def convert_identity(config: dict, run: str) -> dict:
    """What determines the exported Hugging Face folder besides the trained model (its input): the export dtype
    and the largest safetensors file."""
    return {"step": "convert", "version": VERSION, "dtype": config["convert"]["dtype"],
            "max_shard_size": config["convert"]["max_shard_size"]}


def weights_identity(config: dict, run: str) -> dict:
    """What determines the exported weights of ``run`` (a finetune's base): :func:`convert_identity` with
    :data:`WEIGHTS_VERSION` in place of :data:`VERSION`."""
    return {**convert_identity(config, run), "version": WEIGHTS_VERSION}


def convert_resources(config: dict, wildcards) -> dict:
    """The export job: ``convert.resources`` (a run's ``step_resources.convert`` wins)."""
    return step_resources(config, "convert", wildcards.run)


@register("convert", resources=convert_resources, where="convert.resources", plan="convert", kept=KEPT_EXPORT)
def convert(ctx: StepContext) -> dict:
    """Rule ``convert``: export the final checkpoint to a Hugging Face folder (written aside, then renamed)."""
    from llmpipe.hf.export import convert_checkpoint

    run = ctx.wildcards.run
    checkpoint = os.path.abspath(read_json(ctx.input.train)["final_checkpoint"])
    export = ConvertSettings.from_section(ctx.config["convert"])
    settings = run_settings(ctx.config, run)
    base_path = None
    if settings.kind == "finetune":  # a LoRA checkpoint holds the adapters only: the base weights are read here
        from llmpipe.train.finetune import base_model_path
        base_path = base_model_path(settings, results_dir=ctx.config["results_dir"])
    ctx.dispatch(convert_checkpoint, settings, checkpoint, os.path.dirname(ctx.input.tokenizer),
                 os.path.dirname(ctx.output[0]), export, base_path=base_path, step=f"convert {run}")
    return {"checkpoint": checkpoint, "dtype": export.dtype, "resources": ctx.resources}
