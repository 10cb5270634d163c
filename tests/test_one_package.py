"""One copy of llmpipe per run: the rule scripts and jobs import the workflow's own package even when another copy
comes first on PYTHONPATH (as an editable install of another checkout does), and a process that imports another
copy anyway stops at once naming both."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, snakemake

TARGET = "results/data/builtin-docs/raw/manifest.json"  # one rule script and one job, a few seconds


def other_copy(tmp_path: Path, init: str | None = None) -> Path:
    """A second checkout's package folder (its parent goes on PYTHONPATH); ``init`` replaces its __init__.py."""
    root = tmp_path / "other-checkout"
    shutil.copytree(REPO / "llmpipe", root / "llmpipe", ignore=shutil.ignore_patterns("__pycache__"))
    if init is not None:
        (root / "llmpipe" / "__init__.py").write_text(init)
    return root


def test_rule_scripts_and_jobs_import_the_workflows_copy(tmp_path):
    """Another copy first on PYTHONPATH, one that fails whoever imports it: the rule script and its job run."""
    other = other_copy(tmp_path, "raise ImportError('the other checkout was imported')\n")
    wd = tmp_path / "wd"
    wd.mkdir()
    proc = snakemake(wd, "--cores", "1", TARGET, env={"PYTHONPATH": str(other)})
    assert "the other checkout was imported" not in proc.stdout + proc.stderr
    assert (wd / TARGET).exists()


def test_a_process_that_imports_another_copy_stops_naming_both(tmp_path):
    other = other_copy(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(other), "LLMPIPE_PACKAGE_DIR": str(REPO / "llmpipe")}
    proc = subprocess.run([sys.executable, "-c", "import llmpipe.steps"], env=env, cwd=tmp_path, capture_output=True,
                          text=True)
    assert proc.returncode != 0
    assert (f"two copies of llmpipe in one run: this process imported {other / 'llmpipe'}, but the workflow runs "
            f"from {REPO / 'llmpipe'}") in proc.stderr, proc.stderr
    assert f"remove {other} from PYTHONPATH" in proc.stderr
    env["PYTHONPATH"] = str(REPO)
    assert subprocess.run([sys.executable, "-c", "import llmpipe.steps"], env=env, cwd=tmp_path).returncode == 0


def test_a_run_whose_rule_script_imports_another_copy_stops_at_once(tmp_path):
    """A site that puts another copy first in every Python process (here a sitecustomize): the rule script stops at
    its first import, naming both copies, and no job runs."""
    other = other_copy(tmp_path)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"import sys\nsys.path.insert(0, {str(other)!r})\n")
    wd = tmp_path / "wd"
    wd.mkdir()
    proc = snakemake(wd, "--cores", "1", TARGET, env={"PYTHONPATH": str(site)}, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert f"two copies of llmpipe in one run: this process imported {other / 'llmpipe'}" in out, out[-3000:]
    assert not (wd / TARGET).exists() and not list((wd / "results/logs").rglob("*.submitit"))


@pytest.mark.parametrize("category, message, module", [
    (FutureWarning, "You are using a Python version (3.11.7) which Google will stop supporting in new releases of "
                    "google.api_core once it reaches its end of life (2027-10-24).",
     "google.api_core._python_version_support"),
    (UserWarning, "Propagating key_padding_mask to the attention module and applying it within the attention module "
                  "can cause unnecessary computation/memory usage.", "llmfoundry.models.layers.attention"),
    (UserWarning, "Propagating key_padding_mask to the attention module and applying it within the attention module "
                  "can cause unnecessary computation/memory usage.", "transformers_modules.mpt-tiny-hf.attention"),
])
def test_upstream_notices_are_quiet_and_nothing_else(category, message, module):
    """The two upstream notices are ignored by message and module; the same message from another module, and another
    warning of the same category from the same module, still show."""
    import warnings

    import llmpipe

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        llmpipe.quiet_upstream_notices()
        warnings.warn_explicit(message, category, "x.py", 1, module=module)
        warnings.warn_explicit(message, category, "x.py", 2, module="mypackage.attention")
        warnings.warn_explicit("something else", category, "x.py", 3, module=module)
    assert [(w.category, w.lineno) for w in seen] == [(category, 2), (category, 3)], [str(w.message) for w in seen]
