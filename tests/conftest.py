"""Shared fixtures: a workflow working folder, dry runs, and one real run of the tiny pipeline."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = [sys.executable, "-m", "snakemake"]


def load_tool(name: str):
    """A fresh module object of ``tools/<name>.py`` (the tools are scripts, not a package the tests import once)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def project_config() -> dict:
    """config/config.yaml as a workflow run sees it: typed, checked, the schema's defaults filled in
    (:func:`llmpipe.config.schema.load_config`)."""
    from llmpipe.config.schema import load_config

    return load_config(REPO / "config" / "config.yaml")


#: torch.distributed's variables: a test that trains or evaluates in the pytest process sets them; they must not
#: reach the jobs of later tests (which inherit this process's environment).
DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


#: process groups this session took out of torch.distributed but still references. Freeing a gloo group joins its
#: worker threads while holding the GIL, and a worker that is still freeing a finished all-gather's tensors needs the
#: GIL: a deadlock inside ``c10d::ProcessGroupGloo::~ProcessGroupGloo`` that no test timeout can interrupt. Kept
#: until the interpreter exits, when the workers are long idle.
_RETIRED_GROUPS: list = []


def retire_process_groups() -> None:
    """Undo torch.distributed's initialization in this process (``destroy_process_group``) while keeping its groups
    referenced (:data:`_RETIRED_GROUPS`), so none is freed while its worker threads may still need the GIL. No-op
    when torch.distributed is not imported or not initialized."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    _RETIRED_GROUPS.extend(dist.distributed_c10d._world.pg_map)
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _restore_dist_env():
    saved = {k: os.environ.get(k) for k in DIST_VARS}
    yield
    # composer's Trainer initializes a one-process group in this process and writes the variables above; the group
    # and the variables go together (composer refuses an initialized group without NODE_RANK), so both are undone.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() == 1:
        retire_process_groups()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


pytest_plugins = ["tests.slurm_cluster.fixture"] if (REPO / "tests/slurm_cluster/fixture.py").exists() else []


def snakemake(workdir: Path, *args: str, check: bool = True, timeout: float = 1800, env: dict | None = None):
    """Run snakemake on this repository's Snakefile in ``workdir``; return the CompletedProcess."""
    cmd = SNAKEMAKE + ["-s", str(REPO / "Snakefile"), "-d", str(workdir), *args]
    full_env = {**os.environ, **(env or {})}
    # this checkout's package first, whatever else is installed (jobs import llmpipe by name)
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in [full_env.get("PYTHONPATH", ""), str(REPO)] if p)
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=timeout, env=full_env)
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return proc


def planned_jobs(proc) -> dict[str, int]:
    """Parse the 'Job stats' table of a dry run: rule -> number of jobs. Empty when nothing would run."""
    out = proc.stdout + proc.stderr
    if "Nothing to be done" in out:
        return {}
    m = re.search(r"Job stats:\n(.*?)\n\s*total\s+\d+", out, re.S)
    assert m, f"no job stats in dry run output:\n{out[-3000:]}"
    jobs = {}
    for line in m.group(1).splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            jobs[parts[0]] = int(parts[1])
    return jobs


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """An empty working folder for the workflow (results/, .snakemake/ go there)."""
    return tmp_path


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """The embedded default run end to end once per test session (CPU, a few minutes); returns its working folder.

    Runs with symlinks refused (tests/helpers/sitecustomize.py), as on shared drives that refuse them. Under
    pytest-xdist the workers share one run: the first to need it builds it under a file lock in the session's common
    temporary folder, the others wait for it and reuse it (every user copies it before changing anything). A run that
    failed is not reused: each worker that needs it fails with the same error.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return _run_tiny(tmp_path_factory.mktemp("tiny-run"))
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent      # pytest-N/, above every worker's popen-gwK/
    wd = shared / "tiny-run-shared"
    with FileLock(str(shared / "tiny-run-shared.lock")):
        if not (wd / "pipeline-stdout.txt").exists():
            shutil.rmtree(wd, ignore_errors=True)
            wd.mkdir()
            _run_tiny(wd)
    return wd


def _run_tiny(wd: Path) -> Path:
    """The tiny pipeline end to end in ``wd``; writes its console output to ``pipeline-stdout.txt`` once it passed.

    Raises:
        AssertionError: the pipeline failed (its output in the message)."""
    t0 = time.time()
    # progress lines every second (dispatch.progress_s), so that the console output shows them for every step
    proc = snakemake(wd, "--cores", "2", "--config", "dispatch={'progress_s': 1}", env=no_symlink_env(wd))
    (wd / "pipeline-stdout.txt").write_text(proc.stdout + proc.stderr + f"\nseconds: {time.time() - t0:.1f}\n")
    return wd


#: The unit of work of every test file that uses the Slurm test cluster: one cluster per host (its lock file), so
#: these files run one after the other on one worker, which starts with them (they are the longest unit, mostly
#: waiting on Slurm's clocks).
SLURM_UNIT = "slurm-cluster"


@functools.cache
def xdist_unit(nodeid: str) -> str:
    """The pytest-xdist unit of work of a test (its node id, relative to the repository): :data:`SLURM_UNIT` when its
    file uses the ``slurm_cluster`` fixture, else the file, so that the file's module fixtures are built once."""
    test_file = nodeid.split("::", 1)[0]
    return SLURM_UNIT if "slurm_cluster" in (REPO / test_file).read_text() else test_file


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with the Slurm files as one unit (:func:`xdist_unit`); xdist's own ``loadgroup`` marks
    do not reach pytest 9's node ids. An optional hook: the second lock's venv (``make test-torch211``) has no
    pytest-xdist."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileOrSlurmScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_unit(nodeid)

    return FileOrSlurmScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist the Slurm files' tests come first, so that their unit is the first one handed out (the
    Makefile passes ``--no-loadscope-reorder``: units in collection order)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is not None:
        items.sort(key=lambda item: xdist_unit(item.nodeid) != SLURM_UNIT)   # stable


def no_symlink_env(workdir: Path) -> dict:
    """Environment for a workflow run in which creating a symlink anywhere under ``workdir`` fails."""
    return {"PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "helpers"), str(REPO)]),
            "LLMPIPE_TEST_NO_SYMLINK": str(workdir)}


def copy_run(src: Path, dst: Path) -> Path:
    """Copy a finished working folder (results and Snakemake's metadata), keeping modification times."""
    shutil.copytree(src, dst, symlinks=True, copy_function=shutil.copy2)
    return dst
