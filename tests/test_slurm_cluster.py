"""The Slurm test cluster stays in its box: its subnet never leaves through the default route, and another state
folder's start/stop never touches it (tests/slurm_cluster/names.sh)."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.slurm_cluster.fixture import HERE, STOP

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(120)]


def names(state_dir) -> dict[str, str]:
    """BR, NS, VETH, NET of the cluster of ``state_dir`` (what start.sh and stop.sh use)."""
    out = subprocess.run(["bash", "-c", f'DIR="$1"; source {HERE / "names.sh"}; echo "$BR $NS $VETH $NET"',
                          "names", str(state_dir)], capture_output=True, text=True, check=True).stdout.split()
    return dict(zip(["BR", "NS", "VETH", "NET"], out))


def ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout


def test_subnet_has_an_unreachable_route_under_its_bridge(slurm_cluster):
    n = names(slurm_cluster.dir)
    assert f"unreachable {n['NET']}.0/24 metric 4242" in ip("route", "show", "type", "unreachable"), ip("route")
    # while the bridge is up its own route wins; the unreachable one only catches what the bridge no longer routes
    assert f"dev {n['BR']}" in ip("route", "get", f"{n['NET']}.11")


def test_another_state_folders_stop_leaves_this_cluster_alone(slurm_cluster, tmp_path):
    ours, other = names(slurm_cluster.dir), names(tmp_path / "other")
    assert len({ours[k] for k in ours} & {other[k] for k in other}) == 0, (ours, other)
    p = subprocess.run([str(STOP)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "LLMPIPE_SLURM_DIR": str(tmp_path / "other")})
    assert p.returncode == 0, p.stderr
    netns = ip("netns", "list")
    assert all(f"{ours['NS']}{i}" in netns for i in (1, 2)), netns
    assert ip("link", "show", ours["BR"]).strip()
    assert f"unreachable {ours['NET']}.0/24" in ip("route", "show", "type", "unreachable")
    states = slurm_cluster.run("sinfo", "--noheader", "--Node", "--partition", "debug", "--format", "%N %t")
    assert sorted(states.split()) == ["idle", "idle", "n1", "n2"], states
