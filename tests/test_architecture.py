"""The package's shape, as README "Layout" describes it: no import cycles inside llmpipe/ (function-level imports
included), no private name of one module used by another, no module over MAX_LINES lines, and library code that
never imports Snakemake."""

from __future__ import annotations

import ast
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


def test_library_code_never_imports_snakemake():
    bad = [f"{p.relative_to(REPO)}:{node.lineno}" for p in modules().values()
           for node in ast.walk(ast.parse(p.read_text()))
           if isinstance(node, (ast.Import, ast.ImportFrom))
           and any((getattr(node, "module", None) or a.name).split(".")[0] == "snakemake" for a in node.names)]
    assert not bad, f"llmpipe imports snakemake at {bad}"


#: Library modules (data, model, training, export, evaluation, generation): they take a run's merged settings
#: (``rc``) and the other values they need as arguments; only ``llmpipe/steps/`` reads the workflow config.
LIBRARY_MODULES = ("train.py", "finetune.py", "convert.py", "evaluate.py", "generate.py", "data")


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
