"""The `otdus` console script: signal handling first, then the command line.

Importing the CLI (Typer, rich, pydantic) takes a second; a Ctrl-C or SIGTERM in that second must
end the process like one during a command (one line, exit 128 + signal), not with a traceback. Once
the command is over, its exit code stands.
"""

from __future__ import annotations

import signal
import sys

from otdus_cli.errors import Interrupted, exit_on_signals


def main() -> None:
    exit_on_signals()
    try:
        from otdus_cli.cli import main as cli_main  # noqa: PLC0415 - after the handlers, on purpose
    except KeyboardInterrupt as exc:
        stop = exc if isinstance(exc, Interrupted) else Interrupted()
        sys.stderr.write(f"{stop}\n")
        raise SystemExit(stop.exit_code) from None
    try:
        cli_main()
    finally:
        # the command is over, its output whole or removed: a signal during interpreter shutdown (where
        # Python restores the default handlers) must not turn a finished run's exit code into -15
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
