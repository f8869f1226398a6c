"""Checks of a CLI run's outcome that many test files make: one error line, nothing left behind."""

from __future__ import annotations

from pathlib import Path


def one_error_line(result, code: int = 2, message: str | None = None) -> str:
    """A CLI result that failed as promised: exit ``code``, one `error:` line on stderr (holding
    ``message`` when given), no traceback. Returns the line."""
    assert result.exit_code == code, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert "Traceback" not in result.output
    if message is not None:
        assert message in lines[0], lines[0]
    return lines[0]


def no_output_left(parent: Path, out_name: str = "out") -> None:
    """Neither the output nor anything of otdus's life cycle (temporary folders, lock) beside it."""
    assert not (parent / out_name).exists()
    assert not [p.name for p in parent.iterdir() if "otdus-" in p.name]
