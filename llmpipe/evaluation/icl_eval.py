"""Evaluation of the exported model on unseen data through llm-foundry's evaluator.

Held-out language-modelling metrics (cross entropy, perplexity, token accuracy) on the val split of the run's
MDS dataset (``eval.val_batches`` batches), and accuracy on every item of the in-context-learning tasks of the
run's suite (:mod:`llmpipe.evaluation.suites`: llm-foundry's standard tasks, or tasks built by the project from
held-out text, see :mod:`llmpipe.data.icl`), with the items scored and the eval-gauntlet average. The model is the Hugging Face export
(``hf_causal_lm`` with ``trust_remote_code``), so evaluation also proves the export loads and runs.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time

from llmpipe.config.settings import RunSettings
from llmpipe.config.stage_settings import EvalSettings
from llmpipe.evaluation import icl_batches, icl_tokens, shared_prefix, step_clock
from llmpipe.evaluation import suites as eval_tasks


def evaluate(settings: RunSettings, model_dir: str, data_dir: str | None, icl_files: dict[str, str], *,
             eval_settings: EvalSettings, suite: dict, eval_loader: dict | None = None,
             callbacks: dict[str, dict] | None = None) -> dict:
    """Evaluate the Hugging Face model in ``model_dir``; return the eval.json record.

    Args:
        settings: the run's typed settings (:func:`llmpipe.config.runs.run_settings`: its ``name``, and
            ``data.concat_tokens``, the sequence length in tokens).
        model_dir: the Hugging Face export.
        data_dir: the MDS dataset folder (its ``val`` split is used).
        icl_files: ICL task label -> the local jsonl file it is scored on (every task of ``suite``).
        eval_settings: the ``eval:`` settings (``batch_size`` per device, ``val_batches`` over all processes,
            ``icl_batches``: :func:`llmpipe.evaluation.icl_batches.icl_task_configs`).
        suite: the run's ICL suite (:func:`llmpipe.evaluation.suites.run_suite`: ``name``, ``icl_tasks``,
            ``eval_gauntlet``, which may be None).
        eval_loader: an llm-foundry loader config for the held-out metrics instead of ``data_dir``'s val split
            (a finetune's held-out instructions, see :func:`llmpipe.train.finetune.evaluate_finetune`).
        callbacks: more composer callbacks for llm-foundry's evaluation, registry name -> settings (e.g. a
            benchmark's per-item record, ``tools/bench_icl_eval.py``).

    Returns:
        ``{"harness": "llm-foundry <version>", "val": {"loss", "perplexity", "token_accuracy", "tokens" (count),
        "split" ("val"), "token_scope" ("all": every token of the held-out text)}, "icl": {label: {"<k>-shot":
        accuracy}}, "tasks": {label: {"<k>-shot": {"accuracy", "items", "items_cut" (items whose context llm-foundry
        cut from the left to fit ``seq_len``, :func:`llmpipe.evaluation.icl_tokens.context_fit`), "tokens_planned"
        (input tokens of its batches over all processes, :func:`llmpipe.evaluation.icl_tokens.batch_tokens`), ...}}}, "not_scored": {label:
        {"reason", ...}} (tasks left out because an answer leaves no context token,
        :func:`llmpipe.evaluation.icl_tokens.task_fits`), "gauntlet": :func:`llmpipe.evaluation.suites.gauntlet_average` (``partial``
        when a benchmark has no score), "icl_batches" (``trimmed`` or ``padded``), "metrics": every metric llm-foundry computed,
        "processes", "fsdp" (whether it ran under FSDP), "seconds" (llm-foundry's start to the record), "timing" (rank 0's
        ``to_first_batch_s``, ``batches_s``, ``evaluators_s``, ``tokens_run``: the callback's ``timing``; ``planned``:
        :func:`planned_batches`; ``phases``, ``job_s``, ``wall_s``, ``returned_at``: where the job's time went,
        :meth:`llmpipe.evaluation.step_clock.StepClock.phases`, completed by
        :func:`llmpipe.evaluation.step_clock.finish` where eval.json is written), ...}``. Loss in nats per token. Every process
        of the job returns it, each with the metrics and counts summed over all of them (torchmetrics syncs when a
        metric is computed); the step writes rank 0's (:func:`llmpipe.dispatch.jobs.run_step`).

    Raises:
        ValueError: a metric saw no data (it would be NaN), or an ICL task scored another number of items than it
            has (:func:`llmpipe.evaluation.suites.task_scores`).
    """
    clock = step_clock.StepClock()
    import llmfoundry
    import torch
    from llmfoundry.command_utils import evaluate as foundry_evaluate
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from llmpipe.plan.inference_placement import foundry_parallel_settings, node_scratch, per_rank_batches
    from llmpipe.dispatch.rendezvous import export_dist_env
    clock.mark("imports_s")
    dist_env = export_dist_env()
    world = int(dist_env["world_size"])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run = settings.name
    seq = int(settings.data.concat_tokens)
    bs = int(eval_settings.batch_size)
    on_gpu = torch.cuda.is_available()
    scratch = tempfile.mkdtemp(prefix="llmpipe-eval-")
    tasks, task_info = eval_tasks.foundry_tasks(suite["icl_tasks"], icl_files, os.path.join(scratch, "subsets"))
    # before the model loads: a task with an answer that leaves no context token would stop llm-foundry's whole
    # evaluation; it is left out and recorded, the others are scored
    tokenizer = AutoTokenizer.from_pretrained(os.path.abspath(model_dir), model_max_length=int(1e30))
    encoder = icl_tokens.Encoder.from_transformers(tokenizer)
    fits, not_scored = icl_tokens.task_fits(tasks, encoder, seq, f"data.concat_tokens of {run}",
                                            batching=(bs, eval_settings.icl_batches, world))
    tasks = [t for t in tasks if t["label"] not in not_scored]
    for label, rec in not_scored.items():
        rec["items_in_file"] = task_info.pop(label)["items_in_file"]
        if int(dist_env.get("rank", 0)) == 0:
            print(f"[llmpipe] eval {run}: not scored: {rec['reason']}", flush=True)
    for label, by_shot in fits.items():
        for shots, fit in by_shot.items():
            if fit["items_cut"] and int(dist_env.get("rank", 0)) == 0:
                print(f"[llmpipe] eval {run}: {label} {shots}: {fit['items_cut']} of {fit['items']} items cut from "
                      f"the left to fit the {fit['max_seq_len']}-token context", flush=True)
    cfg = {
        "run_name": f"eval-{run}",
        "seed": 17,
        "max_seq_len": seq,
        "device_eval_batch_size": bs,
        "precision": "amp_bf16" if on_gpu else "fp32",
        "python_log_level": "info",
        "log_config": False,
        "models": [{
            "model_name": run,
            "model": {"name": (shared_prefix.register_prefix_model() if eval_settings.icl_batches == "shared_prefix"
                               else "hf_causal_lm"),
                      "pretrained_model_name_or_path": os.path.abspath(model_dir),
                      "pretrained": True, "trust_remote_code": True, "use_auth_token": False},
            "tokenizer": {"name": os.path.abspath(model_dir), "kwargs": {"model_max_length": seq}},
        }],
        "icl_tasks": icl_batches.icl_task_configs(tasks, eval_settings.icl_batches),
        "icl_subset_num_batches": None,  # every item of every ICL task (subsets are files: subset_items)
        "eval_loader": eval_loader if eval_loader is not None else {
                        "name": "text",
                        "dataset": {"local": os.path.abspath(data_dir), "split": "val", "shuffle": False,
                                    "max_seq_len": seq},
                        "drop_last": False, "num_workers": 0, "prefetch_factor": None,
                        "persistent_workers": False},
        # -1 here: Trainer.eval would cap the ICL tasks too; the held-out loader is capped by this callback
        "eval_subset_num_batches": -1,
        "callbacks": {eval_tasks.register_heldout_cap(): {"batches": int(eval_settings.val_batches)},
                      # after the cap: it reads the capped length; the held-out loader and each task's shot counts
                      register_eval_progress(): {"evaluators": 1 + sum(len(t.get("num_fewshot") or [0])
                                                                       for t in tasks)},
                      **(callbacks or {})},
    }
    # more than one process: FSDP across them (llmpipe.plan.inference_placement); metrics are summed over the ranks
    parallel = foundry_parallel_settings(world, on_gpu, cfg["eval_subset_num_batches"], cfg["icl_subset_num_batches"])
    if parallel:
        from llmpipe.train.fsdp import fsdp_on_cpu
        fsdp_on_cpu()  # a host without a GPU (the CPU test) runs composer's FSDP on the CPU with gloo
        cfg["models"][0]["model"]["init_device"] = parallel.pop("model_init_device")
        cfg.update(parallel)
        cap = cfg["callbacks"][eval_tasks.register_heldout_cap()]
        cap["batches"] = per_rank_batches(cap["batches"], world)  # val_batches counts batches over all ranks
    t0 = time.monotonic()
    clock.mark("task_check_s", t0)
    # llm-foundry copies (symlinks) each ICL task file into the working folder; use a node-local scratch folder
    # so nothing lands in the user's folder and shared drives that refuse symlinks are never touched.
    cwd = os.getcwd()
    try:
        with node_scratch(dist_env) as work:  # one folder for the node's ranks (llm-foundry's ICL file copies)
            os.chdir(work)
            try:
                trainers, _ = foundry_evaluate(OmegaConf.create(cfg))
            finally:
                os.chdir(cwd)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    state_metrics = trainers[0].state.eval_metrics
    progress_cb = next((cb for cb in trainers[0].state.callbacks if hasattr(cb, "timing")), None)
    timing = progress_cb.timing(t0) if progress_cb is not None else None
    if timing is not None:
        timing["planned"] = planned_batches(settings, fits, tasks, eval_settings, world,
                                            torch.cuda.get_device_name() if on_gpu else "cpu")
    metrics: dict[str, dict[str, float]] = {}
    for label, mets in state_metrics.items():
        metrics[label] = {}
        for name, metric in mets.items():
            value = float(metric.compute())
            if not math.isfinite(value):
                raise ValueError(f"evaluation metric {label}/{name} is {value}: it saw no data. Fix: check "
                                 f"eval.val_batches and the held-out data of {run}.")
            metrics[label][name] = value
    heldout = metrics.get("eval", {})  # llm-foundry labels a single eval_loader "eval"
    ce = state_metrics.get("eval", {}).get("LanguageCrossEntropy")
    tokens = int(eval_tasks.metric_states(ce, "total_items")[0]) if ce is not None else 0
    if not tokens:
        raise ValueError(f"the held-out evaluation of {run} scored no token. Fix: check its held-out data.")
    scores = eval_tasks.task_scores(state_metrics, task_info)
    icl = {task: {shots: rec["accuracy"] for shots, rec in by_shot.items()} for task, by_shot in scores.items()}
    for task, by_shot in scores.items():
        for shots, rec in by_shot.items():
            rec.update({k: task_info[task][k] for k in ("items_in_file", "subset", "icl_task_type")})
            rec["items_cut"] = fits[task][shots]["items_cut"]
            rec["tokens_planned"] = fits[task][shots]["tokens_planned"]
    loss = heldout.get("LanguageCrossEntropy")
    if timing is not None:
        for phase, at in zip(("datasets_s", "model_load_s", "trainer_s", "batches_s"), progress_cb.marks()):
            if at is not None:
                clock.mark(phase, at)
    seconds = round(time.monotonic() - t0, 2)
    clock.mark("results_s")
    if timing is not None:
        timing.update(clock.phases())
    step_clock.leave_objects_to_exit()
    return {
        "run": run,
        "kind": "pretrain",  # llmpipe.train.finetune.evaluate_finetune writes "finetune"
        "model": model_dir,
        "val": {"loss": loss, "perplexity": heldout.get("LanguagePerplexity", math.exp(loss) if loss else None),
                "token_accuracy": heldout.get("TokenAccuracy"), "tokens": tokens,
                "batches": int(eval_settings.val_batches),
                "batch_size": bs, "seq_len": seq, "split": "val", "token_scope": "all"},
        "harness": f"llm-foundry {llmfoundry.__version__}",
        "icl_batches": eval_settings.icl_batches,
        "suite": suite.get("name"),
        "icl": icl,
        "tasks": scores,
        "not_scored": not_scored,
        "gauntlet": eval_tasks.gauntlet_average(scores, suite.get("eval_gauntlet")),
        "metrics": metrics,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "processes": world,
        "fsdp": bool(trainers[0].state.fsdp_enabled),
        "seconds": seconds,
        "timing": timing,
    }


def planned_batches(settings: RunSettings, fits: dict, tasks: list[dict], eval_settings: EvalSettings, world: int,
                    device: str) -> dict | None:
    """The time plan of this evaluation's batches (:func:`llmpipe.plan.eval_time.plan_seconds`) from its exact
    batches (the few-shot examples llm-foundry draws): ``{"batches_s", "evaluators_s", "basis"}`` to set beside the
    measured ``timing``, or None without the committed constants for ``device`` (``cpu`` or the GPU's name).

    Args:
        fits: :func:`llmpipe.evaluation.icl_tokens.task_fits` with ``batching`` (each fit's ``batch_shapes`` and
            ``forward_shapes``).
        tasks: llm-foundry's task list of the scored tasks (``label``, ``icl_task_type``).
        world: the job's processes.
    """
    from llmpipe.plan import eval_time

    basis = eval_time.load_basis(device)
    if basis is None:
        return None
    seq = int(settings.data.concat_tokens)
    works = [eval_time.heldout_work(eval_settings.val_batches, eval_settings.batch_size, seq, world)]
    for t in tasks:
        generation = t["icl_task_type"] == "generation_task_with_answers"
        for shots, fit in fits[t["label"]].items():
            works.append(eval_time.EvaluatorWork(f"{t['label']}/{shots}", tuple(fit["batch_shapes"]),
                                                 int(fit["longest_answer_tokens"]) if generation else 0, world,
                                                 tuple(fit["forward_shapes"])))
    plan = eval_time.plan_seconds(settings.arch.as_dict(), works, basis)
    return {"batches_s": round(plan["batches_s"], 3),
            "evaluators_s": {k: round(v, 3) for k, v in plan["evaluators_s"].items()}, "basis": plan["basis"]}


#: The registry name of :func:`register_eval_progress`'s callback.
EVAL_PROGRESS = "llmpipe_eval_progress"


def register_eval_progress() -> str:
    """Register (once) a composer callback that writes the evaluation's progress record on rank 0
    (:func:`llmpipe.dispatch.progress.update`): per evaluator (an ICL task and shot count, or the held-out loader) the items
    done of this rank's share (the dataloader's sampler length; batches for a loader without one, e.g. the held-out
    stream), with ``task i/n`` (``n``: the callback's ``evaluators`` setting; composer evaluates one at a time).
    Return its registry name."""
    from composer.core import Callback
    from composer.utils import dist
    from llmfoundry.registry import callbacks

    from llmpipe.dispatch import progress

    class EvalProgress(Callback):
        """The progress record of an evaluation: items (or batches) of the current evaluator, and which one; and
        where the time goes (:meth:`timing`)."""

        def __init__(self, evaluators: int | None = None) -> None:
            self.index, self.items, self.evaluators = 0, None, evaluators
            self.built_at = time.monotonic()   # llm-foundry builds callbacks after its datasets, before the model
            self.init_at = self.first_batch_at = self.last_batch_at = self._started = None
            self.seconds: dict[str, float] = {}
            self.tokens: dict[str, int] = {}

        def init(self, state, logger) -> None:  # noqa: ARG002 - composer's callback signature
            self.init_at = time.monotonic()      # composer's Trainer holds the model, on its device

        def eval_start(self, state, logger) -> None:  # noqa: ARG002
            self.index += 1
            self._started = time.time()
            sampler = getattr(state.dataloader, "sampler", None)
            try:
                self.items = len(sampler) if sampler is not None else None
            except TypeError:   # an iterable dataset's sampler has no length
                self.items = None
            self._write(state, force=True)

        def eval_batch_start(self, state, logger) -> None:  # noqa: ARG002
            if self.first_batch_at is None:
                self.first_batch_at = time.monotonic()
            ids = state.batch.get("input_ids") if isinstance(state.batch, dict) else None
            if ids is not None:
                self.tokens[state.dataloader_label] = self.tokens.get(state.dataloader_label, 0) + int(ids.numel())

        def eval_batch_end(self, state, logger) -> None:  # noqa: ARG002
            self.last_batch_at = time.monotonic()
            self._write(state, force=False)

        def eval_end(self, state, logger) -> None:  # noqa: ARG002
            self.seconds[state.dataloader_label] = round(time.time() - self._started, 3)
            self._write(state, force=True)

        def marks(self) -> tuple[float | None, ...]:
            """``time.monotonic()`` when the callback was built (llm-foundry's datasets built), at composer's
            ``INIT`` (the model loaded), at the first eval batch's start and at the last one's end (None: not yet)."""
            return self.built_at, self.init_at, self.first_batch_at, self.last_batch_at

        def timing(self, started_at: float) -> dict:
            """This rank's ``{"to_first_batch_s": seconds from ``started_at`` (a ``time.monotonic()`` reading
            before llm-foundry's model load and datasets' build) to the first eval batch, "batches_s": first eval batch start to last eval batch end,
            "evaluators_s": {label: seconds}, "tokens_run": {label: input tokens of its batches, padding
            included}}``."""
            first, last = self.first_batch_at, self.last_batch_at
            return {"to_first_batch_s": None if first is None else round(first - started_at, 3),
                    "batches_s": None if first is None or last is None else round(last - first, 3),
                    "evaluators_s": dict(self.seconds), "tokens_run": dict(self.tokens)}

        def _write(self, state, force: bool) -> None:
            if dist.get_global_rank() != 0:
                return
            figures = {"task": f"{self.index}/{self.evaluators or '?'}"}
            if self.items:
                done, total, unit = int(state.eval_timestamp.sample), self.items, "item"
            else:
                done, total, unit = int(state.eval_timestamp.batch), state.dataloader_len, "batch"
            progress.update(done, None if total is None else int(total), unit, task=state.dataloader_label,
                            figures=figures, force=force, since=self._started)

    if EVAL_PROGRESS not in callbacks.get_all():
        callbacks.register(EVAL_PROGRESS, func=EvalProgress)
    return EVAL_PROGRESS
