"""otdus_cli/io/safetensors_format.py: the file layout otdus parses and writes by hand, checked against
the safetensors library (headers it builds load there bit for bit; files the library writes parse to the
right byte ranges), and every malformed header refused with the one line a user sees."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from otdus_cli.errors import OtdusError
from otdus_cli.io.safetensors_format import (
    DATA_ALIGNMENT,
    KNOWN_CODES,
    MAX_HEADER_BYTES,
    TENSOR_NAME,
    build_header,
    code_of,
    itemsize,
    read_header,
    torch_dtype,
)

# every dtype the table knows, with a tensor of it (zero-size and 0-d shapes included)
SAMPLES = {
    "F64": torch.randn(3, 2, dtype=torch.float64),
    "F32": torch.randn(5, generator=torch.Generator().manual_seed(1)),
    "F16": torch.randn(2, 3).half(),
    "BF16": torch.randn(4, 4).bfloat16(),
    "I64": torch.arange(-3, 3, dtype=torch.int64),
    "I32": torch.tensor(7, dtype=torch.int32),  # 0-d
    "I16": torch.arange(6, dtype=torch.int16).reshape(2, 3),
    "I8": torch.tensor([-128, 0, 127], dtype=torch.int8),
    "U8": torch.arange(250, 256, dtype=torch.uint8),
    "BOOL": torch.tensor([True, False, True]),
    "F8_E4M3": torch.randn(8).to(torch.float8_e4m3fn),
    "F8_E5M2": torch.randn(8).to(torch.float8_e5m2),
}


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _write(path: Path, header: dict | str | bytes, data: bytes, length: int | None = None) -> Path:
    blob = (
        header
        if isinstance(header, bytes)
        else (header if isinstance(header, str) else json.dumps(header)).encode()
    )
    path.write_bytes(struct.pack("<Q", len(blob) if length is None else length) + blob + data)
    return path


def test_the_dtype_table_is_the_librarys():
    """Every code otdus knows is the one the library writes for that torch dtype, with its item size."""
    assert set(SAMPLES) == KNOWN_CODES
    for code, tensor in SAMPLES.items():
        assert code_of(tensor.dtype) == code
        assert torch_dtype(code) == tensor.dtype
        assert itemsize(code) == tensor.element_size()
    assert code_of(torch.complex64) is None  # safetensors cannot store it


def test_a_header_otdus_builds_loads_in_the_library_bit_for_bit(tmp_path):
    entries = [(f"t.{code}", code, tuple(t.shape)) for code, t in SAMPLES.items()]
    entries.append(("empty", "F32", (0, 4)))
    tensors = {**{f"t.{c}": t for c, t in SAMPLES.items()}, "empty": torch.zeros(0, 4)}
    prefix, offsets = build_header(entries, {"format": "pt", "note": "ok"})
    out = bytearray(prefix)
    for offset, (name, _, _) in sorted(zip(offsets, entries, strict=True)):
        assert offset == len(out)  # no gap, no overlap
        out += _raw(tensors[name])
    path = tmp_path / "built.safetensors"
    path.write_bytes(bytes(out))
    loaded = load_file(path)
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape, name
        assert _raw(loaded[name]) == _raw(t), name
    infos, metadata = read_header(str(path))
    assert metadata == {"format": "pt", "note": "ok"}
    assert [infos[n].begin for n, _, _ in entries] == offsets


@pytest.mark.parametrize("name_length", range(1, 9))
def test_tensors_start_where_torch_would_allocate_them(name_length):
    """The data buffer starts at a multiple of 64 bytes whatever the header's length (it was padded to
    8: transformers maps the file, so a tensor kept the header's alignment, and DBRX's experts computed
    otherwise than in memory), and so does every tensor whose size is a multiple of 64, an odd-sized
    one listed before them included (it is laid out after them)."""
    entries = [("n" * name_length, "F32", (3,)), ("w", "BF16", (32, 16)), ("b", "I8", (5,))]
    entries.append(("v", "F32", (16,)))
    prefix, offsets = build_header(entries, {"format": "pt"})
    assert len(prefix) % DATA_ALIGNMENT == 0
    assert offsets[1] % DATA_ALIGNMENT == 0 and offsets[3] % DATA_ALIGNMENT == 0
    assert sorted(offsets)[:2] == [len(prefix), len(prefix) + 32 * 16 * 2]


def test_a_file_the_library_writes_parses_to_its_byte_ranges(tmp_path):
    tensors = {f"layer.{code}": t for code, t in SAMPLES.items()}
    path = tmp_path / "lib.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    infos, metadata = read_header(str(path))
    assert metadata == {"format": "pt"} and set(infos) == set(tensors)
    data = path.read_bytes()
    for name, info in infos.items():
        t = tensors[name]
        assert (info.dtype, info.shape, info.numel) == (code_of(t.dtype), tuple(t.shape), t.numel())
        assert info.file == str(path.resolve())
        assert data[info.begin : info.begin + info.nbytes] == _raw(t), name


def test_a_header_without_metadata_is_read(tmp_path):
    path = _write(
        tmp_path / "m.safetensors", {"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, b"xy"
    )
    infos, metadata = read_header(str(path))
    assert metadata == {} and infos["a"].nbytes == 2 and infos["a"].begin == path.stat().st_size - 2


def _entry(code="U8", shape=(4,), offsets=(0, 4)) -> dict:
    return {"dtype": code, "shape": list(shape), "data_offsets": list(offsets)}


# (what is wrong, header, data, the error line's text)
MALFORMED = [
    ("invalid JSON", b"{not json", b"", "corrupt safetensors header (not valid JSON)"),
    ("not UTF-8", b"\xff\xfe{}", b"", "corrupt safetensors header (not valid JSON)"),
    ("a list", "[1, 2]", b"", "corrupt safetensors header (not a JSON object)"),
    (
        "metadata not strings",
        {"__metadata__": {"format": 1}},
        b"",
        "__metadata__ must map strings to strings",
    ),
    ("entry not an object", {"a": [1]}, b"", "corrupt header entry for tensor 'a'"),
    ("negative shape", {"a": _entry(shape=(-4,))}, b"abcd", "corrupt header entry for tensor 'a' (shape"),
    ("bool in shape", {"a": _entry(shape=(True, 4))}, b"abcd", "corrupt header entry for tensor 'a' (shape"),
    ("float offsets", {"a": {**_entry(), "data_offsets": [0.0, 4.0]}}, b"abcd", "(shape or data_offsets)"),
    ("unknown dtype", {"a": _entry(code="F4")}, b"abcd", "tensor 'a' has unsupported dtype F4"),
    ("offsets not the shape's size", {"a": _entry(offsets=(0, 3))}, b"abc", "offsets do not match its shape"),
    ("data past the end", {"a": _entry()}, b"ab", "truncated file, tensor 'a' ends at byte"),
    (
        "a gap",
        {"a": _entry(offsets=(0, 4)), "b": _entry(offsets=(6, 10))},
        b"0123456789",
        "tensor 'b' leaves a gap before it",
    ),
    (
        "an overlap",
        {"a": _entry(offsets=(0, 4)), "b": _entry(offsets=(2, 6))},
        b"012345",
        "tensor 'b' overlaps the previous tensor",
    ),
    (
        "bytes after the tensors",
        {"a": _entry()},
        b"abcdef",
        "its tensors cover 4 bytes of a 6-byte data buffer",
    ),
    (
        "a name that writes YAML keys",
        {"model.norm\nfinetuning_type: full\nx: norm.weight": _entry()},
        b"abcd",
        "tensor name 'model.norm\\nfinetuning_type: full\\nx: norm.weight' is not letters, digits",
    ),
    (
        "a name given twice",
        '{"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}, '
        '"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}',
        b"abcd",
        "corrupt safetensors header (not valid JSON)",
    ),
]


@pytest.mark.parametrize("header, data, message", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_a_malformed_header_is_one_error_naming_the_file(tmp_path, header, data, message):
    path = _write(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(OtdusError) as caught:
        read_header(str(path))
    assert str(caught.value).startswith("bad.safetensors: ") and message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_short_or_overlong_file_is_refused_before_its_header_is_read(tmp_path):
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"abc")
    with pytest.raises(OtdusError, match=r"short.safetensors: not a safetensors file \(shorter than"):
        read_header(str(short))
    for length in (1000, MAX_HEADER_BYTES + 1):
        path = _write(tmp_path / "long.safetensors", "{}", b"", length=length)
        with pytest.raises(
            OtdusError, match=rf"corrupt or truncated safetensors file \(header length {length}\)"
        ):
            read_header(str(path))


def test_a_missing_file_is_named():
    with pytest.raises(OtdusError, match="missing shard: /nonexistent/x.safetensors"):
        read_header("/nonexistent/x.safetensors")


# names of real checkpoints (transformers' own, state-space and GPT-2 style), and names that are not
# identifiers joined by dots
REAL_NAMES = [
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.31.mlp.experts.gate_up_proj",
    "backbone.layers.0.mixer.A_log",
    "transformer.h.11.attn.c_attn.bias",
    "lm_head.weight",
    "model.language_model.layers.0.input_layernorm.weight",
]
NOT_NAMES = ["", "a..b", ".a", "a.", "a b", "a-b", "a/b", "a\nb", "a\x00b", "Ä.weight", "a:b", "a.weight\n"]


@pytest.mark.parametrize("name", REAL_NAMES + NOT_NAMES)
def test_a_tensor_name_is_identifiers_joined_by_dots(tmp_path, name):
    assert bool(TENSOR_NAME.fullmatch(name)) == (name in REAL_NAMES)
    path = _write(tmp_path / "x.safetensors", {name: _entry()}, b"abcd")
    if name in REAL_NAMES:
        assert list(read_header(str(path))[0]) == [name]
        return
    with pytest.raises(OtdusError) as caught:
        read_header(str(path))
    assert str(caught.value).startswith(f"x.safetensors: tensor name {name!r} is not")
