"""What the safety tests compare: the files under a folder, by content, and otdus's leftovers."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from typer.testing import CliRunner

from otdus_cli.cli import app

OTDUS = str(Path(sys.executable).parent / "otdus")  # the installed command, for subprocess runs
_runner = CliRunner()


def run_cli(*args: str):
    """``otdus ARGS`` in this process (typer's runner)."""
    return _runner.invoke(app, [str(a) for a in args])


def tree_digest(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative path -> sha256): proof that nothing was touched."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def leftovers(parent: Path) -> list[str]:
    """Names beside an output that otdus's life cycle makes (temporary folders, the lock)."""
    return sorted(p.name for p in parent.iterdir() if "otdus-" in p.name)
