"""The static check: proof of function preservation without a forward pass, and verify for
checkpoints without a manifest (made by another tool or by hand), by fingerprints or --layer-map."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from otdus_cli.cli import app
from otdus_cli.expand import expand
from otdus_cli.options import ExpandOptions

pytestmark = [pytest.mark.compat]

runner = CliRunner()
SMALL = ("--protocol", "token", "--max-tokens", "300", "--seq-len", "128")


def run_cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def json_of(result, code: int) -> dict:
    assert result.exit_code == code, result.output
    return json.loads(result.stdout)


@pytest.fixture()
def llama_pro(stories, tmp_path) -> Path:
    out = tmp_path / "llama-pro"
    expand(str(stories), out, ExpandOptions(method="llama-pro", layers=5))
    return out


def _set_one(folder: Path, name: str, value: float) -> None:
    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    tensors[name][0, 0] = value
    save_file(tensors, str(f), metadata={"format": "pt"})


def test_static_proof_of_a_llama_pro_expansion(llama_pro):
    proof = json_of(run_cli("verify", llama_pro, "--static", "--json"), 0)
    assert proof["preserving"] and proof["claims_preserving"] and proof["outside_equal"]
    assert [(f["base"], f["identity"], f["copy_of"]) for f in proof["layers"]] == [
        (True, False, 0), (False, True, None), (True, False, 1), (False, True, None), (True, False, 2),
        (False, True, None), (True, False, 3), (False, True, None), (True, False, 4), (False, True, None),
    ]  # fmt: skip
    plain = run_cli("verify", llama_pro, "--static")
    assert "static check: function-preserving (5 base layers in order, 5 identity layers" in plain.stdout


def test_one_non_zero_in_a_new_o_proj_static_and_run_agree(llama_pro):
    _set_one(llama_pro, "model.layers.5.self_attn.o_proj.weight", 1e-3)
    proof = json_of(run_cli("verify", llama_pro, "--static", "--json"), 1)
    assert not proof["preserving"] and proof["claims_preserving"]
    assert proof["reason"] == "layer 5 is new and not an identity (its output projections are not zero)"
    run = json_of(run_cli("verify", llama_pro, *SMALL, "--json"), 1)
    assert run["verdict"].startswith("BROKEN") and not run["logits_equal"]
    assert run["first_divergence"]["expanded_layer"] == 5


def test_negative_zeros_count_as_zeros(stories, llama_pro):
    """mergekit's LLaMA-Pro (`scale: 0.0`) writes -0.0 where a weight was negative: still an identity
    (this failed when zeros were compared byte for byte); a -0.0 next to a real non-zero is not."""
    (llama_pro / "otdus.json").unlink()
    f = llama_pro / "model.safetensors"
    tensors = load_file(str(f))
    for name in ("model.layers.1.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        tensors[name] = tensors["model.layers.0." + name.split(".", 3)[3]] * -0.0  # -0.0 and +0.0 mixed
        assert torch.signbit(tensors[name]).any() and not tensors[name].any()
    save_file(tensors, str(f), metadata={"format": "pt"})
    proof = json_of(run_cli("verify", llama_pro, "--base", stories, "--static", "--json"), 0)
    assert proof["preserving"] and proof["layers"][1]["identity"]
    _set_one(llama_pro, "model.layers.1.self_attn.o_proj.weight", -1e-3)
    proof = json_of(run_cli("verify", llama_pro, "--base", stories, "--static", "--json"), 0)  # no claim
    assert not proof["preserving"] and not proof["layers"][1]["identity"]


@pytest.mark.parametrize(
    "method, layers, preserving",
    [("llama-pro", 5, True), ("solar", 1, False), ("interpose", 2, False), ("copy", 2, False)],
)
def test_verify_without_a_manifest_finds_the_layer_map(stories, tmp_path, method, layers, preserving):
    out = tmp_path / "made-elsewhere"
    result = expand(str(stories), out, ExpandOptions(method=method, layers=layers))
    (out / "otdus.json").unlink()  # as another tool would write it: no manifest
    report = json_of(run_cli("verify", out, "--base", stories, *SMALL, "--json"), 0)
    assert report["expect_parity"] is preserving and report["proof"]["preserving"] is preserving
    assert report["parity"] is preserving
    found = [f["copy_of"] for f in report["proof"]["layers"]]
    expected = [None if lay.new and lay.zero_init else lay.source for lay in result.plan.layer_map]
    assert found == expected


def test_explicit_layer_map_list_and_file(stories, tmp_path, llama_pro):
    (llama_pro / "otdus.json").unlink()
    spec = "0,new,1,new,2,new,3,new,4,new"
    report = json_of(
        run_cli("verify", llama_pro, "--base", stories, "--layer-map", spec, *SMALL, "--json"), 0
    )
    assert report["verdict"].startswith("PARITY") and report["proof"]["claims_preserving"] is False
    assert [c["base_layer"] for c in report["checks"]] == [-1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    map_file = tmp_path / "map.json"
    map_file.write_text(json.dumps([0, None, 1, None, 2, None, 3, None, 4, None]))
    again = json_of(
        run_cli("verify", llama_pro, "--base", stories, "--layer-map", map_file, "--static", "--json"), 0
    )
    assert again["preserving"]


def test_a_layer_map_that_claims_a_wrong_copy_is_noted(stories, llama_pro):
    (llama_pro / "otdus.json").unlink()
    wrong = "0,new,2,new,1,new,3,new,4,new"
    proof = json_of(
        run_cli("verify", llama_pro, "--base", stories, "--layer-map", wrong, "--static", "--json"), 0
    )
    assert proof["layers"][2]["note"] == "claimed a copy of base layer 2, but its tensors differ"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("0,x,1", "'x' is neither"),
        ("0,1", "lists 2 layers"),
        ("0,1,,2", "'' is neither"),
        ("0,new,1,new,2,new,3,new,99,new", "names base layer 99; the base has layers 0..4"),
    ],
)
def test_bad_layer_maps_are_one_line(stories, llama_pro, spec, message):
    result = run_cli("verify", llama_pro, "--base", stories, "--layer-map", spec, "--static")
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], lines


def test_static_needs_a_base(stories):
    result = run_cli("verify", stories, "--static")
    assert result.exit_code == 2 and "give --base" in result.stderr
