"""The tables of the methods, made from the method registry (otdus_cli/methods/registry.py).

    python -m scripts.methods_table           # print both tables
    python -m scripts.methods_table --write   # replace them in README.md and docs/shrink.md (make
                                              # methods-table; tests/test_methods_table.py checks them)

Each table follows a marker line in its page (TARGETS); what a method's row says comes from its
declaration: its summary, and its zero-init default per variant (Method.zero_init_for).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from otdus_cli.methods.base import Method
from otdus_cli.methods.registry import METHODS, SHRINK_METHODS
from otdus_cli.options import ExpandSettings
from otdus_cli.shrink import ShrinkSettings

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SHRINK_PAGE = ROOT / "docs" / "shrink.md"
EXPAND_MARKER = "<!-- the expand methods: make methods-table -->"
SHRINK_MARKER = "<!-- the shrink methods: make methods-table -->"
# the page that holds each table: the expand methods on the front page, shrink's on its own page
TARGETS = ((README, EXPAND_MARKER), (SHRINK_PAGE, SHRINK_MARKER))


def _per_variant(method: Method, say) -> str:
    """``say(zero_init)`` for the method, or per variant where its variants' zero-init defaults differ."""
    variants = method.variants() if method.zero_init_off_for else ()
    if not variants:
        return say(method.zero_init_for(None))
    return "; ".join(f"`{v}`: {say(method.zero_init_for(v))}" for v in variants)


def expand_table(methods: dict[str, Method] = METHODS) -> str:
    rows = ["| `--method` | new layer | zero-init default | function-preserving |", "|---|---|---|---|"]
    for m in methods.values():
        zero = _per_variant(m, lambda on: "on" if on else "off")
        preserving = _per_variant(m, lambda on: "yes" if on else "only with `--zero-init`")
        default = " (default)" if m.name == ExpandSettings.model_fields["method"].default else ""
        rows.append(f"| `{m.name}`{default} | {m.summary} | {zero} | {preserving} |")
    return "\n".join(rows)


def shrink_table(methods: dict[str, Method] = SHRINK_METHODS) -> str:
    rows = ["| `--method` | what becomes of the removed layers |", "|---|---|"]
    for m in methods.values():
        default = " (default)" if m.name == ShrinkSettings.model_fields["method"].default else ""
        rows.append(f"| `{m.name}`{default} | {m.summary} |")
    return "\n".join(rows)


def with_table(text: str, marker: str, name: str = "the page") -> str:
    """``text`` with the table after ``marker`` replaced by the generated one."""
    table = {EXPAND_MARKER: expand_table, SHRINK_MARKER: shrink_table}[marker]()
    pattern = re.compile(re.escape(marker) + r"\n(\|[^\n]*\n)*")
    if not pattern.search(text):
        raise SystemExit(f"{name} has no line {marker!r} followed by a table")
    replacement = f"{marker}\n{table}\n"
    return pattern.sub(lambda _: replacement, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the tables in their pages")
    args = parser.parse_args(argv)
    if args.write:
        for page, marker in TARGETS:
            page.write_text(with_table(page.read_text(), marker, page.name))
    else:
        print(expand_table() + "\n\n" + shrink_table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
