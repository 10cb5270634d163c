"""Evaluation of the exported model on unseen data through llm-foundry's evaluator.

Held-out language-modelling metrics (cross entropy, perplexity, token accuracy) on the val split of the run's
MDS dataset, and accuracy on the in-context-learning tasks of the ``eval.icl_tasks`` setting (built by the
project from held-out text, see :mod:`llmpipe.data.icl`). The model is the Hugging Face export
(``hf_causal_lm`` with ``trust_remote_code``), so evaluation also proves the export loads and runs.
"""

from __future__ import annotations

import math
import os
import time


def evaluate(rc: dict, model_dir: str, data_dir: str | None, icl_files: dict[str, str], *, eval_settings: dict,
             eval_loader: dict | None = None) -> dict:
    """Evaluate the Hugging Face model in ``model_dir``; return the eval.json record.

    Args:
        rc: the run's merged settings (:func:`llmpipe.config.run_config`: ``name``, ``data.concat_tokens``).
        model_dir: the Hugging Face export.
        data_dir: the MDS dataset folder (its ``val`` split is used).
        icl_files: ICL task label -> jsonl path.
        eval_settings: the config's ``eval`` section (``batch_size``, ``val_batches``, ``icl_tasks``).
        eval_loader: an llm-foundry loader config for the held-out metrics instead of ``data_dir``'s val split
            (a finetune's held-out instructions, see :func:`llmpipe.finetune.evaluate_finetune`).

    Returns:
        ``{"val": {"loss", "perplexity", "token_accuracy"}, "icl": {label: {"<k>-shot": accuracy}},
        "metrics": every metric llm-foundry computed, "processes", "fsdp" (whether it ran under FSDP), "items_counted"
        (:func:`llmpipe.inference_placement.item_counts`), "seconds", ...}``. Loss in nats per token.
        Every process of the job returns it, each with the metrics summed over all of them (torchmetrics syncs
        when a metric is computed); the step writes rank 0's (:func:`llmpipe.dispatch.run_step`).
    """
    import torch
    from llmfoundry.command_utils import evaluate as foundry_evaluate
    from omegaconf import OmegaConf

    from llmpipe.inference_placement import foundry_parallel_settings, item_counts, node_scratch
    from llmpipe.train import export_dist_env
    dist_env = export_dist_env()
    world = int(dist_env["world_size"])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run = rc["name"]
    ecfg = eval_settings
    seq = int(rc["data"]["concat_tokens"])
    bs = int(ecfg.get("batch_size", 8))
    on_gpu = torch.cuda.is_available()
    tasks = []
    for t in ecfg.get("icl_tasks", []):
        kind = {"cloze": "language_modeling", "cloze_choice": "multiple_choice"}[t.get("kind", "cloze")]
        tasks.append({"label": t["label"], "dataset_uri": os.path.abspath(icl_files[t["label"]]),
                      "num_fewshot": [int(n) for n in t.get("num_fewshot", [0])], "icl_task_type": kind,
                      "continuation_delimiter": "", "example_delimiter": "\n"})
    items = max([int(t.get("num_items", 200)) for t in ecfg.get("icl_tasks", [])] or [0])
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
            "model": {"name": "hf_causal_lm", "pretrained_model_name_or_path": os.path.abspath(model_dir),
                      "pretrained": True, "trust_remote_code": True, "use_auth_token": False},
            "tokenizer": {"name": os.path.abspath(model_dir), "kwargs": {"model_max_length": seq}},
        }],
        "icl_tasks": tasks,
        "icl_subset_num_batches": math.ceil(items / bs) + 1 if items else None,
        "eval_loader": eval_loader if eval_loader is not None else {
                        "name": "text",
                        "dataset": {"local": os.path.abspath(data_dir), "split": "val", "shuffle": False,
                                    "max_seq_len": seq},
                        "drop_last": False, "num_workers": 0, "prefetch_factor": None,
                        "persistent_workers": False},
        "eval_subset_num_batches": int(ecfg.get("val_batches", -1)),
    }
    # more than one process: FSDP across them (llmpipe.inference_placement); metrics are summed over the ranks
    parallel = foundry_parallel_settings(world, on_gpu, cfg["eval_subset_num_batches"], cfg["icl_subset_num_batches"])
    if parallel:
        from llmpipe.fsdp import fsdp_on_cpu
        fsdp_on_cpu()  # a host without a GPU (the CPU test) runs composer's FSDP on the CPU with gloo
        cfg["models"][0]["model"]["init_device"] = parallel.pop("model_init_device")
        cfg.update(parallel)
    t0 = time.time()
    # llm-foundry copies (symlinks) each ICL task file into the working folder; use a node-local scratch folder
    # so nothing lands in the user's folder and shared drives that refuse symlinks are never touched.
    cwd = os.getcwd()
    with node_scratch(dist_env) as scratch:  # one folder for the node's ranks (llm-foundry's ICL file copies)
        os.chdir(scratch)
        try:
            trainers, _ = foundry_evaluate(OmegaConf.create(cfg))
        finally:
            os.chdir(cwd)
    metrics: dict[str, dict[str, float]] = {}
    for label, mets in trainers[0].state.eval_metrics.items():
        metrics[label] = {}
        for name, metric in mets.items():
            try:
                metrics[label][name] = float(metric.compute())
            except Exception:  # noqa: BLE001 - a metric that saw no batch has no value
                continue
    counted = item_counts(trainers[0].state.eval_metrics)  # summed over the ranks
    heldout = metrics.get("eval", {})  # llm-foundry labels a single eval_loader "eval"
    icl = {}
    for label, mets in metrics.items():
        if "/" in label:
            task, shots = label.split("/", 1)
            acc = next((v for k, v in mets.items() if "Accuracy" in k), None)
            icl.setdefault(task, {})[shots] = acc
    loss = heldout.get("LanguageCrossEntropy")
    return {
        "run": run,
        "model": model_dir,
        "val": {"loss": loss, "perplexity": heldout.get("LanguagePerplexity", math.exp(loss) if loss else None),
                "token_accuracy": heldout.get("TokenAccuracy"), "batches": int(ecfg.get("val_batches", -1)),
                "batch_size": bs, "seq_len": seq},
        "icl": icl,
        "metrics": metrics,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "processes": world,
        "fsdp": bool(trainers[0].state.fsdp_enabled),
        "items_counted": counted,
        "seconds": round(time.time() - t0, 2),
    }
