"""User-facing errors: one clear line for the user, exit code 2, never a traceback."""

from __future__ import annotations

import signal


class OtdusError(Exception):
    """A problem with the user's input or environment that the CLI reports in one line (exit 2)."""

    exit_code = 2


class Interrupted(KeyboardInterrupt):
    """A run stopped by SIGINT, SIGTERM or SIGHUP (Ctrl-C, `timeout`, Slurm's time limit).

    A KeyboardInterrupt, so code that cleans up on Ctrl-C cleans up on every signal alike; ``detail``
    says what was left where, ``exit_code`` is the shell convention 128 + signal number.
    """

    def __init__(self, signum: int = signal.SIGINT, detail: str = ""):
        super().__init__(signum, detail)
        self.signum = int(signum)
        self.detail = detail

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def signal_name(self) -> str:
        try:
            return signal.Signals(self.signum).name
        except ValueError:
            return f"signal {self.signum}"

    def __str__(self) -> str:
        return f"interrupted by {self.signal_name}" + (f": {self.detail}" if self.detail else "")
