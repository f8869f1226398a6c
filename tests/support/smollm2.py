"""SmolLM2-135M for the slow tests: the folder `make smollm2` builds (scripts/make_smollm2.py), built here
by the same command when missing (tests import no script but their own, so it runs as a process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
FOLDER = ROOT / "models" / "smollm2-135m"  # the Makefile's SMOLLM2


def smollm2_folder() -> Path:
    """The built folder; the build skips itself when the folder already holds the pinned weights."""
    done = subprocess.run(
        [sys.executable, "-m", "scripts.make_smollm2", "--out", str(FOLDER)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, f"make smollm2 failed: {done.stderr.strip()[-2000:]}"
    return FOLDER
