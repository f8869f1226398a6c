"""A source whose parts disagree would expand into a silently different model: refused up front.

transformers reads every tensor of every shard and builds the model from config.json; otdus reads
tensors through the index. A tensor the index does not list, a tensor stored twice, or a config whose
dimensions disagree with the tensors must each be one `error:` line, exit 2, and no output.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from otdus_cli.cli import app
from tests.support.cli_checks import no_output_left, one_error_line

runner = CliRunner()


def expand(src: Path, out: Path):
    return runner.invoke(app, ["expand", str(src), "--out", str(out), "--method", "copy"])


def refused(src: Path, tmp_path: Path, message: str) -> None:
    one_error_line(expand(src, tmp_path / "out"), 2, message)
    no_output_left(tmp_path)


@pytest.fixture()
def sharded(sharded_llama, tmp_path) -> Path:
    return Path(shutil.copytree(sharded_llama, tmp_path / "model"))


def _index(src: Path) -> tuple[Path, dict]:
    path = src / "model.safetensors.index.json"
    return path, json.loads(path.read_text())


def test_a_tensor_the_index_does_not_list_is_refused(sharded, tmp_path):
    path, index = _index(sharded)
    dropped = sorted(index["weight_map"])[3]
    del index["weight_map"][dropped]
    path.write_text(json.dumps(index))
    refused(sharded, tmp_path, f"holds tensor {dropped}, which model.safetensors.index.json does not list")


def test_a_tensor_stored_in_two_shards_is_refused(sharded, tmp_path):
    _, index = _index(sharded)
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, s in sorted(index["weight_map"].items()) if s == shards[0])
    other = sharded / shards[1]
    tensors = load_file(other)
    tensors[name] = load_file(sharded / shards[0])[name] + 1  # a different value under the same name
    save_file(tensors, other, metadata={"format": "pt"})
    refused(sharded, tmp_path, f"tensor {name} is stored twice")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("hidden_size", 96, "hidden_size"),
        ("intermediate_size", 128, "intermediate_size"),
        ("num_attention_heads", 4, "num_attention_heads x head_dim"),
        ("num_key_value_heads", 8, "num_key_value_heads x head_dim"),
        ("head_dim", 16, "head_dim"),
        ("vocab_size", 600, "vocab_size"),
    ],
)
def test_a_config_whose_dimensions_disagree_with_the_tensors_is_refused(
    stories, tmp_path, field, value, message
):
    path = stories / "config.json"
    config = json.loads(path.read_text())
    config[field] = value
    path.write_text(json.dumps(config))
    refused(stories, tmp_path, message)


def test_a_consistent_source_still_expands(sharded, tmp_path):
    result = expand(sharded, tmp_path / "out")
    assert result.exit_code == 0, result.output
