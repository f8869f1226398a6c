"""User-facing errors: one clear line for the user, exit code 2, never a traceback."""

from __future__ import annotations


class OtdusError(Exception):
    """A problem with the user's input or environment that the CLI reports in one line (exit 2)."""

    exit_code = 2


class ParityError(OtdusError):
    """Function preservation was expected and does not hold (exit 1)."""

    exit_code = 1
