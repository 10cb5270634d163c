"""One dispatch module for every compute step, built on submitit.

A Snakemake rule calls :func:`run_step` (one job of ``nodes x tasks_per_node`` tasks, e.g. training) or
:func:`map_steps` (many independent single-task jobs, e.g. one per C4 file); both block until the work is
done and return the results. Where the work runs is ``config['dispatch']['executor']``:

* ``local`` – submitit's ``LocalExecutor`` on this machine (the default profile),
* ``slurm`` – submitit's ``SlurmExecutor`` (profiles/slurm), site settings from ``config['slurm']``,
* ``debug`` – in this process (submitit's ``DebugExecutor``), for tests.

Every submission is recorded in ``config['dispatch']['state_dir']`` (outside the step's outputs, which
Snakemake deletes when it marks them incomplete), keyed by the step's output and identity. A later call with the
same key re-attaches to a job that is still queued or running, or collects its finished result, instead of
submitting a duplicate (the Snakemake process may have been killed while the job ran).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from llmpipe.config import schema
from llmpipe.dispatch import interrupts, job_failures
from llmpipe.dispatch import progress as progress_record
from llmpipe.dispatch import rendezvous
from llmpipe.dispatch.interrupts import CONTROLLER_LOG, is_slurm_job
from llmpipe.dispatch.orphans import DieWithParent, sigint_cancels_children

log = logging.getLogger("llmpipe.dispatch.jobs")

_FINISHED_OK = {"COMPLETED", "DONE", "FINISHED"}


class StepFailed(RuntimeError):
    """A dispatched job ended without a result: the message has its job id, state and the tail of its log;
    ``state`` is the job's final state (Slurm's, e.g. ``TIMEOUT``; "" when not known), ``job_id`` its id,
    ``headline`` the cause as the message's first line names it ("" when not known)."""

    def __init__(self, message: str, state: str = "", job_id: str = "", headline: str = ""):
        super().__init__(message)
        self.state, self.job_id, self.headline = state, job_id, headline

    def renamed(self, cause: str) -> StepFailed:
        """The same failure with ``cause`` in place of its headline on the first line (after the job id and state;
        the log and its tail unchanged), e.g. a full disk found by the step
        (:func:`llmpipe.dispatch.job_failures.out_of_space`) in place of "wrote no result"."""
        first, _, rest = str(self).partition("\n")
        if self.headline and first.endswith(self.headline):
            first = first[:-len(self.headline)] + cause
        else:
            first = f"{first}: {cause}"
        return type(self)(f"{first}\n{rest}" if rest else first, self.state, self.job_id, cause)


class StepNeverRuns(StepFailed):
    """A dispatched Slurm job was PENDING for a reason Slurm never resolves; it was cancelled."""


def history_path(log_file: str) -> str:
    """The append-only history of a rule log's lines (``<log>.history``), which Snakemake never deletes."""
    return log_file + ".history"


def say(msg: str, log_file: str | None = None) -> None:
    """Print ``[llmpipe HH:MM:SS] msg`` to stderr; with ``log_file``, append the line to it and to its history
    (:func:`history_path`)."""
    line = f"[llmpipe {time.strftime('%H:%M:%S')}] {msg}"
    print(line, file=sys.stderr, flush=True)
    if log_file:
        for path in (log_file, history_path(log_file)):
            with open(path, "a") as fh:
                fh.write(line + "\n")


def job_key(*parts: Any) -> str:
    """A short stable key for a submission record (sha1 of the parts' JSON)."""
    return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def setting(config: Mapping, section: str, key: str) -> Any:
    """``<section>.<key>`` of ``config`` (``dispatch`` or ``slurm``) as written, else the schema's default: a job's
    config may hold only some keys (``{"dispatch": {"executor": "local"}}``), the validated config holds them all.

    Raises:
        KeyError: the schema gives the key no default."""
    values = config.get(section) or {}
    return values[key] if key in values else (schema.section_defaults(section) or {})[key]


def executor_kind(config: dict) -> str:
    """``dispatch.executor`` of ``config``: ``local`` (the schema's default), ``slurm`` or ``debug``."""
    return setting(config, "dispatch", "executor")


def with_executor(config: dict, executor: str | None) -> dict:
    """A shallow copy of ``config`` whose ``dispatch.executor`` is ``executor`` (unchanged when None).

    Used for steps that must run on the submitting machine, e.g. downloads: compute nodes are often offline.
    """
    if executor is None:
        return config
    return {**config, "dispatch": {**(config.get("dispatch") or {}), "executor": executor}}


def check_executor(config: dict, nodes: int, what: str) -> None:
    """Refuse more than one node on the local or debug executor: they run on this one machine, and submitit's
    LocalExecutor would run the job on one node (another world size than the config asks for).

    Raises:
        ConfigError: naming ``what`` and the fix (``--profile slurm``, or 1 node).
    """
    from llmpipe.config.settings import ConfigError

    kind = executor_kind(config)
    if int(nodes) > 1 and kind != "slurm":
        raise ConfigError(f"{what} needs {nodes} nodes but dispatch.executor is {kind!r}, which runs on this one "
                          f"machine. Fix: run with --profile slurm (from the repository root), or use 1 node.")


def make_executor(config: dict, resources: dict, folder: str, name: str):
    """Build a submitit executor for one step.

    Args:
        config: the workflow config (``dispatch`` and, for Slurm, ``slurm`` sections are read).
        resources: the step's resources (see :func:`llmpipe.config.runs.step_resources`).
        folder: where submitit writes the job's pickles and logs (``%j`` is the job id).
        name: the job name shown by ``squeue``.

    Raises:
        ValueError: unknown ``dispatch.executor``.
    """
    import submitit

    kind = executor_kind(config)
    tasks = int(resources.get("tasks_per_node", 1))
    gpus = int(resources.get("gpus_per_node", 0))
    if kind == "debug":
        return submitit.DebugExecutor(folder=folder)
    if kind == "local":
        check_executor(config, int(resources.get("nodes", 1) or 1), f"step {name}")  # never one node silently
        sigint_cancels_children()   # submitit cancels a local job with SIGINT to its controller
        ex = submitit.LocalExecutor(folder=folder)
        ex.update_parameters(timeout_min=int(resources.get("time_min", 60)), tasks_per_node=tasks,
                             gpus_per_node=gpus, nodes=1, name=name)
        return ex
    if kind == "slurm":
        from llmpipe.dispatch import slurm
        return slurm.make_executor(config, resources, folder, name)
    raise ValueError(f"dispatch.executor is {kind!r}; it must be local, slurm or debug. "
                     f"Fix: use --profile slurm for Slurm, or no profile for local.")


#: The variables Snakemake sets from a rule's ``threads`` in the job's environment.
_SNAKEMAKE_THREAD_VARS = ("OMP_NUM_THREADS", "GOTO_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                          "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


def normalize_thread_env() -> None:
    """Rules that only wait on Slurm take ``threads: 0`` (:meth:`llmpipe.plan.dag_checks.DagChecks.dispatch_threads`),
    so Snakemake sets ``OMP_NUM_THREADS=0`` and the like in the rule's process; sbatch exports the environment to the
    job, and 0 threads is invalid for OpenMP/BLAS there and here. Set them to 1, what the rules and jobs had
    before (when those rules took 1 thread). Called first by the rule script (:func:`llmpipe.steps.run_rule`), so
    the rule's own libraries and every job it submits see the fixed values."""
    for var in _SNAKEMAKE_THREAD_VARS:
        if os.environ.get(var) == "0":
            os.environ[var] = "1"


def _slurm_poll_s(config: dict) -> float:
    return float(setting(config, "slurm", "poll_s"))


def _record_path(config: dict, key: str) -> str:
    d = setting(config, "dispatch", "state_dir")
    os.makedirs(d, exist_ok=True)
    return os.path.join(d, f"{key}.json")


def recorded_job_id(config: dict, key: str) -> str | None:
    """The id of the job recorded under ``key`` (a submission not yet collected; see :func:`run_step`), or None."""
    try:
        with open(_record_path(config, key)) as fh:
            return str(json.load(fh).get("job_id") or "") or None
    except (OSError, ValueError):
        return None


def _write_record(path: str, record: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(record, fh, indent=1)
    os.replace(tmp, path)


def _reattach(config: dict, record: dict):
    """Rebuild a submitit job object from a record; None when it cannot be the same job any more.

    None when the executor kind changed, for local jobs (their processes die with the Snakemake process that
    started them), and for a Slurm job id that Slurm no longer knows or that now names another job (a different
    name: the id was reused, e.g. after the cluster's state was reset).
    """
    import submitit

    if record.get("executor") != executor_kind(config):
        return None
    if record["executor"] == "slurm":
        from llmpipe.dispatch import slurm

        try:
            info = slurm.job_info(record["job_id"])
        except RuntimeError:
            info = {}  # Slurm did not answer: assume the job is still there rather than submit a duplicate
        if info is None:
            return None
        if info and record.get("name") and info.get("JobName") != record["name"]:
            return None
        return submitit.SlurmJob(folder=record["folder"], job_id=record["job_id"],
                                 tasks=list(range(record.get("num_tasks", 1))))
    return None  # local processes die with their parent's session; resubmit


#: Slurm states of a job that has not ended (squeue/sacct names).
_SLURM_LIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED", "STAGE_OUT"}

#: Slurm states in which a job will never run again (sacct's first word; ``CANCELLED by 0`` is ``CANCELLED``).
_SLURM_TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                   "DEADLINE", "REVOKED", "SPECIAL_EXIT"}


def _slurm_state(job, force: bool = False) -> str:
    """The Slurm state of ``job`` (sacct), first word only; ``force`` asks sacct now."""
    return (job.watcher.get_state(job.job_id, mode="force" if force else "standard") or "UNKNOWN").split()[0]


def _final_slurm_state(job, wait_s: float = 20.0) -> str:
    """The state of an ended Slurm job, waiting up to ``wait_s`` for accounting to catch up (RUNNING -> FAILED)."""
    deadline = time.time() + wait_s
    state = _slurm_state(job, force=True)
    while state not in _SLURM_TERMINAL and time.time() < deadline:
        time.sleep(1.0)
        state = _slurm_state(job, force=True)
    return state


def _slurm_really_ended(job) -> bool:
    """Whether a Slurm job that submitit calls done has really ended.

    submitit decides from sacct, which shows a job being requeued (preemption, time-limit checkpoint) as FAILED or
    CANCELLED for a moment. When a task's result is missing, ask the controller (squeue, no accounting lag): if the
    job is still queued or running, forget submitit's cached state and keep waiting.
    """
    tasks = getattr(job, "_sub_jobs", None) or [job]
    if all(t.paths.result_pickle.exists() for t in tasks):
        return True
    from llmpipe.dispatch import slurm

    try:
        info = slurm.job_info(job.job_id)
    except RuntimeError:
        return True
    state = ((info or {}).get("State") or "").split()[0] if info else ""
    if state and state not in _SLURM_TERMINAL:
        job.watcher._finished.discard(job.job_id)  # submitit caches finished states forever
        job.watcher._info_dict.pop(job.job_id, None)
        return False
    return True


def _slurm_where(job) -> tuple[str, str]:
    """(state, nodes) of a Slurm job from the controller (squeue; sacct once it is gone); ("", "") when unknown.

    sacct lags: for a few seconds it can show a running job as PENDING on its batch node only.
    """
    from llmpipe.dispatch import slurm

    try:
        info = slurm.job_info(job.job_id)
    except RuntimeError:
        info = None
    if not info:
        return "", ""
    nodes = info.get("NodeList") or ""
    return (info.get("State") or "").split(" ")[0], "" if nodes in ("None assigned", "(null)") else nodes


def _wait(job, log_file: str | None, poll_s: float, what: str, slurm_poll_s: float,
          progress: Callable[[], str | None] | None, progress_path: str | None, progress_s: float) -> list:
    """Block until ``job`` ends; return the results of all its tasks. Raise StepFailed with state and log.

    Slurm jobs: sacct is asked at least every ``slurm_poll_s`` seconds (submitit's own watcher backs off to 10
    minutes on long jobs), and each state change is logged with its reason and nodes
    (:class:`llmpipe.dispatch.slurm_watch.StateLog`; ``progress`` is asked on a requeue). A job PENDING for a reason Slurm
    never resolves is cancelled and raises :class:`StepFailed` at once. A local job's end is seen when its process
    exits, its state and failed ranks every ``poll_s`` seconds. The job's progress record
    (``progress_path``, :mod:`llmpipe.dispatch.progress`) is printed on the console every ``progress_s`` seconds.
    """
    last_state = last_shown = None
    last_force = time.time()
    slurm = is_slurm_job(job)
    watch = None
    if slurm:
        from llmpipe.dispatch.slurm_watch import NeverRuns, StateLog

        watch = StateLog(job.job_id, what, lambda line: say(line, log_file), progress)
    echo = progress_record.ProgressEcho(progress_path, what, progress_s)   # the job's record on the console
    while True:
        echo.poll()
        force = slurm and time.time() - last_force >= slurm_poll_s
        if force:
            last_force = time.time()
        if watch is not None:
            try:
                watch.poll()
            except NeverRuns as exc:
                with contextlib.suppress(Exception):
                    job.cancel(check=False)
                say(str(exc), log_file)
                raise StepNeverRuns(str(exc)) from None
        if job.done(force_check=force) and (not slurm or _slurm_really_ended(job)):
            break
        if not slurm and job_failures.any_task_raised(job):
            # one rank failed: the others would wait out the process group's timeout. SIGKILL of the controller
            # ends its tasks too (DieWithParent), without the traceback its SIGINT handler prints
            proc = getattr(job, "_process", None)
            proc.kill() if proc is not None else job.cancel(check=False)
            break
        state = job.state
        if not slurm and state != last_state:
            last_state = state
            if state != last_shown:
                say(f"{what}: job {job.job_id} is {state}", log_file)
                last_shown = state
        # submitit's LocalJob is done when its controller process (a Popen; none when re-attached) has exited
        proc = None if slurm else getattr(job, "_process", None)
        if proc is None:
            time.sleep(max(poll_s, 1.0) if slurm else poll_s)
        else:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=poll_s)
    told_nodes = bool(watch and watch.told_nodes)
    nodes = ""
    if slurm:
        live, nodes = _slurm_where(job)
        acct_state = _slurm_state(job, force=True)
        acct_nodes = job.watcher.get_info(job.job_id, mode="cache").get("NodeList", "")
        if acct_state in _SLURM_TERMINAL and acct_nodes and acct_nodes != "None assigned":
            nodes = acct_nodes  # settled accounting has the whole allocation; a completing job's squeue entry may not
        state = live or acct_state
        if not told_nodes and nodes:
            say(f"{what}: job {job.job_id} ran on {nodes} ({state})", log_file)
        # a job that died without writing its result pickles (cancelled, timed out, node failure) never will:
        # do not let submitit wait 15 s per task for them
        if state in _SLURM_TERMINAL and state != "COMPLETED":
            for sub in [job, *getattr(job, "_sub_jobs", [])]:
                sub._results_timeout_s = 3
    elif type(job).__name__ == "LocalJob":
        # the local job's processes have exited: a result pickle that is missing now never comes (submitit would
        # wait 15 s per task for it, e.g. when the result could not be pickled)
        for sub in [job, *getattr(job, "_sub_jobs", [])]:
            sub._results_timeout_s = 0
    try:
        return job.results()
    except Exception as exc:  # noqa: BLE001 - re-raised with context
        rank, headline, task = job_failures.first_failure(job, exc)
        if slurm:
            live, nodes = _slurm_where(job)
            state = live if live in _SLURM_TERMINAL else _final_slurm_state(job)
        else:
            state = job_failures.local_state(job)
        who = f"rank {rank} " if len(getattr(job, "_sub_jobs", []) or []) > 1 else ""
        headline = job_failures.named_oserror(headline)   # ENOSPC (No space left on device) on <path> (OSError)
        raise StepFailed(f"{what}: job {job.job_id} ended in state {state}{f' on {nodes}' if nodes else ''}: "
                         f"{who}{headline}\n"
                         f"log: {task.paths.stderr}\n{job_failures.log_tail(task)}", state=state,
                         job_id=str(job.job_id), headline=headline) from exc


def run_step(fn: Callable, *args: Any, step: str, resources: dict, config: dict, log_dir: str,
             key: str, log_file: str | None = None, progress: Callable[[], str | None] | None = None,
             resume_batch: Callable[[], int] | None = None, on_job: Callable[[str, str], None] | None = None,
             **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` as one job on ``resources`` and return rank 0's result.

    The job has ``nodes x tasks_per_node`` tasks; every task calls ``fn`` (training sets up torch.distributed
    from submitit's environment). Blocks until the job ends.

    Args:
        step: a short name for logs (``train mpt-1b``).
        resources: ``nodes, tasks_per_node, gpus_per_node, cpus_per_task, mem_gb, time_min``.
        log_dir: folder for submitit's pickles and per-task logs.
        key: identity of this submission (see :func:`job_key`); a live job with the same key is re-attached.
        log_file: the Snakemake rule's log; every line printed here is appended to it too.
        progress: returns a short text on the step's progress (e.g. its newest checkpoint's batch), logged when
            Slurm requeues the job; not passed to ``fn``.
        resume_batch: returns the batch of the step's newest complete checkpoint (0: none). With it, a Slurm job
            that ends ``TIMEOUT`` (Slurm's time-limit signal came before the training could handle it, e.g. during
            the batch script's set-up) is submitted again when that batch is later than when the job was submitted
            or re-attached; at most ``slurm.max_requeue_timeouts`` such ends without progress
            (:func:`llmpipe.dispatch.requeue.resubmit_after_timeout`). Not passed to ``fn``.
        on_job: called with ``(executor kind, job id)`` for each job this step waits for, once submitted or
            re-attached to (e.g. to name it as the holder of a lease, :mod:`llmpipe.dispatch.lease`). Not passed to ``fn``.

    Raises:
        StepFailed: the job failed, was cancelled or timed out (message: job id, state, log tail), or it was
            PENDING for a reason Slurm never resolves (:class:`StepNeverRuns`; the job is cancelled).
    """
    rec_path = _record_path(config, key)
    timeouts = {"resubmitted": 0, "no_progress": 0}
    while True:
        job = _reattach_recorded(config, rec_path, step, log_file)
        start = resume_batch() if resume_batch is not None else 0
        if job is None:
            job = _submit(fn, args, kwargs, step=step, resources=resources, config=config, log_dir=log_dir,
                          rec_path=rec_path, log_file=log_file)
        if on_job is not None:
            on_job(executor_kind(config), str(job.job_id))
        try:
            results = _wait_and_forget(job, config, rec_path, log_dir, step, log_file, progress)
        except StepFailed as exc:
            if resume_batch is None or executor_kind(config) != "slurm":
                raise
            from llmpipe.dispatch.requeue import resubmit_after_timeout
            from llmpipe.dispatch.slurm import site_config

            cap = int(site_config(config, resources)["max_requeue_timeouts"])
            if not resubmit_after_timeout(exc.state, exc.job_id, start, resume_batch(), timeouts, step, cap,
                                          lambda line: say(line, log_file)):
                raise
            continue
        say(f"{step}: job {job.job_id} finished (COMPLETED)", log_file)   # every rule log ends with the final state
        return results[0]


def _reattach_recorded(config: dict, rec_path: str, step: str, log_file: str | None):
    """The live or finished job recorded at ``rec_path`` (see :func:`run_step`), or None when there is none to wait
    for (no record, the job is gone, or it ended unsuccessfully)."""
    if not os.path.exists(rec_path):
        return None
    with open(rec_path) as fh:
        record = json.load(fh)
    job = _reattach(config, record)
    if job is None:
        say(f"{step}: earlier {record.get('executor')} job {record.get('job_id')} is gone; "
            f"submitting a new one", log_file)
        return None
    state = job.state
    live = (str(state).split() or [""])[0] in _SLURM_LIVE
    # a job Slurm still lists as live is re-attached even when submitit already calls it done (its result
    # is written while Slurm still shows RUNNING/COMPLETING): _wait then waits for its real end
    if state in _FINISHED_OK or live or not job.done():
        say(f"{step}: re-attaching to job {job.job_id} ({state}) submitted earlier; "
            f"not submitting a second copy", log_file)
        return job
    say(f"{step}: earlier job {job.job_id} ended {state}; submitting a new one", log_file)
    return None


def _wrapped(fn: Callable, config: dict) -> Callable:
    """``fn`` as a job runs it: on the local executor its tasks die with their controller, the PID the step prints
    (:class:`llmpipe.dispatch.orphans.DieWithParent`); on Slurm a finished task ignores a late time-limit signal
    (:class:`llmpipe.dispatch.requeue.IgnoreSignalAfterReturn`)."""
    kind = executor_kind(config)
    if kind == "local":
        return DieWithParent(fn)
    if kind == "slurm":
        from llmpipe.dispatch.requeue import IgnoreSignalAfterReturn
        return IgnoreSignalAfterReturn(fn)
    return fn


def _submit(fn: Callable, args: tuple, kwargs: dict, *, step: str, resources: dict, config: dict, log_dir: str,
            rec_path: str, log_file: str | None):
    """Submit ``fn(*args, **kwargs)``, record it at ``rec_path`` and log where it runs; return the job."""
    os.makedirs(log_dir, exist_ok=True)
    ex = make_executor(config, resources, os.path.join(log_dir, "%j"), name=step.replace(" ", "_"))
    record = progress_record.record_path(log_dir)
    with contextlib.suppress(FileNotFoundError):
        os.remove(record)                          # an earlier job's progress is not this one's
    os.environ[progress_record.ENV] = record       # the job inherits it (submitit passes the environment on)
    with rendezvous.local_master_port(executor_kind(config), int(resources.get("tasks_per_node", 1))):
        with interrupts.controller_stderr(executor_kind(config) == "local", log_dir):
            job = ex.submit(_wrapped(fn, config), *args, **kwargs)
    _write_record(rec_path, {"executor": executor_kind(config), "job_id": str(job.job_id),
                             "folder": os.path.join(log_dir, "%j"), "step": step, "name": step.replace(" ", "_"),
                             "num_tasks": int(getattr(job, "num_tasks", 1)), "submitted": time.time()})
    say(f"{step}: submitted job {job.job_id} ({executor_kind(config)}, {resources.get('nodes', 1)} node(s) x "
        f"{resources.get('tasks_per_node', 1)} task(s), {resources.get('gpus_per_node', 0)} GPU(s)/node); "
        f"log: {getattr(job.paths, 'stderr', log_dir)}", log_file)
    return job


def _wait_and_forget(job, config: dict, rec_path: str, log_dir: str, step: str, log_file: str | None,
                     progress: Callable[[], str | None] | None) -> list:
    """:func:`_wait` for ``job`` (local jobs are cancelled if this process is interrupted); once it ended, remove
    its record and submitit's empty folder pattern."""
    poll_s = float(setting(config, "dispatch", "poll_s"))
    progress_s = float(setting(config, "dispatch", "progress_s"))
    try:
        with interrupts.jobs_stop_with_us([job], step, lambda line: say(line, log_file)):
            return _wait(job, log_file, poll_s, step, _slurm_poll_s(config), progress,
                         progress_record.record_path(log_dir), progress_s)
    except StepNeverRuns:
        with contextlib.suppress(FileNotFoundError):
            os.remove(rec_path)  # cancelled: nothing to re-attach to
        raise
    finally:
        if job.done():
            with contextlib.suppress(FileNotFoundError):
                os.remove(rec_path)
            _drop_pattern_folder(log_dir)


def _drop_pattern_folder(log_dir: str) -> None:
    """Remove the empty ``{log_dir}/%j`` folder submitit leaves behind once the jobs are over (submitit stages
    submissions in its folder pattern taken literally, and its local controller creates it); the jobs' own folders
    are ``{log_dir}/<job id>``. Kept when not empty; so is the local controllers' stderr (:data:`CONTROLLER_LOG`)."""
    try:
        os.rmdir(os.path.join(log_dir, "%j"))
    except OSError:
        pass
    controllers = os.path.join(log_dir, CONTROLLER_LOG)
    with contextlib.suppress(OSError):
        if os.path.getsize(controllers) == 0:
            os.remove(controllers)


def _reattach_array(config: dict, record: dict) -> list | None:
    """The submitit jobs of a recorded Slurm array, or None when they cannot be the same jobs any more (another
    executor, an array Slurm no longer knows or that now has another name)."""
    import submitit

    ids = record.get("job_ids") or []
    if not ids or record.get("executor") != executor_kind(config) or record["executor"] != "slurm":
        return None
    from llmpipe.dispatch import slurm

    try:
        info = slurm.job_info(ids[0])
    except RuntimeError:
        info = {}  # Slurm did not answer: assume the array is still there rather than submit a duplicate
    if info is None or (info and record.get("name") and info.get("JobName") != record["name"]):
        return None
    return [submitit.SlurmJob(folder=folder, job_id=jid) for jid, folder in zip(ids, record["folders"])]


def finish_recorded_array(config: dict, key: str, step: str, log_file: str | None = None) -> bool:
    """Wait for the Slurm array that an earlier call of :func:`map_steps` with this ``key`` submitted, when Slurm
    still knows it (the Snakemake process that submitted it may have been killed during data prep).

    Call before deciding which units still need a job: the earlier array's tasks finish their units instead of a
    second array running them again. Its results are not returned (each task's output is on disk); failed tasks
    are logged, and the caller's next :func:`map_steps` submits what is still missing.

    Returns:
        True when an earlier array was re-attached and waited for.
    """
    rec_path = _record_path(config, key)
    if executor_kind(config) != "slurm" or not os.path.exists(rec_path):
        return False
    with open(rec_path) as fh:
        record = json.load(fh)
    jobs = _reattach_array(config, record)
    if jobs is None:
        say(f"{step}: earlier array {str(record.get('job_ids', ['?'])[0]).split('_')[0]} is gone", log_file)
        os.remove(rec_path)
        return False
    say(f"{step}: re-attaching to array {jobs[0].job_id.split('_')[0]} ({len(jobs)} task(s)) submitted earlier; "
        f"waiting for it before submitting what is still missing", log_file)
    _, failures = _wait_array(jobs, step, config, log_file, None)
    for failure in failures:
        say(f"{step}: earlier {failure.splitlines()[0]}", log_file)
    with contextlib.suppress(FileNotFoundError):
        os.remove(rec_path)
    return True


def _wait_array(jobs: list, step: str, config: dict, log_file: str | None,
                on_result: Callable | None) -> tuple[list, list[str]]:
    """Wait for every job of an array; (results in order, None for failed ones; failure texts). On Slurm each
    task's end is logged with its state, node and log."""
    poll_s = float(setting(config, "dispatch", "poll_s"))
    results: list = [None] * len(jobs)
    pending = set(range(len(jobs)))
    failures: list[str] = []
    slurm_poll_s = _slurm_poll_s(config)
    last_force = time.time()
    with interrupts.jobs_stop_with_us(jobs, step, lambda line: say(line, log_file)):
        while pending:
            if is_slurm_job(jobs[0]) and time.time() - last_force >= slurm_poll_s:
                jobs[0].watcher.update()  # one sacct for all of them; submitit's own backs off to 10 minutes
                last_force = time.time()
            for i in sorted(pending):
                if jobs[i].done():
                    pending.discard(i)
                    where = ""
                    if is_slurm_job(jobs[i]):
                        node = jobs[i].watcher.get_info(jobs[i].job_id, mode="cache").get("NodeList", "")
                        if not node or node == "None assigned":
                            node = _slurm_where(jobs[i])[1]  # sacct's cache had not seen it run
                        if not node or node == "None assigned":  # Slurm forgot it already: submitit logged it
                            node = (job_failures.logged_host(jobs[i].paths.stdout)
                                    or job_failures.logged_host(jobs[i].paths.stderr))
                        where = f"{f' on {node}' if node and node != 'None assigned' else ''}; log: " \
                                f"{jobs[i].paths.stderr}"
                    try:
                        results[i] = jobs[i].result()
                        if where:
                            say(f"{step}: job {jobs[i].job_id} done{where}", log_file)
                        if on_result:
                            on_result(i, results[i])
                    except Exception as exc:  # noqa: BLE001 - collected and re-raised by the caller
                        if where:
                            say(f"{step}: job {jobs[i].job_id} failed ({jobs[i].state}){where}", log_file)
                        tail = job_failures.log_tail(jobs[i], 15)
                        failures.append(f"job {jobs[i].job_id} ({jobs[i].state}): {exc}\n{tail}")
            if pending:
                # local jobs: done() only polls a child process, so look often (a short run's last unit is
                # noticed within 0.1 s, not up to 1 s later); Slurm: the watcher's cached sacct state, every 1 s
                time.sleep(min(poll_s, 1.0 if is_slurm_job(jobs[0]) else 0.1))
    return results, failures


def map_steps(fn: Callable, items: Sequence[Any], *, step: str, resources: dict, config: dict, log_dir: str,
              log_file: str | None = None, max_parallel: int = 0, on_result: Callable | None = None,
              key: str | None = None) -> list:
    """Run ``fn(item)`` for each item as independent single-task jobs (a Slurm array, or local processes).

    Results come back in the order of ``items``. ``on_result(i, result)`` is called as each job finishes so a
    caller can print a line per finished unit. On Slurm each task's end is logged with its state, node and log.

    Args:
        key: identity of this submission (see :func:`job_key`): a Slurm array is recorded under it in
            ``dispatch.state_dir`` until all its tasks ended, for :func:`finish_recorded_array`. None: not recorded.

    Raises:
        StepFailed: one or more jobs failed (message: each failed job's id, state and log tail).
    """
    if not items:
        return []
    os.makedirs(log_dir, exist_ok=True)
    name = step.replace(" ", "_")
    slurm_kind = executor_kind(config) == "slurm"
    one = dict(resources, nodes=1, tasks_per_node=1)
    ex = make_executor(config, one, os.path.join(log_dir, "%j"), name=name)
    if max_parallel and hasattr(ex, "update_parameters") and slurm_kind:
        ex.update_parameters(array_parallelism=max_parallel)
    with interrupts.controller_stderr(executor_kind(config) == "local", log_dir):
        jobs = ex.map_array(_wrapped(fn, config), list(items))
    rec_path = _record_path(config, key) if key and slurm_kind else None
    if rec_path:
        _write_record(rec_path, {"executor": "slurm", "job_ids": [str(j.job_id) for j in jobs],
                                 "folders": [str(j.paths.folder) for j in jobs], "step": step, "name": name,
                                 "submitted": time.time()})
    first = str(jobs[0].job_id)
    what = (f"array {first.split('_')[0]} of {len(jobs)} task(s) ({first} .. {jobs[-1].job_id})" if slurm_kind
            else f"{len(jobs)} job(s) ({executor_kind(config)}; first id {first})")
    say(f"{step}: submitted {what}; logs: {log_dir}/<job id>/<job id>_0_log.err", log_file)
    results, failures = _wait_array(jobs, step, config, log_file, on_result)
    if rec_path:
        with contextlib.suppress(FileNotFoundError):
            os.remove(rec_path)  # every task ended
    _drop_pattern_folder(log_dir)
    if failures:
        raise StepFailed(f"{step}: {len(failures)} of {len(jobs)} job(s) failed:\n" + "\n".join(failures))
    return results
