"""Step identity as text: the one canonical form Snakemake stores as a rule's ``params``, and its comparison.

A step's identity is a dict (built by the step's module in :mod:`llmpipe.steps`); it becomes text once, at the rule
boundary (a rule's ``params``: rules/common.smk ``identity``), with :func:`identity_text`. A training keeps that
text in its checkpoint folder (``identity.json``) and compares it with :func:`same_identity`, which compares
meanings, not characters: identities written before identities were dicts held the identities of their inputs as
JSON text inside JSON text (``"data": "{\\"step\\":\\"mds\\",...}"``); :func:`parse_identity` decodes those, so a
finished training recognizes itself after the upgrade instead of deleting its checkpoints.

No imports from llmpipe: every module may use this one.
"""

from __future__ import annotations

import json
from typing import Any


def normal_numbers(value: Any) -> Any:
    """``value`` with every float that is a whole number written as an int (``0.0`` -> ``0``, ``4.0`` -> ``4``),
    recursively through dicts and lists; booleans, other floats and everything else unchanged.

    ``weight_decay: 0`` and ``weight_decay: 0.0`` configure the same training; without this, restating a shipped
    ``0.0`` as ``0`` would change the identity text and retrain.
    """
    if isinstance(value, dict):
        return {k: normal_numbers(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [normal_numbers(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def identity_text(identity: Any) -> str:
    """``identity`` as canonical JSON text (sorted keys, no whitespace, whole-number floats as ints:
    :func:`normal_numbers`): what a rule's ``params`` hold.

    Reformatting the YAML (comments, key order, ``0`` for ``0.0``) gives the same text. Values JSON cannot represent
    are written with ``str``.
    """
    return json.dumps(normal_numbers(identity), sort_keys=True, separators=(",", ":"), default=str)


def _decode_nested(value: Any) -> Any:
    """``value`` with every string that holds a JSON object replaced by that object, recursively."""
    if isinstance(value, dict):
        return {k: _decode_nested(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_nested(v) for v in value]
    if isinstance(value, str) and value.startswith("{") and value.endswith("}"):
        try:
            inner = json.loads(value)
        except ValueError:
            return value
        if isinstance(inner, dict):
            return _decode_nested(inner)
    return value


def parse_identity(text: str) -> Any:
    """The structure of an identity text, with identities nested as JSON text (the legacy form) decoded and
    whole-number floats as ints (:func:`normal_numbers`).

    Text that is not JSON is returned unchanged (compared as text).
    """
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return normal_numbers(_decode_nested(value))


def same_identity(a: str, b: str) -> bool:
    """Whether two identity texts describe the same step result: equal after :func:`parse_identity` (key order,
    whitespace, ``0`` versus ``0.0`` and the legacy nested-text form do not matter)."""
    return a == b or parse_identity(a) == parse_identity(b)
