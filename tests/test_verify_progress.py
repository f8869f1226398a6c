"""verify's progress where nobody watches a terminal: plain lines on stderr in a job log or a pipe."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

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
    assert any(line.startswith("otdus verify: scoring expanded") for line in lines)
    quiet = run_verify(out, "--quiet")
    assert quiet.returncode == 0 and quiet.stderr == "" and json.loads(quiet.stdout)["parity"]
    # a line comes only once the interval has passed: none in a run shorter than it
    assert run_verify(out, interval="3600").stderr == ""
