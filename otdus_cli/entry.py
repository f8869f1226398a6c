"""The `otdus` console script: signal handling first, then the command line.

Importing the CLI (Typer, rich, pydantic) takes a second; a Ctrl-C or SIGTERM in that second must
end the process like one during a command (one line, exit 128 + signal), not with a traceback. Once
the command is over, its exit code stands.
"""

from __future__ import annotations

import signal
import sys

from otdus_cli.errors import Interrupted
from otdus_cli.signals import STOP_SIGNALS, exit_on_signals


def _finish_background_imports() -> None:
    """An interrupted run may leave the config prefetch thread importing transformers (and torch):
    the interpreter must not tear down under a half-imported C extension (a segfault at exit)."""
    rules = sys.modules.get("otdus_cli.arch.config_rules")
    if rules is not None:
        rules.finish_prefetch()


def main() -> None:
    exit_on_signals()
    try:
        try:
            from otdus_cli.cli import main as cli_main  # noqa: PLC0415 - after the handlers, on purpose
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
