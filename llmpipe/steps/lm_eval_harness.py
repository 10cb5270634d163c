"""Second-harness step: lm-evaluation-harness on a run's Hugging Face export (rule ``lm_eval``).

Off by default (``lm_eval.tasks: []``): the rule runs only when ``results/<run>/eval-lm_eval.json`` is requested.
Its inputs are the export and every file of ``lm_eval.data_dir`` (task YAMLs and data), so a changed task or data
file reruns it; a new lm_eval version changes its identity and reruns it too. The job runs on one device: the
run's evaluation resources (``eval.resources``, ``models.<run>.step_resources.eval``) with at most one GPU.
"""

from __future__ import annotations

import os

from llmpipe.config.runs import gpu_memory, gpu_type, run_config, section_path, step_resources
from llmpipe.config.settings import ConfigError
from llmpipe.evaluation import harness
from llmpipe.steps.context import StepContext
from llmpipe.steps.registry import register

#: Bump when a change in our code changes eval-lm_eval.json (reruns the harness).
VERSION = 1

#: The ``lm_eval:`` settings that determine the result (``data_dir``'s files are the rule's inputs).
IDENTITY_KEYS = ("tasks", "num_fewshot", "batch_size", "limit", "dtype")


def lm_eval_identity(config: dict, run: str) -> dict:
    """What determines eval-lm_eval.json besides the export and the task files: the settings and lm_eval's
    version (None when it is not installed; :func:`lm_eval_inputs` refuses that first)."""
    s = config["lm_eval"]
    return {"step": "lm_eval", "version": VERSION, "lm_eval": harness.installed_version(),
            **{k: s.get(k) for k in IDENTITY_KEYS}}


def lm_eval_inputs(config: dict, run: str) -> list[str]:
    """The files of ``lm_eval.data_dir``, after checking the settings (:func:`llmpipe.evaluation.harness.check_inputs`:
    a ConfigError naming the setting when the harness is off, lm_eval is missing or a task has no YAML)."""
    s = config["lm_eval"]
    files = harness.check_inputs(s["tasks"], s["data_dir"], version=harness.installed_version())
    check_fits_one_gpu(config, run)
    return files


def check_fits_one_gpu(config: dict, run: str) -> None:
    """The harness runs the model in one process on at most one GPU: refuse, in the dry run, a model whose
    evaluation plan (:func:`llmpipe.plan.memory_time.inference_memory`, ``lm_eval.batch_size`` sequences) exceeds one GPU of
    ``gpu_type`` by more than :data:`llmpipe.plan.memory_time.MARGIN`.

    Raises:
        ConfigError: naming the estimate, the GPU and the fix.
    """
    from llmpipe.plan import memory_time as plan
    res = step_resources(config, "eval", run)
    rc = run_config(config, run)
    if int(res["gpus_per_node"]) <= 0 or not config.get("gpu_type") or "d_model" not in (rc.get("arch") or {}):
        return
    capacity = gpu_memory(config)
    if capacity is None:  # gpu_type auto and no GPU here: no card to check against
        return
    need = plan.inference_memory(rc, step="eval", batch_size=int(config["lm_eval"]["batch_size"]))["total_gb"]
    if need > capacity * (1 + plan.MARGIN):
        where = section_path(config, run)
        raise ConfigError(f"{where}: lm_eval scores {run} in one process on one GPU, and its evaluation needs about "
                          f"{need:.0f} GiB (llmpipe.plan.memory_time), more than the {capacity:.0f} GiB of one {gpu_type(config)} "
                          f"GPU (gpu_type). Fix: leave results/{run}/eval-lm_eval.json out of the targets (eval.json "
                          f"evaluates it across the node's GPUs), or a GPU with more memory.")


def lm_eval_resources(config: dict, wildcards) -> dict:
    """The harness's job: the run's evaluation resources, one task, at most one GPU (lm_eval's ``hf`` model runs
    in one process here)."""
    res = dict(step_resources(config, "eval", wildcards.run))
    res["gpus_per_node"] = min(1, int(res["gpus_per_node"]))
    res["tasks_per_node"] = 1
    return res


@register("lm_eval", resources=lm_eval_resources, where="eval.resources")
def lm_eval(ctx: StepContext) -> dict:
    """Rule ``lm_eval``: the export scored by lm-evaluation-harness on the local tasks -> eval-lm_eval.json."""
    s = ctx.config["lm_eval"]
    run = ctx.wildcards.run
    device = "cuda" if int(ctx.resources.get("gpus_per_node", 0)) > 0 else "cpu"
    result = ctx.dispatch(harness.evaluate, os.path.abspath(os.path.dirname(ctx.input.model)),
                          os.path.abspath(s["data_dir"]), list(s["tasks"]), batch_size=int(s["batch_size"]),
                          num_fewshot=s["num_fewshot"], limit=s["limit"], dtype=s["dtype"], device=device,
                          step=f"lm_eval {run}")
    result["run"] = run
    ctx.write_json(result)
    return {"lm_eval": s, "resources": ctx.resources}
