"""The method registry is the one place that names the methods: a method's own package and the
registry's lines are the only code that names LESA (docstrings and comments aside), and what the
CLI offers is what the registry holds."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from typer.testing import CliRunner

from otdus_cli.methods.registry import METHODS, SHRINK_METHODS
from otdus_cli.plan.shrink_map import SELECTIONS

PACKAGE = Path(__file__).resolve().parent.parent / "otdus_cli"
OWN = (PACKAGE / "methods" / "lesa", PACKAGE / "methods" / "registry.py")


def _docstrings(tree: ast.Module) -> set[int]:
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef))]
    return {
        id(node.body[0].value)
        for node in nodes
        if node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }


def lesa_in_code(path: Path) -> list[int]:
    """The lines of ``path`` whose code (names, attributes, strings; not docstrings) names LESA."""
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree)
    found = set()
    for node in ast.walk(tree):
        text = None
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            text = node.value
        elif isinstance(node, ast.Name):
            text = node.id
        elif isinstance(node, ast.Attribute):
            text = node.attr
        elif isinstance(node, ast.alias):
            text = node.name
        elif isinstance(node, ast.ImportFrom):
            text = node.module
        if text and re.search("lesa", text, re.I):
            found.add(node.lineno)
    return sorted(found)


def test_lesa_is_named_only_in_its_package_and_the_registry():
    named = {
        str(path.relative_to(PACKAGE)): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if not any(path == own or own in path.parents for own in OWN)
        if (lines := lesa_in_code(path))
    }
    assert named == {}
    assert lesa_in_code(PACKAGE / "methods" / "registry.py")  # the check sees a name where there is one


def test_the_shrink_cli_offers_what_the_registry_holds():
    from otdus_cli.cli import app

    out = " ".join(CliRunner().invoke(app, ["shrink", "--help"]).output.split())
    assert re.search(r"--method <([^>]*)>", out).group(1).split("|") == list(SHRINK_METHODS)
    assert re.search(r"--select <([^>]*)>", out).group(1).split("|") == list(SELECTIONS)
    for name, method in SHRINK_METHODS.items():
        assert f"{name}: {method.summary}" in out
    for name, what in SELECTIONS.items():
        assert f"{name}: {what}" in out
    out = CliRunner().invoke(app, ["expand", "--help"]).output
    assert re.search(r"--method <([^>]*)>", out).group(1).split("|") == list(METHODS)
