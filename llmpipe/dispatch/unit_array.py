"""Run many independent units of work through the dispatch layer, restartably.

A *unit* is one call ``fn(unit.arg) -> record`` that produces its output atomically and leaves a completion marker
that ``is_complete(unit.arg)`` recognizes (a record, or None when the unit is missing, incomplete or stale). What a
unit computes is the caller's business; this module only decides where units run and which of them run again:

* units that are already complete are reused (never run again); the others run, largest ``weight`` first;
* on the ``local`` executor, ``workers`` processes (submitit's local executor) share one list of units and each
  unit is claimed by exactly one of them (an ``O_EXCL`` file per unit in ``{work_dir}/claims``), which balances
  the load;
* on ``slurm``, a job array of one task per unit (``array_parallelism = workers`` when ``workers`` > 0);
* on ``debug``, in this process (tests).

Progress: a line per finished unit (``{name}: unit {key} done (i/n): {describe(record)}``), printed and appended to
the rule's log. A unit may also write a JSON progress file (:attr:`Unit.progress`, written by the unit, replaced
atomically): ``{"bytes_done", "bytes_total", "done", "record"}``; this process polls those files for a tqdm bar per
running unit on a terminal and announces a unit as soon as its file says ``done`` with its ``record``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from llmpipe.dispatch.jobs import executor_kind, finish_recorded_array, job_key, map_steps, say


@dataclass(frozen=True)
class Unit:
    """One unit of an array.

    Attributes:
        key: names the unit in logs, claim files and announcements (unique in the array, e.g. ``train/unit-00003``).
        arg: what the unit function gets (must pickle).
        progress: the JSON progress file the unit writes (see the module docstring), or None.
        weight: larger units run first (e.g. input bytes).
    """

    key: str
    arg: Any
    progress: str | None = None
    weight: float = 0.0


@dataclass(frozen=True)
class ArrayRun:
    """What :func:`run_unit_array` did: keys of the units ``run`` (in the order they were handed out) and
    ``reused`` (already complete, in input order); ``workers``: processes or array tasks at once (0 when nothing
    ran); ``records``: ``(key, record)`` of each unit run, as the jobs returned them."""

    run: list[str]
    reused: list[str]
    workers: int
    records: list[tuple[str, Any]]


def resolve_workers(workers: int, n_units: int) -> int:
    """How many workers run ``n_units`` units: ``workers``, with 0 (or less) meaning the CPUs available to this
    process; never more than ``n_units``; 0 only when there are no units."""
    w = int(workers or 0)
    if w <= 0:
        try:
            cpus = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cpus = os.cpu_count() or 1
        w = cpus
    return max(1, min(w, n_units)) if n_units else 0


def run_claimed_units(job: dict) -> list[tuple[str, Any]]:
    """Worker entry point (one submitit job): run the units of ``job['units']`` with ``job['fn']``.

    With ``job['claim_dir']`` set, several jobs share one list and each unit is claimed by exactly one job (an
    ``O_EXCL`` file per unit). A unit that ``job['is_complete']`` recognizes is skipped. Returns ``(key, record)``
    of the units this job ran.
    """
    done = []
    claim_dir = job.get("claim_dir")
    for unit in job["units"]:
        if claim_dir:
            try:
                fd = os.open(os.path.join(claim_dir, unit.key.replace("/", ".")), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                os.close(fd)
            except FileExistsError:
                continue
        if job["is_complete"](unit.arg):
            continue
        done.append((unit.key, job["fn"](unit.arg)))
    return done


class ProgressMonitor(threading.Thread):
    """Parent-side progress: a tqdm bar per running unit (on a terminal, when ``bars``) from the units' progress
    files, and one line per finished unit (:meth:`announce`, also called with the records the jobs return)."""

    def __init__(self, units: Sequence[Unit], total: int, *, name: str, describe: Callable[[Any], str],
                 log_file: str | None, bars: bool):
        super().__init__(daemon=True)
        self.units = list(units)
        self.total = total
        self.name = name
        self.describe = describe
        self.log_file = log_file
        self.bars_on = bars and sys.stderr.isatty()
        self.bars: dict[str, Any] = {}
        self.announced: set[str] = set()
        self.lock = threading.Lock()
        self.stop_event = threading.Event()

    def announce(self, key: str, record: Any) -> None:
        """Print ``{name}: unit {key} done (i/n): {describe(record)}`` once per unit and close its bar."""
        with self.lock:
            if key in self.announced:
                return
            self.announced.add(key)
            bar = self.bars.pop(key, None)
            if bar is not None:
                bar.close()
            msg = f"{self.name}: unit {key} done ({len(self.announced)}/{self.total}): {self.describe(record)}"
            if self.bars_on:
                from tqdm import tqdm

                with tqdm.external_write_mode(file=sys.stderr):
                    say(msg, self.log_file)
            else:
                say(msg, self.log_file)

    def poll(self) -> None:
        """Read every unit's progress file once: update its bar, or announce it when it is done."""
        for unit in self.units:
            if unit.key in self.announced or not unit.progress:
                continue
            try:
                with open(unit.progress) as fh:
                    prog = json.load(fh)
            except (OSError, ValueError):
                continue
            if prog.get("done") and prog.get("record"):
                self.announce(unit.key, prog["record"])
                continue
            if self.bars_on:
                from tqdm import tqdm

                with self.lock:
                    bar = self.bars.get(unit.key)
                    if bar is None:
                        bar = self.bars[unit.key] = tqdm(total=prog["bytes_total"], unit="B", unit_scale=True,
                                                         desc=unit.key, leave=False, file=sys.stderr)
                    bar.update(prog["bytes_done"] - bar.n)

    def run(self) -> None:
        while not self.stop_event.wait(0.5):
            self.poll()

    def stop(self) -> None:
        """Stop polling, read the progress files a last time and close the bars."""
        self.stop_event.set()
        self.join(timeout=5)
        self.poll()
        with self.lock:
            for bar in self.bars.values():
                bar.close()
            self.bars.clear()


def run_unit_array(fn: Callable[[Any], Any], units: Sequence[Unit], *, is_complete: Callable[[Any], Any],
                   workers: int, work_dir: str, name: str, step: str, resources: dict, config: dict, log_dir: str,
                   log_file: str | None = None, describe: Callable[[Any], str] = str, verb: str = "running",
                   detail: str = "") -> ArrayRun:
    """Run the units that are not complete through :func:`llmpipe.dispatch.jobs.map_steps`; block until all ended.

    On Slurm the array is recorded (key: ``step`` and the units' keys); a call that finds the array of an earlier,
    killed call still known to Slurm waits for it first (:func:`llmpipe.dispatch.jobs.finish_recorded_array`) and then
    submits only the units still missing.

    Args:
        fn: the unit function, ``fn(unit.arg) -> record``; a module-level function (it is pickled by reference).
            It must write its output atomically (a killed unit leaves nothing that ``is_complete`` accepts).
        units: the units, each with a unique key.
        is_complete: ``is_complete(unit.arg)`` -> truthy when the unit's output is complete and current; called
            here and again by the worker right before it runs a unit. Module-level, as ``fn``.
        workers: processes (local) or array tasks at once (Slurm); 0 = as many as the CPUs available here
            locally, and no limit on Slurm (:func:`resolve_workers`).
        work_dir: a folder for the local workers' claim files (``{work_dir}/claims``, emptied first; the caller
            removes ``work_dir`` when done).
        name: the prefix of the progress lines (``mds``).
        step: the jobs' name in logs and ``squeue``.
        resources: one unit's job resources (``cpus_per_task``, ``mem_gb``, ``time_min``, ...; see
            :func:`llmpipe.config.runs.step_resources`), single node and task.
        config: the workflow config, read by the dispatch layer only (``dispatch``, ``slurm``).
        log_dir: folder for submitit's per-job logs.
        log_file: the rule's log; every progress line is appended to it.
        describe: ``describe(record)`` -> the text after ``done (i/n): `` in a unit's line.
        verb: the line that says how the units run reads ``{name}: {verb} {n} unit(s) of {total} ...``.
        detail: appended to that line (e.g. the settings the units share).

    Returns:
        An :class:`ArrayRun`.

    Raises:
        llmpipe.dispatch.jobs.StepFailed: a unit's job failed (message: each failed job's error and log tail).
    """
    kind = executor_kind(config)
    # a Slurm array an earlier call submitted (its Snakemake process killed meanwhile) finishes its units first
    array_key = job_key("unit-array", step, sorted(u.key for u in units))
    finish_recorded_array(config, array_key, step, log_file)
    todo = [u for u in units if not is_complete(u.arg)]
    todo_keys = {u.key for u in todo}
    reused = [u.key for u in units if u.key not in todo_keys]
    todo.sort(key=lambda u: -u.weight)  # largest first: better balance over the workers
    n_workers = resolve_workers(workers, len(todo))
    if reused:
        say(f"{name}: {len(reused)} unit(s) already complete, reused: {', '.join(reused[:8])}"
            f"{' ...' if len(reused) > 8 else ''}", log_file)
    records: list[tuple[str, Any]] = []
    if todo:
        if kind == "slurm":
            jobs = [{"fn": fn, "is_complete": is_complete, "units": [u], "claim_dir": None} for u in todo]
            max_parallel = n_workers if int(workers or 0) > 0 else 0
            how = f"as a Slurm job array of {len(jobs)} task(s)" + (f", at most {max_parallel} at once"
                                                                   if max_parallel else "")
        else:
            claim_dir = os.path.join(work_dir, "claims")
            shutil.rmtree(claim_dir, ignore_errors=True)  # claims of an earlier call would skip units
            os.makedirs(claim_dir)
            jobs = [{"fn": fn, "is_complete": is_complete, "units": todo, "claim_dir": claim_dir}
                    for _ in range(n_workers)]
            max_parallel = 0
            how = f"with {len(jobs)} worker process(es) ({kind})"
        say(f"{name}: {verb} {len(todo)} unit(s) of {len(units)} {how}{detail}", log_file)
        # progress files are polled for local runs only: on Slurm (hundreds of units on a shared file system)
        # the line per finished unit comes from map_steps' on_result
        mon = ProgressMonitor(todo if kind != "slurm" else [], len(todo), name=name, describe=describe,
                              log_file=log_file, bars=kind == "local")
        mon.start()

        def on_result(_i: int, done: list | None) -> None:
            for key, record in done or []:
                records.append((key, record))
                mon.announce(key, record)

        try:
            map_steps(run_claimed_units, jobs, step=step, resources=resources, config=config, log_dir=log_dir,
                      log_file=log_file, max_parallel=max_parallel, on_result=on_result, key=array_key)
        finally:
            mon.stop()
    return ArrayRun(run=[u.key for u in todo], reused=reused, workers=n_workers if todo else 0, records=records)
