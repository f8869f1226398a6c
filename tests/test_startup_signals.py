"""A signal at any moment of start-up ends the run at a safe point: one line, 128 + signal, nothing left.

A signal handler that raises in the middle of an import leaves a half-initialised C extension behind
(torch, numpy, scipy: later RecursionErrors, pybind11's terminate, segfaults). These tests send the
signal from inside the import system at a chosen import, deterministically, in a real `otdus` process:
the import must complete, and the run must end right after it, cleanly; an interrupted `widen` must
not exit while its config prefetch thread is still importing transformers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from otdus_cli.errors import Interrupted
from otdus_cli.io.output_dir import staged_output
from otdus_cli.signals import output_in_place, raise_interrupted

ROOT = Path(__file__).resolve().parent.parent

# Runs `otdus` (its console entry) with a finder that sends SIGTERM to the process when TRIGGER is
# first looked up (in THREAD, when given), and reports at exit whether the import was whole.
HARNESS = """
import atexit, importlib.abc, os, signal, sys, threading
TRIGGER, THREAD = sys.argv[1], sys.argv[2]

class Trip(importlib.abc.MetaPathFinder):
    fired = False
    def find_spec(self, name, path, target=None):
        here = threading.current_thread().name
        if name == TRIGGER and not Trip.fired and (THREAD == "-" or here == THREAD):
            Trip.fired = True
            os.kill(os.getpid(), signal.SIGTERM)
        return None

def report():
    whole = TRIGGER in sys.modules  # a failed import removes its module
    busy = any(t.name == THREAD and t.is_alive() for t in threading.enumerate())
    sys.stderr.write(f"@@ fired={Trip.fired} whole={whole} busy={busy}\\n")

sys.meta_path.insert(0, Trip())
atexit.register(report)
sys.argv = ["otdus", *sys.argv[3:]]
from otdus_cli.entry import main
main()
"""


def _default_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def run_tripped(trigger: str, thread: str, *args: object) -> tuple[int, list[str], str]:
    proc = subprocess.run(
        [sys.executable, "-c", HARNESS, trigger, thread, *map(str, args)],
        capture_output=True,
        text=True,
        preexec_fn=_default_signals,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("@@")]
    report = next((line for line in proc.stderr.splitlines() if line.startswith("@@")), "")
    return proc.returncode, lines, report


def assert_clean_stop(code: int, lines: list[str], parent: Path) -> None:
    assert code == 128 + signal.SIGTERM, lines
    assert len(lines) == 1 and lines[0].startswith("interrupted by SIGTERM"), lines
    assert sorted(p.name for p in parent.iterdir()) == ["src"]


@pytest.mark.parametrize(  # torch's in make test; numpy's and scipy's (a CLI process each) in test-long
    "trigger",
    [
        "torch._C",
        pytest.param("numpy.linalg", marks=pytest.mark.slow),
        pytest.param("scipy.optimize", marks=pytest.mark.slow),
    ],
)
def test_a_signal_inside_a_heavy_import_waits_for_the_import(stories, tmp_path, trigger):
    """`expand --method ot` imports torch, numpy and scipy after the claim on --out is taken."""
    src = tmp_path / "src"
    stories.rename(src)
    code, lines, report = run_tripped(
        trigger, "-", "expand", src, "--out", tmp_path / "out", "--method", "ot"
    )
    assert "fired=True" in report, (report, lines)
    assert "whole=True" in report, (report, lines)  # the import finished before the run stopped
    assert_clean_stop(code, lines, tmp_path)


def test_an_interrupted_widen_waits_for_its_prefetch_thread(tmp_path):
    src = tmp_path / "src"
    subprocess.run(
        [sys.executable, "-m", "scripts.make_synthetic", "tiny-mixtral", "--out", str(src)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    code, lines, report = run_tripped(
        "transformers.utils", "otdus-prefetch", "widen", src, "--out", tmp_path / "out"
    )
    assert "fired=True" in report, (report, lines)
    assert "busy=False" in report, (report, lines)  # never torn down under a thread mid-import
    assert_clean_stop(code, lines, tmp_path)


def test_a_signal_after_the_swap_says_the_output_is_in_place(tmp_path):
    """Work after the output is swapped in (summaries, the success line) can still be interrupted: the
    line must then say the output is whole and in place, not that the run was merely interrupted."""
    previous = signal.signal(signal.SIGTERM, raise_interrupted)
    try:
        with staged_output(tmp_path / "out", protected=[], force=False) as tmp:
            (tmp / "weights").write_text("whole")
        with pytest.raises(Interrupted, match="already finished: .*out is complete and in place"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs at the next bytecode, long before this ends
    finally:
        signal.signal(signal.SIGTERM, previous)
        output_in_place(None)
    assert (tmp_path / "out" / "weights").read_text() == "whole"
