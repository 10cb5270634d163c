"""Provenance: the small record every step writes beside its output.

Rule: a step whose first output is ``<path>`` writes ``<path>.provenance.json`` next to it
(``results/mpt-tiny/train.json.provenance.json``, ``results/mpt-tiny/hf/manifest.json.provenance.json``), after
the step succeeded, atomically (:mod:`llmpipe.atomic`). The record of an earlier execution is removed when the step
starts, so the file never describes another result than the output beside it. It is not a Snakemake output: it
never decides what reruns.

The record: the rule and its wildcards, the resolved settings the step used, its identity (the rule's
``params.identity``) and version, its other params, the git commit of the workflow (None outside a git checkout),
the versions of the packages that make results (read from their installed metadata, never imported), the host,
the time (UTC) and the Python version.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import subprocess
from typing import Any

from llmpipe.atomic import atomic_write_json, remove_if_exists

#: Distributions whose versions go into every record (absent ones are recorded as None).
PACKAGES = ("llmpipe", "torch", "mosaicml", "llm-foundry", "mosaicml-streaming", "transformers", "snakemake",
            "submitit")

#: The workflow's folder: the git checkout whose commit is recorded.
WORKFLOW_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def provenance_path(output: str) -> str:
    """Where the provenance record of a step whose first output is ``output`` goes."""
    return f"{output}.provenance.json"


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """Installed version of each distribution in ``names`` (None when not installed)."""
    import importlib.metadata  # here: the rule files import this module to plan the DAG, which never needs it

    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_commit(folder: str = WORKFLOW_DIR) -> dict[str, Any] | None:
    """``{"commit": <sha>, "dirty": bool}`` of the git checkout at ``folder``, or None (not a checkout, no git,
    or git did not answer within 10 s). ``dirty``: tracked files differ from the commit."""
    try:
        sha = subprocess.run(["git", "-C", folder, "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        if sha.returncode != 0:
            return None
        status = subprocess.run(["git", "-C", folder, "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": sha.stdout.strip(), "dirty": bool(status.stdout.strip()) if status.returncode == 0 else None}


def record(*, rule: str, wildcards: dict, settings: Any, identity: Any, version: Any, params: dict) -> dict:
    """The provenance record (see the module docstring); ``settings``, ``identity`` and ``params`` are written as
    given (JSON; anything else as its ``str``)."""
    return {
        "rule": rule,
        "wildcards": wildcards,
        "settings": settings,
        "identity": identity,
        "version": version,
        "params": params,
        "git": git_commit(),
        "packages": package_versions(),
        "host": socket.gethostname(),
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
    }


def write(output: str, rec: dict) -> str:
    """Write ``rec`` beside ``output`` (:func:`provenance_path`) atomically; return its path."""
    path = provenance_path(output)
    atomic_write_json(path, rec)
    return path


def forget(output: str) -> None:
    """Remove the provenance record beside ``output`` (an execution of its step starts)."""
    remove_if_exists(provenance_path(output))
