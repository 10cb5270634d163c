"""llmpipe.dispatch.jobs on the real Slurm test cluster (tests/slurm_cluster): multi-node jobs, site settings reaching
the tasks, failures, re-attaching to a job a killed Snakemake left behind, and checkpoint + requeue."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import cloudpickle
import pytest

from llmpipe.dispatch import jobs as dispatch, live_jobs, requeue
from llmpipe.dispatch.jobs import StepFailed, job_key, run_step
from llmpipe.dispatch.rendezvous import job_port
from tests.slurm_cluster import jobs

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(180)]
REPO = Path(__file__).resolve().parents[1]

cloudpickle.register_pickle_by_value(jobs)  # the nodes run the functions without importing the test package


def config(tmp_path: Path, **site) -> dict:
    return {"dispatch": {"executor": "slurm", "state_dir": str(tmp_path / "state"), "poll_s": 0.5},
            "slurm": {"poll_s": 1, "signal_delay_s": 20, **site}}


def resources(**over) -> dict:
    r = {"nodes": 1, "tasks_per_node": 1, "gpus_per_node": 0, "cpus_per_task": 1, "mem_gb": 0, "time_min": 5}
    r.update(over)
    return r


def step_name(tmp_path: Path, what: str) -> str:
    # unique per test and session (pytest-N): sacct --name finds only this test's jobs
    return f"{what} {tmp_path.parent.name}-{tmp_path.name}"


def wait_for_state(cluster, name: str, want: str = "RUNNING", timeout: float = 60) -> str:
    """Wait until the job called ``name`` is in state ``want`` (squeue); return its id."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        out = cluster.run("squeue", "--noheader", "--name", name, "--format", "%i %T").split()
        if len(out) == 2 and out[1] == want:
            return out[0]
        time.sleep(0.3)
    raise AssertionError(f"job {name!r} never reached {want}; squeue: {cluster.run('squeue')}")


def step_in_thread(*args, **kwargs) -> tuple[threading.Thread, list]:
    """``run_step(*args, **kwargs)`` in a started daemon thread, as a waiting rule runs it; returns the thread and a
    list that receives run_step's result, or the exception it raised, once it returns."""
    out: list = []

    def step():
        try:
            out.append(run_step(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - reported by the caller's assertion
            out.append(exc)

    thread = threading.Thread(target=step, daemon=True)
    thread.start()
    return thread, out


@dataclass
class TimeoutRun:
    """The step of :func:`test_job_that_ends_timeout_after_progress_is_submitted_again`, running in a thread."""
    name: str
    log: Path
    t0: float
    thread: threading.Thread
    out: list    # run_step's result or exception, once it returned (:func:`step_in_thread`)


@pytest.fixture(scope="module")
def timeout_run(slurm_cluster, tmp_path_factory):
    """Started by the module's first test: a job that ends TIMEOUT waits for Slurm's 1-minute time limit (and its
    time-limit check, up to 30 s late), so the step runs in a thread beside the module's next tests; its test, before
    the test that asks for two whole nodes (``exclusive``), waits for it. It takes one CPU of one node; every other
    test finds its own jobs by name."""
    tmp_path = tmp_path_factory.mktemp("timeout")
    name = step_name(tmp_path, "timeout")
    folder = tmp_path / "ckpt"

    def newest() -> int:
        return max((int(p.name.split("-")[1]) for p in folder.glob("step-*")), default=0)

    log = tmp_path / "rule.log"
    t0 = time.time()
    # at most 30 steps (seconds) a job, half its 1-minute limit: the first ends TIMEOUT however late Slurm's check
    # comes, the second counts the last 2 and finishes
    thread, out = step_in_thread(jobs.deaf_counter, str(folder), 32, 30, step=name, config=config(tmp_path),
                                 resources=resources(time_min=1), log_dir=str(tmp_path / "logs"), key=job_key(name),
                                 log_file=str(log), resume_batch=newest)
    yield TimeoutRun(name=name, log=log, t0=t0, thread=thread, out=out)
    thread.join(300)
    if thread.is_alive():
        slurm_cluster.run("scancel", "--name", name.replace(" ", "_"), check=False)


def test_two_nodes_one_task_each(timeout_run, slurm_cluster, tmp_path, monkeypatch):
    # timeout_run: asked for here, the module's first Slurm test, so that its job starts first (see the fixture)
    monkeypatch.delenv("MASTER_PORT", raising=False)   # the job inherits this process's environment
    name = step_name(tmp_path, "probe")
    log = tmp_path / "rule.log"
    rank0 = run_step(jobs.where, str(tmp_path / "seen"), step=name, config=config(tmp_path),
                     resources=resources(nodes=2), log_dir=str(tmp_path / "logs"), key=job_key("probe", name),
                     log_file=str(log))
    seen = sorted((json.loads(p.read_text()) for p in (tmp_path / "seen").glob("rank*.json")),
                  key=lambda s: s["rank"])
    assert rank0 == seen[0]
    assert [s["rank"] for s in seen] == [0, 1]
    assert {s["host"] for s in seen} == {"n1", "n2"}, seen            # one rank on each node
    assert [s["node_rank"] for s in seen] == [0, 1]
    assert all(s["world_size"] == 2 and s["local_rank"] == 0 and s["local_world_size"] == 1 for s in seen)
    assert all(s["env"]["WORLD_SIZE"] == "2" and s["env"]["RANK"] == str(s["rank"]) for s in seen)
    n1_addr = re.search(r"NodeAddr=(\S+)", slurm_cluster.run("scontrol", "show", "node", "n1")).group(1)
    assert {s["master_addr"] for s in seen} == {"n1"} and {s["master_ip"] for s in seen} == {n1_addr}
    assert n1_addr.startswith("10.214.") and n1_addr.endswith(".11"), n1_addr   # the cluster's subnet, not a name
    # one port for every rank, computed from the job id below the default ephemeral range (rendezvous.job_port)
    assert {s["master_port"] for s in seen} == {job_port(seen[0]["env"]["SLURM_JOB_ID"])}
    assert 20000 <= seen[0]["master_port"] < 32768 and seen[0]["env"]["MASTER_PORT"] == str(seen[0]["master_port"])
    job_id = seen[0]["env"]["SLURM_JOB_ID"]
    assert seen[1]["env"]["SLURM_JOB_ID"] == job_id
    # the rule's log names the job, its nodes and its log file
    text = log.read_text()
    assert f"submitted job {job_id} (slurm, 2 node(s) x 1 task(s)" in text, text
    # (a job this short may be gone before it is seen RUNNING; then the nodes are those Slurm still lists)
    assert re.search(rf"job {job_id} (is RUNNING|ran) on (n\[1-2\]|n1|n2)(\s|$)", text, re.M), text
    assert str(tmp_path / "logs" / job_id) in text
    assert [j["JobID"] for j in slurm_cluster.jobs_named(name.replace(" ", "_"))] == [job_id]
    assert not list((tmp_path / "state").glob("*.json"))  # the record is gone once the job is collected


def test_gpus_are_requested_as_gres_one_task_per_gpu(slurm_cluster, tmp_path):
    name = step_name(tmp_path, "gpus")
    res = resources(gpus_per_node=2)
    del res["tasks_per_node"]  # one task per GPU by default
    got = run_step(jobs.environment, ["SLURM_NTASKS", "SLURM_TASKS_PER_NODE", "SLURM_GPUS_ON_NODE"], step=name,
                   config=config(tmp_path), resources=res, log_dir=str(tmp_path / "logs"), key=job_key(name))
    assert got["env"]["SLURM_NTASKS"] == "2" and got["env"]["SLURM_GPUS_ON_NODE"] == "2", got
    (job,) = slurm_cluster.jobs_named(name.replace(" ", "_"))
    assert "gres/gpu=2" in job["AllocTRES"], job


def test_site_env_and_container_wrapper_reach_the_task(slurm_cluster, tmp_path):
    # a stand-in for apptainer: records how it was called, then runs the command after the image
    fake = tmp_path / "fake-apptainer"
    fake.write_text("#!/bin/bash\n"
                    "printf '%s\\n' \"$@\" > \"$(dirname \"$0\")/apptainer-argv.$SLURM_PROCID\"\n"
                    "[[ $1 == exec ]] || exit 64; shift\n"
                    "while [[ $1 == -* ]]; do shift; done\n"
                    "export LLMPIPE_TEST_IMAGE=\"$1\"; shift\n"
                    "exec \"$@\"\n")
    fake.chmod(0o755)
    image = tmp_path / "llm-foundry.sif"
    image.write_text("not really an image")
    site = {"env": {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_HCA": "mlx5_0,mlx5_1", "NCCL_DEBUG": "INFO",
                    "LLMPIPE_TEST_QUOTED": "a b $HOME 'q'"},
            "container": {"type": "apptainer", "image": str(image), "apptainer": str(fake),
                          "apptainer_args": ["--nv"], "mounts": [str(REPO), str(tmp_path)], "python": sys.executable},
            "setup": ["export LLMPIPE_TEST_SETUP=from-setup"]}
    name = step_name(tmp_path, "env")
    names = ["NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_DEBUG", "LLMPIPE_TEST_QUOTED", "LLMPIPE_TEST_SETUP",
             "LLMPIPE_TEST_IMAGE"]
    got = run_step(jobs.environment, names, step=name, config=config(tmp_path, **site), resources=resources(nodes=2),
                   log_dir=str(tmp_path / "logs"), key=job_key(name))
    assert got["env"] == {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_HCA": "mlx5_0,mlx5_1", "NCCL_DEBUG": "INFO",
                          "LLMPIPE_TEST_QUOTED": "a b $HOME 'q'", "LLMPIPE_TEST_SETUP": "from-setup",
                          "LLMPIPE_TEST_IMAGE": str(image)}, got
    for rank in (0, 1):  # every task went through the container wrapper
        argv = (tmp_path / f"apptainer-argv.{rank}").read_text().splitlines()
        assert argv[:4] == ["exec", "--nv", f"--bind={REPO},{tmp_path}", str(image)], argv
        assert argv[4:7] == [sys.executable, "-u", "-m"] and argv[7] == "submitit.core._submit", argv


def test_failing_job_raises_with_job_id_state_and_log_tail(slurm_cluster, tmp_path):
    name = step_name(tmp_path, "fails")
    key = job_key(name)
    with pytest.raises(StepFailed) as e:
        run_step(jobs.fail, "optimizer.lr must be positive, got -1", step=name, config=config(tmp_path),
                 resources=resources(nodes=2), log_dir=str(tmp_path / "logs"), key=key)
    (job,) = slurm_cluster.jobs_named(name.replace(" ", "_"))
    msg = str(e.value)
    assert f"job {job['JobID']} ended in state FAILED" in msg, msg
    assert "ValueError: optimizer.lr must be positive, got -1" in msg, msg
    assert "about to fail" in msg  # the log tail
    assert str(tmp_path / "logs" / job["JobID"]) in msg  # where the whole log is
    assert job["State"] == "FAILED"


def test_task_that_dies_without_a_result(slurm_cluster, tmp_path):
    name = step_name(tmp_path, "dies")
    t0 = time.time()
    with pytest.raises(StepFailed) as e:
        run_step(jobs.die_hard, 3, step=name, config=config(tmp_path), resources=resources(),
                 log_dir=str(tmp_path / "logs"), key=job_key(name))
    (job,) = slurm_cluster.jobs_named(name.replace(" ", "_"))
    assert f"job {job['JobID']} ended in state FAILED" in str(e.value) and "exiting hard" in str(e.value)
    assert time.time() - t0 < 60


def test_cancelled_job_raises_with_its_state(slurm_cluster, tmp_path):
    name = step_name(tmp_path, "cancelled")
    caught: list = []

    def rule():
        try:
            run_step(jobs.sleep_then, 120, "never", step=name, config=config(tmp_path), resources=resources(),
                     log_dir=str(tmp_path / "logs"), key=job_key(name))
        except StepFailed as exc:
            caught.append(exc)

    t = threading.Thread(target=rule)
    t.start()
    job_id = wait_for_state(slurm_cluster, name.replace(" ", "_"))
    slurm_cluster.run("scancel", job_id)
    t.join(90)
    assert not t.is_alive() and caught, "run_step did not notice the cancelled job"
    assert f"job {job_id} ended in state CANCELLED" in str(caught[0]), caught[0]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["sigkill", "sigint"])
def test_reattaches_to_the_job_a_killed_snakemake_left_running(slurm_cluster, tmp_path, sig):
    """The rule's process is SIGKILLed, or interrupted (SIGINT: Ctrl-C, or Snakemake passing on its own SIGINT or
    SIGTERM), while its job runs; an interrupted one says in one line that the job runs on and how to cancel it. The
    next call waits for that job, submits nothing."""
    name = step_name(tmp_path, "reattach")
    cfg = config(tmp_path)
    key = job_key("train", name)
    args = dict(step=name, config=cfg, resources=resources(nodes=2), log_dir=str(tmp_path / "logs"), key=key)
    script = (
        "import sys, json, cloudpickle\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from tests.slurm_cluster import jobs\n"
        "cloudpickle.register_pickle_by_value(jobs)\n"
        "from llmpipe.dispatch.jobs import run_step\n"
        f"run_step(jobs.sleep_then, 10, 'first', **json.loads({json.dumps(args)!r}))\n")
    first = subprocess.Popen([sys.executable, "-c", script], env=os.environ.copy(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        job_id = wait_for_state(slurm_cluster, name.replace(" ", "_"))
    finally:
        first.send_signal(sig)
        out, _ = first.communicate(timeout=60)
    if sig == signal.SIGINT:
        assert f"{name}: interrupted; Slurm job(s) {job_id} run on: a rerun re-attaches to them; scancel {job_id} " \
               f"cancels them" in out, out
        assert slurm_cluster.job_fields(job_id)["JobState"] == "RUNNING"
    assert list((tmp_path / "state").glob("*.json")), "no record of the submitted job"
    # what a dry run prints meanwhile (llmpipe.plan.dag_checks)
    notes = "\n".join(live_jobs.notes(str(tmp_path / "state"), lock_dir=str(tmp_path / "locks")))
    assert re.search(rf"{re.escape(name)}: slurm job {job_id} is RUNNING on n\[1-2\]; the next run re-attaches", notes), \
        notes
    log = tmp_path / "second.log"
    got = run_step(jobs.sleep_then, 10, "second", log_file=str(log), **args)
    assert got == {"token": "first", "job_id": job_id}  # the first call's job, not a new one
    assert f"re-attaching to job {job_id}" in log.read_text()
    assert [j["JobID"] for j in slurm_cluster.jobs_named(name.replace(" ", "_"))] == [job_id]


def test_record_of_a_job_slurm_does_not_know_is_not_waited_for(slurm_cluster, tmp_path):
    name = step_name(tmp_path, "stale")
    cfg = config(tmp_path)
    key = job_key(name)
    # a record left by a run against an earlier cluster whose job ids started again from 1
    rec = Path(dispatch._record_path(cfg, key))
    rec.write_text(json.dumps({"executor": "slurm", "job_id": "987654", "folder": str(tmp_path / "old" / "%j"),
                               "step": name, "name": name.replace(" ", "_"), "num_tasks": 1}))
    log = tmp_path / "rule.log"
    got = run_step(jobs.sleep_then, 0, "fresh", step=name, config=cfg, resources=resources(),
                   log_dir=str(tmp_path / "logs"), key=key, log_file=str(log))
    assert got["token"] == "fresh"
    assert "earlier slurm job 987654 is gone; submitting a new one" in log.read_text()


def test_checkpointable_step_is_requeued_and_resumes(slurm_cluster, tmp_path):
    """Slurm's USR2 before the time limit: the step checkpoints, requeues itself and resumes; one job id throughout."""
    name = step_name(tmp_path, "requeue")

    def progress():  # what the step's own files say, as training reads its newest checkpoint
        logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("*/*_0_log.out"))
        steps = re.findall(r"checkpoint at step (\d+)", logs)
        return f"resumes after step {steps[-1]}" if steps else None

    t, out = step_in_thread(jobs.Counter(), 12, step=name, config=config(tmp_path), resources=resources(),
                            log_dir=str(tmp_path / "logs"), key=job_key(name), log_file=str(tmp_path / "rule.log"),
                            progress=progress)
    job_id = wait_for_state(slurm_cluster, name.replace(" ", "_"))
    time.sleep(4)
    slurm_cluster.run("scancel", "--signal=USR2", job_id)   # what --signal=USR2@N does before the time limit
    slurm_cluster.release_requeued(job_id)  # skip Slurm's hold of a requeued job
    t.join(120)
    assert not t.is_alive() and out, "run_step did not return"
    res = out[0]
    assert not isinstance(res, Exception), f"run_step raised {type(res).__name__}: {res}"
    assert res["job_id"] == job_id and res["steps"] == 12
    assert 3 <= res["started_at"] < 12 and res["restarts"] == "1", res  # resumed after its checkpoint
    runs = slurm_cluster.jobs_named(name.replace(" ", "_"), expect=2)
    assert [(r["JobID"], r["State"]) for r in runs] == [(job_id, "REQUEUED"), (job_id, "COMPLETED")], runs
    assert slurm_cluster.job_fields(job_id)["Restarts"] == "1"
    ckpt = re.search(r"checkpoint at step (\d+)", (tmp_path / "logs" / job_id / f"{job_id}_0_log.out").read_text())
    assert ckpt
    # the rule log tells what Slurm did: running where, requeued (restart count, how the run ended, progress),
    # pending and why, running again
    rule_log = (tmp_path / "rule.log").read_text()
    assert re.search(rf"job {job_id} is RUNNING on n[12]\n", rule_log), rule_log
    assert (f"job {job_id} was REQUEUED (restart 1; its earlier run ended REQUEUED); resumes after step "
            f"{ckpt.group(1)}") in rule_log, rule_log
    assert f"job {job_id} is PENDING (BeginTime)" in rule_log, rule_log
    assert rule_log.count(f"job {job_id} is RUNNING on") == 2, rule_log


@pytest.mark.timeout(420)
def test_resubmission_after_timeout_is_capped_by_allocations_without_progress():
    """resubmit_after_timeout: progress is free, ends without progress count against slurm.max_requeue_timeouts,
    and only TIMEOUT is resubmitted."""
    lines: list[str] = []
    counts = {"resubmitted": 0, "no_progress": 0}

    def again(state: str, start: int, now: int) -> bool:
        return requeue.resubmit_after_timeout(state, "7", start, now, counts, "train t", 1, lines.append)

    assert again("TIMEOUT", 0, 40) and again("TIMEOUT", 40, 80)             # progress: never counted
    assert again("TIMEOUT", 80, 80) and counts == {"resubmitted": 3, "no_progress": 1}
    assert not again("TIMEOUT", 80, 80) and counts["no_progress"] == 2     # the second end without progress
    assert "ended TIMEOUT 2 time(s) without a newer checkpoint than batch 80, more than " \
           "slurm.max_requeue_timeouts=1 allows: not submitted again" in lines[-1]
    assert "(resubmission 3; it resumes from batch 80)" in lines[-2]
    assert not again("FAILED", 0, 40) and counts == {"resubmitted": 3, "no_progress": 2}


def test_pending_for_a_reason_that_never_resolves_fails_at_once(slurm_cluster, tmp_path):
    """A time limit over the partition's MaxTime (preflight skipped): Slurm keeps the job PENDING forever."""
    name = step_name(tmp_path, "never")
    log = tmp_path / "rule.log"
    t0 = time.time()
    with pytest.raises(StepFailed) as e:
        run_step(jobs.sleep_then, 0, "never", step=name, config=config(tmp_path, partition="small"),
                 resources=resources(time_min=10), log_dir=str(tmp_path / "logs"), key=job_key(name),
                 log_file=str(log))
    assert time.time() - t0 < 30
    msg = str(e.value)
    # Slurm names it PartitionConfig or PartitionTimeLimit (tests/test_slurm_preflight.py)
    m = re.search(r"is PENDING \((Partition(?:TimeLimit|Config))\), which Slurm never resolves by itself: (.*)", msg)
    assert m and "time_min" in m.group(2) and "The job was cancelled" in msg, msg
    assert f"is PENDING ({m.group(1)})" in log.read_text()
    (job,) = slurm_cluster.jobs_named(name.replace(" ", "_"))
    assert job["State"].startswith("CANCELLED"), job  # not left in the queue
    assert not list((tmp_path / "state").glob("*.json"))  # nothing to re-attach to


def test_map_steps_runs_a_slurm_array(slurm_cluster, tmp_path):
    name = step_name(tmp_path, "array")
    seen = []
    got = dispatch.map_steps(jobs.square, [3, 1, 2], step=name, config=config(tmp_path), resources=resources(),
                             log_dir=str(tmp_path / "logs"), max_parallel=2, on_result=lambda i, r: seen.append(i))
    assert [g["square"] for g in got] == [9, 1, 4] and [g["array_task"] for g in got] == ["0", "1", "2"]
    assert sorted(seen) == [0, 1, 2]
    runs = slurm_cluster.jobs_named(name.replace(" ", "_"), expect=3)
    assert len(runs) == 3 and len({r["JobID"].split("_")[0] for r in runs}) == 1, runs  # one array job


def test_array_of_a_killed_driver_is_reattached_not_resubmitted(slurm_cluster, tmp_path):
    """Data prep's array is recorded: after the driver is SIGKILLed, the next call waits for that array."""
    name = step_name(tmp_path, "array-reattach")
    cfg = config(tmp_path)
    key = job_key("unit-array", name)
    args = dict(step=name, config=cfg, resources=resources(), log_dir=str(tmp_path / "logs"), key=key)
    script = (
        "import sys, json, cloudpickle\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from tests.slurm_cluster import jobs\n"
        "cloudpickle.register_pickle_by_value(jobs)\n"
        "from llmpipe.dispatch.jobs import map_steps\n"
        f"map_steps(jobs.square_slowly, [2, 3], **json.loads({json.dumps(args)!r}))\n")
    first = subprocess.Popen([sys.executable, "-c", script], env=os.environ.copy(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 60
        while "RUNNING" not in slurm_cluster.run("squeue", "--noheader", "--name", name.replace(" ", "_"),
                                                 "--format", "%T") and time.time() < deadline:
            time.sleep(0.3)
    finally:
        first.send_signal(signal.SIGKILL)
        out = first.communicate()[0]
    m = re.search(r"submitted array (\d+) of 2 task\(s\) \(\1_0 \.\. \1_1\)", out)
    assert m, out
    array_id = m.group(1)
    assert list((tmp_path / "state").glob("*.json")), "the array was not recorded"
    log = tmp_path / "second.log"
    assert dispatch.finish_recorded_array(cfg, key, name, str(log))
    text = log.read_text()
    assert f"re-attaching to array {array_id} (2 task(s)) submitted earlier" in text, text
    for i in (0, 1):
        assert re.search(rf"job {array_id}_{i} done on n[12]; log: \S+/{array_id}_{i}_0_log\.err", text), text
    runs = slurm_cluster.jobs_named(name.replace(" ", "_"), expect=2)
    assert sorted(r["JobID"] for r in runs) == [f"{array_id}_0", f"{array_id}_1"], runs  # nothing resubmitted
    assert not list((tmp_path / "state").glob("*.json"))
    assert not dispatch.finish_recorded_array(cfg, key, name, str(log))  # nothing left to wait for


def test_job_that_ends_timeout_after_progress_is_submitted_again(timeout_run, slurm_cluster):
    """The time-limit signal never reaches the step (it came during the set-up): the job ends TIMEOUT with newer
    checkpoints than it started from, and the step submits it again instead of failing; it resumes and finishes
    (:func:`timeout_run`)."""
    run = timeout_run
    run.thread.join(max(1.0, run.t0 + 300 - time.time()))
    assert not run.thread.is_alive() and run.out, "run_step did not return within 300 s"
    res = run.out[0]
    assert not isinstance(res, Exception), f"run_step raised {type(res).__name__}: {res}"
    # the second job's accounting row can lag its end by more than the default 20 s on a loaded 2-core machine
    runs = slurm_cluster.jobs_named(run.name.replace(" ", "_"), expect=2, settle_s=90)
    assert [r["State"] for r in runs] == ["TIMEOUT", "COMPLETED"], runs     # two jobs: Slurm requeued nothing
    first, second = runs[0]["JobID"], runs[1]["JobID"]
    assert res["job_id"] == second and res["steps"] == 32 and res["started_at"] == 30, res
    text = run.log.read_text()
    assert (f"job {first} ended TIMEOUT: the time-limit signal did not reach the training in time" in text and
            f"Its newest checkpoint is at batch {res['started_at']} (progress since batch 0): submitting it again "
            f"(resubmission 1; it resumes from batch {res['started_at']})" in text), text
    assert f"submitted job {second} (slurm" in text and text.count("submitted job") == 2, text


def test_site_settings_reach_the_slurm_job(slurm_cluster, tmp_path):
    """What make_executor asks for is what Slurm records for the job."""
    site = {"partition": "debug", "exclusive": True, "sbatch_args": {"comment": "llmpipe-test", "requeue": True}}
    res = resources(nodes=2, gpus_per_node=1, cpus_per_task=2, mem_gb=1, time_min=7)
    ex = dispatch.make_executor(config(tmp_path, **site), res, str(tmp_path / "logs" / "%j"), name="settings")
    job = ex.submit(jobs.sleep_then, 30, "x")
    try:
        f = wait_and_fields(slurm_cluster, job.job_id)
        assert f["Partition"] == "debug" and f["NumNodes"] == "2" and f["TimeLimit"] == "00:07:00", f
        assert f["NumTasks"] == "2" and f["CPUs/Task"] == "2" and f["MinMemoryNode"] == "1G", f
        assert f["TresPerNode"] == "gres:gpu:1" and f["Requeue"] == "1" and f["Comment"] == "llmpipe-test", f
        assert f["OverSubscribe"] == "NO", f  # --exclusive
        script = Path(job.paths.submission_file).read_text()
        assert "#SBATCH --signal=USR2@20" in script and "#SBATCH --gres=gpu:1" in script, script
    finally:
        job.cancel(check=False)


def wait_and_fields(cluster, job_id: str, timeout: float = 30) -> dict:
    deadline = time.time() + timeout
    while True:
        f = cluster.job_fields(job_id)
        if f.get("JobState") == "RUNNING" or time.time() > deadline:
            return f
        time.sleep(0.3)


def test_pyxis_container_is_an_srun_argument(slurm_cluster, tmp_path):
    """No pyxis on the test cluster: check the batch script submitit would submit (the srun line)."""
    site = {"container": {"type": "pyxis", "image": "nvcr.io#mosaicml/llm-foundry:2.7.0", "mounts": ["/data:/data"],
                          "workdir": "/work", "python": "/usr/bin/python3"}}
    ex = dispatch.make_executor(config(tmp_path, **site), resources(), str(tmp_path / "logs" / "%j"), name="pyxis")
    text = ex._make_submission_file_text("CMD", "uid")
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert "--container-image=nvcr.io#mosaicml/llm-foundry:2.7.0" in srun and "--container-mounts=/data:/data" in srun
    assert "--container-workdir=/work" in srun
    assert ex._submitit_command_str.startswith("/usr/bin/python3 -u -m submitit.core._submit")
