"""`make test` as a person or a CI log sees it: both suites' lines as they come, each labelled with its
suite, and the exit status of a failing suite kept.

The suites are stood in for by a script in place of both environments' python: it says it started,
then waits (at most a minute) for the test to let it finish, so a line can only be seen before the end
if make passes it on at once (with `make -O` it came only when its suite ended).
"""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent

SUITE = """#!/bin/sh
# "-c ...": the version line of test-compat; otherwise a suite
case "$1" in -c) echo "transformers 0.0"; exit 0;; esac
echo "suite started"
i=0
while [ ! -e "$RELEASE" ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i + 1)); done
echo "suite done"
exit "${SUITE_EXIT:-0}"
"""


def _venv(folder: Path) -> Path:
    """A stand-in environment: bin/python is the suite script, .installed newer than pyproject.toml."""
    (folder / "bin").mkdir(parents=True)
    python = folder / "bin" / "python"
    python.write_text(SUITE)
    python.chmod(0o755)
    (folder / ".installed").touch()
    return folder


def make_test(tmp_path: Path, suite_exit: str) -> tuple[list[str], int]:
    """`make test` with both suites stood in for: its lines, and its exit code. The suites finish only
    once both have said they started, so both must have been seen mid-run."""
    release = tmp_path / "release"
    # not the make this test may itself run under (make test): its jobserver and flags are not ours
    inherited = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env = {**inherited, "RELEASE": str(release), "SUITE_EXIT": suite_exit}
    venvs = [f"VENV={_venv(tmp_path / 'main')}", f"COMPAT_VENV={_venv(tmp_path / 'compat')}"]
    make = subprocess.Popen(
        ["make", "--no-print-directory", "-C", str(ROOT), "test", *venvs],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=lambda: [*map(lines.put, make.stdout), lines.put(None)], daemon=True).start()
    seen: list[str] = []
    try:
        while not {"main | suite started", "compat | suite started"} <= {s.strip() for s in seen}:
            line = lines.get(timeout=120)  # held back until a suite ends: never, until released
            assert line is not None, seen
            seen.append(line)
        release.touch()
        while (line := lines.get(timeout=120)) is not None:
            seen.append(line)
    finally:
        release.touch()
        code = make.wait(timeout=120)
    return [s.rstrip("\n") for s in seen], code


@pytest.mark.skipif(
    shutil.which("make") is None or shutil.which("bash") is None, reason="needs make and bash"
)
def test_make_test_streams_labelled_lines_and_keeps_a_failure(tmp_path):
    lines, code = make_test(tmp_path / "pass", "0")
    assert code == 0, lines
    assert {"main | suite done", "compat | transformers 0.0", "compat | suite done"} <= set(lines)
    suites = [line for line in lines if "suite" in line and not line.startswith("make")]
    assert all(line.startswith(("main | ", "compat | ")) for line in suites), lines
    lines, code = make_test(tmp_path / "fail", "1")  # a failing suite fails make test, through the label pipe
    assert code != 0 and "main | suite done" in lines
