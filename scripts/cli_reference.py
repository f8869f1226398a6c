"""docs/cli.md, the command-line reference: every command's --help, generated from the Typer app.

    python -m scripts.cli_reference           # print the page
    python -m scripts.cli_reference --write   # rewrite docs/cli.md (make cli-reference;
                                              # tests/test_cli_reference.py fails when it is stale)

The help is rendered as `otdus COMMAND --help` prints it at its widest (otdus_cli/cli/help.py caps it
at MAX_WIDTH columns), so the page reads as the terminal does and changes only when the CLI does.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import typer.main
from typer.testing import CliRunner

from otdus_cli.cli import app
from otdus_cli.cli.help import MAX_WIDTH

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "cli.md"
HEADER = """# Command-line reference

Every command's `--help`, as `otdus COMMAND --help` prints it. Generated from the CLI by
`make cli-reference` (scripts/cli_reference.py); do not edit by hand. What each command is for, with
examples: the pages linked from the [front page's command list](../README.md#commands).
"""


def _help(*args: str) -> str:
    env = {"COLUMNS": str(MAX_WIDTH), "NO_COLOR": "1"}
    done = CliRunner().invoke(app, [*args, "--help"], env=env, prog_name="otdus")
    if done.exit_code != 0:
        raise SystemExit(f"otdus {' '.join(args)} --help exited {done.exit_code}: {done.output}")
    return "\n".join(line.rstrip() for line in done.stdout.strip().splitlines())


def commands() -> list[str]:
    """The commands in the order `otdus --help` lists them."""
    group = typer.main.get_command(app)
    return list(group.list_commands(group.context_class(group)))


def page() -> str:
    parts = [HEADER, "## otdus", f"```text\n{_help()}\n```"]
    for name in commands():
        parts += [f"## otdus {name}", f"```text\n{_help(name)}\n```"]
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite docs/cli.md")
    args = parser.parse_args(argv)
    if args.write:
        PAGE.write_text(page())
    else:
        print(page(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
