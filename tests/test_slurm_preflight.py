"""Preflight against the real Slurm test cluster: a request that could never run fails at once, naming the fix.

The cluster (tests/slurm_cluster): partition debug (n1, n2; default; MaxTime 24 h) and small (n1; MaxTime 5 min);
each node has 16 CPUs, 32000 MB and 4 GPUs.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmpipe.dispatch import slurm
from llmpipe.config.settings import ConfigError
from llmpipe.evaluation import suites as eval_tasks
from tests.conftest import error_block, project_config, run_literal

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(120)]


def res(**over):
    r = {"nodes": 1, "gpus_per_node": 0, "tasks_per_node": 1, "cpus_per_task": 1, "mem_gb": 0, "time_min": 10}
    r.update(over)
    return r


def cfg(**site):
    return {"dispatch": {"executor": "slurm"}, "slurm": site}


@pytest.fixture(autouse=True)
def _fresh_answers(slurm_cluster):
    slurm.clear_cache()
    yield
    slurm.clear_cache()


def test_fitting_request_passes_and_reports_the_partition(slurm_cluster):
    got = slurm.preflight(cfg(), res(nodes=2, gpus_per_node=4, tasks_per_node=4, cpus_per_task=4, mem_gb=31,
                                     time_min=1440))
    assert got == {"partition": "debug", "max_time_min": 1440, "total_nodes": 2, "fitting_nodes": 2}
    got = slurm.preflight(cfg(partition="small"), res(time_min=5))
    assert got["partition"] == "small" and got["max_time_min"] == 5 and got["total_nodes"] == 1


def test_missing_partition(slurm_cluster):
    with pytest.raises(ConfigError) as e:
        slurm.preflight(cfg(partition="gpu-a100"), res())
    msg = str(e.value)
    assert "slurm.partition" in msg and "'gpu-a100'" in msg
    assert "debug" in msg and "small" in msg  # lists what the cluster has


def test_more_nodes_than_the_partition_has(slurm_cluster):
    with pytest.raises(ConfigError, match=r"models\.big\.resources\.nodes is 3.*'debug' has only 2 node"):
        slurm.preflight(cfg(), res(nodes=3), where="models.big.resources")
    with pytest.raises(ConfigError, match=r"nodes is 2.*'small' has only 1 node.*at most 1"):
        slurm.preflight(cfg(partition="small"), res(nodes=2, time_min=5))


def test_more_gpus_per_node_than_the_nodes_have(slurm_cluster):
    with pytest.raises(ConfigError, match=r"gpus_per_node is 8.*at most 4 GPU"):
        slurm.preflight(cfg(), res(gpus_per_node=8, tasks_per_node=8))
    # a GPU type no node has
    with pytest.raises(ConfigError, match=r"gpus_per_node is 1.*at most 0 gpu:h100"):
        slurm.preflight(cfg(gpu_type="h100"), res(gpus_per_node=1))


def test_time_limit_longer_than_the_partition_allows(slurm_cluster):
    with pytest.raises(ConfigError, match=r"time_min is 1441 minutes.*'debug' allows at most 1440 minutes"):
        slurm.preflight(cfg(), res(time_min=1441))
    with pytest.raises(ConfigError, match=r"time_min is 10 minutes.*'small' allows at most 5 minutes"):
        slurm.preflight(cfg(partition="small"), res(time_min=10))


def test_more_cpus_or_memory_than_a_node_has(slurm_cluster):
    with pytest.raises(ConfigError, match=r"32 CPUs.*most CPUs on a node: 16"):
        slurm.preflight(cfg(), res(tasks_per_node=2, cpus_per_task=16))
    with pytest.raises(ConfigError, match=r"and 40 GB each.*only 0 node"):
        slurm.preflight(cfg(), res(mem_gb=40))


def test_preflight_can_be_switched_off(slurm_cluster):
    assert slurm.preflight(cfg(partition="nope", preflight=False), res(nodes=99)) == {}


def test_slurm_commands_missing_from_path(slurm_cluster, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no sbatch, sinfo, scontrol
    with pytest.raises(ConfigError, match=r"`sbatch` is not on PATH.*Fix:"):
        slurm.preflight(cfg(), res())


def test_what_preflight_rejects_really_would_wait_forever(slurm_cluster):
    """The reason preflight exists: sbatch accepts a too-long job, which then pends forever."""
    out = slurm_cluster.run("sbatch", "--parsable", "--partition=small", "--time=10", "--wrap=true")
    job_id = out.strip().split(";")[0]
    try:
        reason = slurm_cluster.run("squeue", "--noheader", "--jobs", job_id, "--format", "%T %r").strip()
        assert re.fullmatch(r"PENDING Partition(TimeLimit|Config)", reason), reason  # never eligible
    finally:
        slurm_cluster.run("scancel", job_id)


# ---------------------------------------------------------------------------------------------- the real run


def closed_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (bound, then closed): a connection to it is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_jobs_submitted_since(cluster, since: float) -> set[str]:
    """Every job submitted at or after ``since`` (time.time(), whole seconds) that the cluster has queued or run
    (squeue and sacct, all users). A job an earlier test submitted does not count, though accounting may list it
    only a moment later."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(int(since)))
    rows = cluster.run("squeue", "--noheader", "--all", "--format", "%i|%V").split()
    rows += cluster.run("sacct", "--noheader", "--parsable2", "--allusers", "--allocations", "--starttime",
                        "now-1days", "--format", "JobID,Submit").split()
    return {job for job, submit in (r.split("|", 1) for r in rows if "|" in r) if submit >= stamp}


def test_a_refused_real_run_starts_nothing(slurm_cluster, clone, tmp_path):
    """The literal command without -n, on a cluster whose nodes have 4 GPUs (mpt-1b's training asks for 8 per node),
    stops before any job starts (rules/common.smk's onstart makes the dry run's checks of every job first:
    DagChecks.check_jobs), with the dry run's message: no Slurm job queued, no local job started, no file under
    results/, nothing flagged incomplete. Every download points at a local stand-in (the hub at a closed port of
    127.0.0.1, eval.task_data a local folder), so a regression shows as a started job, never as traffic."""
    _, suite = eval_tasks.run_suite(project_config(), "mpt-1b")
    mirror = tmp_path / "llm-foundry-scripts"
    for f in eval_tasks.foundry_files(suite["icl_tasks"]):  # items enough for every task's shots (the dry run counts)
        (mirror / f).parent.mkdir(parents=True, exist_ok=True)
        (mirror / f).write_text('{"stand_in": true}\n' * 40)
    extra = ("--config", f"eval={{task_data: {{source: local, local_dir: '{mirror}'}}}}")
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}", "HF_HOME": str(tmp_path / "hf-home")}
    time.sleep(1.01 - time.time() % 1)   # a new second: an earlier test's job is submitted before it
    t0 = time.time()
    dry = run_literal(clone, tmp_path, *extra, env=env)
    real = run_literal(clone, tmp_path, *extra, dry_run=False, env=env)
    dry_out, real_out = dry.stdout + dry.stderr, real.stdout + real.stderr
    assert dry.returncode != 0 and real.returncode != 0, real_out[-3000:]
    assert re.search(r"^rule corpus:", dry_out, re.M), dry_out[-3000:]  # the dry run lists the data steps first
    refusal = error_block(dry, "WorkflowError in rule train in file")
    assert re.search(r"ConfigError: models\.mpt-1b\.resources\.gpus_per_node is 8, but the nodes of Slurm partition "
                     r"'debug' have at most 4 GPU", refusal), dry_out[-3000:]
    assert error_block(real, "WorkflowError in rule train in file") == refusal, real_out[-3000:]
    assert not re.search(r"^(local)?rule \w+:", real_out, re.M), real_out[-3000:]  # no job started
    assert slurm_jobs_submitted_since(slurm_cluster, t0) == set()
    assert not [p for p in (clone / "results").rglob("*") if p.is_file()]
    assert not list((clone / ".snakemake" / "incomplete").iterdir())
    assert not list((clone / ".snakemake" / "locks").iterdir())


# ---------------------------------------------------------------------------------------------- the slurm profile
# (no cluster needed: a one-rule Snakefile that loads config/config.yaml like ours, resolves it against the schema as
# rules/common.smk does, and prints what it got)

REPO = Path(__file__).resolve().parents[1]
PROBE = """
import json
import sys
sys.path.insert(0, {repo!r})
from llmpipe.config import schema
configfile: {config!r}
schema.resolve(config)
print("CONFIG=" + json.dumps({{"dispatch": config["dispatch"], "has_slurm": "slurm" in config,
                               "partition": (config.get("slurm") or {{}}).get("partition", "-"),
                               "results_dir": config["results_dir"]}}))
rule all:
    output: "x"
    shell: "touch {{output}}"
"""


def probe_config(tmp_path: Path, *args: str, env: dict | None = None) -> dict:
    snakefile = tmp_path / "Snakefile"
    snakefile.write_text(PROBE.format(repo=str(REPO), config=str(REPO / "config" / "config.yaml")))
    p = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(snakefile), "-d", str(tmp_path), "-n",
                        "--workflow-profile", str(REPO / "profiles" / "default"), *args],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})
    assert p.returncode == 0, p.stdout + p.stderr
    line = next(x for x in (p.stdout + p.stderr).splitlines() if x.startswith("CONFIG="))
    return json.loads(line[len("CONFIG="):])


def test_slurm_profile_switches_dispatch_to_slurm(tmp_path):
    got = probe_config(tmp_path, "--profile", str(REPO / "profiles" / "slurm"))
    # merged on top of config/config.yaml: the other dispatch keys survive, the site file's slurm section is there
    assert got["dispatch"]["executor"] == "slurm" and got["dispatch"]["state_dir"] == ".llmpipe/jobs", got
    assert got["has_slurm"] and got["partition"] is None
    assert probe_config(tmp_path)["dispatch"]["executor"] == "local"  # no profile: local


def test_slurm_profile_by_name_from_the_user_config_folder(tmp_path):
    """The README's set-up: a link to profiles/slurm in the Snakemake config folder makes `--profile slurm` work."""
    xdg = tmp_path / "xdg"
    (xdg / "snakemake").mkdir(parents=True)
    (xdg / "snakemake" / "slurm").symlink_to(REPO / "profiles" / "slurm")
    got = probe_config(tmp_path, "--profile", "slurm", env={"XDG_CONFIG_HOME": str(xdg)})
    assert got["dispatch"]["executor"] == "slurm" and got["has_slurm"], got


def test_slurm_profile_survives_a_users_config_and_configfile(tmp_path):
    site = tmp_path / "my-site.yaml"
    site.write_text("slurm: {partition: gpu}\n")
    prof = str(REPO / "profiles" / "slurm")
    got = probe_config(tmp_path, "--profile", prof, "--configfile", str(site))
    assert got["dispatch"]["executor"] == "slurm" and got["partition"] == "gpu", got
    got = probe_config(tmp_path, "--profile", prof, "--config", "results_dir=/scratch/r")
    assert got["dispatch"]["executor"] == "slurm" and got["results_dir"] == "/scratch/r" and got["has_slurm"], got
    got = probe_config(tmp_path, "--profile", prof, "--configfile", str(REPO / "config" / "slurm-site.yaml"), str(site))
    assert got["dispatch"]["executor"] == "slurm" and got["partition"] == "gpu", got
