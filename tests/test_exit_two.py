"""Bad input that used to end in exit 3 ("unexpected ..."): each is one `error:` line and exit 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from otdus_cli.cli import app
from tests.support.cli_checks import no_output_left, one_error_line

runner = CliRunner()
OTDUS = [sys.executable, "-m", "otdus_cli.cli"]


def run_cli(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("model", ["x/..", "org/name.", "a--b/c", "org/.name"])
def test_malformed_hub_ids(tmp_path, model, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    one_error_line(run_cli("expand", model, "--out", tmp_path / "out"), 2, model)
    no_output_left(tmp_path)


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--max-shard-size", "inf"], "cannot read size 'inf'"), (["--ratio", "inf"], "--ratio must be")],
)
def test_infinite_numbers(stories, tmp_path, flags, message):
    one_error_line(
        run_cli("expand", stories, "--out", tmp_path / "out", "--method", "copy", *flags), 2, message
    )
    no_output_left(tmp_path)


def test_a_binary_recipe(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(bytes(range(256)) * 4)
    one_error_line(run_cli("expand", "--recipe", recipe, "--out", tmp_path / "out"), 2, "not a text file")
    no_output_left(tmp_path)


def test_an_unreadable_side_file_stops_the_run_before_any_tensor(stories, tmp_path):
    side = stories / "tokenizer.json"
    side.unlink()
    side.symlink_to("/proc/self/mem")  # a file every read of fails (EIO), even for root
    one_error_line(
        run_cli("expand", stories, "--out", tmp_path / "out", "--method", "copy"), 2, "cannot read"
    )
    no_output_left(tmp_path)


@pytest.fixture()
def small_vocab(stories) -> Path:
    """stories260K with half its embedding rows (and vocab_size saying so): its tokenizer gives ids past
    the embedding."""
    weights = stories / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:256].clone()
    save_file(tensors, weights, metadata={"format": "pt"})
    config = json.loads((stories / "config.json").read_text())
    (stories / "config.json").write_text(json.dumps({**config, "vocab_size": 256}))
    return stories


@pytest.mark.parametrize("command", ["ppl", "verify"])
def test_a_tokenizer_larger_than_the_embedding(small_vocab, command):
    base = ["--base", str(small_vocab)] if command == "verify" else []  # verify needs a base
    result = run_cli(command, small_vocab, *base, "--max-tokens", "64")
    one_error_line(result, 2, "the tokenizer does not belong to this model")


@pytest.mark.parametrize(
    "damage",
    [{"other": [1, 2]}, {"layers": 5}, {"layers": [[1]] * 5}, {"other": {"lm_head.weight": 7}}],
)
def test_malformed_manifest_fingerprints(stories, tmp_path, damage):
    out = tmp_path / "out"
    assert run_cli("expand", stories, "--out", out, "--method", "copy").exit_code == 0
    manifest = json.loads((out / "otdus.json").read_text())
    manifest["source"]["fingerprints"].update(damage)
    (out / "otdus.json").write_text(json.dumps(manifest))
    one_error_line(run_cli("verify", out, "--base", stories, "--static"), 2, "otdus.json is damaged")


_AS_MAPPED_ROOT = ["unshare", "--user", "--map-root-user"]


def _user_namespaces_work() -> bool:
    return shutil.which("unshare") is not None and subprocess.run([*_AS_MAPPED_ROOT, "true"]).returncode == 0


@pytest.mark.skipif(not _user_namespaces_work(), reason="needs unprivileged user namespaces (unshare -r)")
def test_an_unreadable_source_folder(stories, tmp_path):
    """Root reads every folder, so the test runs otdus as the root of a user namespace, where a folder
    of an unmapped owner with mode 000 is unreadable (as a user's folder of another account is)."""
    os.chown(stories, 12345, 12345)
    os.chmod(stories, 0)
    out = tmp_path / "out"
    done = subprocess.run(
        [
            *_AS_MAPPED_ROOT,
            *OTDUS,
            "expand",
            str(stories),
            "--out",
            str(out),
            "--method",
            "copy",
            "--layers",
            "1",
        ],
        capture_output=True,
        text=True,
    )
    os.chmod(stories, 0o755)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("error: cannot read") and "Permission denied" in lines[0], lines
    assert not out.exists()
