"""Atomic file writes: a reader (or Snakemake) sees the old file, no file, or the whole new one, never a part; and
the tolerant read of such a file (:func:`read_json`)."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def umask_mode(mode: int = 0o666) -> int:
    """``mode`` less the process's umask: what ``open()`` (0666) or ``mkdir`` (0777) give a new file or folder."""
    return mode & ~_umask()


def atomic_write_json(path: str, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically (temporary file in the same folder + os.replace).

    A reader (or Snakemake) never sees a half-written file: either the old file, no file, or the new one.
    """
    text = json.dumps(obj, indent=1, ensure_ascii=False, default=str) + "\n"
    atomic_write_bytes(path, text.encode("utf-8"))


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
        os.chmod(tmp, umask_mode(0o666))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def read_json(path: str, default: Any = None) -> Any:
    """The JSON document in ``path``, or ``default`` when the file is missing or is not JSON."""
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return default


def remove_if_exists(path: str) -> None:
    """Delete a file if it is there (used to drop a stale manifest before a step rewrites its outputs)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def sha256_file(path: str) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB blocks. Raises OSError when the file cannot be read."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
