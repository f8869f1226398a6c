"""transformers' config load check runs beside the copy, in a child process, with the same verdicts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from otdus_cli.arch.config_check import ConfigCheck
from otdus_cli.errors import OtdusError


def _config_folder(stories, tmp_path, **changes):
    folder = tmp_path / "cfg"
    folder.mkdir()
    cfg = {**json.loads((stories / "config.json").read_text()), **changes}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_a_copy_expansion_never_imports_transformers_yet_its_config_is_checked(stories, tmp_path):
    """The load check ran in a child (the parent imported neither transformers nor torch), it said
    yes, and the output does load with transformers, config and weights."""
    out = tmp_path / "out"
    code = (
        "import json, sys\n"
        "from otdus_cli.expand import expand\n"
        "from otdus_cli.options import ExpandOptions\n"
        f"r = expand({str(stories)!r}, {str(out)!r}, ExpandOptions(method='solar', layers=3))\n"
        "heavy = [m for m in ('transformers', 'torch') if m in sys.modules]\n"
        "print(json.dumps({'heavy': heavy, 'where': r.timings['config_check_in'],\n"
        "                  'cpu': r.timings['config_check_cpu_s']}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["heavy"] == [] and report["where"] == "child process" and report["cpu"] > 0
    assert json.loads((out / "otdus.json").read_text())["config_checked_by_transformers"] is True

    from transformers import AutoConfig, AutoModelForCausalLM

    assert AutoConfig.from_pretrained(out).num_hidden_layers == 8
    model = AutoModelForCausalLM.from_pretrained(out)
    assert len(model.model.layers) == 8


def test_the_child_accepts_a_good_config(stories, tmp_path):
    check = ConfigCheck(_config_folder(stories, tmp_path), 5, in_child=True)
    check.start()
    assert check.result() is None
    assert check.where == "child process" and check.cpu_s > 0


def test_the_child_reports_what_transformers_rejects(stories, tmp_path):
    folder = _config_folder(stories, tmp_path, layer_types=["mystery_attention"] * 5)
    check = ConfigCheck(folder, 5, in_child=True)
    check.start()
    with pytest.raises(OtdusError, match="transformers rejects the rewritten config"):
        check.result()
    assert check.where == "child process"


def test_the_child_reports_a_wrong_depth(stories, tmp_path):
    check = ConfigCheck(_config_folder(stories, tmp_path), 7, in_child=True)
    check.start()
    with pytest.raises(OtdusError, match="loads with 5 layers, expected 7"):
        check.result()


def test_a_child_that_gives_no_answer_is_not_trusted(stories, tmp_path, monkeypatch):
    """A child that exits without its JSON line (here: not Python at all) means: check in-process."""
    monkeypatch.setattr(sys, "executable", shutil.which("false"))
    folder = _config_folder(stories, tmp_path, layer_types=["mystery_attention"] * 5)
    check = ConfigCheck(folder, 5, in_child=True)
    check.start()
    with pytest.raises(OtdusError, match="transformers rejects the rewritten config"):
        check.result()
    assert check.where == "in process"


def test_cancel_stops_and_reaps_the_child(stories, tmp_path):
    check = ConfigCheck(_config_folder(stories, tmp_path), 5, in_child=True)
    check.start()
    child = check._child
    check.cancel()
    assert child.returncode is not None  # reaped
    check.cancel()  # twice is harmless
