"""Data steps: corpus -> tokenizer -> MDS shards -> verification; ICL tasks and instruction sets.

One function per rule (``corpus``, ``tokenizer``, ``mds``, ``verify_mds``, ``icl_task``, ``instructions``), each
taking the rule's :class:`~llmpipe.steps.context.StepContext` and returning the resolved settings it used (for
its provenance record); the ``*_identity`` functions say what determines each step's result (the rule's
``params``, see :mod:`llmpipe.config.identity`). The work itself is in :mod:`llmpipe.data`.
"""

from __future__ import annotations

import os

from llmpipe.config.runs import step_resources, validate_data_prep
from llmpipe.evaluation.suites import built_task
from llmpipe.steps.context import StepContext, read_json
from llmpipe.steps.registry import register

#: Bump a step's version when a change in our code changes what that step produces: the version is part of the
#: step's identity, so bumping it reruns that step and everything after it.
VERSIONS = {"corpus": 1, "tokenizer": 1, "mds": 1, "verify": 1, "icl_task": 1, "instructions": 1}


# ------------------------------------------------------------------------------------------- identity

def corpus_identity(config: dict, corpus: str) -> dict:
    """What determines a corpus' raw files: source, repo, subset, which files. (Not retries or mirror path.)"""
    c = config["corpora"][corpus]
    keep = {k: c.get(k) for k in ("source", "repo_id", "revision", "subset", "train_files", "val_files")}
    return {"step": "corpus", "version": VERSIONS["corpus"], **keep}


def tokenizer_identity(config: dict, tokenizer: str) -> dict:
    """What determines a tokenizer: its source and name, or its training corpus and vocabulary size."""
    t = config["tokenizers"][tokenizer]
    keep = {k: t.get(k) for k in ("source", "name", "corpus", "vocab_size", "eos_text")}
    if t.get("source") == "train":
        keep["corpus_identity"] = corpus_identity(config, t["corpus"])
    return {"step": "tokenizer", "version": VERSIONS["tokenizer"], **keep}


def mds_identity(config: dict, corpus: str, tokenizer: str, concat: int) -> dict:
    """What determines an MDS dataset: corpus, tokenizer, concat length and shard format.

    Raises:
        ConfigError: ``data_prep`` cannot write this dataset (:func:`llmpipe.config.runs.validate_data_prep`).
    """
    shards = validate_data_prep(config, concat)
    return {"step": "mds", "version": VERSIONS["mds"], "corpus": corpus_identity(config, corpus),
            "tokenizer": tokenizer_identity(config, tokenizer), "concat_tokens": int(concat),
            "compression": shards["compression"]}


def verify_identity(config: dict, corpus: str, tokenizer: str, concat: int) -> dict:
    """What determines a dataset's verification record: the dataset (:func:`mds_identity`) and the checks."""
    return {"step": "verify", "version": VERSIONS["verify"], "mds": mds_identity(config, corpus, tokenizer, concat)}


def icl_task_identity(config: dict, label: str) -> dict:
    """What determines an ICL task file: its entry (kind, items, seed, shots) in ``eval.icl_tasks`` or a suite."""
    task = built_task(config, label)
    return {"step": "icl_task", "version": VERSIONS["icl_task"], "task": task}


def instructions_identity(config: dict, iset: str) -> dict:
    """What determines a prepared instruction set: its source, dataset id, revision, splits, columns, row caps.

    The mirror folder of a local source is left out (as for corpora): the same data read from another path is
    the same data.
    """
    s = config["instruction_sets"][iset]
    keep = {k: s.get(k) for k in ("source", "hf_name", "revision", "train_split", "eval_split", "columns",
                                  "max_rows", "max_items", "eval_percent", "seed")}
    return {"step": "instructions", "version": VERSIONS["instructions"], **keep}


# ------------------------------------------------------------------------------------------- resources

def single_task_resources(config: dict, wildcards) -> dict:
    """One task on one node with ``data_resources``' limits: the preparation steps that run as one process."""
    return dict(step_resources(config, "data"), tasks_per_node=1, nodes=1)


def data_resources(config: dict, wildcards) -> dict:
    """``data_resources`` as they are: the MDS conversion's units share them (:mod:`llmpipe.steps.mds_units`)."""
    return step_resources(config, "data")


# ------------------------------------------------------------------------------------------- steps

def prepare_named(ctx: StepContext, prepare, section: str, name: str, what: str) -> dict:
    """Dispatch ``prepare(settings, out_dir)`` for the entry ``name`` of the config section ``section`` on the
    submitting machine (it may need the hub, which compute nodes often cannot reach); return the settings used.

    Raises:
        RuntimeError: the step ended without writing its output (``ctx.output[0]``).
    """
    settings = dict(ctx.config[section][name], key=name)
    ctx.dispatch(prepare, settings, os.path.dirname(ctx.output[0]), step=f"{what} {name}",
                 config=ctx.on_submitting_machine())
    if not os.path.exists(ctx.output[0]):
        raise RuntimeError(f"{what} {name}: {ctx.output[0]} was not written")
    return settings


@register("corpus", resources=single_task_resources, where="data_resources")
def corpus(ctx: StepContext) -> dict:
    """Rule ``corpus``: write or download a corpus in C4's layout (on the submitting machine: it needs the hub)."""
    from llmpipe.data.corpus import prepare_corpus

    settings = prepare_named(ctx, prepare_corpus, "corpora", ctx.wildcards.corpus, "corpus")
    return {"corpus": settings, "resources": ctx.resources}


@register("tokenizer", resources=single_task_resources, where="data_resources")
def tokenizer(ctx: StepContext) -> dict:
    """Rule ``tokenizer``: fetch, copy or train the tokenizer into ``results/tokenizers/{name}/``."""
    from llmpipe.data.tokenizer import prepare_tokenizer

    name = ctx.wildcards.tokenizer
    settings = dict(ctx.config["tokenizers"][name], key=name)
    corpus_manifest = ctx.input[0] if len(ctx.input) else None
    ctx.dispatch(prepare_tokenizer, settings, os.path.dirname(ctx.output[0]), corpus_manifest,
                 step=f"tokenizer {name}", config=ctx.on_submitting_machine())
    return {"tokenizer": settings, "resources": ctx.resources}


@register("mds", resources=data_resources, where="data_resources")
def mds(ctx: StepContext) -> dict:
    """Rule ``mds``: tokenize and concatenate the corpus into MDS shards, one parallel unit per input file."""
    from llmpipe.steps.mds_units import convert_dataset

    wc = ctx.wildcards
    tok = ctx.config["tokenizers"][wc.tokenizer]
    convert_dataset(ctx.input.corpus, os.path.dirname(ctx.input.tokenizer), int(wc.concat), tok["eos_text"],
                    os.path.dirname(ctx.output[0]), config=ctx.config, log_dir=ctx.log_dir, log_file=ctx.log_file)
    return {"concat_tokens": int(wc.concat), "eos_text": tok["eos_text"],
            "data_prep": ctx.config.get("data_prep"), "data_resources": step_resources(ctx.config, "data")}


@register("verify_mds", resources=single_task_resources, where="data_resources")
def verify_mds(ctx: StepContext) -> dict:
    """Rule ``verify_mds``: read the merged dataset back and check counts, lengths, vocabulary and text."""
    from llmpipe.data.mds_verify import verify_dataset

    vocab_size = int(read_json(ctx.input.tokenizer)["vocab_size"])
    verify_dataset(os.path.dirname(ctx.input.mds), os.path.dirname(ctx.input.tokenizer),
                   int(ctx.wildcards.concat), vocab_size, ctx.output[0])
    return {"concat_tokens": int(ctx.wildcards.concat), "vocab_size": vocab_size}


@register("icl_task")
def icl_task(ctx: StepContext) -> dict:
    """Rule ``icl_task``: build an in-context-learning task from held-out (validation) text.

    Raises:
        ValueError: the task's ``kind`` is not ``cloze`` or ``cloze_choice``.
    """
    from llmpipe.data.icl import build_cloze_choice_task, build_cloze_task

    task = built_task(ctx.config, ctx.wildcards.label)
    kind = task.get("kind", "cloze")
    builders = {"cloze": build_cloze_task, "cloze_choice": build_cloze_choice_task}
    if kind not in builders:
        raise ValueError(f"eval.icl_tasks[{task['label']}].kind is {kind!r}; it must be one of {sorted(builders)}.")
    builders[kind](ctx.input[0], ctx.output[0], int(task.get("num_items", 200)), int(task.get("seed", 17)))
    return {"task": task}


@register("instructions", resources=single_task_resources, where="data_resources")
def instructions(ctx: StepContext) -> dict:
    """Rule ``instructions``: prepare an instruction set on the submitting machine (it may need the hub)."""
    from llmpipe.data.instructions import prepare_instructions

    settings = prepare_named(ctx, prepare_instructions, "instruction_sets", ctx.wildcards.iset, "instructions")
    return {"instruction_set": settings, "resources": ctx.resources}
