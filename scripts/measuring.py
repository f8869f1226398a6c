"""What every benchmark records beside its figures: the machine's load around them and its CPU.

The machines these run on are shared; a figure without the load average it was taken at cannot be
read, so each script prints the load next to its figures with these functions.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path


def load_average() -> tuple[float, float, float]:
    """The 1-, 5- and 15-minute load averages, to two decimals."""
    one, five, fifteen = os.getloadavg()
    return round(one, 2), round(five, 2), round(fifteen, 2)


def load_text() -> str:
    """The load averages as printed beside a figure: ``1.2/1.1/0.5``."""
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    return next(
        (ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")),
        platform.processor() or "unknown",
    )


def commit() -> str:
    """HEAD of the checkout the figures are computed by ("unknown" outside a git checkout)."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
