"""What every command shares: the consoles, one-line errors, JSON output and progress bars.

Errors in the user's input are one line on stderr and exit code 2; set OTDUS_DEBUG=1 to see
tracebacks of unexpected failures.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar

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

from otdus_cli.errors import Interrupted, OtdusError, out_of_memory

R = TypeVar("R")

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
Quiet = Annotated[
    bool,
    typer.Option(
        "--quiet",
        "-q",
        help="No progress on stderr (by default a bar on a terminal, else one line every 10 s).",
    ),
]


def replacing_note(replaced: bool) -> str:
    """What a success line adds when --force replaced an earlier otdus output."""
    return " (replacing the earlier otdus output there)" if replaced else ""


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


_COMMAND: ContextVar[str | None] = ContextVar("otdus_command", default=None)


@contextmanager
def running(command: str | None) -> Iterator[None]:
    """Name the command being run, for the line an allocation failure in it ends with."""
    token = _COMMAND.set(command)
    try:
        yield
    finally:
        _COMMAND.reset(token)


@contextmanager
def user_errors():
    """Turn library errors into one line and an exit code: 2 bad input, 4 out of memory (whatever
    raised it: torch, Python, the OS, or a library step that wrapped it), 3 anything unexpected
    (OTDUS_DEBUG=1 raises it, with its traceback)."""
    try:
        yield
    except KeyboardInterrupt as exc:
        stopped(exc)
    except typer.Exit:
        raise
    except Exception as exc:  # MemoryError included
        memory = out_of_memory(exc, _COMMAND.get())
        if memory is not None:
            fail(str(memory), memory.exit_code)
        if isinstance(exc, OtdusError):
            fail(str(exc), exc.exit_code)
        if os.environ.get("OTDUS_DEBUG"):
            raise
        fail(f"unexpected {exc.__class__.__name__}: {exc} (OTDUS_DEBUG=1 shows the traceback)", 3)


def quiet_transformers() -> None:
    """Model loading inside a command should not print transformers' own bars and advisories."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


class WarningLines:
    """Warnings on stderr, each said once: a note said as it happened (a stale temporary folder
    removed) comes back among the result's warnings, and is not said twice."""

    def __init__(self) -> None:
        self._said: set[str] = set()

    def __call__(self, line: str) -> None:
        if line not in self._said:
            self._said.add(line)
            err_console.print(
                Text.assemble(("warning:", "yellow"), " ", line), highlight=False, soft_wrap=True
            )


def emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


@dataclass(frozen=True)
class ByteReport:
    """The callbacks a run that writes a checkpoint reports through: its total bytes once planned,
    bytes as they are written, and what it is doing (the stage: "layer 5 of 7 (output layer 4: ...)")."""

    set_total: Callable[[int], None]
    advance: Callable[[int], None]
    stage: Callable[[str], None]


_SILENT = ByteReport(lambda total: None, lambda n: None, lambda stage: None)


@contextmanager
def byte_progress(command: str, description: str, quiet: bool, json_out: bool) -> Iterator[ByteReport]:
    """Progress of a run that writes a checkpoint, on stderr: a rich bar over bytes on a terminal
    (none beside --json), else a plain line every ~10 s (OTDUS_PROGRESS_INTERVAL seconds) for a log
    or a pipe, as verify's; nothing with ``quiet``."""
    if quiet:
        yield _SILENT
    elif not err_console.is_terminal:
        with ByteLines(command, _interval()) as lines:
            yield ByteReport(lines.set_total, lines.advance, lines.set_stage)
    elif json_out:
        yield _SILENT
    else:
        with _byte_bar(description) as report:
            yield report


@contextmanager
def _byte_bar(description: str) -> Iterator[ByteReport]:
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
        yield ByteReport(
            lambda total: progress.update(task, total=total),
            lambda n: progress.advance(task, n),
            lambda stage: None,  # the bar shows where the bytes are; a log line needs the words
        )


def write_with_progress(
    write: Callable[..., R], model: str, out: Path, options: Any, report: ByteReport, **kwargs: Any
) -> R:
    """``write(model, out, options, **kwargs)`` (expand, shrink or widen) reporting to ``report``
    (byte_progress), its total set once the plan is known."""
    return write(
        model,
        out,
        options,
        progress=report.advance,
        on_stage=report.stage,
        on_plan=lambda plan: report.set_total(sum(t.nbytes for t in plan.tensors)),
        **kwargs,
    )


# the bar's width: fixed, so that a long label never squeezes it (or the ETA) at 80 columns
BAR_WIDTH = 24


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


@contextmanager
def task_progress(enabled: bool, description: str, unit: str = ""):
    """A rich progress bar over counted steps (on stderr); yields update(done, total, label, unit).

    Columns: what (bold), the bar, the count with its unit, the ETA, then the label (where it is),
    which alone is cut short when the terminal is too narrow for the line."""
    if not enabled:
        yield lambda done, total, label="", unit=unit: None
        return
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(bar_width=BAR_WIDTH),
        TextColumn("{task.fields[count]}"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[label]}"),
        console=err_console,
        transient=True,
    )
    with progress:
        task = progress.add_task(description, total=None, count="", label="")

        def update(done: int, total: int, label: str = "", unit: str = unit) -> None:
            count = f"{done:,}/{total:,}" + (f" {unit}" if unit else "")
            # description, bar, count, ETA (7) and four spaces between five columns
            room = err_console.width - (len(description) + BAR_WIDTH + len(count) + 7 + 4)
            progress.update(task, completed=done, total=total, count=count, label=_cut(label, room))

        yield update


# Seconds between two progress lines when stderr is not a terminal (a job log, a pipe).
PROGRESS_INTERVAL_ENV = "OTDUS_PROGRESS_INTERVAL"
DEFAULT_PROGRESS_INTERVAL_S = 10.0


def _interval() -> float:
    try:
        return max(0.0, float(os.environ.get(PROGRESS_INTERVAL_ENV, DEFAULT_PROGRESS_INTERVAL_S)))
    except ValueError:
        return DEFAULT_PROGRESS_INTERVAL_S


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes} min {seconds:02d} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


class TickLines:
    """Evaluation ticks (verify/progress.py) as one plain line on stderr every ``interval`` seconds:
    phase, where it is, tokens/s since the phase began, and the phase's ETA."""

    def __init__(self, command: str, interval: float):
        self.command, self.interval = command, interval
        self.last_line = time.monotonic()
        self.phase: str | None = None
        self.phase_start = self.last_line

    def __call__(self, tick) -> None:
        now = time.monotonic()
        if tick.phase != self.phase:
            self.phase, self.phase_start = tick.phase, now
        if now - self.last_line < self.interval or tick.done == 0:
            return
        self.last_line = now
        elapsed = max(1e-9, now - self.phase_start)
        rate = tick.tokens / elapsed
        eta = elapsed * (tick.total - tick.done) / tick.done
        share = 100 * tick.done / max(1, tick.total)
        where = f"{tick.detail}, " if tick.detail else ""
        line = (
            f"{self.command}: {tick.phase}, {where}{tick.done:,}/{tick.total:,} {tick.unit} ({share:.0f}%), "
            f"{rate:,.0f} tokens/s, ETA {_duration(eta)}"
        )
        err_console.print(line, highlight=False, markup=False, soft_wrap=True)


class ByteLines:
    """A checkpoint being written, as one plain line on stderr every ``interval`` seconds: the stage,
    bytes written of the total, the rate and the ETA. A heartbeat thread says it while no byte moves
    too (a transport plan being solved can take minutes); with interval 0, a line at every step and
    no thread."""

    def __init__(self, command: str, interval: float):
        self.command, self.interval = command, interval
        self.start = self.last_line = self.writing_since = time.monotonic()
        self.total: int | None = None
        self.done = 0
        self.stage = "reading the source and planning"
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True) if interval > 0 else None

    def __enter__(self) -> ByteLines:
        if self._beat is not None:
            self._beat.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()

    def set_total(self, total: int) -> None:
        self.total, self.writing_since = total, time.monotonic()
        self.stage = "planned, opening the output"  # until the run names its first step
        self._line_if_due()

    def advance(self, n: int) -> None:
        self.done += n
        self._line_if_due()

    def set_stage(self, stage: str) -> None:
        self.stage = stage
        self._line_if_due()

    def _heartbeat(self) -> None:
        while not self._stop.wait(max(0.05, self.last_line + self.interval - time.monotonic())):
            self._line_if_due()

    def _line_if_due(self) -> None:
        with self._lock:  # the heartbeat and the writing thread: one line at a time, none twice
            now = time.monotonic()
            if now - self.last_line < self.interval:
                return
            self.last_line = now
            err_console.print(self._line(now), highlight=False, markup=False, soft_wrap=True)

    def _line(self, now: float) -> str:
        so_far = f"{_duration(now - self.start)} so far"
        if self.total is None:
            return f"{self.command}: {self.stage}, {so_far}"
        total, done = self.total, self.done
        if done >= total:  # the bytes are out; hashes, the config check and the manifest remain
            return f"{self.command}: all {human_bytes(total)} written, finishing the output, {so_far}"
        rate = done / max(1e-9, now - self.writing_since)
        # no rate nor ETA before the first byte: nothing to measure them by
        speed = f", {human_bytes(round(rate))}/s, ETA {_duration((total - done) / rate)}" if done else ""
        share = 100 * done / max(1, total)
        return (
            f"{self.command}: {self.stage}, {human_bytes(done)} of {human_bytes(total)} written "
            f"({share:.0f}%){speed}, {so_far}"
        )


@contextmanager
def tick_progress(command: str, quiet: bool):
    """Progress of an evaluation on stderr: a rich bar on a terminal, else a plain line every ~10 s
    (OTDUS_PROGRESS_INTERVAL seconds), nothing with ``quiet``. Yields the callback for the ticks."""
    if quiet:
        yield None
        return
    if not err_console.is_terminal:
        yield TickLines(command, _interval())
        return
    with task_progress(True, command) as update:

        def on_tick(tick) -> None:
            label = f"{tick.phase}: {tick.detail}" if tick.detail else tick.phase
            update(tick.done, tick.total, label, tick.unit)

        yield on_tick


def show_progress(json_out: bool) -> bool:
    """Progress bars only for a person watching a terminal, never into a pipe or beside --json."""
    return not json_out and err_console.is_terminal
