"""The `otdus` console script: signal handling first, then the command line.

Importing the CLI (Typer, rich, pydantic) takes a second; a Ctrl-C or SIGTERM in that second must
end the process like one during a command (one line, exit 128 + signal), not with a traceback.
"""

from __future__ import annotations

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
    cli_main()
