"""verify's progress where nobody watches a terminal: plain lines on stderr in a job log or a pipe."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from otdus_cli.expand import expand
from otdus_cli.options import ExpandOptions

# phase, where it is, share done, tokens/s, ETA (cli/console.py TickLines)
PHASES = "layers|scoring base|scoring expanded"
LINE = re.compile(rf"^otdus verify: ({PHASES}), .+ \(\d+%\), [\d,]+ tokens/s, ETA \d+")


def run_verify(folder, *extra: str, interval: str = "0") -> subprocess.CompletedProcess:
    env = {**os.environ, "OTDUS_PROGRESS_INTERVAL": interval}
    args = [sys.executable, "-m", "otdus_cli.cli", "verify", str(folder), "--max-tokens", "600", "--json"]
    return subprocess.run(
        [*args, "--device", "cpu", *extra], env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow  # several CLI processes, each importing torch: make test-long
def test_progress_lines_appear_in_a_piped_run_and_quiet_silences_them(tmp_path):
    out = tmp_path / "deeper"
    expand("bundled:stories260k", out, ExpandOptions(method="llama-pro", layers=5))
    piped = run_verify(out, "--batch-size", "1")  # one tick per window, a line per tick (interval 0)
    assert piped.returncode == 0, piped.stderr[-2000:]
    report = json.loads(piped.stdout)  # stdout holds the JSON alone
    assert report["parity"] and report["compute"]["threads"]["threads"] >= 1
    lines = piped.stderr.splitlines()
    assert lines and all(LINE.match(line) for line in lines), piped.stderr[-2000:]
    layers = [line for line in lines if line.startswith("otdus verify: layers")]
    assert any("layer 15/15 (expanded 9)" in line for line in layers)  # 5 base + 10 expanded passes
    # the count has its unit and only grows (a per-layer window count restarted at every layer)
    counts = [
        int(re.search(r"([\d,]+)/[\d,]+ window passes", line).group(1).replace(",", "")) for line in layers
    ]
    assert counts == sorted(counts) and len(set(counts)) > 5
    assert any(line.startswith("otdus verify: scoring expanded") for line in lines)
    quiet = run_verify(out, "--quiet")
    assert quiet.returncode == 0 and quiet.stderr == "" and json.loads(quiet.stdout)["parity"]
    # a line comes only once the interval has passed: none in a run shorter than it
    assert run_verify(out, interval="3600").stderr == ""


def test_bar_at_80_columns_keeps_its_width_eta_and_count_unit(monkeypatch):
    """At 80 columns the bar was 5 characters, the ETA `0:00:…` and the count had no unit."""
    from io import StringIO

    from rich.console import Console

    from otdus_cli.cli import console

    buffer = StringIO()
    terminal = Console(file=buffer, width=80, force_terminal=True, color_system=None)
    monkeypatch.setattr(console, "err_console", terminal)
    label = "layers: layer 3/12 (expanded 1) " + "x" * 80
    with console.task_progress(True, "otdus verify", "window passes") as update:
        update(2072, 18336, label)
    frames = [f for f in re.split(r"[\r\n]|\x1b\[[0-9;]*[A-Za-z]", buffer.getvalue()) if "window passes" in f]
    assert frames, buffer.getvalue()
    frame = frames[-1]
    assert "2,072/18,336 window passes" in frame and len(frame) <= 80, frame
    assert re.search(r"\d+:\d\d:\d\d|-:--:--", frame) and "0:00:…" not in frame, frame
    assert max(len(run) for run in re.findall(r"[━╸╺ ]+", frame)) >= console.BAR_WIDTH - 1, frame
    assert frame.rstrip().endswith("…") and " layers" in frame  # only the label is cut


def test_study_lines_count_runs_over_the_whole_study():
    from otdus_cli.cli.research import study_progress_line
    from otdus_cli.study import StudyEvent

    events = [StudyEvent("data", message="7520 train / 64 eval windows")]
    for k, label in enumerate(["ot", "copy"], start=1):
        events += [
            StudyEvent("expand", label, 0, run=k, runs=2),
            StudyEvent("eval", label, 0, 20, 1.5, k, 2),
            StudyEvent("run", label, 0, 80, 1.5, k, 2),
        ]
    lines = [study_progress_line(e, every_eval=True) for e in events]
    assert lines[0] == "study: 7520 train / 64 eval windows"
    assert lines[1] == "study: run 1/2, ot seed 0: expanding, then training"
    assert lines[2] == "study: run 1/2, ot seed 0: step 20, held-out loss 1.5000"
    assert lines[-1] == "study: run 2/2, copy seed 0: done at step 80, final held-out loss 1.5000"
    # a study that decides on a validation split says which loss it reports
    validated = StudyEvent("eval", "ot", 0, 25, 1.5, 1, 2, message="validation")
    assert study_progress_line(validated, every_eval=True).endswith("step 25, validation loss 1.5000")
    assert study_progress_line(events[2], every_eval=False) is None  # on a terminal the bar shows it
