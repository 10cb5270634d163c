"""Jobs that an earlier or concurrent Snakemake submitted and that are still live, for a note at DAG time.

Every submission is recorded in ``dispatch.state_dir`` (:mod:`llmpipe.dispatch.jobs`) until it ends. When a dry run (or a
run) starts while another driver runs, or after one was killed, those records say which jobs are still queued or
running: a Slurm job or array is re-attached by the next run instead of being submitted again; a local job runs
under the driver that started it and ends with it. :func:`notes` turns them into lines for the user.
"""

from __future__ import annotations

import glob
import json
import os

#: Slurm states of a job that has not ended (as in :mod:`llmpipe.dispatch.jobs`).
_LIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED", "STAGE_OUT"}


def _pid_alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def live_jobs(state_dir: str) -> list[dict]:
    """The recorded jobs that are still live: ``{step, executor, job_id, state, nodes}`` each.

    Slurm jobs (and arrays, by their first task) are asked with ``squeue``/``sacct``
    (:func:`llmpipe.dispatch.slurm.job_info`); a record Slurm does not know is skipped, and one Slurm does not answer for is
    listed with state ``UNKNOWN``. Local jobs are live while their controller process (the recorded id) is.
    """
    out = []
    for path in sorted(glob.glob(os.path.join(state_dir, "*.json"))):
        try:
            with open(path) as fh:
                rec = json.load(fh)
        except (OSError, ValueError):
            continue
        job_id = str(rec.get("job_id") or (rec.get("job_ids") or [""])[0])
        if not job_id:
            continue
        entry = {"step": rec.get("step", "?"), "executor": rec.get("executor"), "job_id": job_id,
                 "array": len(rec.get("job_ids") or []), "state": "", "nodes": ""}
        if rec.get("executor") == "slurm":
            from llmpipe.dispatch import slurm

            try:
                info = slurm.job_info(job_id, timeout=10)
            except RuntimeError:
                info = {"State": "UNKNOWN"}
            if not info or (info.get("State") or "").split()[0] not in _LIVE | {"UNKNOWN"}:
                continue
            if rec.get("name") and info.get("JobName") and info["JobName"] != rec["name"]:
                continue  # the id now names another job
            entry["state"] = info["State"].split()[0]
            nodes = info.get("NodeList") or ""
            entry["nodes"] = "" if nodes in ("(null)", "None assigned") else nodes
        elif rec.get("executor") == "local":
            if not _pid_alive(job_id):
                continue
            entry["state"] = "RUNNING"
        else:
            continue
        out.append(entry)
    return out


def notes(state_dir: str, lock_dir: str = ".snakemake/locks") -> list[str]:
    """Lines that say which recorded jobs are live and what a run would do with them; empty when none are.

    Mentions another Snakemake holding this folder's lock (``lock_dir`` has lock files) when one does.
    """
    jobs = live_jobs(state_dir)
    if not jobs:
        return []
    locked = bool(glob.glob(os.path.join(lock_dir, "*.lock")))
    lines = [f"llmpipe: {len(jobs)} job(s) submitted by "
             f"{'the Snakemake that holds this folder (.snakemake/locks)' if locked else 'an earlier Snakemake'} "
             f"are still live:"]
    for j in jobs:
        what = f"array {j['job_id'].split('_')[0]} ({j['array']} task(s))" if j["array"] else f"job {j['job_id']}"
        where = f" on {j['nodes']}" if j["nodes"] else ""
        if j["executor"] == "slurm":
            then = ("a run started after that Snakemake ends (or is killed) re-attaches to it instead of "
                    "submitting it again" if locked else "the next run re-attaches to it instead of submitting it "
                    "again")
        else:
            then = "it runs under the Snakemake that started it and ends with it"
        lines.append(f"llmpipe:   {j['step']}: {j['executor']} {what} is {j['state']}{where}; {then}")
    return lines
