"""The `otdus` console script: signal handling first, then the command line.

Importing the CLI (Typer, rich, pydantic) takes a second; a Ctrl-C or SIGTERM in that second must
end the process like one during a command (one line, exit 128 + signal), not with a traceback. Once
the command is over, its exit code stands.
"""

from __future__ import annotations

import signal

# First of all, before any other import: a signal from here to exit_on_signals is only noted
_early: list[int] = []


def _note_early(signum: int, frame: object) -> None:
    if not _early:
        _early.append(signum)


for _sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    if signal.getsignal(_sig) != signal.SIG_IGN:
        signal.signal(_sig, _note_early)

import sys  # noqa: E402

from otdus_cli.errors import Interrupted  # noqa: E402
from otdus_cli.signals import STOP_SIGNALS, exit_on_signals  # noqa: E402


def _finish_background_imports() -> None:
    """An interrupted run may leave the config prefetch thread importing transformers (and torch):
    the interpreter must not tear down under a half-imported C extension (a segfault at exit)."""
    rules = sys.modules.get("otdus_cli.arch.config_rules")
    if rules is not None:
        rules.finish_prefetch()


def main() -> None:
    exit_on_signals()
    if _early:
        sys.stderr.write(f"{Interrupted(_early[0])}\n")
        raise SystemExit(128 + _early[0])
    try:
        try:
            from otdus_cli.cli import main as cli_main  # after the handlers, on purpose
        except KeyboardInterrupt as exc:
            stop = exc if isinstance(exc, Interrupted) else Interrupted()
            sys.stderr.write(f"{stop}\n")
            raise SystemExit(stop.exit_code) from None
        cli_main()
    finally:
        # the command is over, its output whole or removed: a signal during interpreter shutdown (where
        # Python restores the default handlers) must not turn a finished run's exit code into -15
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        _finish_background_imports()
