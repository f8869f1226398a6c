"""The `otdus` command line: a thin Typer + rich layer over the library.

One module per group of commands (checkpoint: expand, plan, inspect; evaluation: verify, ppl;
research: study, diagnose; about: demo, version); console.py holds what they share. Errors in the
user's input are one line on stderr and exit code 2; broken parity in `verify` is exit code 1.
"""

from __future__ import annotations

from collections.abc import Callable

import typer

from otdus_cli.cli.about import demo, version
from otdus_cli.cli.checkpoint import expand, inspect, plan
from otdus_cli.cli.evaluation import ppl, verify
from otdus_cli.cli.research import diagnose, study
from otdus_cli.errors import exit_on_signals

app = typer.Typer(
    help="Depth up-scaling checkpoint surgery for Hugging Face LLMs: OT-DUS and its baselines, streamed.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
for command in (expand, plan, inspect, verify, ppl, demo, study, diagnose, version):
    app.command()(command)


def main(argv: list[str] | None = None) -> Callable | None:
    exit_on_signals()  # SIGTERM/SIGHUP (timeout, Slurm) clean up like Ctrl-C
    app(args=argv)
    return None
