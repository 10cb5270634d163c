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


def test_every_direct_dependency_is_imported_by_the_project():
    """Each of pyproject.toml's ``dependencies`` provides a module that the project's code imports (llmpipe/,
    scripts/, tools/, the rules and the Snakefile); one that nothing imports belongs in the lock files only, where a
    locked package requires it."""
    import tomllib
    from importlib.metadata import packages_distributions

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    modules: dict[str, set[str]] = {}
    for module, dists in packages_distributions().items():
        for dist in dists:
            modules.setdefault(re.sub(r"[-_.]+", "-", dist).lower(), set()).add(module)
    sources = [p for d in ("llmpipe", "scripts", "tools", "rules") for p in (REPO / d).rglob("*") if p.is_file()
               and p.suffix in (".py", ".smk")] + [REPO / "Snakefile"]
    imported = set()
    for p in sources:
        imported |= set(re.findall(r"^\s*(?:from|import)\s+([A-Za-z_]\w*)", p.read_text(), re.M))
    unused = []
    for dep in deps:
        name = re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", dep).group(0)).lower()
        if not modules.get(name, set()) & imported:
            unused.append(name)
    assert not unused, f"direct dependencies that no code imports: {unused} (pyproject.toml)"
