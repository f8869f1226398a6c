"""docs/cli.md is the help of the CLI as it is (scripts/cli_reference.py, `make cli-reference`)."""

from __future__ import annotations

import re

from scripts.cli_reference import PAGE, commands, page


def test_the_cli_reference_is_current():
    assert PAGE.read_text() == page(), "docs/cli.md is stale: run python -m scripts.cli_reference --write"


def test_the_cli_reference_holds_every_command_and_option():
    text = PAGE.read_text()
    assert commands()[:3] == ["expand", "widen", "shrink"] and "demo" in commands()
    for name in commands():
        assert f"\n## otdus {name}\n\n```text\nUsage: otdus {name} [OPTIONS]" in text, name
    verify = text.split("## otdus verify\n", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"^  --max-tokens <int range>", verify, re.M) and "[default: wikitext]" in verify
