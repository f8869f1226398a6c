"""The `otdus` command line: a thin Typer + rich layer over the library.

One module per group of commands (checkpoint: expand, plan, inspect; shrinking: shrink; evaluation:
verify, ppl; research: study, diagnose; widening: widen; about: demo, version); console.py holds what they
share. Errors in the user's input, the parser's included, are one line on stderr and exit code 2;
broken parity in `verify` is exit code 1.
"""

from __future__ import annotations

import difflib
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
from otdus_cli.cli.help import Command, HelpContext, format_panels
from otdus_cli.cli.research import diagnose, study
from otdus_cli.cli.shrinking import shrink
from otdus_cli.cli.widening import widen
from otdus_cli.signals import exit_on_signals

# The parser's error class, found from the one Typer exports (Typer >= 0.20 vendors its own click).
UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


# how alike a mistyped option and a real one must be to suggest it: "--max-token" and "--max-tokens"
# (0.95), "--qiuet" and "--quiet" (0.86), not "--out" and "--quiet" (0.67)
_NEAR = 0.8


def _usage_error(exc: Exception) -> None:
    """A parser error (unknown option, bad value, missing argument) as one `error:` line, exit 2."""
    ctx = getattr(exc, "ctx", None)
    names = []
    while ctx is not None and ctx.parent is not None:
        names.insert(0, ctx.info_name)
        ctx = ctx.parent
    message = exc.format_message().replace("Value error, ", "").rstrip(".")
    possible = getattr(exc, "possibilities", None)
    if possible:  # click suggests any option within difflib's loose 0.6: keep only those a typo is near
        near = [p for p in possible if difflib.SequenceMatcher(None, exc.option_name, p).ratio() >= _NEAR]
        message = message.split(" (Possible options:")[0].split(" (Did you mean")[0]
        if near:
            message += f" (did you mean {' or '.join(sorted(near))}?)"
    fail(f"{message}; see `{' '.join(['otdus', *names, '--help'])}`", 2)


class _OtdusGroup(TyperGroup):
    """Typer's group with otdus's output conventions: unwrapped lines off a terminal, and parser errors
    as one line like every other error (Typer draws a box), and help that reads whole at any width."""

    context_class = HelpContext

    def main(self, *args: Any, **kwargs: Any) -> Any:
        fit_consoles_to_streams()
        return super().main(*args, **kwargs)

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        format_panels(self, ctx, formatter)

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


# `otdus -h` lists the commands under these panels, in this order; each command's help ends with its
# example (the quick ones run on the bundled model; those on out/ use the expand example's output)
PANELS: dict[str, list[tuple[Callable, str]]] = {
    "Grow": [
        (expand, "otdus expand bundled:stories260k --out out/deeper"),
        (widen, "otdus widen allenai/OLMoE-1B-7B-0924 --out out/olmoe-wider --factor 2"),
    ],
    "Shrink": [(shrink, "otdus shrink bundled:stories260k --out out/shallower --layers 1")],
    "Check": [
        (plan, "otdus plan bundled:stories260k --method llama-pro --layers 5"),
        (inspect, "otdus inspect out/deeper"),
        (verify, "otdus verify out/deeper --max-tokens 20000"),
        (ppl, "otdus ppl bundled:stories260k --text bundled:tinystories-sample"),
    ],
    "Study": [
        (study, "otdus study bundled:stories260k --train bundled:tinystories-sample --methods ot,copy"),
        (diagnose, "otdus diagnose bundled:stories260k --pair 2,3"),
    ],
    "Hand-off": [(trainable, "otdus trainable out/deeper --format names")],
    "About": [(demo, "otdus demo"), (version, "otdus version --json")],
}
for panel, commands in PANELS.items():
    for command, example in commands:
        app.command(cls=_Command, rich_help_panel=panel, epilog=example)(command)


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
