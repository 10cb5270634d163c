"""Preflight of slurm.account and slurm.qos where the cluster enforces associations (AccountingStorageEnforce).

The first tests use made-up associations (and, for the sacctmgr query, fake Slurm commands on PATH). The last ones use
the real test cluster (tests/slurm_cluster): they add an account, a partition-bound account and two QOS with
sacctmgr, turn on ``AccountingStorageEnforce=associations,qos`` (slurmctld restarted: Slurm 22.05 does not apply it
on ``scontrol reconfigure``), and check that the preflight refuses exactly what sbatch refuses. The cluster's
slurm.conf is restored, slurmctld restarted and the additions removed afterwards, whatever happens.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import time
from pathlib import Path

import pytest

from llmpipe.dispatch import slurm
from llmpipe.config.settings import ConfigError

pytestmark = [pytest.mark.timeout(180)]


def res(**over):
    r = {"nodes": 1, "gpus_per_node": 0, "tasks_per_node": 1, "cpus_per_task": 1, "mem_gb": 0, "time_min": 5}
    r.update(over)
    return r


def cfg(**site):
    return {"dispatch": {"executor": "slurm"}, "slurm": site}


def assoc(account, partition="", qos="normal", defaultqos=""):
    return {"account": account, "partition": partition, "qos": qos, "defaultqos": defaultqos}


ACCOUNTING = {"enforce": "associations,qos", "user": "alice", "cluster": "c1", "default_account": "proj",
              "associations": (assoc("proj"), assoc("big", qos="normal,high", defaultqos="normal"),
                               assoc("gpuonly", partition="gpu", qos="gpuq"),
                               assoc("big", partition="gpu", qos="gpuq"))}


def check(acc=ACCOUNTING, partition="cpu", resources=None, where="resources", **site):
    return slurm.check_associations(slurm.site_config(cfg(**site)), resources or res(), partition, acc, where)


# ---------------------------------------------------------------------------------------------- made-up associations

def test_enforce_flags_follow_slurm_conf_implications():
    assert slurm.enforced_flags("none") == frozenset() and slurm.enforced_flags("") == frozenset()
    assert slurm.enforced_flags("associations") == {"associations"}
    assert slurm.enforced_flags("qos") == {"associations", "qos"}
    assert slurm.enforced_flags("limits") == {"associations", "limits"}
    assert slurm.enforced_flags("wckeys") == {"associations", "wckeys"}
    assert slurm.enforced_flags("safe") == {"associations", "limits", "safe"}
    assert slurm.enforced_flags("nojobs,nosteps") == {"nojobs", "nosteps"}   # accounting off: nothing enforced
    assert {"associations", "qos", "limits", "safe", "wckeys"} <= slurm.enforced_flags("ALL")


def test_nothing_is_checked_where_associations_are_not_enforced():
    assert check({"enforce": "none"}, account="nope", qos="nope") is None
    assert check({"enforce": "nojobs,nosteps"}, account="nope") is None


def test_account_must_be_one_of_the_users_associations():
    with pytest.raises(ConfigError) as e:
        check(account="nope")
    msg = str(e.value)
    assert msg.startswith("slurm.account is 'nope', but Slurm user 'alice' has the account(s) big, proj for "
                          "partition 'cpu' on cluster 'c1' (default account: proj; other partitions: big (partition "
                          "gpu), gpuonly (partition gpu))"), msg
    assert "AccountingStorageEnforce=associations,qos" in msg and "Invalid account" in msg
    assert "Fix: set slurm.account to one of those accounts (or leave it unset" in msg
    assert "sacctmgr add user alice account=nope" in msg
    assert check(account="big")["account"] == "big"
    assert check(account="BIG")["account"] == "big"   # Slurm compares names case-insensitively
    assert check()["account"] == "proj"               # unset: the default account


def test_account_bound_to_another_partition_is_refused():
    with pytest.raises(ConfigError, match=r"slurm.account is 'gpuonly'.*other partitions: .*gpuonly \(partition gpu"):
        check(account="gpuonly", partition="cpu")
    assert check(account="gpuonly", partition="gpu")["qos"] == "gpuq"
    # an association for the partition wins over the account's general one
    assert check(account="big", partition="gpu")["partition"] == "gpu"
    with pytest.raises(ConfigError, match=r"slurm.qos is 'high'.*account 'big'.*allows only the QOS gpuq"):
        check(account="big", partition="gpu", qos="high")


def test_unset_account_needs_an_association():
    none = {**ACCOUNTING, "associations": (), "default_account": ""}
    with pytest.raises(ConfigError) as e:
        check(none)
    msg = str(e.value)
    assert msg.startswith("slurm.account is not set, so jobs would use the default account, but Slurm user 'alice' "
                          "has no account for partition 'cpu'"), msg
    assert "sbatch would refuse every job" in msg and "sacctmgr add user alice account=ACCOUNT" in msg
    # a default account bound to another partition: the accounts that work here are named
    elsewhere = {**ACCOUNTING, "default_account": "gpuonly"}
    with pytest.raises(ConfigError, match=r"not set.*default account: gpuonly.*Fix: set slurm.account to one of"):
        check(elsewhere)


def test_qos_must_be_allowed_by_the_association_used():
    with pytest.raises(ConfigError) as e:
        check(qos="high")   # the default account's association allows only normal
    msg = str(e.value)
    assert msg.startswith("slurm.qos is 'high', but the association of Slurm user 'alice' with account 'proj' on "
                          "cluster 'c1' allows only the QOS normal, and this cluster enforces QOS"), msg
    assert "Invalid qos specification" in msg
    assert "or slurm.account to an account whose association allows it: big" in msg
    assert "sacctmgr modify user alice where account=proj set qos+=high" in msg
    assert check(account="big", qos="high")["account"] == "big"
    with pytest.raises(ConfigError, match=r"'nope'.*allows only the QOS high, normal.*\(or leave it unset: the "
                                          r"default QOS normal\)"):
        check(account="big", qos="nope")
    # associations enforced, QOS not: a QOS is not checked
    assert check({**ACCOUNTING, "enforce": "associations"}, qos="nope")["account"] == "proj"


def test_a_steps_own_account_and_qos_are_named_in_messages():
    step = res(slurm={"account": "nope"})
    with pytest.raises(ConfigError, match=r"^models\.m\.resources\.slurm\.account is 'nope'.*Fix: set "
                                          r"models\.m\.resources\.slurm\.account"):
        slurm.check_associations(slurm.site_config(cfg(account="big"), step), step, "cpu", ACCOUNTING,
                                 "models.m.resources")
    step = res(slurm={"qos": "high"})
    with pytest.raises(ConfigError, match=r"^data_resources\.slurm\.qos is 'high'"):
        slurm.check_associations(slurm.site_config(cfg(), step), step, "cpu", ACCOUNTING, "data_resources")


# ---------------------------------------------------------------------------------------------- fake Slurm commands

FAKE = """#!/bin/sh
echo "${{0##*/}} $*" >> {log}
case "${{0##*/}} $1 $2" in
  "scontrol show partition") echo "PartitionName=cpu Default=YES State=UP TotalNodes=1 Nodes=a1 MaxTime={max_time}";;
  "scontrol show config") printf 'Configuration data as of now\\nAccountingStorageEnforce = {enforce}\\n'
                          echo "ClusterName             = c1";;
  "sinfo "*) echo "a1|(null)|8|1000|idle";;
  "sacctmgr "*) {sacctmgr};;
esac
"""


def fake_slurm(tmp_path: Path, monkeypatch, enforce: str = "associations,qos", sacctmgr: str | None = None,
               max_time: str = "UNLIMITED") -> Path:
    """sbatch, sinfo, scontrol and (unless ``sacctmgr`` is 'missing') sacctmgr answering like a one-node cluster
    whose user has the associations proj (default) and big; every call is logged to the returned file."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    if sacctmgr is None:
        sacctmgr = ('if [ "$4" = user ]; then echo "proj"; else echo "proj||normal|"; '
                    'echo "big||normal,high|normal"; fi')
    text = FAKE.format(log=log, enforce=enforce, sacctmgr=sacctmgr if sacctmgr != "missing" else "exit 127",
                       max_time=max_time)
    for tool in ("sbatch", "sinfo", "scontrol", "sacctmgr"):
        if tool == "sacctmgr" and sacctmgr == "missing":
            continue
        (bin_dir / tool).write_text(text)
        (bin_dir / tool).chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))   # its own cache key
    slurm.clear_cache()
    return log


@pytest.fixture()
def _clear():
    slurm.clear_cache()
    yield
    slurm.clear_cache()


def test_preflight_asks_sacctmgr_once_for_the_users_associations(tmp_path, monkeypatch, _clear):
    log = fake_slurm(tmp_path, monkeypatch)
    user = slurm._slurm_user()
    assert slurm.preflight(cfg(account="big", qos="high"), res())["partition"] == "cpu"
    with pytest.raises(ConfigError, match=r"slurm.account is 'nope'.*account\(s\) big, proj.*cluster 'c1'"):
        slurm.preflight(cfg(account="nope"), res())
    with pytest.raises(ConfigError, match=r"slurm.qos is 'high'.*account 'proj'"):
        slurm.preflight(cfg(qos="high"), res())
    calls = [c.split(" ", 1)[1] for c in log.read_text().splitlines() if c.startswith("sacctmgr ")]
    assert calls == [f"--noheader --parsable2 show associations where user={user} cluster=c1 "
                     f"format=account,partition,qos,defaultqos",
                     f"--noheader --parsable2 show user {user} format=defaultaccount"]   # cached: asked once
    slurm.clear_cache()   # forgets the answers: asked again
    slurm.preflight(cfg(), res())
    assert sum(c.startswith("sacctmgr ") for c in log.read_text().splitlines()) == 4


def test_no_sacctmgr_call_where_associations_are_not_enforced(tmp_path, monkeypatch, _clear):
    log = fake_slurm(tmp_path, monkeypatch, enforce="none", sacctmgr="missing")
    assert slurm.preflight(cfg(account="nope", qos="nope"), res())["partition"] == "cpu"
    calls = log.read_text().splitlines()
    assert "scontrol show config" in calls and not [c for c in calls if c.startswith("sacctmgr")], calls


@pytest.mark.parametrize("sacctmgr, expected", [
    ("missing", r"`sacctmgr` is not on PATH\. Fix: run on a Slurm login node"),
    ("echo 'sacctmgr: error: Problem talking to the database: Connection refused' >&2; exit 1",
     r"failed \(exit 1\): sacctmgr: error: Problem talking to the database: Connection refused\. Fix: check that "
     r"`sacctmgr show associations` works here \(SLURM_CONF, munge, slurmdbd reachable\), or skip the whole check "
     r"with slurm\.preflight: false"),
])
def test_a_failing_sacctmgr_stops_the_preflight_with_the_fix(tmp_path, monkeypatch, _clear, sacctmgr, expected):
    fake_slurm(tmp_path, monkeypatch, enforce="associations", sacctmgr=sacctmgr)
    with pytest.raises(ConfigError) as e:
        slurm.preflight(cfg(), res())
    msg = str(e.value)
    assert msg.startswith("This Slurm cluster enforces associations (AccountingStorageEnforce=associations), so the "
                          "preflight checks slurm.account and slurm.qos with sacctmgr, which did not answer: "), msg
    assert re.search(expected, msg) and slurm.OFFLINE_PLAN_HINT in msg, msg


# ---------------------------------------------------------------------------------------------- the real cluster

ACCT, PART_ACCT, QOS, OTHER_QOS = "llmp_acct", "llmp_small_acct", "llmp_q", "llmp_other_q"
ENFORCE = "AccountingStorageEnforce=associations,qos"


def _restart_slurmctld(cluster, timeout: float = 60) -> None:
    """Stop the test cluster's slurmctld (its PID file, checked against its command line) and start it again with
    the cluster's slurm.conf, as start.sh does; wait until every node is idle again."""
    pid = int((cluster.dir / "run" / "slurmctld.pid").read_text().strip())
    assert b"slurmctld" in Path(f"/proc/{pid}/cmdline").read_bytes(), f"PID {pid} is not slurmctld"
    os.kill(pid, 15)
    deadline = time.time() + timeout
    while Path(f"/proc/{pid}").exists() and time.time() < deadline:
        time.sleep(0.1)
    subprocess.run(["slurmctld", "-f", str(cluster.conf)], check=True, timeout=30, stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **cluster.env})
    while time.time() < deadline:
        states = cluster.run("sinfo", "--noheader", "--Node", "--partition", cluster.partition, "--format", "%t",
                             check=False)
        if len(states.split()) == len(cluster.nodes) and all(s == "idle" for s in states.split()):
            return
        time.sleep(0.2)
    raise AssertionError(f"slurmctld did not come back with idle nodes within {timeout:.0f} s\n{cluster.log_tail()}")


def sbatch(cluster, *args: str) -> subprocess.CompletedProcess:
    """Submit a held job (sbatch checks account and QOS at submission) and cancel it when accepted."""
    p = subprocess.run(["sbatch", "--parsable", "--hold", "--output=/dev/null", "--wrap=true", *args],
                       capture_output=True, text=True, timeout=30, env={**os.environ, **cluster.env})
    if p.returncode == 0:
        cluster.run("scancel", p.stdout.strip().split(";")[0], check=False)
    return p


@pytest.fixture(scope="module")
def enforcing(slurm_cluster):
    """The test cluster with an account (QOS llmp_q only), an account bound to partition small, and associations
    and QOS enforced; everything restored afterwards."""
    c = slurm_cluster
    original = c.conf.read_text()
    try:
        c.run("sacctmgr", "-i", "add", "qos", f"{QOS},{OTHER_QOS}")
        c.run("sacctmgr", "-i", "add", "account", f"{ACCT},{PART_ACCT}", "cluster=llmpipe")
        c.run("sacctmgr", "-i", "add", "user", "root", f"account={ACCT}", f"qos={QOS}", f"defaultqos={QOS}")
        c.run("sacctmgr", "-i", "add", "user", "root", f"account={PART_ACCT}", f"partition={c.small_partition}")
        c.conf.write_text(original + f"\n# test_slurm_accounting.py\n{ENFORCE}\n")
        _restart_slurmctld(c)   # `scontrol reconfigure` shows the setting but Slurm 22.05 does not enforce it
        slurm.clear_cache()
        yield c
    finally:
        slurm.clear_cache()
        c.conf.write_text(original)
        try:
            _restart_slurmctld(c)
            assert "AccountingStorageEnforce = none" in c.run("scontrol", "show", "config")
        finally:
            c.run("sacctmgr", "-i", "delete", "user", "name=root", f"account={ACCT},{PART_ACCT}", check=False)
            c.run("sacctmgr", "-i", "delete", "account", f"{ACCT},{PART_ACCT}", check=False)
            c.run("sacctmgr", "-i", "delete", "qos", f"{QOS},{OTHER_QOS}", check=False)


@pytest.mark.slurm
def test_without_enforcement_any_account_passes(slurm_cluster, _clear):
    assert "AccountingStorageEnforce = none" in slurm_cluster.run("scontrol", "show", "config")
    assert slurm.preflight(cfg(account="no-such-account", qos="no-such-qos"), res())["partition"] == "debug"


@pytest.mark.slurm
def test_preflight_refuses_what_the_enforcing_cluster_refuses(enforcing):
    c = enforcing
    assert "AccountingStorageEnforce = associations,qos" in c.run("scontrol", "show", "config")
    cases = [  # (site settings, sbatch arguments, what the preflight says or None)
        ({}, [], None),                                        # root's default account: other tests' jobs run
        ({"account": ACCT, "qos": QOS}, [f"--account={ACCT}", f"--qos={QOS}"], None),
        ({"account": ACCT.upper()}, [f"--account={ACCT.upper()}"], None),
        ({"account": "no-such-account"}, ["--account=no-such-account"],
         rf"slurm.account is 'no-such-account', but Slurm user 'root' has the account\(s\) {ACCT}, root for "
         rf"partition 'debug' on cluster 'llmpipe' \(default account: root; other partitions: {PART_ACCT} "
         rf"\(partition small\)\)"),
        ({"account": ACCT, "qos": OTHER_QOS}, [f"--account={ACCT}", f"--qos={OTHER_QOS}"],
         rf"slurm.qos is '{OTHER_QOS}', but the association of Slurm user 'root' with account '{ACCT}' .*allows "
         rf"only the QOS {QOS}"),
        ({"account": ACCT, "qos": "no-such-qos"}, [f"--account={ACCT}", "--qos=no-such-qos"], r"allows only the QOS"),
        ({"qos": QOS}, [f"--qos={QOS}"],   # the default account's association does not allow it
         rf"slurm.qos is '{QOS}', but .*account 'root' .*allows only the QOS normal.*whose association allows it: "
         rf"{ACCT}"),
        ({"account": PART_ACCT}, [f"--account={PART_ACCT}"], rf"slurm.account is '{PART_ACCT}'"),
        ({"account": PART_ACCT, "partition": c.small_partition},
         [f"--account={PART_ACCT}", f"--partition={c.small_partition}", "--time=5"], None),
    ]
    for site, args, refused in cases:
        slurm.clear_cache()
        p = sbatch(c, *args)
        if refused is None:
            assert p.returncode == 0, (site, p.stderr)
            slurm.preflight(cfg(**site), res())
        else:
            assert p.returncode != 0 and re.search(r"Invalid (account|qos)", p.stderr), (site, p.stdout, p.stderr)
            with pytest.raises(ConfigError, match=refused):
                slurm.preflight(cfg(**site), res())


@pytest.mark.parametrize("where, says, never", [
    ("models.m.resources", "training checkpoints and requeues itself", "not requeued"),
    ("data_resources", "a data step is not requeued at its time limit", "checkpoint"),
    ("eval.resources", "this step does not checkpoint: it must finish within one allocation", "requeues itself"),
])
def test_the_max_time_fix_speaks_of_the_step_it_refuses(tmp_path, monkeypatch, _clear, where, says, never):
    """The MaxTime refusal's fix: training checkpoints for a training only; the data steps get their own text."""
    fake_slurm(tmp_path, monkeypatch, enforce="none", max_time="5")
    with pytest.raises(ConfigError) as e:
        slurm.preflight(cfg(), res(time_min=30), where=where)
    msg = str(e.value)
    assert msg.startswith(f"{where}.time_min is 30 minutes, but Slurm partition 'cpu' allows at most 5 minutes"), msg
    fix = msg.split("Fix: ", 1)[1]
    assert says in fix and never not in fix, fix


def test_the_time_limit_fix_counts_setup_lines_of_undeclared_length():
    """slurm.setup lines with slurm.setup_s 0: the fix asks for their seconds S and subtracts them, instead of
    offering a delay that only fits a set-up of no time; with setup_s set, the figures include it."""
    step = res(time_min=3)
    with pytest.raises(ConfigError) as e:
        slurm.check_signal_delay(slurm.site_config(cfg(signal_delay_s=90, setup=["module load cuda", "sleep 20"])),
                                 step, "models.m.resources")
    msg = str(e.value)
    assert "slurm.setup_s is 0 but slurm.setup has 2 line(s)" in msg, msg
    assert ("Fix: set slurm.setup_s to the seconds S that the slurm.setup line(s) take (a module load, a container "
            "start), then slurm.signal_delay_s to at most 60 - S, or models.m.resources.time_min to at least "
            "(210 + S) / 60 rounded up (at least 4)") in msg, msg
    with pytest.raises(ConfigError) as e:   # declared: plain figures that include it
        slurm.check_signal_delay(slurm.site_config(cfg(signal_delay_s=90, setup_s=20, setup=["sleep 20"])), step,
                                 "models.m.resources")
    assert ("Fix: set slurm.signal_delay_s to at most 40, or models.m.resources.time_min to at least 4 "
            "(docs/slurm.md") in str(e.value), str(e.value)
    assert "setup has" not in str(e.value)
