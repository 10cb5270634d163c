"""The test cluster's configuration (tests/slurm_cluster/write_conf.sh) and start.sh's failures, without starting a
cluster: GPUS=0 declares no GPUs (not ``nvidia[0--1]``), SITE_CONF's lines reach every start's slurm.conf, and a
start that fails says what failed and stops the daemons it had started."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest

from tests.slurm_cluster.fixture import HERE

pytestmark = pytest.mark.timeout(120)


def write_conf(state: Path, gpus: str, site: Path | None = None) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ["PATH"], "DIR": str(state), "HERE": str(HERE), "NODES": "2", "CPUS": "4",
           "MEM": "1000", "GPUS": gpus, "NET": "10.214.99", "CTL_IP": "10.214.99.1", "CTLD_PORT": "1",
           "SLURMD_PORT": "2", "DBD_PORT": "3", "MSOCK": "/run/m.sock", **({"SITE_CONF": str(site)} if site else {})}
    return subprocess.run(["bash", str(HERE / "write_conf.sh")], capture_output=True, text=True, env=env, timeout=30)


def test_no_gpus_declares_none(tmp_path):
    assert write_conf(tmp_path / "s", "0").returncode == 0
    conf = (tmp_path / "s/etc/slurm.conf").read_text()
    nodes = [line for line in conf.splitlines() if line.startswith("NodeName=")]
    assert len(nodes) == 2 and not any("Gres" in line for line in nodes), nodes
    assert (tmp_path / "s/etc/gres.conf").read_text() == "" and not list((tmp_path / "s/dev").iterdir())
    assert write_conf(tmp_path / "g", "2").returncode == 0
    assert "Gres=gpu:2 " in (tmp_path / "g/etc/slurm.conf").read_text()
    assert (tmp_path / "g/etc/gres.conf").read_text() == f"Name=gpu File={tmp_path}/g/dev/nvidia[0-1]\n"
    bad = write_conf(tmp_path / "b", "-1")
    assert bad.returncode == 1 and "GPUS=-1 is not a count" in bad.stderr


def test_site_settings_are_appended_at_every_start(tmp_path):
    site = tmp_path / "site.conf"
    site.write_text("AccountingStorageEnforce=associations,qos\n")
    for _ in range(2):   # a restart rewrites slurm.conf from the template: the site lines come back
        assert write_conf(tmp_path / "s", "4", site).returncode == 0
        lines = (tmp_path / "s/etc/slurm.conf").read_text().splitlines()
        assert lines[-1] == "AccountingStorageEnforce=associations,qos", lines[-3:]
    assert (tmp_path / "s/etc/site.conf").read_text() == site.read_text()   # what start.sh's "healthy" compares
    missing = write_conf(tmp_path / "m", "4", tmp_path / "nope.conf")
    assert missing.returncode == 1 and "SITE_CONF=" in missing.stderr and "not a readable file" in missing.stderr


FAKE_MUNGED = """#!/bin/bash
# a munged that starts its daemon, then fails
for a; do case $a in --pid-file=*) pf=${a#--pid-file=};; esac; done
bash -c 'exec -a munged sleep 120' </dev/null >/dev/null 2>&1 &
echo $! > "$pf"
exit 3
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="start.sh needs root and ip")
def test_a_failing_start_says_what_failed_and_stops_what_it_started(tmp_path):
    state = tmp_path / "cluster"
    names = subprocess.run(["bash", "-c", f'DIR="$1"; source {HERE / "names.sh"}; echo "$BR $NS"', "n", str(state)],
                           capture_output=True, text=True, check=True).stdout.split()
    if subprocess.run(["ip", "link", "show", names[0]], capture_output=True).returncode == 0 \
            or names[1] in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout:
        pytest.skip(f"a cluster with this state folder's names ({names}) exists on this machine")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("munged", "slurmctld", "slurmd", "slurmdbd", "sbatch", "sinfo", "sacct", "sacctmgr", "mariadbd",
                 "mariadb-install-db"):
        (bin_dir / tool).write_text(FAKE_MUNGED if tool == "munged" else "#!/bin/sh\nexit 1\n")
        (bin_dir / tool).chmod(stat.S_IRWXU)
    p = subprocess.run([str(HERE / "start.sh")], capture_output=True, text=True, timeout=90,
                       env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LLMPIPE_SLURM_DIR": str(state)})
    assert p.returncode == 3, p.stderr
    assert "[slurm-cluster start] ERROR: line " in p.stderr and "of start.sh: `munged -S " in p.stderr, p.stderr
    assert "failed (exit 3); stopping what this start started" in p.stderr, p.stderr
    pid_file = state / "run/munged.pid"
    assert not pid_file.exists()   # stop.sh took the daemon from its PID file
    out = subprocess.run(["pgrep", "-f", "^munged 120$"], capture_output=True, text=True).stdout.split()
    deadline = time.time() + 10
    while out and time.time() < deadline:
        time.sleep(0.2)
        out = subprocess.run(["pgrep", "-f", "^munged 120$"], capture_output=True, text=True).stdout.split()
    assert not out, f"the started daemon is still running: {out}"
