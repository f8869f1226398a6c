"""otdus_cli/io/writer.py: shards written one tensor at a time load in the safetensors library bit for
bit (built, copied and zeroed tensors alike), sharding and the index say where every tensor is, and a
plan the writer was not given is refused rather than written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from otdus_cli.errors import OtdusError
from otdus_cli.io.safetensors_format import read_header
from otdus_cli.io.writer import PlannedTensor, ShardedWriter, parse_size, partition, shard_names

TENSORS = {
    "embed": torch.randn(16, 8, generator=torch.Generator().manual_seed(0)),
    "layer.0.w": torch.randn(8, 8, generator=torch.Generator().manual_seed(1)).bfloat16(),
    "layer.0.norm": torch.rand(8, generator=torch.Generator().manual_seed(2)).half(),
    "layer.1.w": torch.randn(8, 8, generator=torch.Generator().manual_seed(3)).bfloat16(),
    "steps": torch.tensor(3, dtype=torch.int64),
}
CODE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64"}


def _plan(tensors: dict[str, torch.Tensor]) -> list[PlannedTensor]:
    return [PlannedTensor(name, CODE[t.dtype], tuple(t.shape)) for name, t in tensors.items()]


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _write_all(folder: Path, max_shard_bytes: int) -> dict[str, str]:
    writer = ShardedWriter(folder, _plan(TENSORS), max_shard_bytes)
    for name, t in TENSORS.items():
        writer.write_tensor(name, t)
    return writer.finish()


def test_one_shard_loads_in_the_library_bit_for_bit(tmp_path):
    weight_map = _write_all(tmp_path, 10**9)
    assert set(weight_map.values()) == {"model.safetensors"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no index for one shard
    loaded = load_file(tmp_path / "model.safetensors")
    assert set(loaded) == set(TENSORS)
    for name, t in TENSORS.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape, name
        assert _raw(loaded[name]) == _raw(t), name
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}  # what transformers checks before loading


def test_shards_and_index_say_where_every_tensor_is(tmp_path):
    weight_map = _write_all(tmp_path, 200)  # 512 B of embed alone, then 144 and 136 bytes, in plan order
    files = shard_names(3)
    assert files[0] == "model-00001-of-00003.safetensors"
    assert weight_map == {
        "embed": files[0],
        "layer.0.w": files[1],
        "layer.0.norm": files[1],
        "layer.1.w": files[2],
        "steps": files[2],
    }
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == weight_map
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in TENSORS.values())
    for shard in files:
        with safe_open(tmp_path / shard, framework="pt") as f:
            assert {k for k, v in weight_map.items() if v == shard} == set(f.keys()), shard
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                assert _raw(f.get_tensor(name)) == _raw(TENSORS[name]), name


def test_raw_copies_and_zeros_are_the_bytes_they_should_be(tmp_path):
    source = tmp_path / "source.safetensors"
    save_file({"w": TENSORS["layer.0.w"], "e": TENSORS["embed"]}, source)
    infos, _ = read_header(str(source))
    out = tmp_path / "out"
    out.mkdir()
    plan = [PlannedTensor("copied", "BF16", (8, 8)), PlannedTensor("zeros", "F32", (16, 8))]
    writer = ShardedWriter(out, plan, 10**9)
    assert writer.copy_raw("copied", infos["w"]) == 128
    assert writer.write_zeros("zeros") == 512
    writer.finish()
    loaded = load_file(out / "model.safetensors")
    assert _raw(loaded["copied"]) == _raw(TENSORS["layer.0.w"])
    assert _raw(loaded["zeros"]) == bytes(512)


def test_a_built_tensor_is_cast_to_its_planned_dtype(tmp_path):
    value = torch.randn(4, 4, generator=torch.Generator().manual_seed(5))
    writer = ShardedWriter(tmp_path, [PlannedTensor("w", "BF16", (4, 4))], 10**9)
    writer.write_tensor("w", value)
    writer.finish()
    assert _raw(load_file(tmp_path / "model.safetensors")["w"]) == _raw(value.bfloat16())


def test_what_the_plan_does_not_allow_is_refused(tmp_path):
    plan = [PlannedTensor("a", "F32", (2, 2)), PlannedTensor("b", "BF16", (2,))]
    writer = ShardedWriter(tmp_path, plan, 10**9)
    with pytest.raises(RuntimeError, match=r"a: built shape \(3, 2\) differs from planned \(2, 2\)"):
        writer.write_tensor("a", torch.zeros(3, 2))
    writer = ShardedWriter(tmp_path, plan, 10**9)
    writer.write_tensor("a", torch.zeros(2, 2))
    with pytest.raises(RuntimeError, match="tensor a written twice"):
        writer.write_tensor("a", torch.zeros(2, 2))
    source = tmp_path / "s.safetensors"
    save_file({"x": torch.zeros(2)}, source)  # F32: 8 bytes, b is BF16: 4
    with pytest.raises(RuntimeError, match="b: raw copy between different dtypes or sizes"):
        writer.copy_raw("b", read_header(str(source))[0]["x"])
    writer = ShardedWriter(tmp_path, plan, 10**9)
    writer.write_tensor("a", torch.zeros(2, 2))
    with pytest.raises(RuntimeError, match="1 planned tensors were never written, e.g. b"):
        writer.finish()


def test_partition_keeps_order_and_gives_a_big_tensor_its_own_shard():
    sizes = [("a", 100), ("b", 100), ("big", 1000), ("c", 50), ("d", 60)]
    plan = [PlannedTensor(n, "U8", (s,)) for n, s in sizes]
    assert [[t.name for t in group] for group in partition(plan, 250)] == [["a", "b"], ["big"], ["c", "d"]]
    assert shard_names(1) == ["model.safetensors"]


@pytest.mark.parametrize(
    "text, value",
    [
        ("5GB", 5 * 10**9),
        ("500MB", 500 * 10**6),
        ("2GiB", 2 * 2**30),
        ("1.5 kb", 1500),
        ("4096", 4096),
        (7, 7),
    ],
)
def test_sizes_read_as_transformers_reads_them(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["lots", "inf", "0MB", "-5GB"])
def test_a_size_that_is_not_one_is_one_error(text):
    with pytest.raises(OtdusError) as caught:
        parse_size(text)
    assert repr(text) in str(caught.value)
