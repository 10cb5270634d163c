"""In-context-learning suites: which tasks a run is scored on, their checks, llm-foundry's task list, the scores.

A suite is llm-foundry's own pair of lists (its ``scripts/eval/yamls/tasks_v0.3.yaml`` and
``eval_gauntlet_v0.3.yaml``): ``icl_tasks``, each task in llm-foundry's task-list keys (:data:`TASK_KEYS`), and
``eval_gauntlet`` (categories of benchmarks with their random baselines). A run is scored on the suite its
``eval_suite`` names (``models.<run>``, ``model_defaults``, ``finetunes.<run>``, ``finetune_defaults``, else
``eval.suite``): a key of ``eval.suites``, or ``default`` for ``eval.icl_tasks`` with ``eval.eval_gauntlet``.

A task's data is one of:

* built by the project from the run's held-out text (``kind: cloze | cloze_choice``, no ``dataset_uri``;
  :mod:`llmpipe.data.icl`), at ``results/data/<corpus>/icl/<label>.jsonl``;
* llm-foundry's standard data (``dataset_uri: eval/local_data/<category>/<file>.jsonl``, as its task lists write
  it), fetched by the ``eval_task_data`` rule into ``results/data/eval-tasks/<suite>/`` (:mod:`llmpipe.evaluation.task_data`);
* a local jsonl file (any other path; relative paths are read from the working folder).

Every item of a task is scored unless the task sets ``subset_items`` (then its first ``subset_items`` items,
recorded as a subset), whatever the batch sizes. No module here imports torch: the checks run in the dry run.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping

from llmpipe.atomic import read_json
from llmpipe.config.settings import ConfigError
from llmpipe.evaluation.task_data import FOUNDRY_PREFIX, count_items

#: Task types llm-foundry 0.22 registers (llmfoundry/eval/datasets/__init__.py) and the keys of a task each one
#: takes: llm-foundry's build_icl_evaluators reads label, dataset_uri, icl_task_type, num_fewshot, metric_names,
#: max_seq_len, batch_size, has_categories, early_stopping_criteria, question_prelimiter and passes the rest to
#: the dataset's constructor, which refuses a key it does not know.
COMMON_KEYS = ("label", "dataset_uri", "icl_task_type", "num_fewshot", "metric_names", "max_seq_len", "batch_size",
               "has_categories", "fewshot_random_seed", "prompt_string", "example_delimiter",
               "continuation_delimiter", "question_prelimiter", "prelimiter", "strip_dataset", "generation_kwargs")
TYPE_KEYS = {
    "language_modeling": ("context_key",),
    "multiple_choice": ("context_key", "answer_key", "choices_key"),
    "schema": ("answer_key", "choices_key"),
    "generation_task_with_answers": ("context_key", "answer_key", "cot_delimiter", "early_stopping_criteria",
                                     "do_normalization"),
}
#: Every llm-foundry task key this project passes on (the config schema lists the same).
TASK_KEYS = tuple(dict.fromkeys(COMMON_KEYS + sum(TYPE_KEYS.values(), ())))
#: Keys of ours: ``kind``, ``num_items``, ``seed`` (a task the project builds), ``subset_items`` (score a subset).
OWN_KEYS = ("kind", "num_items", "seed", "subset_items")
#: A task the project builds: its kind -> llm-foundry task type and delimiters (see llmpipe.data.icl).
BUILT_KINDS = {"cloze": {"icl_task_type": "language_modeling", "continuation_delimiter": "", "example_delimiter": "\n"},
               "cloze_choice": {"icl_task_type": "multiple_choice", "continuation_delimiter": "",
                                "example_delimiter": "\n"}}
DEFAULT_SUITE = "default"
_REMOTE = ("hf://", "s3://", "gs://", "oci://", "http://", "https://", "dbfs:", "uc://")


# ------------------------------------------------------------------------------------------- which suite

def suite_name(config: Mapping, run: str) -> str:
    """The suite a run is scored on: its own ``eval_suite``, its defaults' (``model_defaults`` or
    ``finetune_defaults``), else ``eval.suite``."""
    fts = config.get("finetunes") or {}
    if run in fts:
        sections = [fts.get(run) or {}, config.get("finetune_defaults") or {}]
    else:
        sections = [(config.get("models") or {}).get(run) or {}, config.get("model_defaults") or {}]
    for s in sections:
        if s.get("eval_suite"):
            return str(s["eval_suite"])
    return str((config.get("eval") or {}).get("suite") or DEFAULT_SUITE)


def suite(config: Mapping, name: str) -> dict:
    """``{"icl_tasks": [...], "eval_gauntlet": {...} | None}`` of a suite name (``default``: ``eval.icl_tasks``).

    Raises:
        ConfigError: no such suite (naming the known ones).
    """
    e = config.get("eval") or {}
    if name == DEFAULT_SUITE:
        return {"icl_tasks": list(e.get("icl_tasks") or []), "eval_gauntlet": e.get("eval_gauntlet"),
                "where": "eval.icl_tasks"}
    suites = e.get("suites") or {}
    if name not in suites:
        raise ConfigError(f"eval suite {name!r} is not defined: known ones are {DEFAULT_SUITE} (eval.icl_tasks), "
                          f"{', '.join(sorted(suites))}. Fix: set the run's eval_suite to one of them, or add "
                          f"eval.suites.{name}: {{icl_tasks: [...], eval_gauntlet: ...}}.")
    s = suites[name] or {}
    return {"icl_tasks": list(s.get("icl_tasks") or []), "eval_gauntlet": s.get("eval_gauntlet"),
            "where": f"eval.suites.{name}.icl_tasks"}


def suite_setting(config: Mapping, run: str) -> str:
    """The config path that chooses a run's suite (see :func:`suite_name`), for error messages."""
    fts = config.get("finetunes") or {}
    if run in fts:
        sections = [(f"finetunes.{run}", fts.get(run) or {}), ("finetune_defaults", config.get("finetune_defaults"))]
    else:
        sections = [(f"models.{run}", (config.get("models") or {}).get(run) or {}),
                    ("model_defaults", config.get("model_defaults"))]
    for at, sec in sections:
        if (sec or {}).get("eval_suite"):
            return f"{at}.eval_suite"
    return "eval.suite"


def run_suite(config: Mapping, run: str) -> tuple[str, dict]:
    """(suite name, :func:`suite`) of a run.

    Raises:
        ConfigError: the suite is not defined, naming the setting that chose it.
    """
    name = suite_name(config, run)
    try:
        return name, suite(config, name)
    except ConfigError as e:
        raise ConfigError(f"{suite_setting(config, run)} is {name!r}: {e}") from None


def known_items(config: Mapping, task: Mapping, suite_name_: str) -> int | None:
    """The items of a task's file as far as the dry run can know them: a built task's ``num_items``; a local
    file's; a standard file in the local mirror (``eval.task_data.source: local``) or in the suite's manifest of an
    earlier fetch. None when unknown (a standard file not fetched yet)."""
    src = data_source(task)
    if src == "built":
        return int(task.get("num_items", 200))
    uri = str(task.get("dataset_uri") or "")
    if src == "local":
        return count_items(uri) if os.path.isfile(uri) else None
    td = (config.get("eval") or {}).get("task_data") or {}
    if td.get("source") == "local" and td.get("local_dir") and os.path.isfile(os.path.join(td["local_dir"], uri)):
        return count_items(os.path.join(td["local_dir"], uri))
    manifest = os.path.join(task_data_dir(str(config["results_dir"]), suite_name_), "manifest.json")
    rec = ((read_json(manifest) or {}).get("files") or {}).get(uri) or {}
    return int(rec["items"]) if rec.get("items") is not None else None


def planned_works(config: Mapping, run: str, world_size: int = 1) -> tuple[list, list[str]]:
    """What an evaluation of ``run`` will run, as far as the dry run can count it: the held-out split's batches and,
    for each task whose file (:func:`file_on_disk`) and the run's prepared tokenizer are on disk, its batches at
    each shot count (:func:`llmpipe.plan.eval_time.icl_work` of
    :func:`llmpipe.evaluation.icl_tokens.item_tokens` with ``fewshot="mean"``: the few-shot preambles estimated, no
    torch), with the ``eval:`` settings (``batch_size``, ``icl_batches``) over ``world_size`` processes.

    Returns:
        (the :class:`llmpipe.plan.eval_time.EvaluatorWork` list, the labels of the tasks not counted: file or
        tokenizer not there yet, an item the counting cannot read, or an answer that leaves no context token).
    """
    from llmpipe.config.runs import run_config
    from llmpipe.config.stage_settings import EvalSettings
    from llmpipe.plan.eval_time import heldout_work

    evals = EvalSettings.from_section(config["eval"])  # type: ignore[arg-type]
    data = run_config(config, run)["data"]  # type: ignore[arg-type]
    seq = int(data["concat_tokens"])
    works = [heldout_work(evals.val_batches, evals.batch_size, seq, world_size)]
    name, s = run_suite(config, run)
    tok_dir = os.path.join(str(config["results_dir"]), "tokenizers", str(data["tokenizer"]))
    manifest = os.path.join(tok_dir, "manifest.json")
    missing = []
    for t in s["icl_tasks"]:
        path = file_on_disk(config, t, name, str(data["corpus"])) if os.path.isfile(manifest) else None
        counted = None
        if path is not None:
            task = foundry_task(t)
            st, mt = os.stat(path), os.stat(manifest)
            try:
                counted = _task_works(path, st.st_mtime_ns, st.st_size, tok_dir, mt.st_mtime_ns,
                                      json.dumps(task, sort_keys=True), t["label"],
                                      tuple(int(k) for k in t.get("num_fewshot", [0])),
                                      int(task.get("max_seq_len") or seq), t.get("subset_items"), evals.batch_size,
                                      evals.icl_batches, int(world_size))
            except ValueError:
                counted = None
        if counted is None:
            missing.append(t["label"])
        else:
            works.extend(counted)
    return works, missing


def uncounted_tasks(config: Mapping, run: str, labels: list[str]) -> list[dict]:
    """What the dry run knows of the tasks of ``run``'s suite that :func:`planned_works` could not count
    (``labels``): per task ``{"label", "icl_task_type", "shots": [k, ...], "max_seq_len" (tokens), "items": the items
    it will be scored on (:func:`known_items`, at most ``subset_items``; ``subset_items`` alone when the file's count
    is unknown; None when neither is known)}``, in the suite's order."""
    from llmpipe.config.runs import run_config

    seq = int(run_config(config, run)["data"]["concat_tokens"])  # type: ignore[arg-type]
    name, s = run_suite(config, run)
    out = []
    for t in s["icl_tasks"]:
        if t["label"] not in labels:
            continue
        known = known_items(config, t, name)
        cap = t.get("subset_items")
        items = min(known, int(cap)) if known is not None and cap is not None else (
            known if known is not None else (int(cap) if cap is not None else None))
        ft = foundry_task(t)
        out.append({"label": t["label"], "icl_task_type": ft["icl_task_type"],
                    "shots": [int(k) for k in t.get("num_fewshot", [0])],
                    "max_seq_len": int(ft.get("max_seq_len") or seq), "items": items})
    return out


@functools.lru_cache(maxsize=256)
def _task_works(path: str, mtime_ns: int, size: int, tok_dir: str, tok_mtime_ns: int, task_json: str, label: str,
                shots: tuple[int, ...], seq: int, subset: int | None, batch_size: int, icl_batches: str,
                world_size: int) -> tuple | None:
    """:func:`planned_works` of one task file (cached per file, tokenizer, task and settings: the DAG asks once per
    job); None when an answer leaves no context token (the task is not scored)."""
    from llmpipe.evaluation import icl_tokens
    from llmpipe.plan.eval_time import task_works

    items = icl_tokens.read_items(path)
    if subset is not None:
        items = items[:int(subset)]
    works = task_works(label, json.loads(task_json), items, icl_tokens.Encoder.from_folder(tok_dir), shots, seq,
                       batch_size, icl_batches, world_size, fewshot="mean")
    return None if works is None else tuple(works)


# ------------------------------------------------------------------------------------------- where the data is

def data_source(task: Mapping) -> str:
    """``built`` (the project builds it), ``foundry`` (llm-foundry's standard data) or ``local`` (a file)."""
    if task.get("kind") and not task.get("dataset_uri"):
        return "built"
    uri = str(task.get("dataset_uri") or "")
    return "foundry" if uri.startswith(FOUNDRY_PREFIX) else "local"


def foundry_files(tasks: list[Mapping]) -> list[str]:
    """The llm-foundry data paths (``eval/local_data/...``) of a suite's tasks, sorted, without repeats."""
    return sorted({t["dataset_uri"] for t in tasks if data_source(t) == "foundry"})


def task_path(task: Mapping, *, results_dir: str, corpus: str, suite: str) -> str:
    """The jsonl file a task is scored on (see the module docstring)."""
    src = data_source(task)
    if src == "built":
        return f"{results_dir}/data/{corpus}/icl/{task['label']}.jsonl"
    if src == "foundry":
        return f"{task_data_dir(results_dir, suite)}/{task['dataset_uri']}"
    return str(task["dataset_uri"])


def task_data_dir(results_dir: str, suite: str) -> str:
    """Where the ``eval_task_data`` rule puts a suite's standard task files (and its manifest.json)."""
    return f"{results_dir}/data/eval-tasks/{suite}"


def built_task(config: Mapping, label: str) -> dict:
    """The project-built task (``kind``) with this label, from ``eval.icl_tasks`` or any suite.

    Raises:
        ConfigError: none has this label, or two suites define it differently (they share one file).
    """
    e = config.get("eval") or {}
    found: dict[str, Mapping] = {}
    lists = {"eval.icl_tasks": e.get("icl_tasks") or []}
    lists.update({f"eval.suites.{n}.icl_tasks": (s or {}).get("icl_tasks") or []
                  for n, s in (e.get("suites") or {}).items()})
    for where, tasks in lists.items():
        for t in tasks:
            if isinstance(t, Mapping) and t.get("label") == label and data_source(t) == "built":
                found[where] = t
    if not found:
        raise ConfigError(f"no ICL task built by the project has the label {label!r}. Fix: add it (with `kind`) to "
                          f"eval.icl_tasks or a suite.")
    first = next(iter(found.values()))
    for where, t in found.items():
        if dict(t) != dict(first):
            raise ConfigError(f"the built task {label!r} differs between {' and '.join(found)}; both would write "
                              f"results/data/<corpus>/icl/{label}.jsonl. Fix: give one another label.")
    return dict(first)


# ------------------------------------------------------------------------------------------- checks (dry run)

def check_suite(config: Mapping, run: str) -> tuple[str, dict]:
    """Check the suite of a run before anything runs; return :func:`run_suite`.

    Checks: the suite exists; labels are unique; each task is either built (``kind``) or has a ``dataset_uri``;
    no remote URI (evaluation never uses the network); keys fit the task's type; a local file exists and has
    items; ``num_fewshot`` leaves at least one other item (built tasks: ``num_items``; local files: their items);
    ``subset_items`` is at most the items of a local file; gauntlet benchmarks name a task and shot count of the
    suite with a baseline in [0, 1); every answer leaves room for context in the run's context
    (:func:`check_answers_fit`, for the task files and the tokenizer already on disk).

    Raises:
        ConfigError: naming the setting's path and the fix.
    """
    name, s = run_suite(config, run)
    where = s["where"]
    seen: dict[str, int] = {}
    shots: dict[str, set[int]] = {}
    if name == DEFAULT_SUITE and (config.get("eval") or {}).get("suites", {}).get(DEFAULT_SUITE):
        raise ConfigError(f"eval.suites.{DEFAULT_SUITE}: the name {DEFAULT_SUITE!r} means eval.icl_tasks. Fix: "
                          f"rename that suite.")
    for i, t in enumerate(s["icl_tasks"]):
        at = f"{where}[{i}]"
        label = t["label"]
        if label in seen:
            raise ConfigError(f"{where}[{seen[label]}] and {at} have the same label {label!r} (each is a key of "
                              f"eval.json). Fix: give {at}.label another name.")
        seen[label] = i
        if label == "eval":
            raise ConfigError(f"{at}.label is 'eval', llm-foundry's name for the held-out loader. Fix: rename it.")
        check_task(t, at, known_items(config, t, name) if data_source(t) == "foundry" else None)
        shots[label] = {int(n) for n in t.get("num_fewshot", [0])}
    g = s.get("eval_gauntlet")
    for c, cat in enumerate((g or {}).get("categories") or []):
        for b, bench in enumerate(cat.get("benchmarks") or []):
            at = f"{where[:-len('icl_tasks')]}eval_gauntlet.categories[{c}].benchmarks[{b}]"
            if int(bench["num_fewshot"]) not in shots.get(bench["name"], set()):
                raise ConfigError(f"{at} is {bench['name']} at {bench['num_fewshot']} shots, which no task of "
                                  f"{where} scores. Fix: add that task (or shot count), or drop the benchmark.")
            if not 0 <= float(bench["random_baseline"]) < 1:
                raise ConfigError(f"{at}.random_baseline is {bench['random_baseline']}; it must be in [0, 1) "
                                  f"(chance accuracy). Fix: e.g. 0.25 for 4 choices, 0 for free answers.")
    averages = (g or {}).get("averages") or {}
    core = averages.get("core_average") if isinstance(averages, Mapping) else None
    known = {c.get("name") for c in (g or {}).get("categories") or []}
    unknown = [c for c in core or [] if c not in known]
    if unknown:
        raise ConfigError(f"{where[:-len('icl_tasks')]}eval_gauntlet.averages.core_average names {unknown}, which "
                          f"no category of the gauntlet is (categories: {sorted(known)}); the average would cover "
                          f"a silent subset. Fix: name existing categories.")
    check_answers_fit(config, run, name, s)
    return name, s


def file_on_disk(config: Mapping, task: Mapping, suite_name_: str, corpus: str) -> str | None:
    """The file a task will be scored on when the dry run can read it now: a local file, a built task's file once
    built, a standard file in the local mirror (``eval.task_data.source: local``) or fetched earlier; else None."""
    src = data_source(task)
    uri = str(task.get("dataset_uri") or "")
    td = (config.get("eval") or {}).get("task_data") or {}
    if src == "foundry" and td.get("source") == "local" and td.get("local_dir"):
        path = os.path.join(td["local_dir"], uri)
    else:
        path = task_path(task, results_dir=str(config["results_dir"]), corpus=corpus,
                         suite=suite_name_)
    return path if os.path.isfile(path) else None


def foundry_task(task: Mapping) -> dict:
    """A task's llm-foundry keys (:data:`TASK_KEYS`; a built task gets its kind's type and delimiters)."""
    out = {k: v for k, v in task.items() if k in TASK_KEYS}
    if data_source(task) == "built":
        out.update(BUILT_KINDS[task["kind"]])
    return out


def check_answers_fit(config: Mapping, run: str, suite_name_: str, s: Mapping) -> None:
    """Refuse a task that cannot be scored in the run's context: an item whose answer leaves no context token
    (:func:`llmpipe.evaluation.icl_tokens.context_fit`), counted with the run's prepared tokenizer
    (``<results_dir>/tokenizers/<data.tokenizer>``). Checks only what is on disk (:func:`file_on_disk`, the
    tokenizer folder's manifest); the evaluation job checks the rest and records such a task as not scored.

    Raises:
        ConfigError: naming the task's config path, the counts and the fix.
    """
    from llmpipe.config.runs import run_config

    data = run_config(config, run)["data"]  # type: ignore[arg-type]
    tok_dir = os.path.join(str(config["results_dir"]), "tokenizers", str(data["tokenizer"]))
    manifest = os.path.join(tok_dir, "manifest.json")
    if not os.path.isfile(manifest):
        return
    for i, t in enumerate(s["icl_tasks"]):
        path = file_on_disk(config, t, suite_name_, str(data["corpus"]))
        if path is None:
            continue
        task = foundry_task(t)
        seq = int(task.get("max_seq_len") or data["concat_tokens"])
        st, mt = os.stat(path), os.stat(manifest)
        try:
            fit = _answers_fit(path, st.st_mtime_ns, st.st_size, tok_dir, mt.st_mtime_ns,
                               json.dumps(task, sort_keys=True), seq, t.get("subset_items"))
        except ValueError as exc:
            raise ConfigError(f"{s['where']}[{i}] ({path}): {exc}") from None
        if fit["items_too_long"]:
            from llmpipe.evaluation.icl_tokens import too_long_reason

            setting = f"{s['where']}[{i}].max_seq_len" if task.get("max_seq_len") else f"data.concat_tokens of {run}"
            raise ConfigError(f"{s['where']}[{i}]: " + too_long_reason(t["label"], fit, setting))


@functools.lru_cache(maxsize=256)
def _answers_fit(path: str, mtime_ns: int, size: int, tok_dir: str, tok_mtime_ns: int, task_json: str, seq: int,
                 subset: int | None) -> dict:
    """:func:`llmpipe.evaluation.icl_tokens.context_fit` of a file's answers (cached per file, tokenizer, task and context:
    the DAG asks once per job)."""
    from llmpipe.evaluation import icl_tokens

    task = json.loads(task_json)
    items = icl_tokens.read_items(path)
    if subset is not None:
        items = items[:int(subset)]
    tokens = icl_tokens.item_tokens(task, items, icl_tokens.Encoder.from_folder(tok_dir), context=False)
    return icl_tokens.context_fit(task["icl_task_type"], tokens, seq)


def check_task_data(config: Mapping, files: list[str]) -> None:
    """Check ``eval.task_data`` for a suite that needs ``files`` (llm-foundry paths): a local source names an
    existing folder that holds them.

    Raises:
        ConfigError: naming the setting, the first missing file and the fix.
    """
    td = (config.get("eval") or {}).get("task_data") or {}
    if td.get("local_dir") and td.get("source") != "local" and files:
        raise ConfigError(f"eval.task_data.local_dir is set but eval.task_data.source is {td.get('source')!r}, so "
                          f"the files would be fetched from the network and the folder ignored. Fix: set "
                          f"eval.task_data.source: local (or drop local_dir).")
    if td.get("source") != "local" or not files:
        return
    root = td.get("local_dir")
    if not root or not os.path.isdir(root):
        raise ConfigError(f"eval.task_data.local_dir is {root!r}, not a folder; with source: local it must hold "
                          f"llm-foundry's scripts/ layout ({FOUNDRY_PREFIX}<category>/<file>.jsonl). Fix: set it "
                          f"(docs/evaluation.md, Evaluation: standard benchmarks) or use source: github.")
    missing = [f for f in files if not os.path.isfile(os.path.join(root, f))]
    if missing:
        raise ConfigError(f"eval.task_data.local_dir {root!r} lacks {len(missing)} of the suite's files, e.g. "
                          f"{missing[0]}. Fix: mirror llm-foundry's scripts/eval/local_data there (docs/evaluation.md).")


def check_task(t: Mapping, at: str, foundry_items: int | None = None) -> None:
    """The checks of :func:`check_suite` on one task at config path ``at``; ``foundry_items``: the items of a
    standard file when known (:func:`known_items`)."""
    src = data_source(t)
    if t.get("kind") and t.get("dataset_uri"):
        raise ConfigError(f"{at} sets both kind (a task the project builds) and dataset_uri. Fix: keep one.")
    if not t.get("kind") and not t.get("dataset_uri"):
        raise ConfigError(f"{at} ({t['label']}) has no data: set dataset_uri (e.g. eval/local_data/"
                          f"commonsense_reasoning/piqa.jsonl, or a local .jsonl) or kind: cloze | cloze_choice.")
    ttype = BUILT_KINDS[t["kind"]]["icl_task_type"] if src == "built" else t.get("icl_task_type")
    if ttype not in TYPE_KEYS:
        raise ConfigError(f"{at}.icl_task_type is {ttype!r}; it must be one of {', '.join(TYPE_KEYS)} (the types "
                          f"llm-foundry 0.22 scores). Fix: set it.")
    allowed = set(COMMON_KEYS) | set(TYPE_KEYS[ttype]) | set(OWN_KEYS)
    for key in t:
        if key not in allowed:
            raise ConfigError(f"{at}.{key} is not taken by a {ttype} task (llm-foundry would refuse it). Fix: drop "
                              f"it; a {ttype} task takes {', '.join(sorted(set(TYPE_KEYS[ttype])))} besides the "
                              f"common keys.")
    if src != "built" and any(k in t for k in ("num_items", "seed", "kind")):
        raise ConfigError(f"{at}: num_items and seed are settings of a task the project builds (kind). Fix: use "
                          f"subset_items to score part of a file.")
    uri = str(t.get("dataset_uri") or "")
    if uri.startswith(_REMOTE):
        raise ConfigError(f"{at}.dataset_uri is {uri!r}: evaluation reads local files only (compute nodes are often "
                          f"offline). Fix: use llm-foundry's eval/local_data/<category>/<file>.jsonl (fetched by "
                          f"the eval_task_data step) or a local .jsonl file.")
    fewshot = [int(n) for n in t.get("num_fewshot", [0])]
    if not fewshot:
        raise ConfigError(f"{at}.num_fewshot is empty. Fix: list the shot counts, e.g. [0].")
    items = foundry_items if src == "foundry" else None
    if src == "built":
        items = int(t.get("num_items", 200))
    elif src == "local":
        if not os.path.isfile(uri):
            raise ConfigError(f"{at}.dataset_uri {uri!r} is not a file. Fix: give the path of a jsonl task file.")
        items = count_items(uri)
        if items == 0:
            raise ConfigError(f"{at}.dataset_uri {uri!r} has no items; its accuracy would be undefined. Fix: use a "
                              f"file with items.")
    sub = t.get("subset_items")
    if sub is not None and items is not None and int(sub) > items:
        raise ConfigError(f"{at}.subset_items is {sub} but the task has {items} items. Fix: lower it or drop it.")
    n = min(items, int(sub)) if sub is not None and items is not None else (int(sub) if sub is not None else items)
    if n is not None and max(fewshot) > n - 1:
        raise ConfigError(f"{at}.num_fewshot has {max(fewshot)} shots but the task has {n} items, so at most "
                          f"{n - 1} other items can be shown (llm-foundry would silently show fewer). Fix: lower "
                          f"num_fewshot or use more items.")


# ------------------------------------------------------------------------------------------- llm-foundry task list

def foundry_tasks(tasks: list[Mapping], paths: Mapping[str, str], scratch: str) -> tuple[list[dict], dict]:
    """llm-foundry's ``icl_tasks`` for a suite, each scored on every item (or its ``subset_items``).

    Args:
        tasks: the suite's tasks (config form).
        paths: label -> the local jsonl file to score.
        scratch: a folder for subset files (the first ``subset_items`` items of a file).

    Returns:
        (the task list for ``llmfoundry.command_utils.evaluate``, label -> ``{"items", "items_in_file",
        "subset", "file", "icl_task_type"}``).

    Raises:
        ValueError: a file has no items, fewer items than ``subset_items``, or too few for ``num_fewshot``.
    """
    out, info = [], {}
    for t in tasks:
        label = t["label"]
        path = os.path.abspath(paths[label])
        total = count_items(path)
        sub = t.get("subset_items")
        n = total if sub is None else int(sub)
        if total == 0 or n > total:
            raise ValueError(f"ICL task {label}: {path} has {total} items"
                             + (f", fewer than subset_items {sub}" if sub is not None else "")
                             + ". Fix: rebuild or re-fetch the file, or lower subset_items.")
        if sub is not None and n < total:
            os.makedirs(scratch, exist_ok=True)
            sub_path = os.path.join(scratch, f"{label}-first{n}.jsonl")
            with open(path, encoding="utf-8") as src, open(sub_path, "w", encoding="utf-8") as dst:
                kept = 0
                for line in src:
                    if line.strip() and kept < n:
                        dst.write(line if line.endswith("\n") else line + "\n")
                        kept += 1
            path = sub_path
        fewshot = [int(k) for k in t.get("num_fewshot", [0])]
        if max(fewshot) > n - 1:
            raise ValueError(f"ICL task {label}: {max(fewshot)} shots need {max(fewshot) + 1} items, the file has "
                             f"{n}. Fix: lower num_fewshot.")
        task = foundry_task(t)
        task.update(dataset_uri=path, num_fewshot=fewshot)
        out.append(task)
        info[label] = {"items": n, "items_in_file": total, "subset": n < total, "file": os.path.abspath(paths[label]),
                       "icl_task_type": task["icl_task_type"]}
    return out, info


# ------------------------------------------------------------------------------------------- scores

def task_scores(eval_metrics: Mapping, info: Mapping[str, Mapping]) -> dict:
    """Accuracy and items scored per task and shot count, from the trainer's ``state.eval_metrics``.

    ``eval_metrics`` maps an evaluator label (``<task>/<k>-shot``, or ``<task>/<k>-shot/<category>`` for tasks
    with ``has_categories``) to its metrics (llm-foundry's ``InContextLearning*Accuracy``, whose ``correct`` and
    ``total`` states count the items). A task with categories scores the mean of its categories' accuracies (as
    llm-foundry's eval gauntlet does) over the sum of their items.

    Returns:
        ``{task: {"<k>-shot": {"accuracy", "items", "correct", "metric", "categories"?}}}``.

    Raises:
        ValueError: a task and shot count saw no item, or scored another number of items than its file holds
            (naming both counts), so no accuracy is NaN and none is over part of a task unknowingly.
    """
    parts: dict[tuple[str, str], list[tuple[str | None, str, float, float]]] = {}
    for label, mets in eval_metrics.items():
        bits = label.split("/")
        if len(bits) < 2 or bits[0] not in info:
            continue
        name = next((k for k in mets if "Accuracy" in k), None)
        if name is None:
            continue
        correct, total = metric_states(mets[name], "correct", "total")
        parts.setdefault((bits[0], bits[1]), []).append((bits[2] if len(bits) > 2 else None, name, correct, total))
    out: dict[str, dict] = {}
    for (task, shots), rows in sorted(parts.items()):
        items = int(round(sum(r[3] for r in rows)))
        want = int(info[task]["items"])
        if items == 0 or any(r[3] == 0 for r in rows):
            raise ValueError(f"ICL task {task} ({shots}) scored no item: its accuracy would be NaN. Fix: check its "
                             f"file {info[task]['file']}.")
        if items != want:
            raise ValueError(f"ICL task {task} ({shots}) scored {items} items but its data has {want}; every item "
                             f"must count. Fix: report this (a batch was dropped or repeated).")
        rec = {"accuracy": sum(r[2] / r[3] for r in rows) / len(rows), "items": items,
               "correct": int(round(sum(r[2] for r in rows))), "metric": rows[0][1]}
        if rows[0][0] is not None:
            rec["categories"] = {r[0]: {"accuracy": r[2] / r[3], "items": int(round(r[3]))} for r in rows}
        out.setdefault(task, {})[shots] = rec
    missing = [t for t in info if t not in out]
    if missing:
        raise ValueError(f"ICL tasks {', '.join(missing)} have no score: llm-foundry ran no evaluator for them.")
    return out


def metric_states(metric, *names: str) -> tuple[float, ...]:
    """The states ``names`` of a torchmetrics metric summed over every process (as ``compute()`` sees them; a
    collective when torch.distributed is initialized, so every rank calls it in the same order)."""
    sync = getattr(metric, "sync_context", None)
    if sync is None:
        return tuple(float(getattr(metric, n)) for n in names)
    with sync(should_sync=True, should_unsync=True):
        return tuple(float(getattr(metric, n)) for n in names)


def gauntlet_average(scores: Mapping[str, Mapping[str, Mapping]], gauntlet: Mapping | None) -> dict | None:
    """The eval-gauntlet average of the task scores, as llm-foundry's eval gauntlet computes it.

    Source: llm-foundry's ``EvalGauntlet`` callback (llmfoundry/callbacks/eval_gauntlet_callback.py, equal
    weighting, ``subtract_random_baseline`` and ``rescale_accuracy`` on) and its scripts/eval/local_data/
    EVAL_GAUNTLET.md. Each benchmark (task at one shot count) scores ``(accuracy - b) / (1 - b)`` with ``b`` its
    random baseline (0 at chance, 1 when every item is right, below 0 under chance); a category scores the mean of
    its benchmarks; the average is the mean of the categories (``core_average`` over the categories listed in
    ``averages`` when given, else over all of them). A category with a benchmark that has no score is left out,
    and listed in ``categories_left_out``; the benchmarks without a score are listed in ``missing`` and
    ``partial`` is then true (the average covers part of the gauntlet).

    Returns:
        ``{"average", "over", "categories": {name: score}, "benchmarks": {"<task>/<k>-shot": score},
        "categories_left_out", "partial", "missing": ["<task>/<k>-shot", ...], "source"}``, or None without a
        gauntlet.
    """
    if not gauntlet or not gauntlet.get("categories"):
        return None
    cats, bench, left_out, missing = {}, {}, [], []
    for cat in gauntlet["categories"]:
        vals, complete = [], True
        for b in cat.get("benchmarks") or []:
            key = f"{b['name']}/{int(b['num_fewshot'])}-shot"
            rec = (scores.get(b["name"]) or {}).get(f"{int(b['num_fewshot'])}-shot")
            if rec is None:
                missing.append(key)
                complete = False
                continue
            base = float(b["random_baseline"])
            bench[key] = (float(rec["accuracy"]) - base) / (1.0 - base)
            vals.append(bench[key])
        if vals and complete:
            cats[cat["name"]] = sum(vals) / len(vals)
        else:
            left_out.append(cat["name"])
    averages = gauntlet.get("averages") or {}
    core = averages.get("core_average") if isinstance(averages, Mapping) else None
    used = [c for c in (core or cats) if c in cats]
    return {"average": sum(cats[c] for c in used) / len(used) if used else None, "over": used, "categories": cats,
            "benchmarks": bench, "categories_left_out": left_out, "partial": bool(missing), "missing": missing,
            "source": "llm-foundry eval gauntlet (EQUAL weighting, random baseline subtracted and rescaled)"}


def suite_identity(config: Mapping, run: str) -> dict:
    """What of a run's suite determines its eval.json: its name, tasks and gauntlet (as JSON-safe dicts)."""
    name, s = run_suite(config, run)
    return {"suite": name, "icl_tasks": json.loads(json.dumps(s["icl_tasks"])),
            "eval_gauntlet": json.loads(json.dumps(s["eval_gauntlet"]))}


# ------------------------------------------------------------------------------------------- held-out batches

#: llm-foundry callback name of :func:`register_heldout_cap`'s callback.
HELDOUT_CAP = "llmpipe_heldout_batches"


def register_heldout_cap() -> str:
    """Register (once) a composer callback that caps only the held-out loader; return its registry name.

    llm-foundry 0.22's ``evaluate`` hands ``eval_subset_num_batches`` to ``Trainer.eval``, which applies it to every
    evaluator, the ICL tasks included: their accuracy would then cover part of each task, a part that changes with
    the batch size. Evaluation passes ``eval_subset_num_batches: -1`` instead and this callback sets
    ``State.dataloader_len`` at ``EVAL_START`` of the held-out loader (label ``eval`` or ``eval/<name>``) to
    ``batches`` (-1: every batch), so the ICL evaluators run over all their batches.
    """
    from composer.core import Callback
    from llmfoundry.registry import callbacks

    class HeldoutBatches(Callback):
        """At most ``batches`` batches of the held-out loader (``-1``: all); other evaluators untouched."""

        def __init__(self, batches: int = -1):
            self.batches = int(batches)

        def eval_start(self, state, logger) -> None:  # noqa: ARG002 - composer's callback signature
            label = state.dataloader_label or ""
            if self.batches > 0 and (label == "eval" or label.startswith("eval/")):
                state.dataloader_len = self.batches

    if HELDOUT_CAP not in callbacks.get_all():
        callbacks.register(HELDOUT_CAP, func=HeldoutBatches)
    return HELDOUT_CAP
