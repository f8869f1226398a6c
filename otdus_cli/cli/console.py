"""What every command shares: the consoles, one-line errors, JSON output and progress bars.

Errors in the user's input are one line on stderr and exit code 2; set OTDUS_DEBUG=1 to see
tracebacks of unexpected failures.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.text import Text

from otdus_cli.errors import Interrupted, OtdusError

out_console = Console()
err_console = Console(stderr=True)
# Width of a console that is not a terminal: lines go out whole, so a path or a figure is never
# broken across lines for grep, a log or the next command in a pipe.
UNWRAPPED_WIDTH = 100_000


def fit_consoles_to_streams() -> None:
    """Wrap at the terminal's width on a terminal, never when writing to a pipe or a file."""
    for console in (out_console, err_console):
        piped = not console.is_terminal
        console.soft_wrap = piped
        console.width = UNWRAPPED_WIDTH if piped else None  # None: the terminal's own width


def heading(title: str) -> None:
    """A section heading: a rule across a terminal, a plain line elsewhere."""
    if out_console.is_terminal:
        out_console.rule(title)
    else:
        out_console.print(f"== {title} ==", highlight=False)


def human_bytes(n: int) -> str:
    """A size in decimal units, as the shard sizes are given: 950 B, 1.4 MB, 16 GB."""
    if n < 1000:
        return f"{n} B"
    size = n / 1000
    for unit in ("kB", "MB", "GB", "TB"):
        if float(f"{size:.3g}") < 1000:
            return f"{size:.3g} {unit}"
        size /= 1000
    return f"{size:.3g} PB"


JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of tables.")]


def fail(message: str, code: int) -> None:
    # one line whatever the message holds (wrapped library errors can span several), and printed as
    # plain text: a message such as "[default]" must not be read as rich markup
    line = " ".join(message.split())
    err_console.print(Text.assemble(("error:", "bold red"), " ", line), highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def stopped(exc: KeyboardInterrupt) -> None:
    """A signal's one line and exit code 128 + signal. Interrupted (from the output life cycle) says
    what is where; one that arrives outside an expansion has nothing to report."""
    stop = exc if isinstance(exc, Interrupted) else Interrupted()
    err_console.print(str(stop), highlight=False, soft_wrap=True)
    raise typer.Exit(stop.exit_code) from None


@contextmanager
def user_errors():
    """Turn library errors into one line and an exit code; keep tracebacks for OTDUS_DEBUG."""
    try:
        yield
    except OtdusError as exc:
        fail(str(exc), exc.exit_code)
    except KeyboardInterrupt as exc:
        stopped(exc)
    except typer.Exit:
        raise
    except Exception as exc:
        if os.environ.get("OTDUS_DEBUG"):
            raise
        fail(f"unexpected {exc.__class__.__name__}: {exc} (OTDUS_DEBUG=1 shows the traceback)", 3)


def quiet_transformers() -> None:
    """Model loading inside a command should not print transformers' own bars and advisories."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


@contextmanager
def byte_progress(enabled: bool, description: str):
    """A rich progress bar over bytes written (on stderr), or a no-op; yields (set_total, advance)."""
    if not enabled:
        yield (lambda total: None), (lambda n: None)
        return
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=err_console,
        transient=True,
    )
    with progress:
        task = progress.add_task(description, total=None)
        yield (lambda total: progress.update(task, total=total)), (lambda n: progress.advance(task, n))


@contextmanager
def task_progress(enabled: bool, description: str):
    """A rich progress bar over counted steps (on stderr); yields update(done, total, label)."""
    if not enabled:
        yield lambda done, total, label="": None
        return
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeRemainingColumn(),
        console=err_console,
        transient=True,
    )
    with progress:
        task = progress.add_task(description, total=None)

        def update(done: int, total: int, label: str = "") -> None:
            progress.update(task, completed=done, total=total, description=f"{description} {label}".strip())

        yield update


def show_progress(json_out: bool) -> bool:
    """Progress bars only for a person watching a terminal, never into a pipe or beside --json."""
    return not json_out and err_console.is_terminal
