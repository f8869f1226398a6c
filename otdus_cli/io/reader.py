"""Lazy, validated reading of a Hugging Face checkpoint folder, one tensor at a time.

Tensors are located through the index's weight_map (or the single `model.safetensors`); shards are
never globbed, since some repos ship extra files such as Mistral's `consolidated.safetensors`.
Every header is validated up front, so a missing, truncated or corrupt shard, or an index entry
that points outside the model folder, is one clear error before any output exists; so are the sizes
and epsilons of config.json (arch/config_values.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from otdus_cli.arch.config_values import check_config_values
from otdus_cli.errors import OtdusError
from otdus_cli.io.memory import return_freed_tensors_to_os
from otdus_cli.io.safetensors_format import (
    TensorInfo,
    check_tensor_name,
    code_of,
    itemsize,
    read_header,
    torch_dtype,
)

if TYPE_CHECKING:
    import torch

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"


@dataclass(frozen=True)
class TensorMeta:
    """Name, dtype code and shape of a tensor, wherever it is stored."""

    name: str
    dtype: str
    shape: tuple[int, ...]


def _inside(folder: Path, relative: str) -> Path:
    """Resolve a shard path from an index, refusing anything that leaves the model folder."""
    if os.path.isabs(relative):
        raise OtdusError(
            f"index names an absolute shard path {relative!r}; refusing to read outside the model"
        )
    # Checked lexically, not by resolving symlinks: the Hugging Face cache links every file in a
    # snapshot folder to a blob elsewhere, and that is fine; a "../" path in an index is not.
    base = os.path.normpath(os.path.abspath(folder))
    candidate = os.path.normpath(os.path.join(base, relative))
    if os.path.commonpath([base, candidate]) != base:
        raise OtdusError(
            f"index names shard {relative!r}, which escapes the model folder; refusing to read it"
        )
    return Path(candidate)


def read_json_object(path: Path) -> dict:
    """A JSON file that must hold an object; anything else is one clear error."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise OtdusError(f"{path} is not valid JSON") from None
    except OSError as exc:
        raise OtdusError(f"cannot read {path} ({exc.strerror})") from None
    if not isinstance(data, dict):
        raise OtdusError(f"{path} is not a JSON object")
    return data


def file_sha256(path: Path) -> str | None:
    if not path.is_file():
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest()


class CheckpointReader:
    """Read-only view of a checkpoint folder: its config and lazily loaded tensors."""

    def __init__(self, folder: str | os.PathLike[str]):
        return_freed_tensors_to_os()
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise OtdusError(f"model folder not found: {self.folder}")
        self.index_file: str | None = None
        self._infos: dict[str, TensorInfo] = {}
        self._bin_files: dict[str, Path] = {}  # tensor name -> pickle shard (weights_only loading)
        self._bin_cache: dict[Path, dict[str, torch.Tensor]] = {}
        self._metas: dict[str, TensorMeta] = {}
        try:
            self.config = self._read_config()
            self._locate_tensors()
        except PermissionError as exc:  # a folder (or file) this user may not read: a user's error
            where = exc.filename or self.folder
            raise OtdusError(
                f"cannot read {where} ({exc.strerror}): the model folder must be readable"
            ) from None

    # -- discovery -------------------------------------------------------------------------
    def _read_config(self) -> dict:
        path = self.folder / "config.json"
        if not path.is_file():
            raise OtdusError(f"no config.json in {self.folder}")
        config = read_json_object(path)
        check_config_values(config)
        return config

    def _read_index(self, name: str) -> dict[str, Path]:
        index = read_json_object(self.folder / name)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise OtdusError(f"{name} is corrupt (no valid weight_map)")
        for tensor in weight_map:
            check_tensor_name(tensor, name)
        self.index_file = name
        return {tensor: _inside(self.folder, str(shard)) for tensor, shard in weight_map.items()}

    def _locate_tensors(self) -> None:
        f = self.folder
        if (f / SAFE_INDEX).is_file():
            self._locate_safetensors(self._read_index(SAFE_INDEX))
        elif (f / SAFE_SINGLE).is_file():
            infos, _ = read_header(str(f / SAFE_SINGLE))
            self._infos = infos
        elif (f / BIN_INDEX).is_file():
            self._bin_files = self._read_index(BIN_INDEX)
        elif (f / BIN_SINGLE).is_file():
            self._bin_files = {name: f / BIN_SINGLE for name in self._bin_state(f / BIN_SINGLE)}
            for name in self._bin_files:
                check_tensor_name(name, BIN_SINGLE)
        else:
            raise OtdusError(f"no weights in {f} (expected {SAFE_INDEX}, {SAFE_SINGLE} or {BIN_SINGLE})")
        for name, info in self._infos.items():
            self._metas[name] = TensorMeta(name, info.dtype, info.shape)
        for name, path in self._bin_files.items():
            state = self._bin_state(path)
            if name not in state:
                raise OtdusError(f"{path.name} does not contain {name}, which the index lists")
            t = state[name]
            code = code_of(t.dtype)
            if code is None:
                raise OtdusError(f"tensor {name} has unsupported dtype {t.dtype}")
            self._metas[name] = TensorMeta(name, code, tuple(t.shape))
        if not self._metas:
            raise OtdusError(f"{f} holds no tensors")

    def _locate_safetensors(self, weight_map: dict[str, Path]) -> None:
        headers: dict[Path, dict[str, TensorInfo]] = {}
        for shard in sorted(set(weight_map.values())):
            if not shard.is_file():
                raise OtdusError(f"missing shard {shard.name} (listed in {SAFE_INDEX})")
            headers[shard], _ = read_header(str(shard))
        # transformers reads every tensor of every shard: one the index does not list, or one stored
        # twice, would make the loaded model differ from the one otdus reads
        seen: dict[str, Path] = {}
        for shard, header in headers.items():
            for name in header:
                if name in seen:
                    raise OtdusError(
                        f"tensor {name} is stored twice, in {seen[name].name} and {shard.name}; "
                        "which copy a loader takes is undefined"
                    )
                seen[name] = shard
                if name not in weight_map:
                    raise OtdusError(
                        f"{shard.name} holds tensor {name}, which {SAFE_INDEX} does not list; "
                        "fix the index (or remove the tensor)"
                    )
        for name, shard in weight_map.items():
            info = headers[shard].get(name)
            if info is None:
                raise OtdusError(f"{shard.name} does not contain {name}, which {SAFE_INDEX} lists")
            self._infos[name] = info

    def _bin_state(self, path: Path) -> dict[str, torch.Tensor]:
        """Load a pickle shard safely: weights_only (no code execution), memory-mapped."""
        if path not in self._bin_cache:
            import torch  # safetensors checkpoints never need it here

            if not path.is_file():
                raise OtdusError(f"missing shard {path.name}")
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as exc:  # torch raises many types for bad pickles
                raise OtdusError(
                    f"{path.name}: cannot load safely with weights_only ({exc.__class__.__name__})"
                ) from None
            if not isinstance(state, dict):
                raise OtdusError(f"{path.name}: not a state dict")
            self._bin_cache[path] = state
        return self._bin_cache[path]

    # -- access ----------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self._metas)

    def __contains__(self, name: str) -> bool:
        return name in self._metas

    def meta(self, name: str) -> TensorMeta:
        try:
            return self._metas[name]
        except KeyError:
            raise OtdusError(f"tensor {name} not found in {self.folder}") from None

    def raw(self, name: str) -> TensorInfo | None:
        """Byte location of a tensor, when it is stored in safetensors (for byte-exact copies)."""
        return self._infos.get(name)

    def get(self, name: str) -> torch.Tensor:
        """Load one tensor into memory (a fresh CPU tensor; nothing else is kept)."""
        info = self._infos.get(name)
        if info is not None:
            return _read_tensor(info, 0, info.shape)
        if name in self._bin_files:
            return self._bin_state(self._bin_files[name])[name].clone()
        raise OtdusError(f"tensor {name} not found in {self.folder}")

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` (along dim 0) of a tensor, reading only their bytes from a safetensors
        shard (a row range is one contiguous byte range); a pickle's rows are sliced from its
        memory-mapped tensor."""
        info = self._infos.get(name)
        if info is None or not info.shape:
            if name in self._bin_files:
                return self._bin_state(self._bin_files[name])[name][start:stop].clone()
            return self.get(name)[start:stop].clone()
        rows = info.shape[0]
        start = max(0, min(start, rows))
        stop = max(start, min(stop, rows))
        row_bytes = info.nbytes // rows if rows else 0
        return _read_tensor(info, start * row_bytes, (stop - start, *info.shape[1:]))

    def nbytes(self, name: str) -> int:
        meta = self.meta(name)
        return math.prod(meta.shape) * itemsize(meta.dtype)

    def read_bytes(self, name: str, offset: int, count: int) -> bytes:
        """``count`` raw bytes of tensor ``name`` from byte ``offset`` of its data (as stored on disk)."""
        info = self._infos.get(name)
        if info is not None:
            count = max(0, min(count, info.nbytes - offset))
            with open(info.file, "rb") as f:
                data = os.pread(f.fileno(), count, info.begin + offset)
            if len(data) != count:
                raise OtdusError(f"{os.path.basename(info.file)}: truncated while reading {name}")
            return data
        if name in self._bin_files:
            import torch

            tensor = self._bin_state(self._bin_files[name])[name].contiguous()
            return tensor.reshape(-1).view(torch.uint8)[offset : offset + count].numpy().tobytes()
        raise OtdusError(f"tensor {name} not found in {self.folder}")

    def total_bytes(self) -> int:
        return sum(math.prod(m.shape) * itemsize(m.dtype) for m in self._metas.values())

    def fingerprint(self) -> dict[str, str | None]:
        """Hashes that identify the source in the manifest (config and index, not the weights)."""
        index = self.folder / self.index_file if self.index_file else None
        return {
            "config_sha256": file_sha256(self.folder / "config.json"),
            "index_sha256": file_sha256(index) if index else None,
        }


def _read_tensor(info: TensorInfo, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A fresh CPU tensor of ``shape`` from ``info``'s data, starting ``offset`` bytes in."""
    import torch  # imported on first tensor work, not for header reads and copies

    dtype = torch_dtype(info.dtype)
    nbytes = math.prod(shape) * itemsize(info.dtype)
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    buf = bytearray(nbytes)
    with open(info.file, "rb") as f:
        f.seek(info.begin + offset)
        if f.readinto(buf) != nbytes:
            raise OtdusError(f"{os.path.basename(info.file)}: truncated while reading {info.name}")
    return torch.frombuffer(buf, dtype=dtype).reshape(shape)
