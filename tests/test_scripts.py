"""scripts/ is a package run from the repository root (`python -m scripts.NAME`): every script has a make
target, every module imports, and nothing reaches another module through a path of its own (no
sys.path edits, no conftest or test-module imports from scripts, no scripts imported by tests but the
tests of that script)."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULES = sorted(p.stem for p in (ROOT / "scripts").glob("*.py") if p.stem != "__init__")
SHELL = sorted(p.name for p in (ROOT / "scripts").glob("*.sh"))
# test file -> the scripts it is about (the only scripts a test may import)
TESTS_OF_SCRIPTS = {
    "test_docs": {"check_docs", "coverage"},
    "test_tiny_configs": {"coverage", "tiny_configs"},
    "test_fault_inject": {"fault_inject"},
    "test_make_synthetic": {"make_synthetic"},
    "test_init_smollm2": {"init_smollm2"},
    "test_shrink_ppl": {"shrink_ppl"},
    "test_shrink_smollm2": {"shrink_smollm2"},
    "test_import_graph": {"import_contracts"},
    "test_methods_table": {"methods_table"},
    "test_cli_reference": {"cli_reference"},
    "test_make_smollm2": {"make_smollm2"},
    "test_bench_smollm2": {"bench_smollm2"},
}


def _imports(path: Path) -> set[str]:
    """The modules a file imports (``from a.b import c`` gives a.b and a.b.c), at any depth."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _python_files() -> list[Path]:
    return [p for d in ("otdus_cli", "scripts", "tests") for p in sorted((ROOT / d).rglob("*.py"))]


def test_every_script_has_a_make_target():
    """Each module (run, or used by a target's script as its comment says) and shell script is named in
    a Makefile recipe or the comment above it."""
    makefile = (ROOT / "Makefile").read_text()
    assert MODULES and SHELL
    missing = [f"scripts.{m}" for m in MODULES if not re.search(rf"scripts\.{m}\b", makefile)]
    missing += [f"scripts/{s}" for s in SHELL if f"scripts/{s}" not in makefile]
    assert not missing, f"no make target names {missing}"
    # and every target that runs one says what it does in the comment line above it
    for target in re.findall(r"^([\w-]+):[^\n]*\n\t[^\n]*scripts[./]", makefile, re.M):
        above = makefile.split(f"\n{target}:")[0].rstrip().splitlines()
        assert above[-1].startswith("#") or "?=" in above[-1], target


@pytest.mark.parametrize("module", MODULES)
def test_every_script_module_imports(module):
    """`python -m scripts.NAME` finds what it imports (otdus_cli, scripts.*, tests.support)."""
    loaded = importlib.import_module(f"scripts.{module}")
    assert loaded.__doc__, f"scripts/{module}.py says what it is for"


def test_no_module_edits_sys_path():
    edits = [
        str(p.relative_to(ROOT))
        for p in _python_files()
        if re.search(r"\bsys\.path\.(insert|append|extend)\(|\bsys\.path\s*(\+?=|\[)", p.read_text())
        and p.name != "test_scripts.py"
    ]
    assert not edits, edits


def test_scripts_import_no_test_module_and_tests_import_only_their_script():
    for path in sorted((ROOT / "scripts").glob("*.py")):
        imported = _imports(path)
        bad = {m for m in imported if m.split(".")[0] == "conftest" or m.split(".")[0].startswith("test_")}
        bad |= {m for m in imported if m.startswith("tests.") and not m.startswith("tests.support")}
        assert not bad, (path.name, bad)
    for path in sorted((ROOT / "tests").rglob("*.py")):
        used = {m.split(".")[1] for m in _imports(path) if m.startswith("scripts.")}
        allowed = TESTS_OF_SCRIPTS.get(path.stem, set())
        assert used <= allowed, (path.name, used - allowed)
        assert "conftest" not in {m.split(".")[-1] for m in _imports(path)}, path.name
