"""The results folder check at DAG time (also during ``snakemake -n``): ``results_dir`` must be writable."""

from __future__ import annotations

import os
import tempfile

from llmpipe.config.settings import ConfigError


def check_results_dir(path: str) -> None:
    """Make sure ``results_dir`` can be created and written.

    Raises:
        ConfigError: the folder cannot be created or written, naming the setting and the fix.
    """
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise ConfigError(
            f"results_dir {path!r} is not writable ({exc.strerror}). Fix: set `results_dir` to a folder you can "
            f"write (e.g. --config results_dir=/scratch/$USER/llmpipe) or fix its permissions.") from None
