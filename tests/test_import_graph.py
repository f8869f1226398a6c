"""No import cycle between otdus's modules: the graph of module-level imports (those run when a
module is imported; imports inside functions and under ``if TYPE_CHECKING`` are deferred) is acyclic,
and each module imports on its own in a fresh interpreter, whatever was imported before."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "otdus_cli"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _run_at_import(body: list[ast.stmt]) -> list[ast.stmt]:
    """The import statements of a module body that run when it is imported."""
    found: list[ast.stmt] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                found += _run_at_import(node.body) + _run_at_import(node.orelse)
        elif isinstance(node, ast.Try):
            found += _run_at_import(node.body + node.orelse + node.finalbody)
            for handler in node.handlers:
                found += _run_at_import(handler.body)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, set())
        for node in _run_at_import(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative import
                    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            edges |= {t for t in targets if t in modules and t != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_graph_sees_imports():
    graph = import_graph()
    assert "otdus_cli.methods.registry" in graph["otdus_cli.options"]
    assert "otdus_cli.methods.ot" in graph["otdus_cli.methods.registry"]
    assert "otdus_cli.methods.ot.builder" not in graph["otdus_cli.methods.ot"]  # deferred: torch


def test_a_cycle_is_found():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    cycle = _cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


@pytest.mark.slow  # several CLI processes, each importing torch: make test-long
def test_the_seam_modules_import_alone():
    """The modules a method meets, each first in a fresh interpreter (an import-order-dependent
    cycle fails here even if the graph missed it)."""
    for name in (
        "otdus_cli.options",
        "otdus_cli.methods.registry",
        "otdus_cli.methods.base",
        "otdus_cli.methods.ot",
        "otdus_cli.methods.ot.builder",
        "otdus_cli.methods.lesa",
        "otdus_cli.methods.lesa.builder",
        "otdus_cli.expand",
        "otdus_cli.output",
        "otdus_cli.source",
        "otdus_cli.manifest",
        "otdus_cli.plan.layer_map",
        "otdus_cli.cli.flags",
    ):
        done = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True)
        assert done.returncode == 0, (name, done.stderr[-2000:])
