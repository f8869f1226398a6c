"""otdus_cli/io/reader.py: a checkpoint folder read as the safetensors library and torch read it
(single file, sharded with an index, pickle shards loaded weights-only), row ranges and raw bytes
included; and every folder it cannot trust refused with one error line, through the CLI too (exit 2,
nothing written)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from otdus_cli.cli import app
from otdus_cli.errors import OtdusError
from otdus_cli.io.reader import CheckpointReader
from otdus_cli.io.writer import PlannedTensor, ShardedWriter
from tests.support.cli_checks import no_output_left, one_error_line

runner = CliRunner()
TENSORS = {
    "model.embed_tokens.weight": torch.randn(12, 4, generator=torch.Generator().manual_seed(0)),
    "model.layers.0.mlp.up_proj.weight": torch.randn(
        6, 4, generator=torch.Generator().manual_seed(1)
    ).bfloat16(),
    "model.norm.weight": torch.rand(4, generator=torch.Generator().manual_seed(2)).half(),
    "model.layers.0.scalar": torch.tensor(2.5),
}
CONFIG = {"model_type": "llama", "num_hidden_layers": 1}


def run_cli(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def assert_clean_failure(result, message: str, parent: Path, code: int = 2) -> None:
    one_error_line(result, code, message)
    no_output_left(parent)


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _folder(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(CONFIG))
    return path


def _single(path: Path) -> Path:
    save_file(TENSORS, _folder(path) / "model.safetensors", metadata={"format": "pt"})
    return path


def _sharded(path: Path) -> Path:
    """Two shards and their index, written by hand (the library's save_file, one file each)."""
    names = list(TENSORS)
    shards = {"a.safetensors": names[:2], "b.safetensors": names[2:]}
    _folder(path)
    for shard, members in shards.items():
        save_file({n: TENSORS[n] for n in members}, path / shard)
    weight_map = {n: shard for shard, members in shards.items() for n in members}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def _index(path: Path) -> dict:
    return json.loads((path / "model.safetensors.index.json").read_text())


def _set_index(path: Path, index: dict) -> None:
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("layout", ["single", "sharded", "bin"])
def test_every_tensor_reads_as_the_library_stores_it(tmp_path, layout):
    if layout == "single":
        folder = _single(tmp_path / "m")
    elif layout == "sharded":
        folder = _sharded(tmp_path / "m")
    else:
        folder = _folder(tmp_path / "m")
        torch.save(TENSORS, folder / "pytorch_model.bin")
    reader = CheckpointReader(folder)
    assert set(reader.names) == set(TENSORS)
    assert reader.index_file == ("model.safetensors.index.json" if layout == "sharded" else None)
    assert reader.config == CONFIG
    for name, t in TENSORS.items():
        meta = reader.meta(name)
        assert (meta.shape, reader.nbytes(name)) == (tuple(t.shape), t.numel() * t.element_size()), name
        got = reader.get(name)
        assert got.dtype == t.dtype and _raw(got) == _raw(t), name
        assert reader.read_bytes(name, 2, 6) == _raw(t)[2:8], name
        if t.dim():
            assert _raw(reader.get_rows(name, 1, 3)) == _raw(t[1:3]), name
            assert reader.get_rows(name, 5, 100).shape[0] == max(0, t.shape[0] - 5), name  # clipped
        assert (reader.raw(name) is None) == (layout == "bin"), name
    assert reader.total_bytes() == sum(t.numel() * t.element_size() for t in TENSORS.values())
    assert name in reader and "model.other" not in reader


def test_a_raw_location_points_at_the_tensors_bytes(tmp_path):
    folder = _single(tmp_path / "m")
    data = (folder / "model.safetensors").read_bytes()
    for name, t in TENSORS.items():
        info = CheckpointReader(folder).raw(name)
        assert data[info.begin : info.begin + info.nbytes] == _raw(t), name


def test_a_checkpoint_otdus_wrote_reads_back_as_written(tmp_path):
    out = _folder(tmp_path / "out")
    plan = [PlannedTensor(n, {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}[t.dtype],
                          tuple(t.shape)) for n, t in TENSORS.items()]  # fmt: skip
    writer = ShardedWriter(out, plan, 40)
    for name, t in TENSORS.items():
        writer.write_tensor(name, t)
    writer.finish()
    reader = CheckpointReader(out)
    assert reader.index_file == "model.safetensors.index.json"
    for name, t in TENSORS.items():
        assert _raw(reader.get(name)) == _raw(t), name
        shard = _index(out)["weight_map"][name]
        assert _raw(load_file(out / shard)[name]) == _raw(t), name


def _unlisted(folder: Path) -> None:
    index = _index(folder)
    del index["weight_map"]["model.norm.weight"]
    _set_index(folder, index)


def _listed_missing(folder: Path) -> None:
    index = _index(folder)
    index["weight_map"]["model.extra"] = "a.safetensors"
    _set_index(folder, index)


def _twice(folder: Path) -> None:
    save_file(
        {"model.norm.weight": TENSORS["model.norm.weight"], "x": torch.zeros(1)}, folder / "c.safetensors"
    )
    index = _index(folder)
    index["weight_map"]["x"] = "c.safetensors"
    _set_index(folder, index)


def _absolute(folder: Path) -> None:
    index = _index(folder)
    index["weight_map"]["model.norm.weight"] = str(folder / "b.safetensors")
    _set_index(folder, index)


def _odd_name(folder: Path) -> None:
    index = _index(folder)
    index["weight_map"]["model.norm\nx: y"] = "a.safetensors"
    _set_index(folder, index)


def _bad_weight_map(folder: Path) -> None:
    _set_index(folder, {"weight_map": ["a.safetensors"]})


def _not_json(folder: Path) -> None:
    (folder / "model.safetensors.index.json").write_text("{")


# (what is wrong, how the sharded folder is damaged, the error's text)
DAMAGED = [
    (
        "a shard holds a tensor the index does not list",
        _unlisted,
        "b.safetensors holds tensor model.norm.weight, which",
    ),
    (
        "the index lists a tensor no shard holds",
        _listed_missing,
        "a.safetensors does not contain model.extra",
    ),
    (
        "a tensor stored twice",
        _twice,
        "tensor model.norm.weight is stored twice, in b.safetensors and c.safetensors",
    ),
    ("an absolute shard path", _absolute, "index names an absolute shard path"),
    (
        "an index naming a tensor that is not identifiers joined by dots",
        _odd_name,
        "model.safetensors.index.json: tensor name 'model.norm\\nx: y' is not",
    ),
    (
        "a weight_map that is not a map",
        _bad_weight_map,
        "model.safetensors.index.json is corrupt (no valid weight_map)",
    ),
    ("an index that is not JSON", _not_json, "model.safetensors.index.json is not valid JSON"),
    ("a missing shard", lambda f: (f / "b.safetensors").unlink(), "missing shard b.safetensors"),
    ("no config", lambda f: (f / "config.json").unlink(), "no config.json in"),
    (
        "a config that is a list",
        lambda f: (f / "config.json").write_text("[]"),
        "config.json is not a JSON object",
    ),
]


@pytest.mark.parametrize("damage, message", [d[1:] for d in DAMAGED], ids=[d[0] for d in DAMAGED])
def test_a_folder_it_cannot_trust_is_refused(tmp_path, damage, message):
    folder = _sharded(tmp_path / "m")
    damage(folder)
    with pytest.raises(OtdusError) as caught:
        CheckpointReader(folder)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_folder_without_weights_or_tensors_is_refused(tmp_path):
    with pytest.raises(OtdusError, match="model folder not found"):
        CheckpointReader(tmp_path / "nowhere")
    folder = _folder(tmp_path / "m")
    with pytest.raises(OtdusError, match="no weights in"):
        CheckpointReader(folder)
    torch.save([1, 2], folder / "pytorch_model.bin")
    with pytest.raises(OtdusError, match="pytorch_model.bin: not a state dict"):
        CheckpointReader(folder)


def test_a_pickle_that_runs_code_is_not_loaded(tmp_path):
    folder = _folder(tmp_path / "m")
    torch.save({"w": torch.zeros(1), "f": Path}, folder / "pytorch_model.bin")  # a class: not weights-only
    with pytest.raises(OtdusError, match="cannot load safely with weights_only"):
        CheckpointReader(folder)


def test_a_pickle_holding_a_name_that_is_not_identifiers_is_refused(tmp_path):
    folder = _folder(tmp_path / "m")
    torch.save({"model.norm\nx: y": torch.zeros(1)}, folder / "pytorch_model.bin")
    with pytest.raises(OtdusError, match=r"pytorch_model.bin: tensor name 'model.norm\\nx: y' is not"):
        CheckpointReader(folder)


def test_an_unknown_tensor_is_named(tmp_path):
    reader = CheckpointReader(_single(tmp_path / "m"))
    for read in (reader.meta, reader.get):
        with pytest.raises(OtdusError, match="tensor model.other not found in"):
            read("model.other")


# -- the same refusals as a user meets them: one error line, exit 2, nothing written -------------------


def test_missing_shard(sharded_llama, tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    for f in sharded_llama.iterdir():
        os.symlink(f, src / f.name)
    victim = sorted(src.glob("model-0000*.safetensors"))[1]
    victim.unlink()
    assert_clean_failure(
        run_cli("expand", src, "--out", tmp_path / "out", "--method", "copy"),
        f"missing shard {victim.name}",
        tmp_path,
    )


def test_truncated_shard(stories, tmp_path):
    f = stories / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    assert_clean_failure(run_cli("expand", stories, "--out", tmp_path / "out"), "truncated", tmp_path)


def test_corrupt_header(stories, tmp_path):
    f = stories / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:16] = b"\xff\xfe{{{{{{"
    f.write_bytes(bytes(data))
    assert_clean_failure(run_cli("expand", stories, "--out", tmp_path / "out"), "corrupt", tmp_path)


def test_not_a_safetensors_file(stories, tmp_path):
    (stories / "model.safetensors").write_bytes(b"abc")
    assert_clean_failure(
        run_cli("expand", stories, "--out", tmp_path / "out"), "not a safetensors file", tmp_path
    )


def test_index_path_escaping_the_model_folder(sharded_llama, tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    for f in sharded_llama.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    index = json.loads((src / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../model/" + index["weight_map"][name]  # still inside: allowed
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert run_cli("plan", src, "--method", "copy").exit_code == 0
    index["weight_map"][name] = "../../etc/passwd"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_clean_failure(
        run_cli("expand", src, "--out", tmp_path / "out"), "escapes the model folder", tmp_path
    )
