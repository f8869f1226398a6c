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

JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of tables.")]


def fail(message: str, code: int) -> None:
    # one line whatever the message holds (wrapped library errors can span several), and printed as
    # plain text: a message such as "[default]" must not be read as rich markup
    line = " ".join(message.split())
    err_console.print(Text.assemble(("error:", "bold red"), " ", line), highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@contextmanager
def user_errors():
    """Turn library errors into one line and an exit code; keep tracebacks for OTDUS_DEBUG."""
    try:
        yield
    except OtdusError as exc:
        fail(str(exc), exc.exit_code)
    except KeyboardInterrupt as exc:
        # Interrupted (any signal, from the output life cycle) says what is where; a bare Ctrl-C
        # outside an expansion has nothing to report
        stopped = exc if isinstance(exc, Interrupted) else Interrupted()
        err_console.print(str(stopped), highlight=False, soft_wrap=True)
        raise typer.Exit(stopped.exit_code) from None
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
