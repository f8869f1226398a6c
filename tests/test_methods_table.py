"""The methods tables (README.md's, docs/shrink.md's) are the ones scripts/methods_table.py makes from
the registry."""

from __future__ import annotations

from otdus_cli.methods.registry import METHODS, SHRINK_METHODS
from scripts.methods_table import README, SHRINK_PAGE, TARGETS, expand_table, shrink_table, with_table


def test_the_pages_hold_the_generated_tables():
    for page, marker in TARGETS:
        text = page.read_text()
        assert with_table(text, marker) == text, "run: python -m scripts.methods_table --write"
    assert expand_table() in README.read_text() and shrink_table() in SHRINK_PAGE.read_text()


def test_every_registered_method_has_its_row():
    rows = expand_table().splitlines()[2:]
    assert [row.split("`")[1] for row in rows] == list(METHODS)
    assert rows[0].startswith("| `ot` (default) |")
    assert "| `lesa` |" in rows[1] and "`pair`: on; `published`: off" in rows[1]
    rows = shrink_table().splitlines()[2:]
    assert [row.split("`")[1] for row in rows] == list(SHRINK_METHODS)
    assert rows[0].startswith("| `drop` (default) |")
