"""Every command's --help explains its options with their defaults (rich markup must not eat them)."""

import re

import pytest
from typer.testing import CliRunner

from otdus_cli.cli import app

COMMANDS = ["expand", "plan", "inspect", "verify", "ppl", "demo", "study", "diagnose"]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_lists_options_with_defaults(command):
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    text = result.stdout
    options = set(re.findall(r"--[a-z][a-z-]+", text)) - {"--help", "--json", "--no-zero-init"}
    assert options or command == "inspect"  # inspect takes only a path and --json
    if command == "expand":
        for default in (
            "[default: ot]",
            "[default: top]",
            "[default: 5GB]",
            "[default: 0.06]",
            "[default: auto]",
        ):
            assert default in text, default
    if command == "verify":
        assert "[default: wikitext]" in text and "[default: 2048]" in text


def test_version_plain_and_json():
    import json

    from otdus_cli import __version__

    plain = CliRunner().invoke(app, ["version"])
    assert plain.exit_code == 0 and plain.stdout.strip() == __version__
    data = json.loads(CliRunner().invoke(app, ["version", "--json"]).stdout)
    assert data["otdus"] == __version__ and data["libraries"]["torch"] and data["python"]
