"""Code hygiene, run by the README's test command: Snakemake's linter, snakefmt and ruff on this checkout.

The one lint accepted is Snakemake's advice to give every rule its own conda environment or container: this project
installs one pinned pip environment for every step (envs/requirements.lock; README "Quick start")."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import REPO, snakemake

#: Snakemake lints this project does not follow, with the reason in the module docstring.
ACCEPTED_LINTS = {"Specify a conda environment or container for each rule."}


def test_snakemake_lint_finds_nothing_but_the_per_rule_environment_advice(tmp_path):
    proc = snakemake(tmp_path, "--lint", check=False)
    out = proc.stdout + proc.stderr
    lints = set(re.findall(r"^\s+\* (.+?):$", out, re.M))
    assert lints <= ACCEPTED_LINTS, f"snakemake --lint: {sorted(lints - ACCEPTED_LINTS)}\n{out[-4000:]}"
    assert "Lints for" in out or proc.returncode == 0, out[-2000:]  # the linter ran (it prints what it checked)


def test_snakefmt_check():
    proc = subprocess.run([sys.executable, "-m", "snakefmt", "--check", "Snakefile", "rules"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"snakefmt would reformat (run `snakefmt Snakefile rules`):\n{proc.stderr[-3000:]}"


def test_ruff_check():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, f"ruff check (rules in pyproject.toml):\n{proc.stdout[-4000:]}"
