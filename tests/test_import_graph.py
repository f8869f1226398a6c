"""No import cycle between otdus's modules, and the low layers import no higher one: the graph of
every import statement (those inside functions and under ``if TYPE_CHECKING`` included: a deferred
import still makes the importer depend on the imported) is acyclic; import-linter checks the same and
the layers (pyproject.toml, [tool.importlinter]); and each module imports on its own in a fresh
interpreter, whatever was imported before."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "otdus_cli"
# lint-imports, run by the interpreter of the tests (its console script may sit elsewhere)
LINT = (
    "import sys; from importlinter.cli import lint_imports; "
    "sys.exit(lint_imports(no_cache=True, no_logo=True))"
)


def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, wherever it stands (function bodies included)."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    modules = _modules(package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, set())
        for node in _imports(ast.parse(path.read_text())):
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
    assert "otdus_cli.methods.ot.builder" in graph["otdus_cli.methods.ot"]  # deferred (torch): counted


def test_a_cycle_is_found():
    from scripts.import_contracts import cycles  # import-linter's contract type (the dev extra)

    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    cycle = _cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_import_linter_keeps_the_layers_and_finds_no_cycle():
    done = subprocess.run([sys.executable, "-c", LINT], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken." in done.stdout


def _package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_import_linter_counts_deferred_imports(tmp_path):
    """A loop closed only by an import inside a function, and a low module reaching a high one only
    that way, break the project's two contract types."""
    _package(
        tmp_path,
        {
            "__init__.py": "",
            "low/__init__.py": "",
            "low/a.py": "def f():\n    from pkg.low import b\n",
            "low/b.py": "from pkg.low import a\n",
            "low/c.py": "def g():\n    from pkg.high import h\n",
            "high/__init__.py": "",
            "high/h.py": "",
        },
    )
    (tmp_path / "scripts").symlink_to(ROOT / "scripts")
    (tmp_path / ".importlinter").write_text(
        textwrap.dedent(
            """\
            [importlinter]
            root_package = pkg
            contract_types =
                acyclic_modules: scripts.import_contracts.AcyclicModulesContract

            [importlinter:contract:layers]
            name = low imports no high
            type = forbidden
            source_modules = pkg.low
            forbidden_modules = pkg.high

            [importlinter:contract:cycles]
            name = no cycle
            type = acyclic_modules
            package = pkg
            """
        )
    )
    assert _cycle(import_graph(tmp_path / "pkg")) == ["pkg.low.a", "pkg.low.b", "pkg.low.a"]
    done = subprocess.run([sys.executable, "-c", LINT], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Contracts: 0 kept, 2 broken." in done.stdout
    assert "pkg.low.c -> pkg.high.h" in done.stdout
    assert "pkg.low.a -> pkg.low.b" in done.stdout and "pkg.low.b -> pkg.low.a" in done.stdout


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
        "otdus_cli.methods.lesa.options",
        "otdus_cli.methods.merge",
        "otdus_cli.arch.family_lookup",
        "otdus_cli.arch.heads",
        "otdus_cli.arch.tiny",
        "otdus_cli.plan.layer_scores",
        "otdus_cli.verify.streaming",
        "otdus_cli.shrink",
        "otdus_cli.expand",
        "otdus_cli.output",
        "otdus_cli.source",
        "otdus_cli.manifest",
        "otdus_cli.plan.layer_map",
        "otdus_cli.cli.flags",
    ):
        done = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True)
        assert done.returncode == 0, (name, done.stderr[-2000:])
