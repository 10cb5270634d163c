"""The package's shape, as README "Layout" describes it: no import cycles inside llmpipe/ (function-level imports
included), no private name of one module used by another, no module over MAX_LINES lines, no module name twice, one
home for each error type, every module listed in README "Layout", typed settings without ``.get`` fallbacks, and
library code that never imports Snakemake."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "llmpipe"
#: Longest module (lines) before it should be split by concern.
MAX_LINES = 700


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path, known: set[str]) -> list[tuple[str, str | None, int]]:
    """(imported llmpipe module, imported name or None, line) for every import in ``path``, at any depth."""
    out = []
    pkg = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "llmpipe"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "llmpipe":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub, None, node.lineno) if sub in known else (base, a.name, node.lineno))
    return out


def test_no_import_cycles_inside_the_package():
    mods = modules()
    graph = {m: {i for i, _, _ in imports(p, set(mods)) if i in mods and i != m} for m, p in mods.items()}
    # a package's __init__ importing its own submodules is not a cycle through them
    for m in graph:
        graph[m] = {i for i in graph[m] if not i.startswith(m + ".")}
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_private_names_used_across_modules():
    mods = modules()
    bad = []
    for m, p in mods.items():
        tree = ast.parse(p.read_text())
        for target, name, line in imports(p, set(mods)):
            if name and name.startswith("_") and target != m:
                bad.append(f"{p.relative_to(REPO)}:{line} imports {target}.{name}")
        aliases = {a.asname or a.name.split(".")[-1]: f"{node.module}.{a.name}" if isinstance(node, ast.ImportFrom)
                   else a.name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                   for a in node.names}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and aliases.get(node.value.id, "") in mods
                    and aliases[node.value.id] != m):
                bad.append(f"{p.relative_to(REPO)}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert not bad, "\n".join(bad)


def test_no_module_over_max_lines():
    long = {m: n for m, p in modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_no_module_name_twice():
    """Each module and subpackage name occurs once in the package (``llmpipe.steps.training`` beside
    ``llmpipe.train.pretrain``, never two ``train`` modules), so a name in a traceback or a log finds one file."""
    names = [p.stem for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"]
    names += [p.name for p in PACKAGE.rglob("*") if p.is_dir() and (p / "__init__.py").exists()]
    twice = sorted({n for n in names if names.count(n) > 1})
    assert not twice, f"module or subpackage names used twice in llmpipe/: {twice}"


def test_readme_layout_lists_every_module_once():
    """README "Layout" names each module of llmpipe/ on a line of its own, under its subpackage."""
    import re

    block = (REPO / "README.md").read_text().split("\nllmpipe/ ", 1)[1].split("\nscripts/ ", 1)[0]
    listed, pkg = [], ""
    for line in block.splitlines():
        if m := re.match(r"^  (\w+)/", line):
            pkg = m.group(1) + "/"
        elif m := re.match(r"^  (\w+\.py) ", line):
            listed.append(m.group(1))
        elif m := re.match(r"^    (\w+\.py) ", line):
            listed.append(pkg + m.group(1))
    files = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                   if p.name != "__init__.py" or p.parent == PACKAGE)
    assert sorted(listed) == files, (sorted(set(files) - set(listed)), sorted(set(listed) - set(files)))


#: Files outside llmpipe/ that import the package's error types.
IMPORTERS = ("rules", "scripts", "tools", "tests", "Snakefile")


def error_homes() -> dict[str, str]:
    """Exception classes defined in llmpipe/ -> the module that defines them (classes whose bases end in Error,
    Exception, Failed or Refused, or are another such class of the package)."""
    homes: dict[str, str] = {}
    for _ in range(3):   # a class derived from one of the package's own errors, defined in another module
        for mod, path in modules().items():
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and any(
                        (b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "")).endswith(
                            ("Error", "Exception", "Failed", "Refused")) or getattr(b, "id", "") in homes
                        for b in node.bases):
                    homes[node.name] = mod
    return homes


def test_each_error_type_has_one_home():
    """Every import of one of the package's exception classes names the module that defines it (no re-export), and
    no module reaches one through another module's namespace (``cfg.ConfigError``)."""
    homes = error_homes()
    assert {"ConfigError", "StepFailed", "DataError", "TaskDataError", "LeaseHeld"} <= set(homes), homes
    files = [*PACKAGE.rglob("*.py")]
    for name in IMPORTERS:
        path = REPO / name
        files += sorted(p for p in path.rglob("*") if p.suffix in (".py", ".smk")) if path.is_dir() else [path]
    wrong = []
    for path in files:
        text = path.read_text()
        try:
            tree = ast.parse(text)
        except SyntaxError:   # a .smk file: its Python import lines only
            tree = ast.parse("\n".join(line for line in text.splitlines() if line.startswith(("from ", "import "))))
        aliases = {}   # local name -> the llmpipe module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("llmpipe"):
                wrong += [f"{path.relative_to(REPO)}:{node.lineno} imports {a.name} from {node.module}"
                          for a in node.names if a.name in homes and homes[a.name] != node.module]
                aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
            elif isinstance(node, ast.Import):
                aliases.update({a.asname: a.name for a in node.names if a.asname and a.name.startswith("llmpipe")})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr in homes and isinstance(node.value, ast.Name)
                    and aliases.get(node.value.id, homes[node.attr]) != homes[node.attr]):
                wrong += [f"{path.relative_to(REPO)}:{node.lineno} uses {node.attr} through "
                          f"{aliases[node.value.id]} ({node.value.id}.{node.attr})"]
    assert not wrong, "\n".join(wrong)


def test_library_code_never_imports_snakemake():
    bad = [f"{p.relative_to(REPO)}:{node.lineno}" for p in modules().values()
           for node in ast.walk(ast.parse(p.read_text()))
           if isinstance(node, (ast.Import, ast.ImportFrom))
           and any((getattr(node, "module", None) or a.name).split(".")[0] == "snakemake" for a in node.names)]
    assert not bad, f"llmpipe imports snakemake at {bad}"


#: Library modules (data, model, training, export, evaluation, generation): they take a run's typed settings
#: (training and export: :class:`llmpipe.config.settings.RunSettings`) and the other values they need as arguments; only
#: ``llmpipe/steps/`` reads the workflow config.
LIBRARY_MODULES = ("train/pretrain.py", "train/finetune.py", "hf/export.py", "evaluation/icl_eval.py",
                   "evaluation/generation.py", "data")


def library_files() -> list[Path]:
    out = []
    for name in LIBRARY_MODULES:
        path = PACKAGE / name
        out += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return out


def test_library_functions_do_not_take_the_workflow_config():
    files = library_files()
    assert len(files) >= 6 and all(p.exists() for p in files)
    bad = []
    for p in files:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
                if "config" in names:
                    bad.append(f"{p.relative_to(REPO)}:{node.lineno} {getattr(node, 'name', 'lambda')}(config, ...)")
    assert not bad, ("library functions take the whole workflow config; pass the run's merged settings (rc) and "
                     "the values they need instead (built in llmpipe/steps/):\n" + "\n".join(bad))


# ------------------------------------------------------------------------------------------- typed settings

def test_training_export_and_step_work_take_the_typed_settings():
    """Training, finetuning and conversion, and the training steps' work, take a run's typed settings
    (:class:`llmpipe.config.settings.RunSettings`, built once by :func:`llmpipe.config.runs.run_settings`): a parameter annotated
    with that class, and none named ``rc`` / ``run_cfg`` or a ``config`` / ``settings`` annotated as a dict."""
    import typing

    from llmpipe.hf import export as convert
    from llmpipe.train import finetune, throughput, pretrain as train
    from llmpipe.config.settings import RunSettings
    from llmpipe.steps import training as train_step

    takers = [train.TrainTask.__init__, finetune.FinetuneTask.__init__, train.foundry_train_config, train.uses_fsdp,
              train.summarize, finetune.foundry_finetune_config, finetune.finetuning_loader,
              finetune.build_dataloader, finetune.require_peft, finetune.base_model_path, convert.mpt_config_dict,
              convert.build_hf_model, convert.convert_checkpoint, throughput.monitor_args,
              train_step.training_task, train_step.finished_training, train_step.check_all_steps,
              train_step.check_vocab_fits]
    bad = []
    for fn in takers:
        hints = typing.get_type_hints(fn)
        params = [p for p in inspect.signature(fn).parameters if p != "self"]
        if not any(hints.get(p) is RunSettings for p in params):
            bad.append(f"{fn.__qualname__}: no parameter annotated RunSettings")
        for p in params:
            if p in ("rc", "run_cfg") or p in ("config", "settings") and typing.get_origin(hints.get(p)) is None \
                    and hints.get(p) in (dict, typing.Mapping):
                if not (p == "config" and fn.__module__.startswith("llmpipe.steps.")):  # a step's workflow config
                    bad.append(f"{fn.__qualname__}: parameter {p} takes a dict")
    assert not bad, "\n".join(bad)


def test_export_generation_and_evaluation_take_their_typed_settings():
    """Export, generation and evaluation (and a finetune's evaluation) take the typed settings of their stage
    (:mod:`llmpipe.config.stage_settings`) and, where they need the run's, :class:`llmpipe.config.settings.RunSettings`: one
    parameter annotated with each class, none annotated as a dict or Mapping; the steps build them with one
    constructor each (annotated to return the class)."""
    import typing

    from llmpipe.config import runs as config
    from llmpipe.hf import export as convert
    from llmpipe.evaluation import icl_eval as evaluate, generation as generate
    from llmpipe.train import finetune
    from llmpipe.config.settings import RunSettings
    from llmpipe.config.stage_settings import ConvertSettings, EvalSettings, GenerateSettings
    from llmpipe.steps import generate as generate_step

    takers = {convert.convert_checkpoint: (RunSettings, ConvertSettings), generate.generate: (GenerateSettings,),
              evaluate.evaluate: (RunSettings, EvalSettings), finetune.evaluate_finetune: (RunSettings, EvalSettings)}
    bad = []
    for fn, classes in takers.items():
        hints = typing.get_type_hints(fn)
        params = [p for p in inspect.signature(fn).parameters if p != "self"]
        for cls in classes:
            if not any(hints.get(p) is cls for p in params):
                bad.append(f"{fn.__qualname__}: no parameter annotated {cls.__name__}")
        for p in params:
            if p in ("rc", "run_cfg", "gen_cfg", "ecfg") or hints.get(p) in (dict, typing.Mapping) and p in (
                    "settings", "eval_settings", "export_settings"):
                bad.append(f"{fn.__qualname__}: parameter {p} takes a dict")
    builders = {config.run_settings: RunSettings, generate_step.run_generate_settings: GenerateSettings,
                EvalSettings.from_section: EvalSettings, ConvertSettings.from_section: ConvertSettings,
                GenerateSettings.from_section: GenerateSettings}
    bad += [f"{fn.__qualname__} does not return {cls.__name__}" for fn, cls in builders.items()
            if typing.get_type_hints(fn).get("return") is not cls]
    assert not bad, "\n".join(bad)


#: Receivers whose ``.get(<literal key>, <default>)`` is a settings fallback: these names (a run's settings and
#: their sections, the workflow config and its sections) and attributes of them (``self.rc``, ``ctx.config``),
#: items of them (``rc["train"]``) and ``(<one of them>.get(...) or {})``.
SETTINGS_NAMES = frozenset({"rc", "train", "arch", "data", "opt", "sched", "settings", "cfg", "run_cfg", "config",
                            "ecfg", "gen_cfg", "eval_settings"})
#: ``.get`` calls with a default on values of those names that are not our settings: (file, key) -> why.
NOT_SETTINGS = {
    ("llmpipe/model/attention.py", "attn_type"): "llm-foundry's MPT attn_config as MPT reads it (MPT's own default)",
    ("llmpipe/hf/export.py", "attn_type"): "the exported Hugging Face model's config (MPT's own default)",
    ("llmpipe/report/chain_summary.py", "steps"): "a train.json record (a job's result), shown as '?' when absent",
    ("llmpipe/model/mfu.py", "learned_pos_emb"): "an MPT config mapping (MPTConfig's default), also a hub model's",
    ("llmpipe/model/mfu.py", "tie_word_embeddings"): "an MPT config mapping (MPTConfig's default), also a hub model's",
}
#: Fallbacks not yet moved to typed settings (remaining work; none may be added): (file, key).
NOT_YET_TYPED = frozenset({
    ("llmpipe/train/lora.py", "expansion_ratio"), ("llmpipe/model/mfu.py", "expansion_ratio"), ("llmpipe/model/mfu.py", "no_bias"),
})


def settings_receiver(node: ast.AST) -> bool:
    """Whether ``node`` (the receiver of a ``.get``) is settings by :data:`SETTINGS_NAMES`."""
    if isinstance(node, ast.Name):
        return node.id in SETTINGS_NAMES
    if isinstance(node, ast.Attribute):
        return node.attr in SETTINGS_NAMES or settings_receiver(node.value)
    if isinstance(node, ast.Subscript):
        return settings_receiver(node.value)
    if isinstance(node, ast.BoolOp):
        return settings_receiver(node.values[0])
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return settings_receiver(node.func.value)
    return False


def settings_fallbacks(path: Path) -> list[tuple[str, int]]:
    """(key, line) of every ``<settings>.get("<key>", <default>)`` in ``path``: a default other than None or an
    empty ``{}`` / ``[]`` / ``()`` (an absent section or list read as empty is no value of its own)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and len(node.args) == 2 and isinstance(node.args[0], ast.Constant)):
            continue
        default = node.args[1]
        if isinstance(default, ast.Constant) and default.value is None or \
                isinstance(default, (ast.Dict, ast.List, ast.Tuple)) and not ast.unparse(default)[1:-1].strip():
            continue
        if settings_receiver(node.func.value):
            out.append((str(node.args[0].value), node.lineno))
    return out


def test_no_settings_get_fallbacks():
    """A setting's default lives once, in schemas/config.schema.yaml or config/config.yaml; code reads the validated
    value (a typed field, or the key itself), never ``.get(key, <its own default>)``."""
    found = {(str(p.relative_to(REPO)), key): line for p in sorted(PACKAGE.rglob("*.py"))
             for key, line in settings_fallbacks(p)}
    bad = [f"{f}:{line} .get({key!r}, <default>)" for (f, key), line in sorted(found.items())
           if (f, key) not in NOT_SETTINGS and (f, key) not in NOT_YET_TYPED]
    assert not bad, "settings read with a code default (read the typed settings instead):\n" + "\n".join(bad)
    gone = sorted(k for k in NOT_YET_TYPED if k not in found)
    assert not gone, f"fixed: remove from NOT_YET_TYPED: {gone}"


def test_settings_fallback_scan_finds_one():
    tree = "def f(rc, ctx):\n    a = rc['train'].get('attn_impl', 'torch')\n    b = ctx.config.get('x', 1)\n" \
           "    c = (config.get('d') or {}).get('e', 2)\n    d = rc.get('lora')\n    e = job.get('steps', 0)\n" \
           "    f = config.get('models', {})\n"
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".py") as fh:
        fh.write(tree)
        fh.flush()
        assert settings_fallbacks(Path(fh.name)) == [("attn_impl", 2), ("x", 3), ("e", 4)]
