"""The whole workflow on the real Slurm test cluster (tests/slurm_cluster) through ``--profile profiles/slurm``.

One finished run is shared by the module (:func:`two_node_run`): the tiny pipeline end to end, pretraining on 2 nodes
x 1 task (gloo on CPU), every Slurm task started through a stand-in apptainer that records what it was given. The
other tests copy that working folder and break or interrupt one step of it: a requeue twice during pretraining, a
killed Snakemake, a step that fails at run time, preflight errors at dry-run time, a SIGKILLed training job.

Settings come in as a site file on top of config/slurm-site.yaml, as a user's own site file would
(``--configfile config/slurm-site.yaml my-site.yaml``): a YAML file keeps their types (``--config`` hands nested
values over as strings).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from llmpipe.steps import THIS_RUN
from tests.conftest import REPO, SNAKEMAKE, copy_run, planned_jobs, project_config, snakemake

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 60          # models.mpt-tiny.train.max_duration_batches for this module (the default is 120)
SAVE_EVERY = 20
TRAIN_JSON = "results/mpt-tiny/train.json"
RUN_DIR = "results/mpt-tiny"

FAKE_APPTAINER = """#!/bin/bash
# stand-in for apptainer: record how this task was started and what it sees, then run the command after the image
rec="$(dirname "$0")/records"; mkdir -p "$rec"
tag="$SLURM_JOB_ID.${SLURM_ARRAY_TASK_ID:-x}.$SLURM_PROCID.${SLURM_RESTART_COUNT:-0}"
printf '%s\\n' "$@" > "$rec/argv.$tag"
{ echo "HOSTNAME_SEEN=$(hostname)"; env; } > "$rec/env.$tag"
[[ $1 == exec ]] || exit 64; shift
while [[ $1 == -* ]]; do shift; done
export LLMPIPE_TEST_IMAGE="$1"; shift
exec "$@"
"""

SITE_ENV = {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_HCA": "mlx5_0,mlx5_1", "NCCL_DEBUG": "INFO",
            "LLMPIPE_TEST_QUOTED": "a b $HOME 'q'"}


@dataclass
class Site:
    dir: Path
    args: list[str]          # --profile ... --configfile ... for every snakemake call of this module
    image: Path
    records: Path

    def with_configfile(self, extra: Path) -> list[str]:
        """The same arguments with one more config file merged last."""
        return [*self.args, str(extra)]


@dataclass
class Run:
    wd: Path
    output: str
    seconds: float
    t0: float       # when it started (time.time())


# ------------------------------------------------------------------------------------------------ helpers

def rule_log(wd: Path, step: str) -> str:
    """This run's lines of a rule log (not the earlier runs' lines that a new log repeats at its top)."""
    p = wd / "results/logs" / step / "mpt-tiny.log"
    return p.read_text().split(THIS_RUN)[-1] if p.exists() else ""


def submitted_ids(text: str) -> list[str]:
    return re.findall(r"submitted job (\d+) \(slurm", text)


def read_json(wd: Path, rel: str) -> dict:
    return json.loads((wd / rel).read_text())


def max_batch(wd: Path) -> int:
    logs = list((wd / RUN_DIR / "checkpoints").glob("*/train_log.jsonl"))  # one folder per training identity
    return max((json.loads(line)["batch"] for p in logs for line in p.read_text().splitlines() if line.strip()),
               default=0)


def task_log(wd: Path, job_id: str, rank: int = 0, kind: str = "out") -> str:
    p = wd / "results/logs/train/mpt-tiny.submitit" / job_id / f"{job_id}_{rank}_log.{kind}"
    return p.read_text(errors="replace") if p.exists() else ""


def usr2_checkpoints(wd: Path, job_id: str) -> list[int]:
    """Batches at which rank 0 of ``job_id`` saved a checkpoint because Slurm signalled USR2."""
    return [int(b) for b in re.findall(r"saving checkpoint at batch (\d+) before requeue", task_log(wd, job_id))]


def fresh_training(wd: Path) -> None:
    """Make the copied run train again from scratch: no train.json, no checkpoints, no loss curve (and no rule log
    naming the copied run's training job)."""
    (wd / TRAIN_JSON).unlink()
    (wd / "results/logs/train/mpt-tiny.log").unlink()
    shutil.rmtree(wd / RUN_DIR / "checkpoints")  # the loss log lives there too


def slurm_jobs_since(cluster, t0: float, name: str | None, wd: Path) -> list[dict[str, str]]:
    """Every run (requeues included) of jobs called ``name`` (None: of any name) that the working folder ``wd``
    submitted (sacct's WorkDir: the tests of this module run their jobs beside each other's) at or after ``t0``:
    JobID, State, Submit, NodeList, WorkDir."""
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t0 - 1))
    keys = ["JobID", "State", "Submit", "NodeList", "WorkDir"]
    named = ["--name", name] if name else []
    out = cluster.run("sacct", "--noheader", "--parsable2", "--allocations", "--duplicates", *named,
                      "--starttime", since, "--format", ",".join(keys))
    rows = [dict(zip(keys, line.split("|"))) for line in out.splitlines() if line.strip()]
    rows = [r for r in rows if os.path.realpath(r["WorkDir"]) == os.path.realpath(wd)]
    ids = {r["JobID"] for r in rows if r["Submit"] >= since}
    return [r for r in rows if r["JobID"] in ids]


def settled_jobs_since(cluster, t0: float, name: str, wd: Path, expect: int,
                       timeout: float = 30) -> list[dict[str, str]]:
    """:func:`slurm_jobs_since` once accounting shows at least ``expect`` rows, all in a final state."""
    final = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "REQUEUED"}
    deadline = time.time() + timeout
    while True:
        rows = slurm_jobs_since(cluster, t0, name, wd)
        if (len(rows) >= expect and all(r["State"].split()[0] in final for r in rows)) or time.time() > deadline:
            return rows
        time.sleep(0.5)


def wait_until(pred, timeout: float, what: str, bg_out: Path | None = None, poll: float = 0.5):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(poll)
    tail = bg_out.read_text()[-4000:] if bg_out and bg_out.exists() else ""
    squeue = subprocess.run(["squeue"], capture_output=True, text=True).stdout
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\nsqueue:\n{squeue}\n{tail}")


@contextlib.contextmanager
def background_snakemake(wd: Path, *args: str, env: dict | None = None):
    """snakemake in its own session (stdout+stderr to a file; ``env`` added to this process's environment);
    SIGKILLs that session if it is still running."""
    out = wd / f"snakemake-bg-{time.time_ns()}.txt"
    with open(out, "w") as fh:
        proc = subprocess.Popen(SNAKEMAKE + ["-s", str(REPO / "Snakefile"), "-d", str(wd), *args], cwd=wd,
                                stdout=fh, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                env={**os.environ, **(env or {})})
    try:
        yield proc, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL snakemake and every process of its session (rule scripts included): a closed terminal, a reboot."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def rule_scripts(wd: Path) -> list[int]:
    """PIDs of the rule scripts Snakemake runs for the working folder ``wd`` (``.snakemake/scripts/...``)."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes() if d.name.isdigit() else b""
        except OSError:
            continue
        if b"/.snakemake/scripts/" in cmd and str(wd).encode() in cmd:
            pids.append(int(d.name))
    return pids


def cancel_jobs_of(cluster, wd: Path, settle_s: float = 30) -> None:
    """Cancel any Slurm job this working folder submitted that is still queued or running (after a failed test).

    A job whose result is already written can still be in the queue for a moment while its tasks exit; it gets up
    to ``settle_s`` seconds to leave the queue on its own, so that a passing test does not turn it into CANCELLED.
    (Job ids come from submitit's per-job folders; until llmpipe removed the empty literal ``%j`` folder, the id
    "%j" made this scancel fail as a whole and cancel nothing.)"""
    ids = sorted({p.name.split("_")[0] for p in wd.glob("results/logs/*/*.submitit/*")  # array tasks: <id>_<i>
                  if p.is_dir() and p.name.split("_")[0].isdigit()})
    if not ids:
        return
    deadline = time.time() + settle_s
    while time.time() < deadline and cluster.run("squeue", "--noheader", "--format", "%i", "--jobs", ",".join(ids),
                                                 check=False).strip():
        time.sleep(1)
    cluster.run("scancel", *ids, check=False)


def sigkill_tasks(job_id: str) -> list[int]:
    """SIGKILL every Python process of a Slurm job's tasks (found by SLURM_JOB_ID in their environment), as a
    cgroup OOM kill or a dying node would: no signal handler and no cleanup, not even by the resource tracker that
    multiprocessing starts next to each task (it would unlink the task's shared memory). Returns the task PIDs.

    (``scancel --signal=KILL`` is not that: Slurm turns it into an ordinary cancel, SIGTERM first.)"""
    tasks, helpers = [], []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if not os.path.basename(cmd[0]).startswith(b"python") or f"SLURM_JOB_ID={job_id}".encode() not in env:
            continue   # not a Python process of this job (srun, slurmstepd, the batch shell)
        (tasks if b"submitit.core._submit" in cmd else helpers).append(int(d.name))
    for pid in helpers + tasks:
        os.kill(pid, signal.SIGKILL)
    return tasks


def node_shm(cluster, node: str) -> list[str]:
    """The files in a test node's private /dev/shm (seen through its slurmd's mount namespace)."""
    pid = (cluster.dir / "run" / f"slurmd-{node}.pid").read_text().strip()
    out = subprocess.run(["nsenter", "-t", pid, "-m", "ls", "-1", "/dev/shm"], capture_output=True, text=True,
                         timeout=10)
    return out.stdout.split()


# ------------------------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Site:
    """A site file like a user's own: NCCL variables, a setup line, an apptainer container (a stand-in script),
    short polls; and the module's small experiment (60 steps on 2 nodes x 1 task, short eval and generation)."""
    d = tmp_path_factory.mktemp("slurm-site")
    fake = d / "fake-apptainer"
    fake.write_text(FAKE_APPTAINER)
    fake.chmod(0o755)
    image = d / "llm-foundry.sif"
    image.write_text("not really an image")
    base = project_config()
    icl = [dict(t, num_items=16) for t in base["eval"]["icl_tasks"]]
    conf = {
        "dispatch": {"poll_s": 1},
        "slurm": {
            "poll_s": 1,
            "env": SITE_ENV,
            "setup": ["export LLMPIPE_TEST_SETUP=from-setup"],
            "container": {"type": "apptainer", "image": str(image), "apptainer": str(fake),
                          "apptainer_args": ["--nv"], "mounts": [str(REPO), str(d.parent)],
                          "python": sys.executable},
        },
        "models": {"mpt-tiny": {"train": {"max_duration_batches": STEPS, "save_interval_batches": SAVE_EVERY},
                                "resources": {"nodes": 2, "tasks_per_node": 1}}},
        "eval": {"val_batches": 2, "icl_tasks": icl},
        "generate": {"max_new_tokens": 8},
        "data_resources": {"cpus_per_task": 4},
    }
    (d / "site.yaml").write_text(yaml.safe_dump(conf, sort_keys=False))
    args = ["--profile", str(REPO / "profiles/slurm"),
            "--configfile", str(REPO / "config/slurm-site.yaml"), str(d / "site.yaml")]
    return Site(dir=d, args=args, image=image, records=d / "records")


@pytest.fixture(scope="module")
def two_node_run(slurm_cluster, site, tmp_path_factory) -> Run:
    """The tiny pipeline end to end on the cluster, once for the module."""
    wd = tmp_path_factory.mktemp("slurm-run")
    t0 = time.time()
    try:
        proc = snakemake(wd, *site.args, check=False, timeout=900)
    finally:
        cancel_jobs_of(slurm_cluster, wd)
    out = proc.stdout + proc.stderr
    (wd / "snakemake-output.txt").write_text(out)
    assert proc.returncode == 0, f"the pipeline failed on Slurm:\n{out[-8000:]}\n{slurm_cluster.log_tail(10)}"
    return Run(wd=wd, output=out, seconds=time.time() - t0, t0=t0)


@dataclass
class Background:
    wd: Path
    proc: subprocess.Popen
    out: Path
    t0: float
    steps: int
    min_step_s: float


@pytest.fixture(scope="module")
def time_limit_run(tiny_run, site, slurm_cluster, tmp_path_factory):
    """The training of :func:`test_training_over_several_time_limits_with_a_long_setup_finishes_by_itself`, started in
    the background by the module's first test before the module's shared run (:func:`two_node_run`): its allocations
    (about 5 minutes, mostly Slurm's clock) run beside that run and the module's next tests, which share only the
    cluster's nodes (each test finds its jobs by working folder; each training has its own shared-memory names,
    ``llmpipe.train.shm_names``). It trains on the data and tokenizer of the session's local tiny run (the same
    identities). Its test, later in the file, waits for it; the requeue test runs before that, beside it (it
    releases its requeued job once no node is completing a job, this one's included). A thread releases this
    training's requeued job from Slurm's hold the same way (:func:`_release_requeue_holds`). The SIGKILL test runs after it:
    it reads the shared memory that its killed job leaves on the nodes, which another job's start on the same node
    would clean up (``llmpipe.train.shm_names``).

    One node (the requeue and SIGKILL tests train on two), a 3-minute time limit and a 30 s batch-script set-up: one
    allocation trains at most 180 - 30 (set-up) - 10 (signal delay) - ~10 (start-up) = 130 s, less when the signal
    comes early (the controller's 30 s event loop) or the start-up is slow: 140 s of training needs at least two
    allocations. The steps are paced (tests/helpers/sitecustomize.py) above the tiny model's step with a checkpoint
    save on a loaded 2-core machine, so that the training's seconds do not depend on the load."""
    wd = copy_run(tiny_run, tmp_path_factory.mktemp("time-limits") / "wd")
    min_step_s = 0.6
    steps = int(140 / min_step_s)
    fresh_training(wd)
    extra = wd.parent / "time-limits.yaml"
    extra.write_text(yaml.safe_dump({
        "slurm": {"setup": ["export LLMPIPE_TEST_SETUP=from-setup", "sleep 30"], "setup_s": 30, "signal_delay_s": 10},
        "models": {"mpt-tiny": {"train": {"max_duration_batches": steps, "save_interval_batches": steps // 20},
                                "resources": {"time_min": 3, "nodes": 1}}}}))
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "helpers"), str(REPO)]),
           "LLMPIPE_TEST_MIN_STEP_S": str(min_step_s)}
    t0 = time.time()
    stop = threading.Event()
    try:
        with background_snakemake(wd, TRAIN_JSON, *site.with_configfile(extra), env=env) as (proc, out):
            releaser = threading.Thread(target=_release_requeue_holds, args=(slurm_cluster, wd, proc, stop),
                                        name="time-limit-releaser", daemon=True)
            releaser.start()
            yield Background(wd=wd, proc=proc, out=out, t0=t0, steps=steps, min_step_s=min_step_s)
    finally:
        stop.set()
        cancel_jobs_of(slurm_cluster, wd)


def _release_requeue_holds(cluster, wd: Path, proc: subprocess.Popen, stop: threading.Event) -> None:
    """Release the training job of ``wd`` from Slurm's hold each time it is requeued (``release_requeued``: the
    cluster's cred_expire, 30 s), as the requeue test does, until its Snakemake ends: the allocations and their time
    limits are Slurm's own. Checks every 2 s."""
    while proc.poll() is None and not stop.wait(2):
        with contextlib.suppress(Exception):     # no job yet, or one Slurm no longer lists
            ids = submitted_ids(rule_log(wd, "train"))
            if ids and cluster.job_fields(ids[-1]).get("Reason") == "BeginTime":    # requeued and held
                cluster.release_requeued(ids[-1], timeout=20)


# ------------------------------------------------------------------------------------------------ 1. end to end

@pytest.mark.timeout(900)
def test_tiny_pipeline_on_two_nodes(time_limit_run, two_node_run, site, slurm_cluster):
    # time_limit_run: asked for here, the module's first test, and before two_node_run, so that its training starts
    # first (see the fixture)
    wd = two_node_run.wd
    train = read_json(wd, TRAIN_JSON)
    assert train["steps"] == STEPS and train["devices"] == 2 and train["nodes"] == 2, train
    assert train["resumed_from"] is None and train["batches_this_job"] == STEPS

    # one training job, one rank on each node, world size 2
    (job_id,) = submitted_ids(rule_log(wd, "train"))
    assert f"submitted job {job_id} (slurm, 2 node(s) x 1 task(s), 0 GPU(s)/node)" in rule_log(wd, "train")
    ranks = {}
    for rank in (0, 1):
        m = re.search(r"llmpipe: rank (\d)/(\d) on (\S+) \(node rank (\d), master (\S+)\)", task_log(wd, job_id, rank))
        assert m, task_log(wd, job_id, rank)[-3000:]
        ranks[rank] = m.groups()
    assert ranks == {0: ("0", "2", "n1", "0", "n1"), 1: ("1", "2", "n2", "1", "n1")}, ranks
    # this run's jobs only: the time-limit training (same job name) still runs beside it
    rows = settled_jobs_since(slurm_cluster, two_node_run.t0, "train_mpt-tiny", wd, expect=1)
    assert [(r["State"], r["NodeList"]) for r in rows] == [("COMPLETED", "n[1-2]")], rows

    # every compute step went to Slurm (data prep as a job array), each through the dispatch module
    for step in ("train", "convert", "generate", "eval"):
        assert len(submitted_ids(rule_log(wd, step))) == 1, (step, rule_log(wd, step))
    mds_log = next((wd / "results/logs/mds").glob("*.log")).read_text()
    m = re.search(r"submitted array (\d+) of (\d+) task\(s\) \(\1_0 \.\. \1_(\d+)\)", mds_log)
    assert m and int(m.group(3)) == int(m.group(2)) - 1, mds_log
    for i in range(int(m.group(2))):  # each task's end with its node and log
        assert re.search(rf"job {m.group(1)}_{i} done on n[12]; log: \S+_0_log\.err", mds_log), mds_log
    assert not list((wd / ".llmpipe/jobs").glob("*.json"))  # every record collected

    ev = read_json(wd, "results/mpt-tiny/eval.json")
    assert ev["val"]["loss"] > 0 and ev["icl"], ev
    gen = read_json(wd, "results/mpt-tiny/generate.json")
    assert all(o["new_tokens"] > 0 for o in gen["outputs"]), gen
    # nothing left to do
    assert planned_jobs(snakemake(wd, "-n", *site.args)) == {}


# ------------------------------------------------------------------------------------------------ 7. env + container

def _records(site: Site, job_id: str) -> dict[str, tuple[list[str], dict[str, str]]]:
    got = {}
    for argv in sorted(site.records.glob(f"argv.{job_id}.*")):
        tag = argv.name[len("argv."):]
        env = dict(line.split("=", 1) for line in (site.records / f"env.{tag}").read_text().splitlines()
                   if "=" in line)
        got[tag] = (argv.read_text().splitlines(), env)
    return got


@pytest.mark.timeout(900)
def test_site_env_and_container_reach_the_training_tasks(two_node_run, site):
    wd = two_node_run.wd
    (job_id,) = submitted_ids(rule_log(wd, "train"))
    recs = _records(site, job_id)
    assert sorted(recs) == [f"{job_id}.x.0.0", f"{job_id}.x.1.0"], recs.keys()   # both training tasks
    hosts = set()
    for tag, (argv, env) in recs.items():
        assert argv[:4] == ["exec", "--nv", f"--bind={REPO},{site.dir.parent}", str(site.image)], argv
        assert argv[4:8] == [sys.executable, "-u", "-m", "submitit.core._submit"], argv
        assert {k: env.get(k) for k in SITE_ENV} == SITE_ENV, env
        assert env.get("LLMPIPE_TEST_SETUP") == "from-setup"
        assert env["SLURM_JOB_ID"] == job_id and env["SLURM_NNODES"] == "2" and env["SLURM_NTASKS"] == "2"
        hosts.add(env["HOSTNAME_SEEN"])
    assert hosts == {"n1", "n2"}
    # the other Slurm steps went through the container too
    for step in ("convert", "generate", "eval"):
        (jid,) = submitted_ids(rule_log(wd, step))
        assert _records(site, jid), f"{step} job {jid} did not start through the container"


# ------------------------------------------------------------------------------------------------ 3. killed snakemake

@pytest.mark.timeout(600)
def test_killed_snakemake_reattaches_to_the_running_job(two_node_run, site, slurm_cluster, tmp_path):
    wd = copy_run(two_node_run.wd, tmp_path / "wd")
    fresh_training(wd)
    t0 = time.time()
    try:
        with background_snakemake(wd, TRAIN_JSON, *site.args) as (proc, out):
            job_id = wait_until(lambda: (submitted_ids(rule_log(wd, "train")) or [None])[0], 120,
                                "the training job", out)
            # killed as soon as the job runs, so that its start-up and 60 batches outlast the kill and the checks
            # below on a loaded machine too
            wait_until(lambda: slurm_cluster.job_fields(job_id).get("JobState") == "RUNNING", 120, "the job to run",
                       out)
            assert rule_scripts(wd), "no rule script is waiting for the job"
            os.kill(proc.pid, signal.SIGKILL)    # Snakemake alone, not its session: its rule script must follow
            wait_until(lambda: not rule_scripts(wd), 30, "the orphaned rule script to exit", out)
            kill_session(proc)
        assert slurm_cluster.job_fields(job_id)["JobState"] == "RUNNING"   # the job outlives its Snakemake
        assert list((wd / ".llmpipe/jobs").glob("*.json")), "no record of the submitted job"

        locked = snakemake(wd, TRAIN_JSON, *site.args, check=False, timeout=120)
        msg = locked.stdout + locked.stderr
        assert locked.returncode != 0 and "--unlock" in msg, msg[-3000:]   # Snakemake says what to do
        snakemake(wd, *site.args, "--unlock", timeout=120)
        snakemake(wd, TRAIN_JSON, *site.args, timeout=400)               # the profile sets --rerun-incomplete
    finally:
        cancel_jobs_of(slurm_cluster, wd)
    log = rule_log(wd, "train")
    assert f"re-attaching to job {job_id}" in log and "not submitting a second copy" in log, log
    assert not submitted_ids(log), log
    # the submission line outlives the rule log that Snakemake deleted (its history, which the new log names);
    # one watcher wrote the end, once
    history = (wd / "results/logs/train/mpt-tiny.log.history").read_text()   # the copied run's lines come first
    assert submitted_ids(history)[-1:] == [job_id] and history.count(f"job {job_id} finished") == 1, history
    assert "earlier runs of this step: " in (wd / "results/logs/train/mpt-tiny.log").read_text().split(THIS_RUN)[0]
    train = read_json(wd, TRAIN_JSON)
    assert train["steps"] == STEPS and train["resumed_from"] is None and train["batches_this_job"] == STEPS, train
    rows = settled_jobs_since(slurm_cluster, t0, "train_mpt-tiny", wd, expect=1)
    assert [(r["JobID"], r["State"]) for r in rows] == [(job_id, "COMPLETED")], rows


# ------------------------------------------------------------------------------------------------ 4. run-time failure

@pytest.mark.timeout(600)
def test_step_failing_at_run_time_reports_job_state_and_log(two_node_run, site, slurm_cluster, tmp_path):
    wd = copy_run(two_node_run.wd, tmp_path / "wd")
    bad = tmp_path / "bad.yaml"   # a valid change; the job then finds no weights in the export (moved aside)
    bad.write_text(yaml.safe_dump({"generate": {"prompts": ["Once upon a time"]}}))
    weights = wd / "results/mpt-tiny/hf/model.safetensors"
    shutil.move(weights, tmp_path / "model.safetensors")
    t0 = time.time()
    try:
        assert planned_jobs(snakemake(wd, "-n", *site.with_configfile(bad))) == {"generate": 1, "all": 1}
        failed = snakemake(wd, *site.with_configfile(bad), check=False, timeout=300)
    finally:
        cancel_jobs_of(slurm_cluster, wd)
    out = failed.stdout + failed.stderr
    assert failed.returncode != 0
    (row,) = settled_jobs_since(slurm_cluster, t0, "generate_mpt-tiny", wd, expect=1)
    job_id = row["JobID"]
    assert row["State"] == "FAILED", row
    log = rule_log(wd, "generate")
    for text in (out, log):   # Snakemake's output (the step's own short summary) and the rule's log
        assert f"generate mpt-tiny: job {job_id} ended in state FAILED" in text, text[-5000:]
        assert "model.safetensors" in text and "no file named" in text, text[-5000:]   # transformers' error
        assert "--- stderr (last " in text                                    # the tail of the job's log
        assert f"results/logs/generate/mpt-tiny.submitit/{job_id}/{job_id}_0_log.err" in text
    assert out.count(f"job {job_id} ended in state FAILED") == 1, out[-5000:]   # once, not once per printer
    assert "rule log: results/logs/generate/mpt-tiny.log" in out and "--- stderr (last 40 lines) ---" in log
    assert not (wd / "results/mpt-tiny/generate.json").exists()
    assert not list((wd / ".llmpipe/jobs").glob("*.json"))
    # fixed: only that step runs again
    shutil.move(tmp_path / "model.safetensors", weights)
    # generate.json is gone: the evaluation (ancient() spares existing files only) reruns after the generation
    assert planned_jobs(snakemake(wd, "-n", *site.args)) == {"generate": 1, "eval": 1, "all": 1}
    t1 = time.time()
    try:
        snakemake(wd, *site.args, timeout=300)
    finally:
        cancel_jobs_of(slurm_cluster, wd)
    assert read_json(wd, "results/mpt-tiny/generate.json")["settings"]["do_sample"] is False
    # back at the site's settings, generation and evaluation have kept results of this identity and these inputs:
    # restored, no job (llmpipe.steps.kept_results)
    for step in ("generate", "eval"):
        assert "restored from results/mpt-tiny/kept/" in rule_log(wd, step), rule_log(wd, step)
    for name in ("generate_mpt-tiny", "train_mpt-tiny", "convert_mpt-tiny", "eval_mpt-tiny"):
        assert len(slurm_jobs_since(slurm_cluster, t1, name, wd)) == 0, name


# ------------------------------------------------------------------------------------------------ 5. preflight

@pytest.mark.timeout(300)
@pytest.mark.parametrize("change,expected", [
    ("slurm={'partition': 'nope'}",
     r"slurm\.partition is 'nope', but this cluster has no such partition \(it has: debug, small\)"),
    ("models={'mpt-tiny': {'resources': {'nodes': 4}}}",
     r"models\.mpt-tiny\.resources\.nodes is 4, but Slurm partition 'debug' has only 2 node\(s\).*"
     r"Fix: lower models\.mpt-tiny\.resources\.nodes to at most 2"),
    # (a global batch that 2 nodes x 8 GPUs divide: the batch check comes before the partition's)
    ("models={'mpt-tiny': {'resources': {'gpus_per_node': 8}, 'train': {'global_batch_size': 16}}}",
     r"models\.mpt-tiny\.resources\.gpus_per_node is 8, but the nodes of Slurm partition 'debug' have at most 4 "
     r"GPU\(s\) each"),
    ("models={'mpt-tiny': {'resources': {'time_min': 2000}}}",
     r"models\.mpt-tiny\.resources\.time_min is 2000 minutes, but Slurm partition 'debug' allows at most 1440 "
     r"minutes"),
], ids=["partition", "nodes", "gpus", "time-limit"])
def test_preflight_fails_the_dry_run(slurm_cluster, site, tmp_path, change, expected):
    t0 = time.time()
    # `--profile slurm` by name, set up as docs/slurm.md says (a link in the user's Snakemake config folder)
    (tmp_path / "xdg/snakemake").mkdir(parents=True)
    (tmp_path / "xdg/snakemake/slurm").symlink_to(REPO / "profiles/slurm")
    args = ["--profile", "slurm", *site.args[2:]]
    proc = snakemake(tmp_path, "-n", *args, "--config", change, check=False, timeout=120,
                     env={"XDG_CONFIG_HOME": str(tmp_path / "xdg")})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Using profiles slurm" in out, out[-2000:]
    assert re.search(r"ConfigError: " + expected, out, re.S), out[-4000:]
    # the message alone, not wrapped as an input function's failure with a traceback
    assert "InputFunctionException" not in out and "Traceback" not in out, out[-4000:]
    # nothing was submitted from this folder (other tests' jobs run beside this one: time_limit_run)
    assert slurm_jobs_since(slurm_cluster, t0, None, tmp_path) == []


def test_fitting_request_passes_preflight_by_profile_name(slurm_cluster, site, tmp_path):
    (tmp_path / "xdg/snakemake").mkdir(parents=True)
    (tmp_path / "xdg/snakemake/slurm").symlink_to(REPO / "profiles/slurm")
    proc = snakemake(tmp_path, "-n", "--profile", "slurm", *site.args[2:], timeout=120,
                     env={"XDG_CONFIG_HOME": str(tmp_path / "xdg")})
    assert planned_jobs(proc)["train"] == 1


# ------------------------------------------------------------------------------------------------ 2. requeue twice

@pytest.mark.timeout(600)
def test_requeued_twice_resumes_and_ends_at_the_step_count(two_node_run, site, slurm_cluster, tmp_path):
    wd = copy_run(two_node_run.wd, tmp_path / "wd")
    fresh_training(wd)
    t0 = time.time()
    saved: list[int] = []
    try:
        with background_snakemake(wd, TRAIN_JSON, *site.args) as (proc, out):
            job_id = wait_until(lambda: (submitted_ids(rule_log(wd, "train")) or [None])[0], 120,
                                "the training job", out)
            for n in (1, 2):
                # well into training (the signal handler is installed), and past the last checkpoint
                start = saved[-1] if saved else 0
                wait_until(lambda: max_batch(wd) >= start + 10, 240, f"training past batch {start + 10}", out)
                slurm_cluster.run("scancel", "--signal=USR2", job_id)  # what Slurm sends before a time limit
                found = wait_until(lambda: len(usr2_checkpoints(wd, job_id)) >= n and usr2_checkpoints(wd, job_id),
                                   120, f"checkpoint {n} on USR2", out)
                assert len(found) == n, found
                saved.append(found[-1])
                slurm_cluster.release_requeued(job_id, timeout=120)
            proc.wait(300)
            text = out.read_text()
        assert proc.returncode == 0, text[-6000:]
    finally:
        cancel_jobs_of(slurm_cluster, wd)

    train = read_json(wd, TRAIN_JSON)
    assert train["steps"] == STEPS, train                       # exactly the configured step count
    assert train["final_checkpoint"].endswith(f"ep0-ba{STEPS}") and train["fsdp"]  # 2 ranks: a sharded checkpoint
    assert saved[0] < saved[1] < STEPS, saved
    # each run resumed from the checkpoint written on the signal: the newest one
    log0 = task_log(wd, job_id)
    resumed = [int(b) for b in re.findall(r"rank 0 resuming from \S+/ep0-ba(\d+)\b", log0)]
    assert resumed == saved, (resumed, saved)
    assert train["resumed_from"].endswith(f"ep0-ba{saved[1]}") and \
        train["batches_this_job"] == STEPS - saved[1], train
    assert "Caught signal SIGUSR2 on n1: this job is preempted" in task_log(wd, job_id, kind="err")  # submitit's path
    # one job id, requeued twice, never submitted again
    rows = settled_jobs_since(slurm_cluster, t0, "train_mpt-tiny", wd, expect=3)
    assert [(r["JobID"], r["State"]) for r in rows] == [(job_id, "REQUEUED"), (job_id, "REQUEUED"),
                                                        (job_id, "COMPLETED")], rows
    assert slurm_cluster.job_fields(job_id)["Restarts"] == "2"
    assert submitted_ids(rule_log(wd, "train")) == [job_id]


# ------------------------------------------------------------------------------------------------ 2a. the last save interval

FINAL_STEPS, FINAL_SAVE_EVERY = 12, 4     # the last save interval: batches 9 to 12


def _signal_paused_training(cluster, wd: Path, extra: Path, site: Site, pause_at: str, requeue: bool) -> dict:
    """Train ``wd``'s tiny run under ``extra``; once it pauses at ``pause_at`` (tests/helpers/sitecustomize.py),
    ``scancel --signal=USR2`` its job, wait until its rank 0 caught the signal, let it go on, release its requeued
    job when ``requeue`` is expected. Returns the job id, Snakemake's return code and output."""
    pause = wd.parent / "pause"
    pause.mkdir()
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "helpers"), str(REPO)]),
           "LLMPIPE_TEST_PAUSE_AT": pause_at, "LLMPIPE_TEST_PAUSE_DIR": str(pause)}
    with background_snakemake(wd, TRAIN_JSON, *site.with_configfile(extra), env=env) as (proc, out):
        wait_until(lambda: (pause / "paused").exists(), 300, f"the training paused at {pause_at}", out)
        job_id = submitted_ids(rule_log(wd, "train"))[0]
        cluster.run("scancel", "--signal=USR2", job_id)            # what Slurm sends before the time limit
        wait_until(lambda: "caught signal" in task_log(wd, job_id), 60, "rank 0 to catch USR2", out)
        (pause / "go").touch()
        if requeue:
            cluster.release_requeued(job_id, timeout=120)
        proc.wait(300)
        return {"job_id": job_id, "rc": proc.returncode, "out": out.read_text()}


@pytest.mark.timeout(900)
def test_a_time_limit_signal_in_the_last_save_interval_never_leaves_the_training_stuck(tiny_run, site, slurm_cluster,
                                                                                       tmp_path):
    """Three trainings side by side (one node each, :data:`FINAL_STEPS` batches, a checkpoint every
    :data:`FINAL_SAVE_EVERY`), each signalled with USR2 while paused: at the first batch of its last save interval, at
    its final batch, during its final save. The first checkpoints at that batch, is requeued once and resumes; the
    other two save the final checkpoint and end with their result in their one allocation (no requeue: a requeued
    finished training was what left runs stuck). Every one writes train.json at the step count."""
    cases = {"first batch": (str(FINAL_STEPS - FINAL_SAVE_EVERY + 1), True), "final batch": (str(FINAL_STEPS), False),
             "final save": (f"save:{FINAL_STEPS}", False)}
    t0 = time.time()
    runs: dict[str, dict] = {}
    wds: dict[str, Path] = {}

    def one(name: str, pause_at: str, requeue: bool) -> None:
        try:
            wd = wds[name]
            extra = wd.parent / "final-interval.yaml"
            extra.write_text(yaml.safe_dump({"models": {"mpt-tiny": {
                "train": {"max_duration_batches": FINAL_STEPS, "save_interval_batches": FINAL_SAVE_EVERY},
                "resources": {"nodes": 1}}}}))
            runs[name] = _signal_paused_training(slurm_cluster, wd, extra, site, pause_at, requeue)
        except BaseException as exc:     # noqa: BLE001 - reported by the test thread below
            runs[name] = {"error": exc}

    for i, name in enumerate(cases):
        wds[name] = copy_run(tiny_run, tmp_path / f"case{i}" / "wd")
        fresh_training(wds[name])
    threads = [threading.Thread(target=one, args=(name, *case), daemon=True) for name, case in cases.items()]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(800)
    finally:
        for wd in wds.values():
            cancel_jobs_of(slurm_cluster, wd)
    for name, (pause_at, requeue) in cases.items():
        run, wd = runs.get(name, {"error": "did not finish"}), wds[name]
        if "error" in run:
            raise AssertionError(f"{name}: {run['error']}")
        job_id = run["job_id"]
        assert run["rc"] == 0, (name, run["out"][-6000:])
        train = read_json(wd, TRAIN_JSON)
        assert train["steps"] == FINAL_STEPS and not train.get("recovered"), (name, train)
        log0 = task_log(wd, job_id)
        rows = settled_jobs_since(slurm_cluster, t0, "train_mpt-tiny", wd, expect=2 if requeue else 1)
        if requeue:
            batch = int(pause_at)
            assert usr2_checkpoints(wd, job_id) == [batch], (name, log0[-3000:])
            assert train["resumed_from"].endswith(f"-ba{batch}-rank0.pt"), (name, train)
            assert [(r["JobID"], r["State"]) for r in rows] == [(job_id, "REQUEUED"), (job_id, "COMPLETED")], rows
        else:
            assert usr2_checkpoints(wd, job_id) == [], (name, log0[-3000:])
            assert f"came after the final batch {FINAL_STEPS} had trained" in log0, (name, log0[-3000:])
            assert train["resumed_from"] is None and train["batches_this_job"] == FINAL_STEPS, (name, train)
            assert [(r["JobID"], r["State"]) for r in rows] == [(job_id, "COMPLETED")], (name, rows)
        assert submitted_ids(rule_log(wd, "train")) == [job_id]


# ------------------------------------------------------------------------------------------------ 2b. time limits

@pytest.mark.timeout(1800)
def test_training_over_several_time_limits_with_a_long_setup_finishes_by_itself(time_limit_run, slurm_cluster):
    """A 3-minute time limit, a 30 s batch-script set-up and a training that needs two allocations
    (:func:`time_limit_run`): it finishes without a rerun by hand (Slurm's early time-limit signal, a requeue or the
    step's own resubmission after TIMEOUT), and the rule log shows the batch each later allocation resumed from. No
    allocation is left FAILED."""
    run = time_limit_run
    wd, steps = run.wd, run.steps
    try:
        run.proc.wait(timeout=max(1.0, run.t0 + 1700 - time.time()))
    finally:
        cancel_jobs_of(slurm_cluster, wd)
    out = run.out.read_text()
    assert run.proc.returncode == 0, out[-6000:]
    train = read_json(wd, TRAIN_JSON)
    assert train["steps"] == steps, train
    log = rule_log(wd, "train")
    resumed = [int(a or b) for a, b in re.findall(r"resumes from the checkpoint at batch (\d+)|it resumes from "
                                                  r"batch (\d+)", log)]
    assert resumed and resumed == sorted(set(resumed)) and resumed[0] > 0, (resumed, log)   # >= 2 allocations
    # one rank: a full checkpoint (ep<E>-ba<N>-rank0.pt), not a sharded folder
    assert re.search(rf"-ba{resumed[-1]}-rank0\.pt$", train["resumed_from"]), (train, resumed)
    # the pace reached the ranks: the last allocation's batches came at least min_step_s apart
    rows = [json.loads(line) for line in (wd / train["train_log"]).read_text().splitlines()]
    # the lines of the log interval only: the final batch's line may come fewer batches after the one before it
    every = project_config()["models"]["mpt-tiny"]["train"]["log_interval_batches"]
    last = [r for r in rows if r["batch"] > resumed[-1] + 1 and r["batch"] % every == 0]
    paces = [(b["elapsed_s"] - a["elapsed_s"]) / (b["batch"] - a["batch"]) for a, b in zip(last, last[1:])]
    assert paces and min(paces) >= run.min_step_s * 0.95, rows[-5:]
    rows = settled_jobs_since(slurm_cluster, run.t0, "train_mpt-tiny", wd, expect=len(resumed) + 1, timeout=60)
    states = [r["State"].split()[0] for r in rows]
    assert states[-1] == "COMPLETED" and "FAILED" not in states and len(states) == len(resumed) + 1, (rows, log)


# ------------------------------------------------------------------------------------------------ 6. SIGKILLed job

@pytest.mark.timeout(600)
def test_sigkilled_training_job_does_not_poison_the_rerun(two_node_run, site, slurm_cluster, tmp_path):
    wd = copy_run(two_node_run.wd, tmp_path / "wd")
    fresh_training(wd)
    ck = wd / RUN_DIR / "checkpoints"
    t0 = time.time()
    try:
        with background_snakemake(wd, TRAIN_JSON, *site.args) as (proc, out):
            job_id = wait_until(lambda: (submitted_ids(rule_log(wd, "train")) or [None])[0], 120,
                                "the training job", out)
            wait_until(lambda: any(ck.glob(f"*/ep0-ba{SAVE_EVERY}.complete")) and
                       max_batch(wd) >= SAVE_EVERY + 5, 240, "the first checkpoint", out)
            shm_during = {n: node_shm(slurm_cluster, n) for n in ("n1", "n2")}
            killed = sigkill_tasks(job_id)                          # every task dies at once, mid-step
            assert len(killed) == 2, killed
            proc.wait(120)
            text = out.read_text()
        assert proc.returncode != 0
        (row,) = settled_jobs_since(slurm_cluster, t0, "train_mpt-tiny", wd, expect=1)
        assert row["JobID"] == job_id and row["State"] != "COMPLETED", row
        assert f"train mpt-tiny: job {job_id} ended in state {row['State']}" in text, text[-4000:]
        assert not (wd / TRAIN_JSON).exists()
        # what the killed job leaves behind: the streaming dataloader's shared memory on both nodes (never
        # cleaned up by a SIGKILLed process) ...
        for n in ("n1", "n2"):
            assert shm_during[n] and set(shm_during[n]) <= set(node_shm(slurm_cluster, n)), (n, shm_during[n])
        # ... and, had the kill come during a save, a half-written newer sharded checkpoint without its marker
        newest = max(int(m.group(1)) for p in ck.glob("*/ep0-ba*.complete")
                     if (m := re.match(r"ep0-ba(\d+)\.complete$", p.name)))
        assert SAVE_EVERY <= newest < STEPS, newest
        half = next(ck.glob("*/identity.json")).parent / f"ep0-ba{newest + SAVE_EVERY}"
        half.mkdir(exist_ok=True)
        (half / "__0_0.distcp").write_bytes(b"half-written")
        snakemake(wd, TRAIN_JSON, *site.args, timeout=400)
    finally:
        cancel_jobs_of(slurm_cluster, wd)
    train = read_json(wd, TRAIN_JSON)
    assert train["steps"] == STEPS, train
    assert train["resumed_from"].endswith(f"ep0-ba{newest}"), train   # the newest complete one
    assert train["batches_this_job"] == STEPS - newest
    assert (half / ".metadata").exists()  # removed, then written again for real by the resumed training
    rows = settled_jobs_since(slurm_cluster, t0, "train_mpt-tiny", wd, expect=2)
    assert [r["State"] for r in rows][-1] == "COMPLETED" and len({r["JobID"] for r in rows}) == 2, rows
