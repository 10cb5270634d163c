"""The data steps' error type (and, re-exported, the atomic writes they use)."""

from __future__ import annotations

from llmpipe.atomic import atomic_write_bytes, atomic_write_json, remove_if_exists  # noqa: F401


class DataError(ValueError):
    """Input data or a prepared data product is wrong; the message names the file or setting and the fix."""
