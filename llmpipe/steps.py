"""Glue between Snakemake rules and the step logic: what each ``scripts/*.py`` calls with its ``snakemake`` object.

Each function reads the rule's inputs, outputs, wildcards and config, dispatches the heavy work through
:mod:`llmpipe.dispatch` and writes the rule's output atomically (a temporary file renamed into place), so a
killed step never leaves an output that looks complete.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import traceback
from typing import Any

from llmpipe import dispatch
from llmpipe.atomic import atomic_write_json as write_json
from llmpipe.config import is_finetune, run_config, step_resources


def read_json(path: str) -> Any:
    with open(path) as fh:
        return json.load(fh)


def _logged(step_fn):
    """Append the error of a failing step to the rule's log, so `--show-failed-logs` shows why it failed."""

    @functools.wraps(step_fn)
    def wrapper(smk):
        dispatch.normalize_thread_env()  # threads: 0 of Slurm-waiting rules -> OMP_NUM_THREADS=0 from Snakemake
        try:
            return step_fn(smk)
        except Exception as exc:
            with open(smk.log[0], "a") as fh:
                fh.write(f"\nERROR: {type(exc).__name__}: {exc}\n")
                if not isinstance(exc, (dispatch.StepFailed, ValueError)):
                    fh.write(traceback.format_exc())
            raise

    return wrapper


def _log_dir(smk, step: str, name: str) -> str:
    return os.path.join(smk.config["results_dir"], "logs", step, f"{name}.submitit")


def _start_log(smk) -> str:
    log_file = smk.log[0]
    os.makedirs(os.path.dirname(log_file), exist_ok=True)
    open(log_file, "w").close()
    return log_file


def check_vocab_fits(tok_manifest: dict, rc: dict, run: str) -> None:
    """Raise ValueError (naming the setting and the fix) when the tokenizer has more tokens than the model."""
    if int(tok_manifest["vocab_size"]) > int(rc["arch"]["vocab_size"]):
        raise ValueError(f"the tokenizer {rc['data']['tokenizer']} has {tok_manifest['vocab_size']} tokens but "
                         f"models.{run}.arch.vocab_size is {rc['arch']['vocab_size']}. Fix: raise vocab_size.")


def check_all_steps(result: dict | None, rc: dict, label: str) -> None:
    """Raise RuntimeError unless a training ``result`` reached ``train.max_duration_batches`` steps."""
    want = int(rc["train"]["max_duration_batches"])
    if result is None or result.get("steps") != want:
        raise RuntimeError(f"{label}: training ended at step {None if result is None else result.get('steps')} "
                           f"instead of {want}")


def training_task(smk, config: dict, run: str, rc: dict):
    """The task a training rule (``train``, ``finetune``, ``scaling_train``) dispatches for ``run``.

    A finetune gets :class:`llmpipe.finetune.FinetuneTask` (instruction set ``smk.input.instructions``, its base
    model; ``peft`` is checked first when LoRA is on), a pretraining run :class:`llmpipe.train.TrainTask` (the MDS
    dataset beside ``smk.input.data``; the tokenizer must fit the model's vocabulary). Both write into the folder of
    ``smk.output[0]`` under the identity ``smk.params.identity``.

    Raises:
        ValueError / ConfigError: the tokenizer does not fit, or LoRA is on without ``peft`` (before any job waits
            in a queue).
    """
    run_dir = os.path.dirname(smk.output[0])
    tok_dir = os.path.dirname(smk.input.tokenizer)
    if is_finetune(config, run):
        from llmpipe.finetune import FinetuneTask, base_model_path, require_peft
        require_peft(config, run)
        return FinetuneTask(config, run, os.path.dirname(smk.input.instructions), tok_dir, run_dir,
                            smk.params.identity, base_model_path(config, run))
    from llmpipe.train import TrainTask
    check_vocab_fits(read_json(smk.input.tokenizer), rc, run)
    return TrainTask(config, run, os.path.join(os.path.dirname(smk.input.data), "mds"), tok_dir, run_dir,
                     smk.params.identity)


def _key(smk, step: str) -> str:
    return dispatch.job_key(step, list(smk.output), list(smk.params))


@_logged
def corpus(smk) -> None:
    """Rule ``corpus``: write or download a corpus in C4's layout (on the submitting machine: it needs the hub)."""
    from llmpipe.data.corpus import prepare_corpus
    log_file = _start_log(smk)
    name = smk.wildcards.corpus
    out_dir = os.path.dirname(smk.output[0])
    conf = dispatch.with_executor(smk.config, "local" if smk.config["dispatch"]["executor"] != "debug" else None)
    dispatch.run_step(prepare_corpus, dict(smk.config["corpora"][name], key=name), out_dir, step=f"corpus {name}",
                      resources=dict(step_resources(smk.config, "data"), tasks_per_node=1, nodes=1),
                      config=conf, log_dir=_log_dir(smk, "corpus", name), key=_key(smk, "corpus"),
                      log_file=log_file)
    if not os.path.exists(smk.output[0]):
        raise RuntimeError(f"corpus {name}: {smk.output[0]} was not written")


@_logged
def tokenizer(smk) -> None:
    """Rule ``tokenizer``: fetch, copy or train the tokenizer into ``results/tokenizers/{name}/``."""
    from llmpipe.data.tokenizer import prepare_tokenizer
    log_file = _start_log(smk)
    name = smk.wildcards.tokenizer
    out_dir = os.path.dirname(smk.output[0])
    corpus_manifest = smk.input[0] if len(smk.input) else None
    conf = dispatch.with_executor(smk.config, "local" if smk.config["dispatch"]["executor"] != "debug" else None)
    dispatch.run_step(prepare_tokenizer, dict(smk.config["tokenizers"][name], key=name), out_dir, corpus_manifest,
                      step=f"tokenizer {name}",
                      resources=dict(step_resources(smk.config, "data"), tasks_per_node=1, nodes=1),
                      config=conf, log_dir=_log_dir(smk, "tokenizer", name), key=_key(smk, "tokenizer"),
                      log_file=log_file)


@_logged
def mds(smk) -> None:
    """Rule ``mds``: tokenize and concatenate the corpus into MDS shards, one parallel unit per input file."""
    from llmpipe.mds_dispatch import convert_dataset
    log_file = _start_log(smk)
    tok = smk.config["tokenizers"][smk.wildcards.tokenizer]
    out_dir = os.path.dirname(smk.output[0])
    name = f"{smk.wildcards.corpus}-{smk.wildcards.tokenizer}-concat{smk.wildcards.concat}"
    convert_dataset(smk.input.corpus, os.path.dirname(smk.input.tokenizer), int(smk.wildcards.concat),
                    tok["eos_text"], out_dir, config=smk.config, log_dir=_log_dir(smk, "mds", name),
                    log_file=log_file)


@_logged
def verify_mds(smk) -> None:
    """Rule ``verify_mds``: read the merged dataset back and check counts, lengths, vocabulary and text."""
    from llmpipe.data.mds_verify import verify_dataset
    _start_log(smk)
    tok_manifest = read_json(smk.input.tokenizer)
    verify_dataset(os.path.dirname(smk.input.mds), os.path.dirname(smk.input.tokenizer), int(smk.wildcards.concat),
                   int(tok_manifest["vocab_size"]), smk.output[0])


@_logged
def icl_task(smk) -> None:
    """Rule ``icl_task``: build an in-context-learning task from held-out (validation) text."""
    from llmpipe.data.icl import build_cloze_choice_task, build_cloze_task
    _start_log(smk)
    task = next(t for t in smk.config["eval"]["icl_tasks"] if t["label"] == smk.wildcards.label)
    kind = task.get("kind", "cloze")
    builders = {"cloze": build_cloze_task, "cloze_choice": build_cloze_choice_task}
    if kind not in builders:
        raise ValueError(f"eval.icl_tasks[{task['label']}].kind is {kind!r}; it must be one of {sorted(builders)}.")
    builders[kind](smk.input[0], smk.output[0], int(task.get("num_items", 200)), int(task.get("seed", 17)))


@_logged
def train(smk) -> None:
    """Rule ``train``: pretrain one run on ``nodes x tasks_per_node`` ranks; write train.json from rank 0."""
    log_file = _start_log(smk)
    run = smk.wildcards.run
    config = smk.config
    res = step_resources(config, "train", run)
    rc = run_config(config, run)
    task = training_task(smk, config, run, rc)
    result = dispatch.run_step(task, step=f"train {run}", resources=res, config=config,
                               log_dir=_log_dir(smk, "train", run), key=_key(smk, "train"), log_file=log_file)
    check_all_steps(result, rc, f"train {run}")
    write_json(smk.output[0], result)


@_logged
def convert(smk) -> None:
    """Rule ``convert``: export the final checkpoint to a Hugging Face folder (written aside, then renamed)."""
    from llmpipe.convert import convert_checkpoint
    log_file = _start_log(smk)
    run = smk.wildcards.run
    train_result = read_json(smk.input.train)
    out_dir = os.path.dirname(smk.output[0])
    dispatch.run_step(convert_checkpoint, smk.config, run, os.path.abspath(train_result["final_checkpoint"]),
                      os.path.dirname(smk.input.tokenizer), out_dir, smk.config["convert"]["dtype"],
                      step=f"convert {run}", resources=step_resources(smk.config, "convert", run),
                      config=smk.config, log_dir=_log_dir(smk, "convert", run), key=_key(smk, "convert"),
                      log_file=log_file)


@_logged
def generate(smk) -> None:
    """Rule ``generate``: the converted model answers the configured prompts -> generate.json."""
    from llmpipe.generate import generate as gen
    log_file = _start_log(smk)
    run = smk.wildcards.run
    result = dispatch.run_step(gen, os.path.dirname(smk.input[0]), smk.config["generate"],
                               step=f"generate {run}", resources=step_resources(smk.config, "generate", run),
                               config=smk.config, log_dir=_log_dir(smk, "generate", run),
                               key=_key(smk, "generate"), log_file=log_file)
    write_json(smk.output[0], result)


@_logged
def evaluate(smk) -> None:
    """Rule ``eval``: held-out loss, perplexity, token accuracy and ICL accuracy of the converted model."""
    from llmpipe.evaluate import evaluate as ev
    log_file = _start_log(smk)
    run = smk.wildcards.run
    icl = dict(zip([t["label"] for t in smk.config["eval"]["icl_tasks"]], list(smk.input.icl)))
    result = dispatch.run_step(ev, smk.config, run, os.path.dirname(smk.input.model),
                               os.path.join(os.path.dirname(smk.input.data), "mds"), icl,
                               step=f"eval {run}", resources=step_resources(smk.config, "eval", run),
                               config=smk.config, log_dir=_log_dir(smk, "eval", run), key=_key(smk, "eval"),
                               log_file=log_file)
    write_json(smk.output[0], result)


def remove_tree(path: str) -> None:
    """Remove a folder if it exists (used for temporary export folders)."""
    shutil.rmtree(path, ignore_errors=True)
