"""The workflow's steps: one function per Snakemake rule, one module per stage.

The flow, for every rule::

    config/config.yaml -> rules/<stage>.smk (rule: inputs, outputs, log, params = the step's identity text,
                          resources and threads from the registered step: rules/common.smk's identity/res/threads)
      -> scripts/run_rule.py (every rule's script: ``run_rule(snakemake)``)
      -> run_rule: one StepContext from Snakemake's object -> the step function registered under the rule's name
      -> ctx.dispatch(...) -> llmpipe.dispatch.jobs.run_step -> a submitit job (local, Slurm, or in-process for tests)

The rule table is :data:`~llmpipe.steps.registry.RULES`: each step function is registered under its rule's name
(:func:`~llmpipe.steps.registry.register`, a decorator above the step function in its stage module) with its
job's resources, the config path of those resources (for the Slurm preflight), its memory plan and whether its result
is kept; the step's submitit folder is derived from the rule's ``log:``. ``tests/test_steps.py`` checks that every rule with a script is registered and vice versa.

=======================  ===================================================================================
module                   rules
=======================  ===================================================================================
:mod:`.data`             corpus, tokenizer, mds, verify_mds, icl_task, instructions
:mod:`.train`            train, finetune
:mod:`.convert`          convert
:mod:`.generate`         generate
:mod:`.evaluate`         eval, finetune_eval, eval_task_data
:mod:`.lm_eval_harness`  lm_eval (the optional second harness, lm-evaluation-harness)
:mod:`.scaling`          scaling_train, scaling_table
:mod:`.allreduce`        allreduce, allreduce_plot, allreduce_health, allreduce_gate, scaling_allreduce_gate
:mod:`.report`           report, report_run
=======================  ===================================================================================

Each module also declares its steps' versions and identity functions (dicts; the rule files turn them into text
once, through rules/common.smk's ``identity`` and :func:`llmpipe.config.identity.identity_text`). :func:`run_rule` is the
one entry: it empties the rule's log, makes the thread variables valid
(:func:`llmpipe.dispatch.jobs.normalize_thread_env`), builds the :class:`~llmpipe.steps.context.StepContext`, calls the
step, and writes the step's provenance record beside its first output (:mod:`llmpipe.steps.provenance`:
``<output>.provenance.json``). A failing step's error is appended to the rule's log, so ``--show-failed-logs`` shows
why it failed. The steps after training (rules with :attr:`Rule.kept`: convert, generate, eval, finetune_eval) keep
their finished results per identity and restore them instead of running again when the same identity comes back on
the same inputs (:mod:`llmpipe.steps.kept_results`).

Nothing here imports torch: the rule files import these modules to plan the DAG.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import traceback
from typing import Any

from llmpipe.dispatch import jobs as dispatch
from llmpipe.dispatch.interrupts import StepInterrupted, ignore_interrupts
from llmpipe.dispatch.job_failures import named_oserror
from llmpipe.dispatch.orphans import exit_when_snakemake_dies
from llmpipe.steps import allreduce, convert, evaluate, generate, kept_results, lm_eval_harness, provenance, scaling
from llmpipe.steps import prepare as data
from llmpipe.steps import reporting as report
from llmpipe.steps import training as train
from llmpipe.steps.context import StepContext, parse_params, wildcard_values
from llmpipe.steps.registry import RULES, Kept, Rule, submitit_folder

#: The stage modules; importing them fills :data:`RULES`.
STAGES = (data, train, convert, generate, evaluate, lm_eval_harness, scaling, allreduce, report)


#: The line that ends the repeated history at the top of a rule log; what follows is this run's.
THIS_RUN = "--- this run ---\n"


def start_log(log_file: str, repeat: int = 5) -> None:
    """Create (or empty) the rule's log file. Snakemake deletes a rule's log before each run, so the step's
    submission lines also go to an append-only history beside it (:func:`llmpipe.dispatch.jobs.history_path`); a new
    log starts by naming that file and repeating its last ``repeat`` lines."""
    os.makedirs(os.path.dirname(log_file) or ".", exist_ok=True)
    history = dispatch.history_path(log_file)
    with open(log_file, "w") as fh:
        if os.path.exists(history):
            with open(history) as hf:
                last = hf.readlines()[-repeat:]
            fh.write(f"earlier runs of this step: {os.path.abspath(history)}; its last {len(last)} line(s):\n")
            fh.writelines("  " + line for line in last)
            fh.write(THIS_RUN)


def log_error(log_file: str, exc: BaseException) -> None:
    """Append a failing step's error to its log; the traceback too, unless the error is one whose message says
    it all (a failed job's, with its own log tail, or a bad setting's)."""
    with open(log_file, "a") as fh:
        fh.write(f"\nERROR: {type(exc).__name__}: {exc}\n")
        if not isinstance(exc, (dispatch.StepFailed, ValueError)):
            fh.write(traceback.format_exc())


#: Lines of each log tail a failure shows on the console (the rule log keeps the whole message).
CONSOLE_TAIL_LINES = 12


def console_failure(exc: BaseException, log_file: str) -> str:
    """What a failing step prints on the console, once: the error (for a failed job its state, first error and job
    log, with each log tail cut to its last :data:`CONSOLE_TAIL_LINES` lines; an ``OSError`` of the step itself named
    by its errno and path, :func:`llmpipe.dispatch.job_failures.named_oserror`) and the rule log that has all of it
    (the traceback too, for an error of the step itself)."""
    out: list[str] = []
    tail: list[str] | None = None
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, OSError):   # a write of the step itself: ENOSPC (No space left on device) on <path> (OSError)
        text = named_oserror(text)
    for line in text.splitlines():
        head = re.fullmatch(r"--- (\w+) \(last \d+ lines\) ---", line)
        if head:
            out += (tail or [])[-CONSOLE_TAIL_LINES:]
            out.append(f"--- {head.group(1)} (last {CONSOLE_TAIL_LINES} lines; the rule log has more) ---")
            tail = []
        elif tail is not None:
            tail.append(line)
        else:
            out.append(line)
    out += (tail or [])[-CONSOLE_TAIL_LINES:]
    traced = not isinstance(exc, (dispatch.StepFailed, ValueError))
    return "\n".join([*out, f"rule log{' (with the traceback)' if traced else ''}: {log_file}"])


def context(smk: Any, rule: Rule) -> StepContext:
    """The :class:`StepContext` of Snakemake's ``smk`` for ``rule``: a rule with resources dispatches a job, whose
    submitit folder is beside the rule's log (:func:`~llmpipe.steps.registry.submitit_folder`); one without
    dispatches nothing (no folder, no resources)."""
    if rule.resources is None:
        return StepContext.build(smk, log_dir=None, resources={})
    return StepContext.build(smk, log_dir=submitit_folder(smk.log[0], smk.config["results_dir"]),
                             resources=rule.resources(smk.config, smk.wildcards))


def kept_key(ctx: StepContext, kept: Kept) -> dict | None:
    """The key of the result ``ctx`` makes (:func:`llmpipe.steps.kept_results.result_key`): the rule's identity and the
    contents of its inputs but ``kept.ignore_inputs``; None when the rule has no identity or an input is a folder.

    Raises:
        OSError: an input cannot be read.
    """
    identity = getattr(ctx.params, "identity", None)
    if not isinstance(identity, str):
        return None
    ignored = set()
    for name in kept.ignore_inputs:
        value = getattr(ctx.input, name, None)
        ignored.update([value] if isinstance(value, str) else list(value or []))
    return kept_results.result_key(identity, [f for f in ctx.input if f not in ignored], ctx.config["results_dir"])


def restore_kept(ctx: StepContext, kept: Kept) -> str | None:
    """Put back the kept result of this exact identity and inputs in place of the rule's outputs, without a job;
    return the kept folder, or None when there is none (the step then runs). Logs ``restored from <folder>``."""
    key = kept_key(ctx, kept)
    run = ctx.wildcards.run
    store = kept_results.store_dir(ctx.config["results_dir"], run, ctx.rule)
    folder = None if key is None else kept_results.find(store, key)
    if folder is None:
        return None
    kept_results.restore(folder, os.path.join(ctx.config["results_dir"], run), earlier_to_keep(ctx, kept))
    dispatch.say(f"{ctx.rule} {run}: restored from {folder} (kept when this identity finished on the same inputs); "
                 f"no job submitted", ctx.log_file)
    return folder


def keep_result(ctx: StepContext, kept: Kept) -> str | None:
    """Keep the finished outputs of ``ctx`` under their key (:func:`llmpipe.steps.kept_results.keep`); return the kept
    folder, or None when the result has no key or could not be kept (logged: a full disk never fails a finished
    step)."""
    run = ctx.wildcards.run
    run_dir = os.path.join(ctx.config["results_dir"], run)
    paths = [os.path.dirname(ctx.output[0])] if kept.whole_folder else list(ctx.output)
    try:
        key = kept_key(ctx, kept)
        if key is None:
            return None
        return kept_results.keep(kept_results.store_dir(ctx.config["results_dir"], run, ctx.rule), key, paths,
                                 run_dir, earlier_to_keep(ctx, kept))
    except OSError as exc:
        dispatch.say(f"{ctx.rule} {run}: the finished result was not kept for a later restore ({exc})", ctx.log_file)
        return None


def earlier_to_keep(ctx: StepContext, kept: Kept) -> int:
    """``<kept.section>.earlier_identities_to_keep`` of the config, else the schema's default
    (:func:`llmpipe.dispatch.jobs.setting`)."""
    return int(dispatch.setting(ctx.config, kept.section, "earlier_identities_to_keep"))


def run_step(ctx: StepContext, rule: Rule) -> Any:
    """Run ``rule``'s step in ``ctx`` and write its provenance record beside its first output; return what the
    step returned. The record of an earlier execution is removed first.

    A rule with :attr:`Rule.kept` first restores the kept result of its identity and inputs when there is one
    (:func:`restore_kept`; no job, the step function is not called, the settings are ``{"restored_from": ...}``),
    and keeps its finished result otherwise (:func:`keep_result`)."""
    provenance.forget(ctx.output[0])
    restored = restore_kept(ctx, rule.kept) if rule.kept else None
    if restored is not None:
        settings = {"restored_from": restored}
    else:
        if rule.kept:  # a step writing an output in place must never change the kept result it is a link of
            for path in ctx.output:
                if os.path.isfile(path) and os.stat(path).st_nlink > 1:
                    os.unlink(path)
        settings = rule.step(ctx)
        if rule.kept:
            keep_result(ctx, rule.kept)
    params = parse_params(ctx.params)
    identity = params.pop("identity", None)
    provenance.write(ctx.output[0], provenance.record(
        rule=ctx.rule, wildcards=wildcard_values(ctx.wildcards), settings=settings, identity=identity,
        version=identity.get("version") if isinstance(identity, dict) else None, params=params))
    return settings


def run_rule(smk: Any) -> None:
    """What ``scripts/run_rule.py``, every rule's script, calls with its ``snakemake`` object: run the step
    registered under the rule's name (:data:`~llmpipe.steps.registry.RULES`).

    Raises:
        KeyError: no step is registered under the rule's name.
        SystemExit: (code 1) the step raised; its error is in the rule's log and, shortened, on stderr. (Code 130)
            the step was interrupted (SIGINT: Ctrl-C, or Snakemake passing its own interrupt on,
            :func:`llmpipe.dispatch.orphans.interrupt_rule_scripts_on_signal`): one line on stderr and in the rule
            log says what became of its jobs (:class:`llmpipe.dispatch.interrupts.StepInterrupted`), no traceback.
        BaseException: another exit (SIGTERM while waiting, ``sys.exit``) that ended the step, after its reason was
            appended to the rule's log: every exit of the rule script leaves its reason there.
    """
    start_log(smk.log[0])
    try:
        rule = RULES[smk.rule]
        dispatch.normalize_thread_env()  # threads: 0 of Slurm-waiting rules -> OMP_NUM_THREADS=0 from Snakemake
        exit_when_snakemake_dies()       # no watcher outlives its Snakemake (llmpipe.dispatch.orphans)
        run_step(context(smk, rule), rule)
    except KeyboardInterrupt as exc:
        ignore_interrupts()  # a second Ctrl-C (from the terminal, then from Snakemake) is not a traceback
        if not isinstance(exc, StepInterrupted):   # interrupted while not waiting for a job
            dispatch.say(f"{smk.rule}: interrupted", smk.log[0])
        raise SystemExit(130) from None
    except Exception as exc:
        log_error(smk.log[0], exc)
        # once, on the console: no traceback and no whole log tail here (the rule log has them; Snakemake names it)
        print(f"[llmpipe] {smk.rule} failed: {console_failure(exc, smk.log[0])}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except BaseException as exc:   # not an error of the step: say what ended it, then end as it asks
        with contextlib.suppress(OSError), open(smk.log[0], "a") as fh:
            fh.write(f"\nERROR: the step was ended by {type(exc).__name__}"
                     f"{f': {exc}' if str(exc) else ''} (exit status {exit_status(exc)})\n")
        raise


def exit_status(exc: BaseException) -> int:
    """The exit status the interpreter gives for ``exc`` left unhandled: a ``SystemExit``'s code (0 for None, 1 for
    a message), 130 for ``KeyboardInterrupt`` (Python's convention for SIGINT: 128 + 2), else 1."""
    if isinstance(exc, SystemExit):
        code = exc.code
        return 0 if code is None else code if isinstance(code, int) else 1
    return 130 if isinstance(exc, KeyboardInterrupt) else 1


__all__ = ["RULES", "Rule", "Kept", "StepContext", "register", "run_rule", "run_step", "context"]
