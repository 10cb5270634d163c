"""The ``slurm_cluster`` pytest fixture: a real Slurm cluster on this machine for the session.

Register it with ``pytest_plugins = ["tests.slurm_cluster.fixture"]`` (tests/conftest.py does). It starts the
cluster with start.sh (munged, MariaDB + slurmdbd, slurmctld, nodes n1 and n2 in their own network namespaces, each
declaring 16 CPUs, 32000 MB and 4 GPUs (stand-ins: nothing is enforced); partitions debug (default, MaxTime 24 h)
and small (n1, MaxTime 5 min); each node has its own /dev/shm, everything else is this machine's), sets
``SLURM_CONF`` in ``os.environ`` for the session, and always stops it with stop.sh at the end (which kills only what
start.sh started). The session holds ``$LLMPIPE_SLURM_DIR.lock`` meanwhile: another session waits for it, and
start.sh/stop.sh run by anyone else (``.ci/slurm.sh cleanup``) leave the cluster alone while it is held.

Without root, ``ip netns`` or the Slurm binaries the tests that use it are skipped with the reason; with
``LLMPIPE_REQUIRE_SLURM=1`` (CI) they fail instead. Other environment variables:
``LLMPIPE_SLURM_DIR`` (state folder, default /tmp/llmpipe-slurm), ``LLMPIPE_SLURM_REUSE=1`` (keep a healthy running
cluster instead of starting afresh), ``LLMPIPE_SLURM_KEEP=1`` (do not stop it at the end, for debugging).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
START = HERE / "start.sh"
STOP = HERE / "stop.sh"
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "REQUEUED",
                "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
BINARIES = ("munged", "slurmctld", "slurmd", "slurmdbd", "sbatch", "srun", "squeue", "sacct", "sinfo", "scontrol",
            "sacctmgr", "mariadbd", "mariadb-install-db", "ip", "nsenter", "unshare")


@dataclass
class SlurmCluster:
    """A running test cluster. ``env`` holds what a process needs to reach it (already in ``os.environ``)."""

    dir: Path
    conf: Path
    partition: str = "debug"                 # all nodes, the default, MaxTime 24 h
    small_partition: str = "small"           # n1 only, MaxTime 5 min
    small_max_time_min: int = 5
    max_time_min: int = 1440
    nodes: list[str] = field(default_factory=lambda: ["n1", "n2"])
    gpus_per_node: int = 4
    cpus_per_node: int = 16
    mem_mb_per_node: int = 32000
    env: dict[str, str] = field(default_factory=dict)

    def run(self, *cmd: str, check: bool = True, timeout: float = 30) -> str:
        """Run a Slurm command (``squeue``, ``sacct``, ``scontrol`` ...) against this cluster; return stdout."""
        p = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env={**os.environ, **self.env})
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()}")
        return p.stdout

    def jobs_named(self, name: str, expect: int = 1, settle_s: float = 20) -> list[dict[str, str]]:
        """Every run of every job with this name that accounting knows (a requeued job has one row per run, all
        with the same JobID; the earlier ones REQUEUED): JobID, State, NodeList, AllocTRES.

        Accounting lags the controller by a moment: waits up to ``settle_s`` seconds for at least ``expect`` rows
        and for every row to be in a final state."""
        keys = ["JobID", "State", "NodeList", "AllocTRES"]
        deadline = time.time() + settle_s
        while True:
            out = self.run("sacct", "--noheader", "--parsable2", "--allocations", "--duplicates", "--name", name,
                           "--starttime", "now-1days", "--format", ",".join(keys))
            rows = [dict(zip(keys, line.split("|"))) for line in out.splitlines() if line.strip()]
            settled = len(rows) >= expect and all(r["State"].split()[0] in FINAL_STATES for r in rows)
            if settled or time.time() > deadline:
                return rows
            time.sleep(0.5)

    def job_fields(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, Reason, NodeList ...); the controller keeps
        finished jobs for MinJobAge (5 minutes)."""
        out = self.run("scontrol", "show", "job", "--oneliner", str(job_id))
        return dict(tok.split("=", 1) for tok in out.split() if "=" in tok)

    def release_requeued(self, job_id: str, timeout: float = 60) -> None:
        """Wait until ``job_id`` was requeued (PENDING, Reason=BeginTime: Slurm holds a requeued job for AuthInfo's
        cred_expire, 30 s on this cluster) and its earlier run is cleaned up on every node, then release it with
        ``StartTime=now``; return as well when the hold ended first (the job runs again).

        Releasing sooner makes Slurm start it on a node still cleaning up, which kills it ("Job credential
        revoked", state FAILED). Raises AssertionError when the job is not requeued within ``timeout`` seconds.
        """
        deadline = time.time() + timeout
        restarts = self.job_fields(job_id).get("Restarts", "0")
        while time.time() < deadline:
            f = self.job_fields(job_id)
            if f.get("Restarts", "0") != restarts and f.get("JobState") in ("RUNNING", "COMPLETED"):
                return   # requeued, and Slurm's own hold ended before the nodes were clean for a release
            if f.get("JobState") == "PENDING" and f.get("Reason") == "BeginTime":
                busy = self.run("sinfo", "--noheader", "--Node", "--partition", self.partition, "--format", "%t")
                if not any(s.strip().startswith("comp") for s in busy.splitlines()):
                    time.sleep(1.0)
                    self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
                    return
            time.sleep(0.3)
        raise AssertionError(f"job {job_id} was not requeued within {timeout:.0f} s: {self.job_fields(job_id)}")

    def log_tail(self, n: int = 30) -> str:
        """The last lines of the controller's and nodes' logs (for assertion messages)."""
        out = []
        for f in sorted((self.dir / "log").glob("slurm*.log")):
            lines = f.read_text(errors="replace").splitlines()[-n:]
            out.append(f"--- {f.name}\n" + "\n".join(lines))
        return "\n".join(out)


def unavailable_reason() -> str | None:
    """Why the cluster cannot start here (None when it can)."""
    if os.geteuid() != 0:
        return "the Slurm test cluster needs root (munged, slurmd, network namespaces)"
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return f"Slurm test cluster binaries missing ({', '.join(missing)}): run tests/slurm_cluster/install.sh"
    try:
        p = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns` does not work here: {exc}"
    if p.returncode != 0:
        return f"`ip netns` does not work here: {p.stderr.strip()}"
    return None


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("LLMPIPE_REQUIRE_SLURM") == "1":
        pytest.fail(f"LLMPIPE_REQUIRE_SLURM=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real 2-node Slurm cluster for the whole session (see the module docstring); stopped at the end."""
    reason = unavailable_reason()
    if reason:
        _skip_or_fail(reason)
    state = Path(os.environ.get("LLMPIPE_SLURM_DIR", "/tmp/llmpipe-slurm"))
    state.parent.mkdir(parents=True, exist_ok=True)
    # one cluster per state folder: a second pytest session waits for the first one's cluster to go away
    lock = open(f"{state}.lock", "w")
    deadline = time.time() + float(os.environ.get("LLMPIPE_SLURM_LOCK_WAIT_S", "1200"))
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.time() > deadline:
                lock.close()
                _skip_or_fail(f"another test session holds the Slurm test cluster ({state}.lock)")
            time.sleep(2)
    env = {"LLMPIPE_SLURM_DIR": str(state), "LLMPIPE_SLURM_LOCK_HELD": "1"}  # start.sh/stop.sh: we hold the lock
    if os.environ.get("LLMPIPE_SLURM_REUSE") != "1":
        env["FRESH"] = "1"
    conf = state / "etc" / "slurm.conf"
    saved = {k: os.environ.get(k) for k in ("SLURM_CONF",)}
    try:
        p = subprocess.run([str(START)], capture_output=True, text=True, timeout=300, env={**os.environ, **env})
        if p.returncode != 0:
            logs = ""
            for f in sorted((state / "log").glob("*.log")) if (state / "log").is_dir() else []:
                logs += f"\n--- {f}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:])
            pytest.fail(f"the Slurm test cluster did not start ({p.returncode}):\n{p.stdout}\n{p.stderr}{logs}",
                        pytrace=False)
        os.environ["SLURM_CONF"] = str(conf)
        yield SlurmCluster(dir=state, conf=conf, env={"SLURM_CONF": str(conf)})
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if os.environ.get("LLMPIPE_SLURM_KEEP") != "1":
            subprocess.run([str(STOP)], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "LLMPIPE_SLURM_DIR": str(state), "LLMPIPE_SLURM_LOCK_HELD": "1"})
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()
