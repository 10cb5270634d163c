"""The workflow config's schema (``schemas/config.schema.yaml``): typing of ``--config`` values, the error message a
user gets for a wrong key or value, the defaults of the settings sections and the speed-only markings.

``rules/common.smk`` calls :func:`prepare` (read values as YAML would, then refuse unknown keys and wrong types with
:class:`ConfigError`) and then Snakemake's ``validate(config, SCHEMA_PATH)``, which fills the defaults. Code outside
a workflow (tests, tools) gets the same config from :func:`resolve`.

Imports only PyYAML at import time (jsonschema when checking, Snakemake in :func:`resolve`); never torch: this runs
in the dry run and inside every job that reads a default.
"""

from __future__ import annotations

import copy
import difflib
import functools
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml

from llmpipe.config.settings import ConfigError, check_unique_labels  # the one error class of config checks

#: The schema file; its ``$defs`` name the shared shapes (train, arch, resources, slurm, ...).
SCHEMA_PATH = Path(__file__).resolve().parents[2] / "schemas" / "config.schema.yaml"



@functools.lru_cache(maxsize=1)
def load() -> dict:
    """The schema as a dict (parsed once per process; treat it as read-only)."""
    with open(SCHEMA_PATH) as fh:
        return yaml.load(fh, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # libyaml's loader: 10x faster


def speed_only_keys(shape: str) -> frozenset[str]:
    """Keys of the shape ``$defs.<shape>`` marked ``x-speed-only: true``: settings that change only speed or placement,
    never what a step produces (left out of step identity)."""
    props = load()["$defs"][shape]["properties"]
    return frozenset(k for k, v in props.items() if v.get("x-speed-only"))


def closest(key: str, known: Iterable[str], aliases: dict | None = None) -> str | None:
    """The known key a user most likely meant by ``key``: its alias (``aliases``, e.g. ``{learning_rate: lr}``), a
    known key that extends it or that it extends (``t_warmup`` -> ``t_warmup_batches``), else the closest spelling
    (difflib); None when nothing is close."""
    known = sorted(known)
    if aliases and aliases.get(key) in known:
        return aliases[key]
    nested = [k for k in known if min(len(k), len(key)) >= 3 and (k.startswith(key) or key.startswith(k))]
    if nested:
        return min(nested, key=lambda k: abs(len(k) - len(key)))
    close = difflib.get_close_matches(key, known, n=1)
    return close[0] if close else None


def keys_by_name(shape: str) -> dict[str, list[str]]:
    """``$defs.<shape>``'s ``x-keys-by-name``: for each ``name`` (an optimizer or scheduler), the keys its class
    takes besides ``name`` (``{"decoupled_adamw": ["lr", "betas", ...]}``); empty when the shape has none."""
    return dict(load()["$defs"][shape].get("x-keys-by-name") or {})


def check_named_arguments(train: dict, written_at: Callable[[str], str]) -> None:
    """Check that a run's merged ``train.optimizer`` and ``train.scheduler`` set only keys the class their ``name``
    picks takes (:func:`keys_by_name`; the schema checks each section's keys alone, while ``name`` may be inherited,
    e.g. from ``model_defaults``). ``written_at`` maps a dotted key (``train.optimizer.lr``) to the config path where
    it is written (:func:`llmpipe.config.settings.written_at`).

    Raises:
        ConfigError: naming where the key is written, the class's keys and the closest one.
    """
    for part in ("optimizer", "scheduler"):
        value = train.get(part) or {}
        known = keys_by_name(part).get(value.get("name"))
        if known is None:
            continue  # an unknown name is the schema's to name
        for key in sorted(set(value) - set(known) - {"name"}):
            close = closest(key, known)
            raise ConfigError(f"{written_at(f'train.{part}.{key}')} is not a setting of the {part} {value['name']} "
                              f"({written_at(f'train.{part}.name')}); {f'did you mean {close}? ' if close else ''}"
                              f"It takes {', '.join(known) or 'no settings'}. Fix: "
                              f"{f'rename it to {close}' if close else 'remove it'}, or pick another {part}.")


def section_defaults(section: str) -> Any:
    """The defaults of one top-level settings section (``allreduce``, ``report``, ``slurm`` ...) as the schema gives
    them, nested defaults filled; a new object each call.

    Raises:
        KeyError: ``section`` is not a top-level key of the schema.
    """
    return fill_defaults({})[section] if "default" in load()["properties"][section] else None


def fill_defaults(config: dict) -> dict:
    """``config`` (changed in place and returned) with every missing key that has a schema default set to it, nested
    mappings filled too: what Snakemake's ``validate(..., set_default=True)`` does, without jsonschema (jobs read
    section defaults through :func:`section_defaults`)."""
    _fill(load(), config)
    return config


def _fill(node: dict, value: Any) -> None:
    if not isinstance(value, dict):
        return
    for n in _expand(node):
        for key, sub in (n.get("properties") or {}).items():
            if "default" in sub and key not in value:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                _fill(sub, value[key])


def _expand(node: Any) -> list[dict]:
    """``node`` and what it includes by ``$ref`` and ``allOf`` (not the alternatives of ``anyOf``/``oneOf``)."""
    if not isinstance(node, dict):
        return []
    out = [node]
    ref = node.get("$ref")
    if ref:
        out += _expand(node_at(ref))
    for sub in node.get("allOf") or []:
        out += _expand(sub)
    return out


def node_at(ref: str) -> dict:
    """The schema node a local reference (``#/$defs/train``) points at.

    Raises:
        ValueError: ``ref`` is not local to the schema file; KeyError: it points at nothing.
    """
    if not ref.startswith("#/"):
        raise ValueError(f"only local references are supported in {SCHEMA_PATH}, got {ref!r}")
    node: Any = load()
    for part in ref[2:].split("/"):
        node = node[part]
    return node


@functools.lru_cache(maxsize=1)
def _validator():
    from jsonschema import Draft202012Validator

    return Draft202012Validator(load())


# ------------------------------------------------------------------------------------------------ --config typing

def coerce(config: dict) -> dict:
    """A copy of ``config`` with values typed as a YAML file would type them, driven by the schema.

    ``snakemake --config`` hands nested values over as strings (``{'train': {'seed': 17}}`` gives ``'17'``). A string
    where the schema does not take that string is read as YAML (and as a number: ``'1e-3'``); the reading is kept when
    the schema takes it. A null (or a text YAML reads as null: ``'null'``, ``'~'``, ``''``; ``'none'`` stays text)
    becomes ``{}`` for a section whose schema default is a mapping (its defaults apply, as for a section not
    written), else None where the schema allows null. Inside open mappings (e.g. ``attn_config.rope_dail_config``,
    ``compile.options``) number, true/false and null texts are read as
    YAML. Values the schema refuses either way are left for :func:`check` to name.
    """
    return _coerce([load()], config)


def _types(node: dict) -> set[str] | None:
    t = node.get("type")
    return None if t is None else {t} if isinstance(t, str) else set(t)


def _admits(node: dict, kind: str) -> bool:
    types = _types(node)
    return types is None or kind in types


def _valid(nodes: list[dict], value: Any) -> bool:
    """Whether every node takes the scalar ``value`` by its type, enum, const, pattern and alternatives (bounds are
    left to :func:`check`, so that ``'0'`` for a positive integer is read as 0 and named as out of range)."""
    return all(_takes(n, value) for n in nodes)


_PY_TYPES = {"null": lambda v: v is None, "boolean": lambda v: isinstance(v, bool),
             "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
             "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
             "string": lambda v: isinstance(v, str), "array": lambda v: isinstance(v, list),
             "object": lambda v: isinstance(v, dict)}


def _takes(node: Any, value: Any) -> bool:
    if isinstance(node, bool):
        return node
    types = _types(node)
    if types is not None and not any(_PY_TYPES[t](value) for t in types):
        return False
    if "enum" in node and value not in node["enum"]:
        return False
    if "const" in node and value != node["const"]:
        return False
    if "pattern" in node and isinstance(value, str) and not re.search(node["pattern"], value):
        return False
    if "$ref" in node and not _takes(node_at(node["$ref"]), value):
        return False
    if any(not _takes(sub, value) for sub in node.get("allOf") or []):
        return False
    for key in ("anyOf", "oneOf"):
        if key in node and not any(_takes(sub, value) for sub in node[key]):
            return False
    return True


def _is_null_text(value: Any) -> bool:
    """None, or a text YAML reads as null (``null``, ``Null``, ``NULL``, ``~``, the empty scalar); ``none`` and
    ``None`` are text, as in a YAML file (``slurm.qos: none`` names a QOS)."""
    if value is None:
        return True
    if not isinstance(value, str):
        return False
    try:
        return yaml.safe_load(value) is None and not value.lstrip().startswith("#")
    except yaml.YAMLError:
        return False


def _readings(text: str) -> Iterable[Any]:
    try:
        got = yaml.safe_load(text)
    except yaml.YAMLError:
        got = text
    if not isinstance(got, str):
        yield got
    for kind in (int, float):
        try:
            yield kind(text.strip())
        except ValueError:
            pass


def _open(value: Any) -> Any:
    """A value under a mapping the schema leaves open: number, true/false and null texts read as YAML."""
    if isinstance(value, dict):
        return {k: _open(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_open(v) for v in value]
    if isinstance(value, str):
        for got in _readings(value):
            if got is None or isinstance(got, (bool, int, float)):
                return got
    return value


def _coerce(nodes: list[Any], value: Any) -> Any:
    if any(n is False for n in nodes):
        return value
    nodes = [x for n in nodes for x in _expand(n)]
    if not nodes:
        return _open(value)
    if _is_null_text(value) and any(isinstance(n.get("default"), dict) for n in nodes):
        return {}  # a settings section (or slurm.container) given as null: its defaults apply
    typed = [t for n in nodes if (t := _types(n)) is not None]
    if _is_null_text(value) and typed and all("object" in t and "null" not in t for t in typed):
        return {}  # a mapping written empty (`train:` in a YAML file): as if not written, what it inherits applies
    alternatives = [x for n in nodes for alt in (n.get("anyOf") or []) + (n.get("oneOf") or []) for x in _expand(alt)]
    if isinstance(value, dict):
        shapes = [n for n in nodes + alternatives if _admits(n, "object") and (
            "properties" in n or "additionalProperties" in n)]
        if not shapes:
            return _open(value) if all(_admits(n, "object") for n in nodes) else value
        out = {}
        for key, sub in value.items():
            subs = [n["properties"][key] for n in shapes if key in (n.get("properties") or {})]
            if not subs:
                extra = [n.get("additionalProperties", True) for n in shapes]
                subs = [e for e in extra if isinstance(e, dict)]
                if not subs and any(e is False for e in extra):
                    out[key] = sub  # an unknown key: check() names it
                    continue
            out[key] = _coerce(subs, sub)
        return out
    if isinstance(value, list):
        items = [n["items"] for n in nodes + alternatives if _admits(n, "array") and isinstance(n.get("items"), dict)]
        return [_coerce(items, v) for v in value]
    if isinstance(value, str):
        if _is_null_text(value) and _valid(nodes, None):
            return None
        if _valid(nodes, value):
            return value
        for got in _readings(value):
            if _valid(nodes, got):
                return got
    return value


# ------------------------------------------------------------------------------------------------ checking

def check(config: dict) -> None:
    """Raise :class:`ConfigError` for the most relevant way ``config`` breaks the schema: an unknown key (named with
    its full path, where it is written, and the closest known key) or a wrong value (its path, what it must be, and
    the fix). Nothing is changed; call it on :func:`coerce`'s result.
    """
    from jsonschema.exceptions import relevance

    errors = list(_validator().iter_errors(config))
    if errors:
        worst = max(errors, key=relevance)
        setting = tuple(worst.absolute_path)
        if worst.validator == "additionalProperties" and isinstance(worst.instance, dict):
            known = set((worst.schema.get("properties") or {}) if isinstance(worst.schema, dict) else ())
            setting += tuple(sorted(set(worst.instance) - known)[:1])   # the unknown key itself
        raise ConfigError(message(worst), setting=setting)


def check_part(value: Any, shape: str, where: str) -> None:
    """Raise :class:`ConfigError` when ``value`` (a part of the config written at ``where``, e.g. a step's
    ``resources.slurm``) breaks the shape ``$defs.<shape>``; the message names ``where`` and the key below it."""
    from jsonschema.exceptions import relevance

    errors = list(_validator().evolve(schema=load()["$defs"][shape]).iter_errors(value))
    if errors:
        raise ConfigError(message(max(errors, key=relevance), prefix=where.split(".")))


def origin(setting: tuple, configfiles: list[str], overrides: dict | None) -> str | None:
    """Where the value at ``setting`` (a path of keys) was written: ``--config`` when the command line's overrides
    set it (they win), else the last of ``configfiles`` (YAML files, lowest precedence first) that sets it; None when
    none does (a schema default)."""
    import yaml

    def sets(tree: Any) -> bool:
        node = tree
        for key in setting:
            if isinstance(node, str):        # --config hands nested values over as YAML text
                try:
                    node = yaml.safe_load(node)
                except yaml.YAMLError:
                    return False
            if isinstance(node, dict) and key in node:
                node = node[key]
            elif isinstance(node, list) and isinstance(key, int) and key < len(node):
                node = node[key]
            else:
                return False
        return bool(setting)

    if sets(overrides or {}):
        return "--config"
    for path in reversed(configfiles):
        try:
            with open(path) as fh:
                tree = yaml.safe_load(fh)
        except (OSError, yaml.YAMLError):
            continue
        if sets(tree):
            return path
    return None


def with_origin(exc: ConfigError, configfiles: list[str], overrides: dict | None) -> ConfigError:
    """``exc`` with the file (or ``--config``) its setting was written in appended (:func:`origin`); ``exc``
    itself when it names no setting or none sets it."""
    where = origin(exc.setting, configfiles, overrides) if exc.setting else None
    if where is None:
        return exc
    return ConfigError(f"{exc} (written in {where})", setting=exc.setting)


def prepare(config: dict) -> dict:
    """Type ``config``'s values as YAML would (:func:`coerce`) in place, then :func:`check` it; return it.

    Raises:
        ConfigError: naming the first wrong setting and the fix.
    """
    typed = coerce(config)
    config.clear()
    config.update(typed)
    check(config)
    check_unique_labels(config)
    return config


def resolve(config: dict) -> dict:
    """``config`` as a workflow run sees it: :func:`prepare`, then the schema's defaults filled
    (:func:`fill_defaults`, what rules/common.smk's ``validate`` does); in place, returned."""
    prepare(config)
    return fill_defaults(config)


def load_config(*paths: str | Path, overrides: dict | None = None) -> dict:
    """The config files ``paths`` (YAML, later ones merged over earlier ones key by key, as Snakemake's
    ``--configfile``), then ``overrides`` (as ``--config``), resolved (:func:`resolve`)."""
    config: dict = {}
    for path in paths:
        with open(path) as fh:
            config = deep_merge(config, yaml.safe_load(fh) or {})
    config = deep_merge(config, overrides or {})
    return resolve(config)


def deep_merge(base: dict, override: dict | None) -> dict:
    """Return a new dict: ``base`` updated recursively with ``override`` (Snakemake's rule for config files).

    Nested dicts merge key by key; any other value in ``override`` (lists included) replaces the base value.
    ``None`` as an override value replaces too (``fsdp: null`` turns FSDP off).
    """
    out = copy.deepcopy(base)
    for key, value in (override or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _path(parts: Iterable[Any]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "config"


def _repr(value: Any) -> str:
    """``value`` as a message shows it: YAML's ``null``/``true``/``false``, else Python's repr (quoted text)."""
    return _show(value) if value is None or isinstance(value, bool) else repr(value)


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


_TYPE_WORDS = {"object": "a mapping", "array": "a list", "string": "text", "integer": "an integer",
               "number": "a number", "boolean": "true or false", "null": "null"}


def _must(node: dict) -> str:
    if node.get("x-must"):
        return node["x-must"]
    if "enum" in node:
        return f"be one of {', '.join(_show(v) for v in node['enum'])}"
    types = _types(node) or set()
    words = [word for t, word in _TYPE_WORDS.items() if t in types]
    if "pattern" in node:  # text of a given form: say the form, not only "text"
        words = [f"text matching {node['pattern']}" if w == "text" else w for w in words] or [
            f"text matching {node['pattern']}"]
    return "be " + " or ".join(words) if words else "match its description"


def _described(node: dict) -> str:
    d = " ".join(str(node.get("description", "")).split())
    return f" ({d.rstrip('.')})" if d else ""


def message(error: Any, prefix: list[str] | tuple = ()) -> str:
    """The user's message for one ``jsonschema.ValidationError`` of the workflow config: the setting's full path (where
    it is written), what is wrong, the closest known key for an unknown one, and the fix. ``prefix``: the path of
    the part checked when that is not the whole config (:func:`check_part`)."""
    parts = [*prefix, *error.absolute_path]
    where = _path(parts)
    node, kind, value = error.schema if isinstance(error.schema, dict) else {}, error.validator, error.instance
    if kind in ("anyOf", "oneOf"):
        # a mapping or list: report inside the alternative of that shape (e.g. its unknown key), not the alternatives
        inside = [e for e in error.context if isinstance(value, (dict, list)) and not (
            e.validator == "type" and len(e.absolute_path) == len(error.absolute_path))]
        if inside:
            from jsonschema.exceptions import relevance

            return message(max(inside, key=relevance), prefix)
    if "propertyNames" in error.schema_path:  # a name (of a model, corpus ...) the wildcards cannot match
        return (f"{where}.{value} is not a usable name: a name must {_must(node)}. Fix: rename {value!r} (e.g. "
                f"{re.sub(r'[^A-Za-z0-9_.-]+', '-', str(value)).strip('-') or 'name'}) here and where it is used.")
    if kind == "additionalProperties":
        known = sorted(node.get("properties") or {})
        key = sorted(set(value) - set(known))[0]
        close = [c] if (c := closest(key, known, node.get("x-aliases"))) else []
        what = node.get("x-key-kind") or f"setting of `{where}:`"
        hint = node.get("x-hint", " (Its value would be ignored.)").format(sp=" ", where=where)
        fix = f"rename it to {close[0]}" if close else "remove it"
        article = "an" if what[:1].lower() in "aeiou" else "a"
        return (f"{where}.{key} is not {article} {what}; {f'did you mean {close[0]}? ' if close else ''}Known ones: "
                f"{', '.join(known)}.{hint} Fix: {fix} (schemas/config.schema.yaml lists every setting).")
    if kind == "required":
        missing = [k for k in node.get("required", []) if k not in value][0]
        about = _described((node.get("properties") or {}).get(missing, {}))
        return f"{where}.{missing} is missing. Fix: set it{about}."
    if kind in ("type", "enum", "anyOf", "oneOf", "const", "pattern"):
        section = load()["properties"].get(parts[0], {}) if not prefix and len(parts) == 1 else {}
        if isinstance(section.get("default"), dict):
            return (f"`{where}:` is {_repr(value)}; it must be a mapping of settings. Fix: remove it (the defaults "
                    f"apply) "
                    f"or give its keys, e.g. {where}: {{key: value}} (schemas/config.schema.yaml lists them).")
        text_fix = node.get("x-text-fix") or {}
        batches = re.fullmatch(r"\s*(\d+)\s*ba\s*", value) if isinstance(value, str) else None
        if isinstance(value, str) and value in text_fix.get("values", ()):
            fix = text_fix["fix"].format(where=where, value=value)
        elif batches and "integer" in (_types(node) or ()):  # composer's '100ba' where a count of batches is asked
            low = node.get("minimum")
            fix = (f"write the number alone, {where}: {batches.group(1)} (the setting counts batches"
                   f"{f'; it must be >= {low}' if low is not None and int(batches.group(1)) < low else ''})")
        elif "object" in (_types(node) or ()):
            fix = f"give its keys, e.g. {parts[-1] if parts else 'section'}: {{key: value}}"
        else:
            fix = f"set {where} to such a value"
        return f"{where} is {_repr(value)}; it must {_must(node)}{_described(node)}. Fix: {fix}."
    bounds = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}
    if kind in bounds:
        return (f"{where} is {_repr(value)}; it must be {bounds[kind]} {error.validator_value}{_described(node)}. "
                f"Fix: set {where} to such a value.")
    if kind == "minItems" and node.get("x-must"):
        return f"{where} is {_repr(value)}; it must {_must(node)}{_described(node)}. Fix: set {where} to such a list."
    return f"{where} is {_repr(value)}: {error.message}{_described(node)}. Fix: set {where} as its description says."
