"""Progress of the commands that write a checkpoint (expand, shrink, widen) where nobody watches a
terminal: plain lines on stderr in a job log or a pipe, as verify's; --quiet silences them.

Typer's runner captures stderr as a pipe does (not a terminal); OTDUS_PROGRESS_INTERVAL=0 makes a
line of every step, so the lines are checked without timing anything.
"""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from otdus_cli.cli import app
from tests.support.tiny_models import build_tiny

# the stage, then bytes written of the total and the share once planned, then rate and ETA once a byte has
# moved (cli/console.py ByteLines)
LINE = re.compile(
    r"^otdus (expand|shrink|widen): (?P<stage>.+?)(, [\d.]+ [kMG]?B of [\d.]+ [kMG]?B written \(\d+%\)"
    r"(, [\d.]+ [kMG]?B/s, ETA \d+ s)?)?, \d+ s so far$"
)
FINISHED = re.compile(r"^otdus (expand|shrink|widen): all [\d.]+ [kMG]?B written, finishing the output")


@pytest.fixture(autouse=True)
def _every_step(monkeypatch):
    monkeypatch.setenv("OTDUS_PROGRESS_INTERVAL", "0")


def run(*args) -> tuple[list[str], str]:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.stderr.splitlines(), result.stdout


def stages(lines: list[str]) -> list[str]:
    """The stages of the progress lines, in order, each once; every line checked on the way."""
    seen: list[str] = []
    for line in lines:
        if line.startswith("warning:") or FINISHED.match(line):
            continue
        match = LINE.match(line)
        assert match, line
        if match["stage"] not in seen:
            seen.append(match["stage"])
    return seen


def test_expand_in_a_log_says_each_layer_and_quiet_silences_it(tmp_path):
    lines, _ = run("expand", "bundled:stories260k", "--out", tmp_path / "ot")
    said = stages(lines)
    assert said[:4] == [
        "planned, opening the output",
        "setting up ot",
        "preparing ot (its pass over the source layers)",
        "copying the embeddings",
    ]
    assert "layer 1 of 7 (output layer 0: base layer 0)" in said
    assert "layer 4 of 7 (output layer 3: new, ot of base layers 2 and 3)" in said  # where the time goes
    assert said[-1] == "copying the final norm and head"
    assert FINISHED.match(lines[-1])
    lines, stdout = run(
        "expand", "bundled:stories260k", "--out", tmp_path / "q", "--method", "copy", "--quiet"
    )
    assert lines == [] and "wrote" in stdout


def test_shrink_says_its_scoring_pass_and_widen_its_tensors(tmp_path):
    lines, _ = run("shrink", "bundled:stories260k", "--out", tmp_path / "s", "--layers", "1", "--json")
    said = stages(lines)  # beside --json too: the lines are on stderr, the JSON alone on stdout
    assert said[0].startswith("scoring the layers on up to ")
    assert "layer 4 of 4 (output layer 3: base layer 4)" in said
    assert run("shrink", "bundled:stories260k", "--out", tmp_path / "q", "--layers", "1", "-q")[0] == []
    moe = build_tiny("mixtral", tmp_path / "mixtral")
    said = stages(run("widen", moe, "--out", tmp_path / "w")[0])
    assert said[1] == "source tensor 1 of " + said[-1].rsplit(" ", 1)[1]
    assert run("widen", moe, "--out", tmp_path / "wq", "--quiet")[0] == []
    grown = run(
        "expand", moe, "--out", tmp_path / "g", "--method", "interpose", "--layers", "2", "--experts", "2"
    )
    said = [line for line in grown[0] if not line.startswith("warning:")]
    assert any(line.startswith("otdus expand: expand step, layer 1 of ") for line in said), said
    assert any(line.startswith("otdus expand: widen step, source tensor 1 of ") for line in said), said
