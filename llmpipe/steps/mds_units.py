"""The ``mds`` step's conversion: a corpus to MDS train/val datasets, one unit per input file, run in parallel.

The data side (what a unit writes, the dataset layout, the merge) is :mod:`llmpipe.data.mds`; this module reads the
workflow config's ``data_prep`` and ``data_resources`` and runs the units through :mod:`llmpipe.dispatch.unit_array`: locally
as ``data_prep.workers`` processes that claim units from a shared list (largest file first), on Slurm as a job array
of one task per unit (``array_parallelism = workers``). Progress: a tqdm bar per running unit on a terminal and a
line per finished unit (tokens written).
"""

from __future__ import annotations

import os
import time

from llmpipe.config.runs import step_resources, validate_data_prep
from llmpipe.data.mds import check_concat_tokens, convert_unit, finish_dataset, plan_dataset, unit_complete
from llmpipe.dispatch.jobs import executor_kind, say
from llmpipe.dispatch.unit_array import Unit, run_unit_array


def describe_unit(rec: dict) -> str:
    """A finished unit's record as its progress line says it: tokens, samples, documents, seconds, speed."""
    rate = rec["tokens"] / rec["seconds"] if rec.get("seconds") else 0.0
    return (f"{rec['tokens']:,} tokens in {rec['samples']:,} samples from {rec['documents']:,} documents, "
            f"{rec['seconds']:.1f} s, {rate / 1e6:.2f} M tokens/s")


def convert_dataset(corpus_manifest: str, tokenizer_dir: str, concat_tokens: int, eos_text: str, out_dir: str, *,
                    config: dict, log_dir: str, log_file: str | None = None, batch_chars: int | None = None) -> dict:
    """Tokenize, concatenate and write a corpus as MDS train/val datasets, one parallel unit per input file.

    Units that are complete and current are reused; a rerun converts only the missing, damaged or stale ones.

    Args:
        corpus_manifest: the corpus' ``manifest.json`` (from :func:`llmpipe.data.corpus.prepare_corpus`).
        tokenizer_dir: a tokenizer folder (from :func:`llmpipe.data.tokenizer.prepare_tokenizer`).
        concat_tokens: ids per sample (e.g. 2048).
        eos_text: text put between documents (its ids follow every document); must tokenize to >= 1 id.
        out_dir: the dataset folder (layout in :mod:`llmpipe.data.mds`).
        config: the workflow config: ``data_prep`` (``compression``, ``size_limit`` in bytes per shard,
            ``workers``: 0 = min(units, CPUs); optional ``cpus_per_unit`` (1), ``mem_gb_per_unit`` (4)),
            ``dispatch`` (executor: local | slurm | debug) and ``data_resources`` (time limit).
        log_dir: folder for submitit's per-job logs.
        log_file: the rule's log file; the per-unit lines are appended to it too.
        batch_chars: characters of text per tokenizer call (default :data:`llmpipe.data.mds.BATCH_CHARS`); for
            benchmarks, the samples do not depend on it.

    Returns:
        The dataset manifest (also ``{out_dir}/manifest.json``; see :func:`llmpipe.data.mds.finish_dataset`).

    Raises:
        DataError: bad input file (names it), ``eos_text`` that tokenizes to nothing, a split with 0 samples
            (corpus too small for ``concat_tokens``).
        ConfigError: bad ``data_prep.compression`` / ``data_prep.size_limit``.
        llmpipe.dispatch.jobs.StepFailed: a unit's job failed (message: the job's error and log tail, which name
            the file for bad input).
    """
    t0 = time.time()
    concat = check_concat_tokens(concat_tokens)
    shards = validate_data_prep(config, concat)  # size_limit None: one shard per unit
    dp = config.get("data_prep") or {}
    kind = executor_kind(config)
    # local workers log to files and the parent draws their bars from their progress files; on Slurm the bar
    # goes to the job's log (a line a minute); in debug mode the unit runs here and draws its own bar
    plan = plan_dataset(corpus_manifest, tokenizer_dir, concat, eos_text, out_dir, compression=shards["compression"],
                        size_limit=shards["size_limit"], batch_chars=batch_chars, progress=kind != "slurm",
                        quiet=kind == "local")
    res = dict(step_resources(config, "data"))
    res.update(nodes=1, gpus_per_node=0, tasks_per_node=1, cpus_per_task=int(dp.get("cpus_per_unit", 1)),
               mem_gb=int(dp.get("mem_gb_per_unit", 4)))
    units = [Unit(key=f"{s['split']}/{s['name']}", arg=s, progress=s["progress"], weight=s["input_bytes"])
             for s in plan.specs]
    run = run_unit_array(convert_unit, units, is_complete=unit_complete, workers=int(dp.get("workers", 0) or 0),
                         work_dir=plan.work_dir, name="mds", step="mds " + "/".join(plan.out_dir.split(os.sep)[-4:]),
                         resources=res, config=config, log_dir=log_dir, log_file=log_file, describe=describe_unit,
                         verb="converting", detail=f"; concat_tokens={concat}, eos ids {list(plan.eos_ids)}")
    manifest = finish_dataset(plan, converted=run.run, reused=run.reused, workers=run.workers, started_at=t0,
                              log_dir=log_dir)
    say(f"mds: {plan.out_dir}: " + ", ".join(f"{k} {v['samples']:,} samples ({v['tokens']:,} tokens)"
                                             for k, v in manifest["splits"].items())
        + f" in {manifest['seconds']:.1f} s", log_file)
    return manifest
