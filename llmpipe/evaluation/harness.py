"""A second evaluation harness: EleutherAI's lm-evaluation-harness (``lm_eval``) on a run's Hugging Face export.

Optional (``pip install -e '.[lm-eval]'``, pinned in ``envs/lm-eval.lock``). Everything is local and offline:

* the model and its tokenizer come from the export folder (``results/<run>/hf``, loaded with
  ``trust_remote_code`` as :mod:`llmpipe.hf.export` writes it);
* the tasks are lm_eval task YAMLs in one local folder (``lm_eval.data_dir``), each reading local data files
  (``dataset_path: json`` with ``dataset_kwargs: {data_files: ...}``, paths relative to that folder); lm_eval's
  built-in task registry is not used, so no task can fetch its data from the hub;
* ``HF_DATASETS_OFFLINE``, ``HF_HUB_OFFLINE``, ``TRANSFORMERS_OFFLINE`` and ``HF_EVALUATE_OFFLINE`` are set for the
  evaluation (also in libraries already imported), and the datasets cache is a temporary folder, so a stale cached
  copy of a data file is never read.

The result (:func:`evaluate`) is labelled with the harness and its version and goes to its own file
(``results/<run>/eval-lm_eval.json``), never into llm-foundry's ``eval.json``. It holds, per task, each metric with
its standard error, the items scored and available, the few-shot count, and the SHA-256 of the task's YAML and data
files. No NaN or infinity is written: a non-finite value (or lm_eval's ``"N/A"`` standard error) is left out and
named under ``absent`` with the reason.

This module imports nothing heavy at import time: the rule files call :func:`check_inputs` while planning the DAG.
"""

from __future__ import annotations

import contextlib
import glob
import math
import os
import re
import tempfile
import time
from importlib import metadata

from llmpipe.atomic import sha256_file
from llmpipe.config.settings import ConfigError

HARNESS = "lm-evaluation-harness"
PACKAGE = "lm_eval"
#: What the settings errors tell a user to run when ``lm_eval`` is missing.
INSTALL_HINT = "pip install -r envs/lm-eval.lock (or pip install -e '.[lm-eval]')"
#: Environment of the evaluation: no library may reach the hub.
OFFLINE_ENV = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_EVALUATE_OFFLINE": "1"}
#: datasets' packaged builders whose ``data_files`` are local files.
LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")

_NAME_LINE = re.compile(r"""^(?:task|group):[ \t]*["']?([^"'\s#\[\]{}]+)""", re.M)


def installed_version() -> str | None:
    """The installed ``lm_eval`` version (package metadata; nothing imported), or None when it is missing."""
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return None


def task_yamls(data_dir: str) -> dict[str, str]:
    """Task and group names defined by the YAMLs under ``data_dir`` (``task: <name>`` / ``group: <name>`` lines)
    -> the YAML's path. Read as text: YAMLs with lm_eval's ``!function`` tags need no import."""
    names: dict[str, str] = {}
    for path in sorted(glob.glob(os.path.join(data_dir, "**", "*.y*ml"), recursive=True)):
        with open(path, encoding="utf-8") as fh:
            for name in _NAME_LINE.findall(fh.read()):
                names.setdefault(name, path)
    return names


def local_files(data_dir: str) -> list[str]:
    """Every file under ``data_dir`` except hidden ones, sorted: the rule's inputs, so a changed task YAML or data
    file reruns the harness."""
    out = []
    for root, dirs, files in os.walk(data_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        out += [os.path.join(root, f) for f in sorted(files) if not f.startswith(".")]
    return out


def _tolerant_yaml(path: str) -> dict:
    """A task YAML as a mapping, lm_eval's ``!function`` and other tags read as None (nothing imported)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    with open(path, encoding="utf-8") as fh:
        doc = yaml.load(fh, Loader=Loader)  # noqa: S506 - a SafeLoader subclass
    return doc if isinstance(doc, dict) else {}


def check_task_yaml(task: str, path: str, data_dir: str) -> None:
    """A task's YAML reads local files only: its ``dataset_path`` is one of datasets' file builders
    (:data:`LOCAL_BUILDERS`) and every ``dataset_kwargs.data_files`` entry (a path or glob pattern) matches a file under ``data_dir``. A YAML without
    ``dataset_path`` (a group, or one that ``include``s another) is not checked here.

    Raises:
        ConfigError: naming the task, its YAML, the field and the fix.
    """
    doc = _tolerant_yaml(path)
    source = doc.get("dataset_path")
    if source is None:
        return
    if str(source) not in LOCAL_BUILDERS:
        raise ConfigError(f"lm_eval.tasks: {task!r} ({path}) has dataset_path {source!r}, which lm_eval would fetch "
                          f"from the hub (evaluation runs offline). Fix: dataset_path: json with dataset_kwargs: "
                          f"{{data_files: ...}} pointing at local files (docs/evaluation.md, 'Second harness').")
    files = (doc.get("dataset_kwargs") or {}).get("data_files") or []
    if isinstance(files, dict):
        files = [f for v in files.values() for f in ([v] if isinstance(v, str) else v or [])]
    elif isinstance(files, str):
        files = [files]
    missing = [f for f in files if not glob.glob(os.path.join(data_dir, f))]  # data_files may be glob patterns
    if missing:
        raise ConfigError(f"lm_eval.tasks: {task!r} ({path}) reads {missing[0]!r}, which matches no file under "
                          f"{data_dir} (data_files are relative to lm_eval.data_dir). Fix: put the file there "
                          f"(docs/evaluation.md, 'Second harness') or correct data_files.")


def check_inputs(tasks: list[str], data_dir: str, *, version: str | None) -> list[str]:
    """Check the harness's settings while the DAG is built; return the local files the evaluation reads.

    Args:
        tasks: ``lm_eval.tasks``.
        data_dir: ``lm_eval.data_dir`` (as written: relative to the working folder, or absolute).
        version: :func:`installed_version`.

    Raises:
        ConfigError: no tasks, lm_eval missing, no such folder, or a task that no YAML there defines (each
            message names the setting and the fix).
    """
    if not tasks:
        raise ConfigError("lm_eval.tasks is empty, so the second harness is off and results/<run>/eval-lm_eval.json "
                          "cannot be made. Fix: list task names defined by YAMLs in lm_eval.data_dir, e.g. "
                          "--config 'lm_eval={tasks: [arc_easy_local], data_dir: lm_eval_data}'.")
    if version is None:
        raise ConfigError(f"lm_eval.tasks is set but lm-evaluation-harness (lm_eval) is not installed. "
                          f"Fix: {INSTALL_HINT}.")
    if not os.path.isdir(data_dir):
        raise ConfigError(f"lm_eval.data_dir: {data_dir!r} is not a folder (relative paths are read from the working "
                          f"folder {os.getcwd()}). Fix: create it with the task YAMLs and their data files "
                          f"(docs/evaluation.md, 'Second harness'), or set lm_eval.data_dir to the mirror's path.")
    known = task_yamls(data_dir)
    missing = [t for t in tasks if t not in known]
    if missing:
        raise ConfigError(f"lm_eval.tasks: {missing} are defined by no YAML in {data_dir} (`task: <name>`; found: "
                          f"{sorted(known) or 'none'}). Fix: add their YAMLs there or drop them from lm_eval.tasks "
                          f"(lm_eval's built-in registry is not used: its tasks read the hub).")
    for task in tasks:
        check_task_yaml(task, known[task], data_dir)
    return local_files(data_dir)


def _file_record(path: str, data_dir: str) -> dict:
    return {"path": os.path.relpath(path, data_dir), "sha256": sha256_file(path), "bytes": os.path.getsize(path)}


def data_file_records(task_config: dict, data_dir: str) -> list[dict]:
    """Path (relative to ``data_dir``), SHA-256 and size of each local data file a task's config reads.

    Args:
        task_config: lm_eval's resolved config of the task (``results["configs"][task]``): ``dataset_path`` and
            ``dataset_kwargs`` (``data_files``: a path or glob, a list, or split -> either; ``data_dir``), as
            ``datasets.load_dataset`` takes them, relative to ``data_dir``.
    """
    kwargs = task_config.get("dataset_kwargs") or {}
    base = os.path.join(data_dir, kwargs.get("data_dir") or "")
    spec = kwargs.get("data_files")
    patterns: list[str] = []
    for item in (spec.values() if isinstance(spec, dict) else [spec]):
        patterns += [item] if isinstance(item, str) else list(item or [])
    path = task_config.get("dataset_path") or ""
    if not patterns and path not in LOCAL_BUILDERS and os.path.isdir(os.path.join(data_dir, path)):
        return [_file_record(f, data_dir) for f in local_files(os.path.join(data_dir, path))]
    files = sorted({f for p in patterns for f in glob.glob(os.path.join(base, p), recursive=True)})
    return [_file_record(f, data_dir) for f in files]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def metric_entries(task_result: dict) -> tuple[dict, dict]:
    """Split one task's lm_eval results (``{"acc,none": 0.5, "acc_stderr,none": 0.1, "alias": ...}``) into
    ``metrics`` (name -> ``{"value", "stderr"}``; the name carries the filter when it is not ``none``:
    ``exact_match/strict-match``) and ``absent`` (what was left out -> why). A value or standard error that is not
    a finite number (NaN, infinity, lm_eval's ``"N/A"``) is never written: it is named in ``absent`` instead."""
    metrics: dict[str, dict] = {}
    absent: dict[str, str] = {}
    for key, value in task_result.items():
        if "," not in key or "_stderr," in key:
            continue
        metric, filt = key.split(",", 1)
        name = metric if filt == "none" else f"{metric}/{filt}"
        if not _finite(value):
            absent[name] = f"lm_eval gave {value!r}, not a finite number"
            continue
        stderr = task_result.get(f"{metric}_stderr,{filt}")
        metrics[name] = {"value": float(value), "stderr": float(stderr) if _finite(stderr) else None}
        if not _finite(stderr):
            absent[f"{name}.stderr"] = (f"lm_eval gave {stderr!r} for its standard error (it computes none for this "
                                        f"aggregation)" if stderr == "N/A" or stderr is None
                                        else f"lm_eval gave {stderr!r}, not a finite number")
    return metrics, absent


def result_record(raw: dict, data_dir: str, *, version: str, settings: dict) -> dict:
    """The harness's result file from ``lm_eval.simple_evaluate``'s output.

    Args:
        raw: what ``simple_evaluate`` returned (``results``, ``configs``, ``n-samples``, ``n-shot``, ``versions``,
            ``group_subtasks``).
        data_dir: the absolute task folder (paths in the record are relative to it).
        version: the lm_eval version that produced ``raw``.
        settings: the settings the evaluation ran with (recorded as they are).

    Returns:
        ``{"harness", "version", "settings", "data_dir", "tasks": {name: {...}}, "groups": {name: {...}}}``; each
        task: ``items`` (``scored``, ``available``), ``num_fewshot``, ``task_version``, ``output_type``,
        ``metrics``, ``absent``, ``yaml`` and ``data_files`` (path, sha256, bytes).

    Raises:
        ValueError: a task scored no item, or has no finite metric (its numbers would mean nothing).
    """
    tasks, groups = {}, {}
    configs = raw.get("configs") or {}
    for name, res in (raw.get("results") or {}).items():
        metrics, absent = metric_entries(res)
        if name not in configs:  # a group: lm_eval's aggregate of its subtasks
            groups[name] = {"subtasks": list((raw.get("group_subtasks") or {}).get(name, [])),
                            "metrics": metrics, "absent": absent}
            continue
        conf = configs[name]
        counts = (raw.get("n-samples") or {}).get(name) or {}
        scored = int(counts.get("effective", 0))
        if scored <= 0:
            raise ValueError(f"lm_eval task {name} scored no item (its data file is empty, or the split it names "
                             f"holds nothing): its metrics would be NaN. Fix the task's data in {data_dir}.")
        if not metrics:
            raise ValueError(f"lm_eval task {name} gave no finite metric ({absent}); nothing to record.")
        source = (conf.get("metadata") or {}).get("config_source")
        tasks[name] = {
            "items": {"scored": scored, "available": int(counts.get("original", scored))},
            "num_fewshot": (raw.get("n-shot") or {}).get(name),
            "task_version": (raw.get("versions") or {}).get(name),
            "output_type": conf.get("output_type"),
            "metrics": metrics,
            "absent": absent,
            "yaml": _file_record(source, data_dir) if source and os.path.isfile(source) else None,
            "data_files": data_file_records(conf, data_dir),
        }
    return {"harness": HARNESS, "package": PACKAGE, "version": version, "settings": settings,
            "data_dir": data_dir, "tasks": tasks, "groups": groups}


@contextlib.contextmanager
def offline(data_dir: str):
    """Within: the offline variables set (and read by huggingface_hub / datasets even when imported before), a
    temporary datasets cache, and ``data_dir`` as the working folder (lm_eval hands ``data_files`` to
    ``datasets.load_dataset``, which reads relative paths from there). All restored after."""
    import sys

    saved_env = {k: os.environ.get(k) for k in [*OFFLINE_ENV, "HF_DATASETS_CACHE"]}
    patched = []
    for mod, attrs in (("huggingface_hub.constants", ("HF_HUB_OFFLINE",)),
                       ("datasets.config", ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")),
                       ("transformers.utils.hub", ("_is_offline_mode",))):
        m = sys.modules.get(mod)
        for a in attrs:
            if m is not None and hasattr(m, a):
                patched.append((m, a, getattr(m, a)))
                setattr(m, a, True)
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="lm-eval-datasets-") as cache:
        os.environ.update(OFFLINE_ENV, HF_DATASETS_CACHE=cache)
        os.chdir(data_dir)
        try:
            yield
        finally:
            os.chdir(cwd)
            for m, a, v in patched:
                setattr(m, a, v)
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def context_length(model_dir: str) -> int | None:
    """The export's context length (``max_seq_len`` of MPT's config.json, else ``max_position_embeddings`` or
    ``n_positions``); lm_eval would otherwise assume 2048 and feed an MPT of a shorter context too many positions."""
    from llmpipe.atomic import read_json

    conf = read_json(os.path.join(model_dir, "config.json"), {}) or {}
    for key in ("max_seq_len", "max_position_embeddings", "n_positions"):
        if isinstance(conf.get(key), int):
            return int(conf[key])
    return None


def evaluate(model_dir: str, data_dir: str, tasks: list[str], *, batch_size: int, num_fewshot: int | None = None,
             limit: int | None = None, dtype: str = "auto", device: str = "cpu") -> dict:
    """Run lm_eval's ``simple_evaluate`` (model ``hf``) on an export, offline, and return the result record.

    Args:
        model_dir: the Hugging Face export (``results/<run>/hf``): weights, config with its modelling code,
            tokenizer.
        data_dir: the folder of the task YAMLs (lm_eval's ``include_path``; the built-in registry is left out)
            and of their data files.
        tasks: task or group names defined there.
        batch_size: requests per forward pass.
        num_fewshot: few-shot examples for every task; None - each task's own.
        limit: score only the first ``limit`` items of each task; None - all.
        dtype: ``auto`` (float32 on CPU, the export's dtype elsewhere) or a torch dtype name.
        device: ``cpu`` or ``cuda`` (one device).

    Returns:
        :func:`result_record`, plus ``seconds`` (wall time of the evaluation).

    Raises:
        ConfigError: lm_eval is not installed.
        ValueError: see :func:`result_record`; whatever lm_eval raises for a broken task.
    """
    version = installed_version()
    if version is None:
        raise ConfigError(f"lm_eval.tasks is set but lm_eval is not installed where the job runs. Fix: {INSTALL_HINT}.")
    model_dir, data_dir = os.path.abspath(model_dir), os.path.abspath(data_dir)
    if dtype == "auto":
        dtype = "float32" if device == "cpu" else "auto"
    model_args = {"pretrained": model_dir, "trust_remote_code": True, "dtype": dtype,
                  "max_length": context_length(model_dir)}
    settings = {"tasks": list(tasks), "num_fewshot": num_fewshot, "batch_size": batch_size, "limit": limit,
                "device": device, "model": model_dir, "model_args": dict(model_args),
                "offline_env": dict(OFFLINE_ENV)}
    t0 = time.time()
    with offline(data_dir):
        import lm_eval
        from lm_eval.tasks import TaskManager

        raw = lm_eval.simple_evaluate(
            model="hf", model_args={k: v for k, v in model_args.items() if v is not None}, tasks=list(tasks),
            num_fewshot=num_fewshot, batch_size=batch_size, device=device, limit=limit, log_samples=False,
            task_manager=TaskManager(include_path=data_dir, include_defaults=False))
    record = result_record(raw, data_dir, version=version, settings=settings)
    record["seconds"] = round(time.time() - t0, 2)
    return record
