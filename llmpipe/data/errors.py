"""The data steps' error type and small shared helpers (atomic writes, gzip reading)."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class DataError(ValueError):
    """Input data or a prepared data product is wrong; the message names the file or setting and the fix."""


def atomic_write_json(path: str, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically (temporary file in the same folder + os.replace).

    A reader (or Snakemake) never sees a half-written file: either the old file, no file, or the new one.
    """
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(obj, fh, indent=1, sort_keys=False, ensure_ascii=False)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temporary file in the same folder + os.replace)."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def remove_if_exists(path: str) -> None:
    """Delete a file if it is there (used to drop a stale manifest before a step rewrites its outputs)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
