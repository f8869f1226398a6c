"""The `otdus` command line: a thin Typer + rich layer over the library.

One module per group of commands (checkpoint: expand, plan, inspect; shrinking: shrink; evaluation:
verify, ppl; research: study, diagnose; widening: widen; about: demo, version); console.py holds what they
share. Errors in the user's input, the parser's included, are one line on stderr and exit code 2;
broken parity in `verify` is exit code 1.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from otdus_cli.card import set_invocation
from otdus_cli.cli.about import demo, version
from otdus_cli.cli.checkpoint import expand, inspect, plan
from otdus_cli.cli.console import fail, fit_consoles_to_streams, running, stopped
from otdus_cli.cli.evaluation import ppl, verify
from otdus_cli.cli.handoff import trainable
from otdus_cli.cli.help import Command, HelpContext
from otdus_cli.cli.research import diagnose, study
from otdus_cli.cli.shrinking import shrink
from otdus_cli.cli.widening import widen
from otdus_cli.signals import exit_on_signals

# The parser's error class, found from the one Typer exports (Typer >= 0.20 vendors its own click).
UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


def _usage_error(exc: Exception) -> None:
    """A parser error (unknown option, bad value, missing argument) as one `error:` line, exit 2."""
    ctx = getattr(exc, "ctx", None)
    names = []
    while ctx is not None and ctx.parent is not None:
        names.insert(0, ctx.info_name)
        ctx = ctx.parent
    message = exc.format_message().replace("Value error, ", "").rstrip(".")
    fail(f"{message}; see `{' '.join(['otdus', *names, '--help'])}`", 2)


class _OtdusGroup(TyperGroup):
    """Typer's group with otdus's output conventions: unwrapped lines off a terminal, and parser errors
    as one line like every other error (Typer draws a box), and help that reads whole at any width."""

    context_class = HelpContext

    def main(self, *args: Any, **kwargs: Any) -> Any:
        fit_consoles_to_streams()
        return super().main(*args, **kwargs)

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().make_context(*args, **kwargs)
        except UsageError as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # `otdus` alone prints the help
                raise
            _usage_error(exc)
        except KeyboardInterrupt as exc:  # click would print "Aborted!" and exit 1
            stopped(exc)

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except UsageError as exc:
            _usage_error(exc)
        except KeyboardInterrupt as exc:
            stopped(exc)


class _Command(Command):
    """A command that names itself in the line an allocation failure ends with (console.running)."""

    def invoke(self, ctx: Any) -> Any:
        with running(self.name):
            return super().invoke(ctx)


app = typer.Typer(
    cls=_OtdusGroup,
    help="Depth up-scaling checkpoint surgery for Hugging Face LLMs: OT-DUS and its baselines, streamed.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help, wrapped between words (help.py)
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        version()
        raise typer.Exit()


@app.callback()
def _root(
    _version: Annotated[
        bool,
        typer.Option(
            "--version", help="Print the otdus version and exit.", callback=_print_version, is_eager=True
        ),
    ] = False,
) -> None:
    """Depth up-scaling checkpoint surgery for Hugging Face LLMs: OT-DUS and its baselines, streamed."""


for command in (expand, plan, inspect, verify, ppl, demo, study, diagnose, version, widen, shrink, trainable):
    app.command(cls=_Command)(command)


def main(argv: list[str] | None = None) -> Callable | None:
    exit_on_signals()  # SIGTERM/SIGHUP (timeout, Slurm) clean up like Ctrl-C
    set_invocation(["otdus", *(sys.argv[1:] if argv is None else argv)])  # the command on the model card
    try:
        app(args=argv, prog_name="otdus")
    except KeyboardInterrupt as exc:  # a signal while Typer builds the command, before any work
        try:
            stopped(exc)
        except typer.Exit as done:
            raise SystemExit(done.exit_code) from None
    except SystemExit as done:
        _end_rank(done.code)
        raise
    return None


def _end_rank(code: object) -> None:
    """Under torchrun/srun, end this rank once its command is over (its output is whole, or removed,
    and said) with the command's exit code: see distributed.end_rank. One process: nothing."""
    from otdus_cli.distributed import end_rank

    end_rank(code if isinstance(code, int) else (0 if code is None else 1))
