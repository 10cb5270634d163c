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


def error_block(proc, header: str) -> str:
    """The error Snakemake printed last, from the first line that matches the regex ``header`` to the end of the
    stream that holds it (a dry run logs to stdout, a real run to stderr); "" when no line matches."""
    for text in (proc.stdout, proc.stderr):
        m = re.search(rf"^(?:{header}).*", text, re.M | re.S)
        if m:
            return m.group(0).strip()
    return ""


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """An empty working folder for the workflow (results/, .snakemake/ go there)."""
    return tmp_path


def shared_run(tmp_path_factory, name: str, build) -> Path:
    """A working folder that ``build(folder)`` creates and fills once per test session (``folder`` does not exist
    yet when ``build`` is called). Under pytest-xdist the workers share it: the first to need it builds it under a
    file lock in the session's common temporary folder, the others wait for it and reuse it (every user copies it
    before changing anything). ``build`` writes ``<name>-stdout.txt`` last, once it passed: a folder without it (a
    build that failed) is built again by the next worker that needs it, which then fails with the same error."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        wd = tmp_path_factory.mktemp(name) / "wd"
        build(wd)
        return wd
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent      # pytest-N/, above every worker's popen-gwK/
    wd = shared / f"{name}-shared"
    with FileLock(str(shared / f"{name}-shared.lock")):
        if not (wd / f"{name}-stdout.txt").exists():
            shutil.rmtree(wd, ignore_errors=True)
            build(wd)
    return wd


def _snakemake_logged(wd: Path, name: str, *args: str, env: dict | None = None) -> None:
    """``snakemake(wd, *args)``, then its console output and seconds in ``wd/<name>-stdout.txt``.

    Raises:
        AssertionError: the run failed (its output in the message)."""
    t0 = time.time()
    proc = snakemake(wd, *args, env=env)
    (wd / f"{name}-stdout.txt").write_text(proc.stdout + proc.stderr + f"\nseconds: {time.time() - t0:.1f}\n")


def _tiny(wd: Path) -> None:
    wd.mkdir()
    _snakemake_logged(wd, "pipeline", "--cores", "2", "--config", "dispatch={'progress_s': 1}",
                      env=no_symlink_env(wd))


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """The embedded default run end to end once per test session (CPU, a few minutes), shared by the workers
    (:func:`shared_run`); returns its working folder, with the console output in ``pipeline-stdout.txt``.

    Runs with symlinks refused (tests/helpers/sitecustomize.py), as on shared drives that refuse them, and with
    progress lines every second (``dispatch.progress_s``), so that the console output shows them for every step.
    """
    return shared_run(tmp_path_factory, "pipeline", _tiny)


#: The tiny finetunes of config/config.yaml after the tiny pretraining: full (mpt-tiny-sft: eval and generation) and
#: LoRA (mpt-tiny-sft-lora: eval, which needs its export).
FINETUNE_TARGETS = ("results/mpt-tiny-sft/eval.json", "results/mpt-tiny-sft/generate.json",
                    "results/mpt-tiny-sft-lora/eval.json")


@pytest.fixture(scope="session")
def finetune_run(tiny_run, tmp_path_factory) -> Path:
    """The tiny run's folder with both tiny finetunes (:data:`FINETUNE_TARGETS`) trained, exported and evaluated in
    one workflow run (their instruction data built once), shared by the workers (:func:`shared_run`); console output
    in ``finetune-stdout.txt``."""
    return shared_run(tmp_path_factory, "finetune", lambda wd: _snakemake_logged(
        copy_run(tiny_run, wd), "finetune", "--cores", "2", *FINETUNE_TARGETS))


#: The unit of work of every test file that uses the Slurm test cluster: one cluster per host (its lock file), so
#: these files run one after the other on one worker, which starts with them (they are the longest unit, mostly
#: waiting on Slurm's clocks).
SLURM_UNIT = "slurm-cluster"


@functools.cache
def _test_file_text(test_file: str) -> str:
    """The source of a test file (relative to the repository), read once per session for the scheduling below."""
    return (REPO / test_file).read_text()


@functools.cache
def xdist_unit(nodeid: str) -> str:
    """The pytest-xdist unit of work of a test (its node id, relative to the repository): :data:`SLURM_UNIT` when its
    file uses the ``slurm_cluster`` fixture, else the file, so that the file's module fixtures are built once."""
    test_file = nodeid.split("::", 1)[0]
    return SLURM_UNIT if "slurm_cluster" in _test_file_text(test_file) else test_file


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


#: Test seconds of each file in a full ``make test`` on the 2-core CI machine (``tests/helpers/suite_digest.py
#: --write-seconds``): the order in which the units are handed out, never an expectation of any test.
FILE_SECONDS = REPO / "tests" / "file-seconds.json"


@functools.cache
def _file_seconds() -> dict[str, float]:
    import json

    return json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.exists() else {}


def unit_order(nodeid: str) -> tuple[int, float]:
    """The sort key of a test under pytest-xdist: the Slurm unit first (:data:`SLURM_UNIT`, the longest: one worker
    starts with it), then the other files longest first by :data:`FILE_SECONDS`, a file missing there before every
    measured one (it may be long), so that the units left for the end are the short ones and both workers end close
    together (longest-processing-time-first scheduling). Inside the Slurm unit the files that use the session's
    :func:`tiny_run` come last: the other worker builds it at its start, and it is ready by then instead of waited
    for."""
    if xdist_unit(nodeid) == SLURM_UNIT:
        return (0, 1.0 if "tiny_run" in _test_file_text(nodeid.split("::", 1)[0]) else 0.0)
    seconds = _file_seconds().get(nodeid.split("::", 1)[0])
    return (1, float("-inf") if seconds is None else -seconds)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist the tests in :func:`unit_order`, a stable sort (a file's tests keep their order), so that
    the units are handed out in that order (the Makefile passes ``--no-loadscope-reorder``: units in collection
    order)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is not None:
        items.sort(key=lambda item: unit_order(item.nodeid))


def no_symlink_env(workdir: Path) -> dict:
    """Environment for a workflow run in which creating a symlink anywhere under ``workdir`` fails."""
    return {"PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "helpers"), str(REPO)]),
            "LLMPIPE_TEST_NO_SYMLINK": str(workdir)}


#: A shorter tiny training for tests that kill and resume it: half the tiny run's batches, a checkpoint every 20.
SHORT_TRAIN = "'train': {'max_duration_batches': 60, 'save_interval_batches': 20}"
#: :data:`SHORT_TRAIN` as a ``--config`` value.
SHORT_TINY = "models={'mpt-tiny': {" + SHORT_TRAIN + "}}"


def copy_run(src: Path, dst: Path) -> Path:
    """Copy a finished working folder (results and Snakemake's metadata), keeping modification times."""
    shutil.copytree(src, dst, symlinks=True, copy_function=shutil.copy2)
    return dst


#: The design card's literal command (tests/test_literal_command.py), run in a fresh clone's root.
LITERAL = ["--profile", "slurm", "results/mpt-1b/eval.json"]


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A fresh ``git clone`` of this checkout's committed state, once per test module (skipped without git)."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs git and a git checkout of the repository")
    dest = tmp_path_factory.mktemp("clone") / "llmpipe"
    subprocess.run(["git", "clone", "-q", str(REPO), str(dest)], check=True, timeout=120)
    return dest


def run_literal(clone: Path, tmp_path: Path, *extra: str, dry_run: bool = True, env: dict | None = None,
                timeout: float = 300) -> subprocess.CompletedProcess:
    """``snakemake [-n] --profile slurm results/mpt-1b/eval.json [extra]`` (:data:`LITERAL`) in the clone's root, as a
    user would: an empty Snakemake configuration folder (``XDG_CONFIG_HOME``), no ``SNAKEMAKE_PROFILE``; ``env`` on
    top of this process's environment."""
    xdg = tmp_path / "xdg"
    xdg.mkdir(exist_ok=True)
    full_env = {**os.environ, "XDG_CONFIG_HOME": str(xdg), "PYTHONPATH": str(clone), **(env or {})}
    full_env.pop("SNAKEMAKE_PROFILE", None)
    return subprocess.run([*SNAKEMAKE, *(["-n"] if dry_run else []), *LITERAL, *extra], cwd=clone,
                          capture_output=True, text=True, timeout=timeout, env=full_env)
