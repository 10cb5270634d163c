"""llmpipe: the workflow's logic (README "Layout"); this file only makes sure a run uses one copy of it.

rules/common.smk puts the workflow's own folder first on ``PYTHONPATH``, so that its rule scripts and every job they
start import the package from the workflow (not, e.g., an editable install of another checkout), and names that
package's folder in ``LLMPIPE_PACKAGE_DIR``. A process of the run that still imports another copy stops here, at
import, naming both.
"""

from __future__ import annotations

import os
import warnings

#: The environment variable rules/common.smk sets to the running workflow's ``llmpipe`` folder.
PACKAGE_DIR_VARIABLE = "LLMPIPE_PACKAGE_DIR"

#: Upstream notices that no user of this workflow can act on, ignored in every process that imports llmpipe (rule
#: scripts, jobs), each by its category, message and module: (category, message regex, module regex).
#: - google.api_core's notice that it will drop Python 3.11 in 2027 (the pinned stack runs on 3.11; installation.md);
#: - llm-foundry's advice to its own developers, once per attention call of MPT's reference (``torch``) attention
#:   with a padding mask (the exported model's copy of it included: ``transformers_modules.<folder>.attention``).
QUIET_NOTICES: tuple[tuple[type[Warning], str, str], ...] = (
    (FutureWarning, r"You are using a Python version", r"google\.api_core\._python_version_support$"),
    (UserWarning, r"Propagating key_padding_mask to the attention module",
     r"(llmfoundry\.models\.layers|transformers_modules\..+)\.attention$"),
)


def quiet_upstream_notices() -> None:
    """Ignore the warnings of :data:`QUIET_NOTICES` (and only those: other warnings of the same categories and
    modules still show). Idempotent."""
    for category, message, module in QUIET_NOTICES:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def check_one_copy(expected: str | None = None) -> None:
    """Refuse to run from another copy of llmpipe than the workflow's own.

    Args:
        expected: the workflow's ``llmpipe`` folder (default: ``$LLMPIPE_PACKAGE_DIR``; unset or empty: no check).
            Compared as a file (``os.path.samefile``), so the same folder reached by another path (a symlink, a
            container's bind mount) counts as the same; a folder this process cannot see is not compared.

    Raises:
        ImportError: this package is another folder; the message names both and the fix.
    """
    expected = os.environ.get(PACKAGE_DIR_VARIABLE) if expected is None else expected
    if not expected:
        return
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        same = os.path.samefile(here, expected)
    except OSError:
        return
    if not same:
        raise ImportError(
            f"two copies of llmpipe in one run: this process imported {here}, but the workflow runs from "
            f"{os.path.abspath(expected)} ({PACKAGE_DIR_VARIABLE}, set by rules/common.smk). Fix: make the workflow's "
            f"copy the one Python finds: remove {os.path.dirname(here)} from PYTHONPATH, or install the environment "
            f"from this checkout (pip install --no-deps -e {os.path.dirname(os.path.abspath(expected))}).")


def use_only_this_copy(workflow_dir: str) -> None:
    """Make the workflow in ``workflow_dir`` run on its own package, in this process and every process it starts:
    check that this process imported ``<workflow_dir>/llmpipe``, put ``workflow_dir`` first on ``PYTHONPATH`` and set
    ``LLMPIPE_PACKAGE_DIR`` (which :func:`check_one_copy` reads at every import). Called by rules/common.smk.

    Raises:
        ImportError: this process imported another copy (the message names both).
    """
    package = os.path.join(workflow_dir, "llmpipe")
    check_one_copy(package)
    os.environ["PYTHONPATH"] = os.pathsep.join([workflow_dir, *filter(None, [os.environ.get("PYTHONPATH")])])
    os.environ[PACKAGE_DIR_VARIABLE] = package


check_one_copy()
quiet_upstream_notices()
