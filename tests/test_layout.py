"""The package's shape: no import circles (an import inside a function counts), and every module in the layout."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "paddle_mnist"


def imports_of(path: Path) -> set[str]:
    """The package's modules that a module imports, wherever the import statement stands."""
    found = set()
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:  # from .x import y
                found.add(node.module.split(".")[0])
            elif node.level == 1 or node.module == "paddle_mnist":  # from . import x, y
                found.update(a.name for a in node.names if a.name in modules)
            elif node.module and node.module.startswith("paddle_mnist."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("paddle_mnist."))
    return found - {path.stem}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_circle_through_three_modules():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_the_package_imports_itself_round_a_circle():
    graph = {p.stem: imports_of(p) for p in PACKAGE.glob("*.py")}
    assert graph["cli"] >= {"trainer", "config"}, graph["cli"]  # the reader sees the package's imports
    assert cycles(graph) == []


def test_the_layout_in_the_development_docs_names_every_module():
    text = (ROOT / "docs" / "development.md").read_text()
    layout = text.split("## The package's layout", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(\w+)`", layout))
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert modules - named == set(), "modules missing from docs/development.md's layout"
    assert {"trainer", "launch"} <= named
