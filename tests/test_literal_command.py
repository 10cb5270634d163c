"""The design card's literal command, as a new user types it: ``snakemake --profile slurm results/mpt-1b/eval.json``
from the root of a fresh clone, with an empty Snakemake configuration folder (``XDG_CONFIG_HOME``).

Snakemake looks a profile name up in the current folder first; the repository root's ``slurm`` links to
``profiles/slurm``. The clone is made from this checkout's committed state (``git clone``), so a link that is not
committed, or a profile whose ``configfiles:`` path does not resolve through the link, fails here.
"""
from __future__ import annotations

import re

from tests.conftest import planned_jobs, run_literal


def test_literal_command_finds_the_profile_in_a_fresh_clone(clone, tmp_path):
    """Without a reachable Slurm the dry run stops at the preflight, naming the site setting; on a login node it plans,
    or the preflight refuses what the partition cannot hold (the CI's test cluster has 4 GPUs per node). Either way
    the profile was found and applied."""
    proc = run_literal(clone, tmp_path)
    out = proc.stdout + proc.stderr
    assert "profile given but no config.yaml found" not in out, out[-3000:]
    assert "Using profile slurm" in out or "Using profiles slurm" in out, out[-3000:]
    if proc.returncode != 0 and "of Slurm partition" in out:
        # a reachable cluster (the CI's test cluster) whose partition cannot hold the plan: the preflight compared
        # the plan with the real partition, which is the profile at work
        assert "ConfigError" in out and "Fix:" in out, out[-3000:]
    elif proc.returncode != 0:
        assert "ConfigError" in out and "slurm.preflight" in out, out[-3000:]
        assert "slurm={preflight: false}" in out, out[-3000:]
    else:
        assert planned_jobs(proc)["train"] == 1


def test_literal_command_plans_with_the_site_file_and_no_preflight(clone, tmp_path):
    proc = run_literal(clone, tmp_path, "--config", "slurm={preflight: false}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    jobs = planned_jobs(proc)
    assert jobs["train"] == 1 and jobs["eval"] == 1, jobs
    # the Slurm executor is on: rules that only wait on Slurm take no local cores
    train = re.search(r"rule train:.*?(?:\n\n|\Z)", proc.stdout, re.S)
    assert train and "threads: 0" in train.group(0), proc.stdout[-3000:]


def test_literal_command_reads_the_site_file_through_the_link(clone, tmp_path):
    """The profile's ``configfiles:`` (relative to the profile folder) resolves through the root link: a key the
    site file is not allowed to hold is reported, so the file was read."""
    site = clone / "config" / "slurm-site.yaml"
    original = site.read_text()
    try:
        site.write_text(original + "  not_a_site_key: 1\n")
        proc = run_literal(clone, tmp_path, "--config", "slurm={preflight: false}")
    finally:
        site.write_text(original)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "slurm.not_a_site_key is not a Slurm site setting" in out, out[-3000:]
