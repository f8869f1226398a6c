"""Growth in steps (expand, then expand or widen or shrink the output): every step is kept in the
manifest's history and named on the card, with the first source as base_model; verify checks the last
output against the first base through the composed layer map.

The two-step recipe (recipes/stories260k-grow-step*.yaml) runs as shipped, from a scratch folder:
the bundled stories260K grown 5 -> 7 -> 9 layers verifies PARITY against the 5-layer base.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from huggingface_hub import ModelCard
from typer.testing import CliRunner

from otdus_cli.cli import app
from otdus_cli.manifest import read_manifest
from tests.support.hub_cache import make_hub_cache, otdus

pytestmark = [pytest.mark.usefixtures("single_thread")]
runner = CliRunner()
RECIPES = Path(__file__).parent.parent / "recipes"
TEXT = ["--text", "bundled:tinystories-sample", "--max-tokens", "200"]


def run(*args) -> str:
    done = runner.invoke(app, [*map(str, args)])
    assert done.exit_code == 0, done.output
    return done.stdout


def test_two_step_recipe_verifies_against_the_first_base(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    for step in (1, 2):
        run("expand", "--recipe", RECIPES / f"stories260k-grow-step{step}.yaml")
    out = tmp_path / "out" / "stories260k-grow-9"
    manifest = read_manifest(out)
    assert [r["source"]["num_hidden_layers"] for r in manifest["history"]] == [5]
    assert manifest["history"][0]["source"]["id"] == "bundled:stories260k"
    assert manifest["source"]["num_hidden_layers"] == 7 and manifest["num_hidden_layers"] == 9
    verified = run("verify", out, "--base", "bundled:stories260k", *TEXT, "--json")
    report = json.loads(verified)
    assert report["verdict"].startswith("PARITY") and report["logits_equal"]
    card = ModelCard.load(out / "README.md")
    assert card.data.license == "mit" and card.data.tags == ["otdus", "depth-up-scaling", "ot"]
    assert "from **bundled:stories260k** in 2 steps: 5 -> 9 layers" in card.text
    assert "step 1: expand by `ot (paper)` from bundled:stories260k, 5 -> 7 layers" in card.text
    assert "step 2: expand by `ot (paper)` from the previous step's output, 7 -> 9 layers" in card.text
    # the layer map over the first base: step 2's layers named by the step that made them
    assert "| 5 | from 4, 5 of step 1's output | yes (step 2) | ot | yes |" in card.text
    assert "| 8 | 4 |  | base |  |" in card.text


def test_a_hub_first_step_stays_the_base_model_through_a_local_second_step(stories, tmp_path):
    cache = tmp_path / "hub"
    make_hub_cache(cache, "tiny-org/stories", stories)
    first, second = tmp_path / "first", tmp_path / "second"
    for source, out in (("tiny-org/stories", first), (first, second)):
        done = otdus("expand", source, "--out", out, "--method", "copy", "--layers", "1", cache=cache)
        assert done.returncode == 0, done.stderr
    card = ModelCard.load(second / "README.md")
    assert card.data.base_model == "tiny-org/stories"
    assert "from **tiny-org/stories** (revision" in card.text and "in 2 steps: 5 -> 7 layers" in card.text
    step = "step 1: expand by `copy` from tiny-org/stories, 5 -> 6 layers (not function-preserving)"
    assert step in card.text
    assert str(tmp_path) not in card.content  # no path of this machine on a card meant for upload
