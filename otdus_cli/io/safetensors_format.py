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


def itemsize(code: str) -> int:
    return _DTYPE_TABLE[code][1]


def torch_dtype(code: str):
    """The torch dtype of a safetensors code (imports torch)."""
    import torch  # noqa: PLC0415 - only tensor work needs torch

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


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate one safetensors file's header; return its tensors and metadata.

    Checks everything that a truncated or corrupt file would break, so that problems surface
    as one clear error before any output is written.
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
            header = json.loads(f.read(header_len))
    except FileNotFoundError:
        raise OtdusError(f"missing shard: {path}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise OtdusError(f"{name}: corrupt safetensors header (not valid JSON)") from None
    except OSError as exc:
        raise OtdusError(f"{name}: cannot read ({exc.strerror})") from None
    if not isinstance(header, dict):
        raise OtdusError(f"{name}: corrupt safetensors header")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + header_len
    tensors: dict[str, TensorInfo] = {}
    for tname, entry in header.items():
        try:
            code = entry["dtype"]
            shape = tuple(int(s) for s in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise OtdusError(f"{name}: corrupt header entry for tensor {tname!r}") from None
        if code not in KNOWN_CODES:
            raise OtdusError(f"{name}: tensor {tname!r} has unsupported dtype {code}")
        nbytes = math.prod(shape) * itemsize(code)
        if end - begin != nbytes or begin < 0:
            raise OtdusError(f"{name}: corrupt header, tensor {tname!r} offsets do not match its shape")
        if data_start + end > size:
            raise OtdusError(
                f"{name}: truncated file, tensor {tname!r} ends at byte {data_start + end} "
                f"but the file has {size} bytes"
            )
        tensors[tname] = TensorInfo(tname, code, shape, os.path.abspath(path), data_start + begin, nbytes)
    return tensors, {str(k): str(v) for k, v in metadata.items()}


def build_header(
    entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str]
) -> tuple[bytes, list[int]]:
    """Serialise a header for tensors laid out in the given order.

    Returns the header bytes (length prefix included, padded to 8 bytes so data stays aligned)
    and each tensor's absolute byte offset in the file.
    """
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    relative: list[int] = []
    for name, code, shape in entries:
        nbytes = math.prod(shape) * itemsize(code)
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        relative.append(offset)
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    prefix = struct.pack("<Q", len(blob)) + blob
    return prefix, [len(prefix) + r for r in relative]
