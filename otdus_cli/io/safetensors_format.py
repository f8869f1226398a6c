"""The safetensors file layout, parsed and written by hand so tensors can be streamed.

A safetensors file is: 8 bytes little-endian header length N, N bytes of JSON header
({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}), then the
data buffer. Offsets are relative to the start of the data buffer. Knowing the header lets us
copy a tensor's bytes without decoding them and write a file one tensor at a time.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass

from otdus_cli.errors import OtdusError

# safetensors dtype code -> (torch dtype name, bytes per element). Kept as names so that reading
# headers and copying bytes never imports torch (seconds of start-up); ``torch_dtype`` maps them.
_DTYPE_TABLE: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
}
KNOWN_CODES = frozenset(_DTYPE_TABLE)
FLOAT_CODES = {"F64", "F32", "F16", "BF16"}
# torch dtype names (as in config.json's torch_dtype) -> code
CODE_OF_NAME: dict[str, str] = {name: code for code, (name, _) in _DTYPE_TABLE.items()}

MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
# where the data buffer of a file otdus writes starts: a multiple of the alignment torch gives the
# tensors it allocates (c10's 64 bytes). transformers loads a checkpoint's tensors as views of the
# mapped file, so their addresses keep the file's alignment; CPU kernels round differently on data
# aligned otherwise (DBRX's experts, a row slice multiplied by x.matmul(w.T), differ in the last bit
# when 8 bytes off), and a checkpoint laid out otherwise would not compute what it computed in memory
DATA_ALIGNMENT = 64


# A tensor name: identifiers joined by dots, as in every checkpoint transformers writes
# (model.layers.0.self_attn.q_proj.weight). safetensors allows any string, but names reach YAML,
# Markdown and JSON that otdus writes: a newline or a quote in one could add keys of its own there.
TENSOR_NAME = re.compile(r"[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*")


def check_tensor_name(name: object, where: str) -> None:
    """Refuse (OtdusError naming ``where``) a tensor name that is not identifiers joined by dots."""
    if isinstance(name, str) and TENSOR_NAME.fullmatch(name):
        return
    shown = repr(name[:200] + "..." if isinstance(name, str) and len(name) > 200 else name)
    raise OtdusError(
        f"{where}: tensor name {shown} is not letters, digits and underscores joined by dots; "
        "otdus reads no checkpoint holding such a name"
    )


def itemsize(code: str) -> int:
    return _DTYPE_TABLE[code][1]


def torch_dtype(code: str):
    """The torch dtype of a safetensors code (imports torch)."""
    import torch  # only tensor work needs torch

    return getattr(torch, _DTYPE_TABLE[code][0])


def code_of(dtype) -> str | None:
    """The safetensors code of a torch dtype, or None for one safetensors cannot store."""
    return CODE_OF_NAME.get(str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives on disk and what it is."""

    name: str
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    file: str  # absolute path of the shard
    begin: int  # absolute byte offset of the tensor data in the file
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate key")
    return dict(pairs)


def _shape(value: object) -> tuple[int, ...] | None:
    """A shape as safetensors accepts it: a list of non-negative integers (not bools, not floats)."""
    if not isinstance(value, list):
        return None
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in value):
        return None
    return tuple(value)


def _offsets(value: object) -> tuple[int, int] | None:
    if not isinstance(value, list) or len(value) != 2:
        return None
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value):
        return None
    return value[0], value[1]


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate one safetensors file's header; return its tensors and metadata.

    Enforces what the safetensors library enforces, so a truncated, corrupt or crafted file is one
    clear error before any output is written: a JSON object header of at most 100 MB, metadata a map
    of strings, every entry a known dtype, a shape of non-negative integers and offsets matching it,
    the tensors' byte ranges contiguous from 0 (no overlap, no gap) and ending exactly at the end of
    the file. Stricter in two points: a name given twice is refused (the library keeps one of them,
    and another reader might keep the other), and so is a name that is not identifiers joined by
    dots (:data:`TENSOR_NAME`).
    """
    name = os.path.basename(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise OtdusError(f"{name}: not a safetensors file (shorter than its 8-byte header length)")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise OtdusError(
                    f"{name}: corrupt or truncated safetensors file (header length {header_len})"
                )
            header = json.loads(f.read(header_len).decode("utf-8"), object_pairs_hook=_no_duplicates)
    except FileNotFoundError:
        raise OtdusError(f"missing shard: {path}") from None
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise OtdusError(f"{name}: corrupt safetensors header (not valid JSON)") from None
    except OSError as exc:
        raise OtdusError(f"{name}: cannot read ({exc.strerror})") from None
    if not isinstance(header, dict):
        raise OtdusError(f"{name}: corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise OtdusError(f"{name}: corrupt safetensors header (__metadata__ must map strings to strings)")
    data_start = 8 + header_len
    data_size = size - data_start
    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for tname, entry in header.items():
        check_tensor_name(tname, name)
        if not isinstance(entry, dict):
            raise OtdusError(f"{name}: corrupt header entry for tensor {tname!r}")
        code, shape, offsets = (
            entry.get("dtype"),
            _shape(entry.get("shape")),
            _offsets(entry.get("data_offsets")),
        )
        if shape is None or offsets is None:
            raise OtdusError(f"{name}: corrupt header entry for tensor {tname!r} (shape or data_offsets)")
        if not isinstance(code, str) or code not in KNOWN_CODES:
            raise OtdusError(f"{name}: tensor {tname!r} has unsupported dtype {code}")
        begin, end = offsets
        nbytes = math.prod(shape) * itemsize(code)
        if end < begin or end - begin != nbytes:
            raise OtdusError(f"{name}: corrupt header, tensor {tname!r} offsets do not match its shape")
        if end > data_size:
            raise OtdusError(
                f"{name}: truncated file, tensor {tname!r} ends at byte {data_start + end} "
                f"but the file has {size} bytes"
            )
        spans.append((begin, end, tname))
        tensors[tname] = TensorInfo(tname, code, shape, os.path.abspath(path), data_start + begin, nbytes)
    position = 0
    for begin, end, tname in sorted(spans):
        if begin != position:
            what = "overlaps the previous tensor" if begin < position else "leaves a gap before it"
            raise OtdusError(f"{name}: corrupt header, tensor {tname!r} {what} (byte {begin})")
        position = end
    if position != data_size:
        raise OtdusError(
            f"{name}: corrupt file, its tensors cover {position} bytes of a {data_size}-byte data buffer"
        )
    return tensors, dict(metadata)


def build_header(
    entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str]
) -> tuple[bytes, list[int]]:
    """Serialise a header for tensors laid out in the given order, but for those whose size is not a
    multiple of DATA_ALIGNMENT, which go last: the format allows no gap between tensors, so this way
    every other tensor starts at a multiple of it, as the data buffer does.

    Returns the header bytes (length prefix included, padded with spaces as the format allows so the
    data starts at a multiple of DATA_ALIGNMENT) and each entry's absolute byte offset in the file.
    """
    sizes = [math.prod(shape) * itemsize(code) for _, code, shape in entries]
    layout = sorted(range(len(entries)), key=lambda k: sizes[k] % DATA_ALIGNMENT != 0)
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    relative = [0] * len(entries)
    for k in layout:
        name, code, shape = entries[k]
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + sizes[k]]}
        relative[k] = offset
        offset += sizes[k]
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % DATA_ALIGNMENT)
    prefix = struct.pack("<Q", len(blob)) + blob
    return prefix, [len(prefix) + r for r in relative]
