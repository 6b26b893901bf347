"""The package layering that docs/architecture.md states: imports point down its list of layers,
never up, and no two packages import each other. Every import in `flashtree/` (inside functions
and under TYPE_CHECKING too) is read with `ast`."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "flashtree"
# The line of docs/architecture.md that orders the layers, top to bottom.
LAYERS_LINE = re.compile(r"^Layers, top to bottom: ([^.]+)\.", re.MULTILINE)


def documented_layers() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    found = LAYERS_LINE.search(text)
    assert found, "docs/architecture.md lost its 'Layers, top to bottom: ...' line"
    return [name.strip(" `/") for name in found.group(1).split(",")]


def unit_of(module: str) -> str | None:
    """The first-level name under flashtree (`speculative` for flashtree.speculative.tree)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "flashtree" else None


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imported_modules(path: Path) -> set[str]:
    """Absolute names of every flashtree module `path` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return {n for n in names if n.startswith("flashtree.")}


def unit_imports() -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) -> the files where it happens."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        src = unit_of(module_name(path))
        for name in imported_modules(path):
            dst = unit_of(name)
            if src and dst and src != dst:
                edges.setdefault((src, dst), []).append(str(path.relative_to(ROOT)))
    return edges


def test_no_package_imports_a_higher_layer():
    layers = documented_layers()
    rank = {name: i for i, name in enumerate(layers)}
    upward = [f"{src} -> {dst} ({', '.join(sorted(set(files)))})"
              for (src, dst), files in unit_imports().items()
              if src in rank and dst in rank and rank[dst] < rank[src]]
    assert not upward, "imports up the layering of docs/architecture.md:\n" + "\n".join(upward)


def test_no_two_packages_import_each_other():
    edges = unit_imports()
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    cycles = sorted(f"{a} <-> {b}" for a, b in edges
                    if a < b and (b, a) in edges and {a, b} <= packages)
    assert not cycles, "packages importing each other:\n" + "\n".join(cycles)


@pytest.mark.parametrize("source, expected", [
    ("from flashtree.runner.model_runner import ModelRunner", {"flashtree.runner.model_runner",
                                                                "flashtree.runner.model_runner."
                                                                "ModelRunner"}),
    ("from ..kv import cache", {"flashtree.kv", "flashtree.kv.cache"}),
    ("def f():\n    import flashtree.graphs.runner", {"flashtree.graphs.runner"}),
])
def test_imports_are_read_from_every_form(tmp_path, monkeypatch, source, expected):
    """The reader sees absolute, relative and function-level imports (a file placed as
    flashtree/speculative/x.py)."""
    fake_root = tmp_path
    target = fake_root / "flashtree" / "speculative" / "x.py"
    target.parent.mkdir(parents=True)
    target.write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake_root)
    assert imported_modules(target) == expected


def module_imports() -> dict[str, set[str]]:
    """Module -> the flashtree modules (files, packages' __init__ left out) it imports."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = {m for m, p in files.items() if p.name != "__init__.py"}
    graph = {}
    for name in modules:
        found = imported_modules(files[name])
        graph[name] = {n for n in found if n in modules} | {
            n.rsplit(".", 1)[0] for n in found if n.rsplit(".", 1)[0] in modules} - {name}
    return graph


def test_no_module_import_cycles():
    """No cycle among modules either (two modules importing each other's types, say)."""
    graph = module_imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[str] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [node, nxt]))
            elif nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("package", ["engine", "speculative", "runner", "graphs"])
def test_functions_of_the_step_fit_a_screen(package):
    """No function of the step's packages runs over 60 lines (split it where it does)."""
    long = []
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > 60:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines}")
    assert not long, "functions over 60 lines:\n" + "\n".join(long)
