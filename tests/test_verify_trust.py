"""A manifest verify can trust: the base must be the recorded one, and nothing a hand edit changes
turns a broken checkpoint into a pass. Damaged manifests and malicious pickles are one line."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from otdus_cli.cli import app
from otdus_cli.expand import expand
from otdus_cli.options import ExpandOptions
from tests.support.cli_checks import one_error_line

runner = CliRunner()
VERIFY = ("--protocol", "token", "--max-tokens", "300", "--seq-len", "128")


def run_cli(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def one_line(result, code: int) -> str:
    return one_error_line(result, code)


@pytest.fixture()
def expanded(stories, tmp_path) -> Path:
    out = tmp_path / "deeper"
    expand(str(stories), out, ExpandOptions(method="copy", layers=2, zero_init=True))
    return out


def _edit_manifest(folder: Path, edit) -> None:
    manifest = json.loads((folder / "otdus.json").read_text())
    edit(manifest)
    (folder / "otdus.json").write_text(json.dumps(manifest))


def _perturb_layer(folder: Path, name: str) -> None:
    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    tensors[name] = tensors[name] * 1.001
    save_file(tensors, str(f), metadata={"format": "pt"})


def test_parity_with_the_recorded_base(expanded):
    result = run_cli("verify", expanded, *VERIFY, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["verdict"].startswith("PARITY")
    assert report["proof"]["preserving"] and report["proof"]["base_checks"] == [
        "config.json fields",
        "tensor fingerprints",
    ]


def test_manifest_pointing_at_another_model_is_a_wrong_base(expanded, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(expanded.parent / "stories260k", other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-6  # a different model of the same shape
    (other / "config.json").write_text(json.dumps(cfg))
    _edit_manifest(expanded, lambda m: m["source"].update(path=str(other), id=str(other)))
    line = one_line(run_cli("verify", expanded, *VERIFY), 2)
    assert "is not the model this expansion was made from: config.json field rms_norm_eps" in line


def test_an_edited_manifest_is_said_at_once_and_in_the_report(expanded):
    result = run_cli("verify", expanded, *VERIFY, "--json")
    assert json.loads(result.stdout)["proof"]["manifest_check"] == "unchanged"
    assert "edited" not in result.stderr
    _edit_manifest(expanded, lambda m: m.update(warnings=["hand-written"]))
    result = run_cli("verify", expanded, *VERIFY, "--json")
    assert result.exit_code == 0, result.output  # the claims are checked all the same: still parity
    assert json.loads(result.stdout)["proof"]["manifest_check"] == "edited"
    assert f"warning: {expanded / 'otdus.json'} was edited since otdus wrote it" in result.stderr
    static = run_cli("verify", expanded, "--static")
    assert "was edited since otdus wrote it" in static.stderr


def test_a_base_resaved_with_another_layout_is_still_the_base(expanded, tmp_path):
    from tests.support.tiny_models import load_causal_lm

    base = expanded.parent / "stories260k"
    resaved = tmp_path / "resaved"
    load_causal_lm(base).save_pretrained(resaved, max_shard_size="300KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / name, resaved / name)
    assert (resaved / "model.safetensors.index.json").is_file()  # sharded now, config re-written
    result = run_cli("verify", expanded, "--base", resaved, *VERIFY)
    assert result.exit_code == 0, result.output


def test_a_base_retrained_since_is_a_wrong_base_not_a_broken_expansion(expanded, tmp_path):
    base = expanded.parent / "stories260k"
    _perturb_layer(base, "model.layers.3.mlp.up_proj.weight")
    line = one_line(run_cli("verify", expanded, "--base", base, *VERIFY), 2)
    assert "layer 3 differs from the recorded fingerprint" in line


def test_a_damaged_copied_layer_is_broken_and_named(expanded):
    _perturb_layer(expanded, "model.layers.1.self_attn.v_proj.weight")
    result = run_cli("verify", expanded, *VERIFY, "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["verdict"].startswith("BROKEN")
    assert "static check: base layer 1 does not appear, in order, as a copy" in report["verdict"]
    assert report["first_divergence"]["expanded_layer"] == 1
    finding = report["proof"]["layers"][1]
    assert finding["note"].startswith("claimed a copy of base layer 1, but its tensors differ")


def test_a_recorded_path_that_is_gone_is_never_looked_up_elsewhere(expanded, tmp_path, monkeypatch):
    base = expanded.parent / "stories260k"
    # the id recorded is relative; a folder of that name exists where verify runs, but is not the base
    _edit_manifest(expanded, lambda m: m["source"].update(id="stories260k", kind="local"))
    decoy_dir = tmp_path / "elsewhere"
    decoy_dir.mkdir()
    shutil.copytree(base, decoy_dir / "stories260k")
    shutil.rmtree(base)
    monkeypatch.chdir(decoy_dir)
    line = one_line(run_cli("verify", expanded, *VERIFY), 2)
    assert "no longer exists" in line and "--base" in line


def test_a_gone_local_path_is_not_taken_for_a_hub_repository(expanded, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    shutil.rmtree(expanded.parent / "stories260k")
    _edit_manifest(expanded, lambda m: m["source"].update(id="org/model", kind="local"))
    line = one_line(run_cli("verify", expanded, *VERIFY), 2)
    assert "no longer exists" in line and "hub" not in line


@pytest.mark.parametrize(
    "damage",
    [
        lambda m: m.update(layers=5),
        lambda m: m.update(source="somewhere"),
        lambda m: m["layers"][0].update(source="zero"),
        lambda m: m.pop("otdus_version"),
        lambda m: m.update(num_hidden_layers=99),
    ],
)
def test_damaged_manifest_is_one_line_everywhere(expanded, damage):
    _edit_manifest(expanded, damage)
    for args in (["inspect", expanded], ["verify", expanded, *VERIFY]):
        assert "is damaged" in one_line(run_cli(*args), 2)


def test_manifest_that_is_not_json_is_one_line(expanded):
    (expanded / "otdus.json").write_text("{not json")
    assert "not valid JSON" in one_line(run_cli("inspect", expanded), 2)


class _Marker:
    """Unpickling this runs os.system: a harmless stand-in for code a malicious checkpoint carries."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _malicious_bin(folder: Path, marker: Path) -> None:
    """A pytorch_model.bin (torch's zip format) whose pickle calls os.system."""
    for f in folder.glob("*.safetensors"):
        f.unlink()
    with zipfile.ZipFile(folder / "pytorch_model.bin", "w") as z:
        z.writestr(
            "archive/data.pkl", pickle.dumps({"model.embed_tokens.weight": _Marker(marker)}, protocol=2)
        )
        z.writestr("archive/version", "3\n")
        z.writestr("archive/byteorder", "little")


@pytest.mark.parametrize("command", ["inspect", "diagnose"])  # plan and expand: test_expand.py
def test_malicious_pickle_is_one_line_and_never_runs(stories, tmp_path, command):
    marker = tmp_path / "pwned"
    _malicious_bin(stories, marker)
    args = {
        "inspect": ["inspect", stories],
        "diagnose": ["diagnose", stories, "--max-tokens", "64", "--seq-len", "32"],
    }[command]
    line = one_line(run_cli(*args), 2)
    assert "weights_only" in line and "weights_only=False" not in line
    assert not marker.exists()
