"""What otdus.json records of the files otdus wrote, read back: a claim (function-preserving) is of
the files as written, and inspect and verify say when they changed since (weights trained in place)."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from otdus_cli.cli import app
from otdus_cli.expand import expand
from otdus_cli.manifest import changed_since_written
from otdus_cli.options import ExpandOptions

pytestmark = [pytest.mark.usefixtures("single_thread")]
runner = CliRunner()


def test_inspect_and_verify_say_the_files_changed_since_otdus_wrote_them(tmp_path):
    out = tmp_path / "out"
    expand("bundled:stories260k", out, ExpandOptions(method="ot", layers=2))
    assert changed_since_written(out) == []
    # a training step saved in place: a new layer's zeroed projection moved
    shard = out / "model.safetensors"
    tensors = load_file(shard)
    tensors["model.layers.3.mlp.down_proj.weight"] += 0.01
    save_file(tensors, shard, metadata={"format": "pt"})
    assert [c.split(" (")[0] for c in changed_since_written(out)] == ["model.safetensors"]
    shown = runner.invoke(app, ["inspect", str(out)], env={"COLUMNS": "300"}).stdout
    assert "True as written; changed since otdus wrote it: model.safetensors" in shown
    info = json.loads(runner.invoke(app, ["inspect", str(out), "--json"]).stdout)
    assert info["changed_since_written"][0].startswith("model.safetensors (")
    args = ["verify", str(out), "--text", "bundled:tinystories-sample", "--max-tokens", "200"]
    done = runner.invoke(app, args)
    assert done.exit_code == 1
    verdict = next(line for line in done.stdout.splitlines() if line.startswith("BROKEN"))
    assert "changed since otdus wrote it: model.safetensors" in verdict
