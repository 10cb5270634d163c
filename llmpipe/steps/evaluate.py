"""Evaluation steps: held-out metrics and ICL accuracy of an exported model (rules ``eval`` and ``finetune_eval``).

A pretraining run is evaluated on the val split of its MDS dataset, a finetune on the held-out split of its
instruction set (response tokens only); both on every item of the ICL tasks of the run's suite
(:mod:`llmpipe.evaluation.suites`), whose standard data the rule ``eval_task_data`` fetches beforehand.
"""

from __future__ import annotations

import os

from llmpipe.config.runs import run_config, run_settings, step_resources
from llmpipe.config.stage_settings import EvalSettings
from llmpipe.evaluation import suites as eval_tasks
from llmpipe.steps.context import StepContext
from llmpipe.steps.prepare import instructions_identity
from llmpipe.steps.registry import KEPT_EVAL, register

#: Bump when a change in our code changes eval.json (reruns evaluation).
VERSIONS = {"eval": 3, "finetune_eval": 3, "eval_task_data": 1}


def eval_identity(config: dict, run: str) -> dict:
    """What determines eval.json besides its inputs: eval-only settings (val batches, batch size, ICL batching) and
    the run's ICL suite (its tasks and gauntlet)."""
    e = config["eval"]
    return {"step": "eval", "version": VERSIONS["eval"], "val_batches": e.get("val_batches"),
            "batch_size": e.get("batch_size"), "icl_batches": e["icl_batches"],
            **eval_tasks.suite_identity(config, run)}


def eval_task_data_identity(config: dict, suite: str) -> dict:
    """What determines a suite's fetched task files: the files and where they come from (a local mirror's folder
    is left out, as for corpora: the same files read from another path are the same files)."""
    td = config["eval"]["task_data"]
    return {"step": "eval_task_data", "version": VERSIONS["eval_task_data"],
            "files": eval_tasks.foundry_files(eval_tasks.suite(config, suite)["icl_tasks"]),
            "revision": td.get("revision"), "base_url": td.get("base_url") if td.get("source") != "local" else None}


def finetune_eval_identity(config: dict, run: str) -> dict:
    """What determines a finetune's eval.json: the eval settings, the held-out split and its sequence length."""
    d = run_config(config, run)["data"]
    return {"step": "finetune_eval", "version": VERSIONS["finetune_eval"], "eval": eval_identity(config, run),
            "instructions": instructions_identity(config, d["instructions"]),
            "max_seq_len": int(d["concat_tokens"]), "icl_corpus": d["icl_corpus"]}


def eval_resources(config: dict, wildcards) -> dict:
    """The evaluation job: ``eval.resources`` (a run's ``step_resources.eval`` wins)."""
    return step_resources(config, "eval", wildcards.run)


def icl_suite(ctx: StepContext) -> tuple[dict, dict[str, str]]:
    """The run's suite (``name``, ``icl_tasks``, ``eval_gauntlet``) and ICL task label -> the file it is scored on
    (:func:`llmpipe.evaluation.suites.task_path`; the rule's inputs are those files or the manifest of their folder)."""
    run = ctx.wildcards.run
    name, s = eval_tasks.run_suite(ctx.config, run)
    corpus = run_config(ctx.config, run)["data"]["corpus"]
    files = {t["label"]: eval_tasks.task_path(t, results_dir=ctx.config["results_dir"], corpus=corpus, suite=name)
             for t in s["icl_tasks"]}
    return {"name": name, "icl_tasks": s["icl_tasks"], "eval_gauntlet": s["eval_gauntlet"]}, files


def finish_timing(result: dict) -> None:
    """Complete eval.json's ``timing`` just before the step writes it: the job's hand-back and its wall time, job
    start to eval.json (:func:`llmpipe.evaluation.step_clock.finish`)."""
    from llmpipe.evaluation.step_clock import finish

    if result.get("timing") is not None:
        finish(result["timing"])


@register("eval_task_data")
def eval_task_data(ctx: StepContext) -> dict:
    """Rule ``eval_task_data``: fetch (or copy from ``eval.task_data.local_dir``) the llm-foundry task files of
    a suite, here on the machine running Snakemake (compute nodes are often offline)."""
    from llmpipe.evaluation.task_data import fetch_task_files

    suite = ctx.wildcards.suite
    td = ctx.config["eval"]["task_data"]
    files = eval_tasks.foundry_files(eval_tasks.suite(ctx.config, suite)["icl_tasks"])
    manifest = fetch_task_files(files, os.path.dirname(ctx.output[0]), td)
    ctx.log(f"{len(files)} task files of suite {suite} from {manifest.get('local_dir') or manifest['base_url']}")
    return {"task_data": td, "files": files}


@register("eval", resources=eval_resources, where="eval.resources", plan="eval", kept=KEPT_EVAL)
def evaluate(ctx: StepContext) -> dict:
    """Rule ``eval``: held-out loss, perplexity, token accuracy and ICL accuracy of the converted model."""
    from llmpipe.evaluation.icl_eval import evaluate as evaluate_model

    run = ctx.wildcards.run
    suite, files = icl_suite(ctx)
    result = ctx.dispatch(evaluate_model, run_settings(ctx.config, run), os.path.dirname(ctx.input.model),
                          os.path.join(os.path.dirname(ctx.input.data), "mds"), files,
                          eval_settings=EvalSettings.from_section(ctx.config["eval"]), suite=suite,
                          step=f"eval {run}")
    finish_timing(result)
    ctx.write_json(result)
    return {"eval": ctx.config["eval"], "run": run_config(ctx.config, run), "resources": ctx.resources}


@register("finetune_eval", resources=eval_resources, where="eval.resources", plan="eval", kept=KEPT_EVAL)
def finetune_eval(ctx: StepContext) -> dict:
    """Rule ``finetune_eval``: held-out response-token metrics and ICL accuracy of the finetune's export."""
    from llmpipe.train.finetune import evaluate_finetune

    run = ctx.wildcards.run
    suite, files = icl_suite(ctx)
    result = ctx.dispatch(evaluate_finetune, run_settings(ctx.config, run), os.path.dirname(ctx.input.model),
                          os.path.dirname(ctx.input.instructions), files,
                          eval_settings=EvalSettings.from_section(ctx.config["eval"]), suite=suite,
                          step=f"eval {run}")
    finish_timing(result)
    ctx.write_json(result)
    return {"eval": ctx.config["eval"], "run": run_config(ctx.config, run), "resources": ctx.resources}
