"""Evaluation steps: held-out metrics and ICL accuracy of an exported model (rules ``eval`` and ``finetune_eval``).

A pretraining run is evaluated on the val split of its MDS dataset, a finetune on the held-out split of its
instruction set (response tokens only); both on the ICL tasks of ``eval.icl_tasks``.
"""

from __future__ import annotations

import os

from llmpipe.config import run_config, step_resources
from llmpipe.steps.context import StepContext
from llmpipe.steps.data import instructions_identity

#: Bump when a change in our code changes eval.json (reruns evaluation).
VERSIONS = {"eval": 1, "finetune_eval": 1}


def eval_identity(config: dict, run: str) -> dict:
    """What determines eval.json besides its inputs: eval-only settings (val batches, batch size, ICL tasks)."""
    e = config["eval"]
    return {"step": "eval", "version": VERSIONS["eval"], "val_batches": e.get("val_batches"),
            "batch_size": e.get("batch_size"), "icl_tasks": e.get("icl_tasks")}


def finetune_eval_identity(config: dict, run: str) -> dict:
    """What determines a finetune's eval.json: the eval settings, the held-out split and its sequence length."""
    d = run_config(config, run)["data"]
    return {"step": "finetune_eval", "version": VERSIONS["finetune_eval"], "eval": eval_identity(config, run),
            "instructions": instructions_identity(config, d["instructions"]),
            "max_seq_len": int(d["concat_tokens"]), "icl_corpus": d["icl_corpus"]}


def eval_resources(config: dict, wildcards) -> dict:
    """The evaluation job: ``eval.resources`` (a run's ``step_resources.eval`` wins)."""
    return step_resources(config, "eval", wildcards.run)


def icl_files(ctx: StepContext) -> dict[str, str]:
    """ICL task label -> its task file among the rule's ``icl`` inputs (in ``eval.icl_tasks`` order)."""
    return dict(zip([t["label"] for t in ctx.config["eval"]["icl_tasks"]], list(ctx.input.icl), strict=True))


def evaluate(ctx: StepContext) -> dict:
    """Rule ``eval``: held-out loss, perplexity, token accuracy and ICL accuracy of the converted model."""
    from llmpipe.evaluate import evaluate as evaluate_model

    run = ctx.wildcards.run
    result = ctx.dispatch(evaluate_model, run_config(ctx.config, run), os.path.dirname(ctx.input.model),
                          os.path.join(os.path.dirname(ctx.input.data), "mds"), icl_files(ctx),
                          eval_settings=ctx.config["eval"], step=f"eval {run}")
    ctx.write_json(result)
    return {"eval": ctx.config["eval"], "run": run_config(ctx.config, run), "resources": ctx.resources}


def finetune_eval(ctx: StepContext) -> dict:
    """Rule ``finetune_eval``: held-out response-token metrics and ICL accuracy of the finetune's export."""
    from llmpipe.finetune import evaluate_finetune

    run = ctx.wildcards.run
    result = ctx.dispatch(evaluate_finetune, run_config(ctx.config, run), os.path.dirname(ctx.input.model),
                          os.path.dirname(ctx.input.instructions), icl_files(ctx), eval_settings=ctx.config["eval"],
                          step=f"eval {run}")
    ctx.write_json(result)
    return {"eval": ctx.config["eval"], "run": run_config(ctx.config, run), "resources": ctx.resources}
