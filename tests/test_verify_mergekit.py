"""verify on checkpoints made by mergekit, not by otdus: no manifest, mergekit's own tensor layout.

tests/data/mergekit/ holds two real mergekit 0.1.5 passthrough merges of the bundled stories260K
(written by `python -m scripts.make_mergekit_outputs tests/data/mergekit`; float32, as
`mergekit-yaml` saved them, its mergekit_config.yml kept beside them):

- solar: base layers [0, 4) then [1, 5), 5 -> 8 layers (copies only: not function-preserving);
- llama-pro: a copy after every base layer with o_proj and down_proj scaled by 0.0 (an exact
  identity, where mergekit leaves -0.0 for negative weights), 5 -> 10 layers.

verify must find each layer map from the fingerprints, prove the LLaMA-Pro merge function-preserving
statically and by bitwise logits, and say of SOLAR that no parity is expected, without a manifest.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from otdus_cli.cli import app

MERGEKIT = Path(__file__).parent / "data" / "mergekit"
SMALL = ("--protocol", "token", "--max-tokens", "600", "--seq-len", "128")
runner = CliRunner()


def verify_json(*args) -> dict:
    result = runner.invoke(app, ["verify", *[str(a) for a in args], "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("name", ["solar", "llama-pro"])
def test_the_data_are_mergekit_outputs_without_a_manifest(name):
    folder = MERGEKIT / name
    assert (folder / "mergekit_config.yml").is_file() and not (folder / "otdus.json").exists()


def test_verify_proves_a_mergekit_llama_pro_merge_function_preserving(stories):
    out = MERGEKIT / "llama-pro"
    proof = verify_json(out, "--base", stories, "--static")
    assert proof["preserving"] and not proof["claims_preserving"]  # proven, not claimed
    assert [f["copy_of"] for f in proof["layers"]] == [0, None, 1, None, 2, None, 3, None, 4, None]
    assert all(f["identity"] for f in proof["layers"][1::2])
    report = verify_json(out, "--base", stories, *SMALL)
    assert report["expect_parity"] and report["parity"] and report["logits_equal"]
    assert report["verdict"].startswith("PARITY")


def test_verify_finds_a_mergekit_solar_merge_and_expects_no_parity(stories):
    out = MERGEKIT / "solar"
    report = verify_json(out, "--base", stories, *SMALL)
    assert [f["copy_of"] for f in report["proof"]["layers"]] == [0, 1, 2, 3, 1, 2, 3, 4]
    assert not report["expect_parity"] and not report["proof"]["preserving"]
    assert not report["logits_equal"]  # layers repeated: a different function, and verify says so
