"""Streaming, atomic output of a sharded safetensors checkpoint.

The full layout (every tensor's name, dtype, shape, shard and byte offset) is decided before any
data is written, so each tensor can be written straight to its final place, in any order, and
memory holds at most one tensor. The folder written into is a temporary one (see output_dir.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import math
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from otdus_cli.errors import OtdusError
from otdus_cli.io.safetensors_format import TensorInfo, build_header, code_of, itemsize, torch_dtype

if TYPE_CHECKING:
    import torch

COPY_CHUNK = 64 * 1024 * 1024
ZERO_CHUNK = 16 * 1024 * 1024
# Start the disk writes of an output file every this many bytes (from a helper thread, so copying
# never waits on the disk queue), so the final fsync finds little left to flush: the disk works while
# the copy goes on instead of after it, as with `cp && sync`, where the kernel starts only once a
# tenth of the memory is dirty.
WRITEBACK_STEP = 256 * 1024 * 1024
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def parse_size(text: str | int) -> int:
    """'5GB' -> 5_000_000_000 (decimal units as in transformers; KiB/MiB/GiB are binary)."""
    if isinstance(text, int):
        return text
    s = text.strip().upper().replace(" ", "")
    for unit in sorted(_UNITS, key=len, reverse=True):
        if s.endswith(unit):
            number = s[: -len(unit)]
            break
    else:
        unit, number = "B", s
    try:
        value = int(float(number) * _UNITS[unit])
    except (ValueError, OverflowError):  # OverflowError: "inf"
        raise OtdusError(f"cannot read size {text!r} (examples: 5GB, 500MB, 2GiB)") from None
    if value <= 0:
        raise OtdusError(f"size must be positive, got {text!r}")
    return value


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: str  # safetensors code
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class Slot:
    """Where one output tensor goes."""

    file: str  # shard file name
    offset: int
    tensor: PlannedTensor


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]


def partition(tensors: list[PlannedTensor], max_shard_bytes: int) -> list[list[PlannedTensor]]:
    """Split tensors, in order, into shards of at most max_shard_bytes (a bigger tensor gets its own)."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


class ShardedWriter:
    """Writes tensors into pre-laid-out shard files inside a folder.

    ``create``: make the files and write their headers (one process, or rank 0 of several); False
    opens the files another process created, to write some of the tensors into them (every process
    computes the same layout from the same plan, so each writes its own tensors' byte ranges).
    """

    def __init__(self, folder: Path, tensors: list[PlannedTensor], max_shard_bytes: int, create: bool = True):
        self.folder = folder
        groups = partition(tensors, max_shard_bytes)
        self.files = shard_names(len(groups))
        self.slots: dict[str, Slot] = {}
        self._fds: dict[str, int] = {}
        self._unflushed: dict[str, int] = {}  # output file -> bytes written since writeback started
        self._sources: dict[str, int] = {}  # source shard -> its fd, open until close()
        self._kicker = WritebackKicker()
        self._written: set[str] = set()
        self.sync_s = 0.0  # time spent in the final fsync
        for fname, group in zip(self.files, groups, strict=True):
            header, offsets = build_header([(t.name, t.dtype, t.shape) for t in group], {"format": "pt"})
            if create:
                fd = os.open(folder / fname, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                os.pwrite(fd, header, 0)
            else:
                fd = os.open(folder / fname, os.O_RDWR)
            self._fds[fname] = fd
            for t, off in zip(group, offsets, strict=True):
                self.slots[t.name] = Slot(fname, off, t)
        self.total_size = sum(t.nbytes for t in tensors)

    def _slot(self, name: str) -> Slot:
        if name in self._written:
            raise RuntimeError(f"tensor {name} written twice")
        self._written.add(name)
        return self.slots[name]

    def write_tensor(self, name: str, tensor: torch.Tensor) -> int:
        """Cast to the planned dtype and write; returns bytes written."""
        slot = self._slot(name)
        planned = slot.tensor
        if tuple(tensor.shape) != planned.shape:
            raise RuntimeError(
                f"{name}: built shape {tuple(tensor.shape)} differs from planned {planned.shape}"
            )
        return self._write_cast(slot, tensor, slot.offset)

    def _write_cast(self, slot: Slot, tensor: torch.Tensor, offset: int) -> int:
        """``tensor`` cast to the slot's planned dtype, written at file ``offset``; bytes written."""
        import torch  # only built tensors need it; copies and zeros do not

        data = tensor.detach().to(device="cpu", dtype=torch_dtype(slot.tensor.dtype)).contiguous()
        raw = data.reshape(-1).view(torch.uint8).numpy()
        _pwrite_all(self._fds[slot.file], memoryview(raw), offset)
        self._wrote(slot.file, len(raw))
        return len(raw)

    def write_rows(self, name: str, pieces: Iterable[tuple[int, torch.Tensor]]) -> int:
        """Write a tensor in pieces, each (its first row along dim 0, its rows), cast to the planned
        dtype; together they must fill it exactly once. Returns bytes written."""
        slot = self._slot(name)
        planned = slot.tensor
        row_bytes = planned.nbytes // planned.shape[0]
        done = 0
        for start, rows in pieces:
            if tuple(rows.shape[1:]) != planned.shape[1:] or start + rows.shape[0] > planned.shape[0]:
                raise RuntimeError(f"{name}: rows {start}+{tuple(rows.shape)} do not fit {planned.shape}")
            done += self._write_cast(slot, rows, slot.offset + start * row_bytes)
        if done != planned.nbytes:
            raise RuntimeError(f"{name}: {done} bytes written in pieces, {planned.nbytes} planned")
        return done

    def copy_raw(self, name: str, source: TensorInfo) -> int:
        """Copy a tensor's bytes unchanged from a source shard (no decode, no re-encode)."""
        slot = self._slot(name)
        if source.nbytes != slot.tensor.nbytes or source.dtype != slot.tensor.dtype:
            raise RuntimeError(f"{name}: raw copy between different dtypes or sizes")
        _copy_range(
            self._source_fd(source.file), source.begin, self._fds[slot.file], slot.offset, source.nbytes
        )
        self._wrote(slot.file, source.nbytes)
        return source.nbytes

    def _source_fd(self, path: str) -> int:
        fd = self._sources.get(path)
        if fd is None:
            fd = os.open(path, os.O_RDONLY)
            if hasattr(os, "posix_fadvise"):  # a larger read-ahead on a cold cache, as cp asks for
                with contextlib.suppress(OSError):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            self._sources[path] = fd
        return fd

    def _wrote(self, file: str, nbytes: int) -> None:
        pending = self._unflushed.get(file, 0) + nbytes
        if pending >= WRITEBACK_STEP:
            self._kicker.kick(self._fds[file])
            pending = 0
        self._unflushed[file] = pending

    def write_zeros(self, name: str) -> int:
        slot = self._slot(name)
        fd = self._fds[slot.file]
        # The file was created empty and each slot is written once, so this range was never written:
        # allocating it (unwritten extents, no data moved) makes it read as zeros, durably after fsync.
        if _allocate(fd, slot.offset, slot.tensor.nbytes):
            return slot.tensor.nbytes
        zeros = bytes(min(ZERO_CHUNK, slot.tensor.nbytes))
        done = 0
        while done < slot.tensor.nbytes:
            n = min(len(zeros), slot.tensor.nbytes - done)
            _pwrite_all(fd, memoryview(zeros)[:n], slot.offset + done)
            done += n
        self._wrote(slot.file, slot.tensor.nbytes)
        return slot.tensor.nbytes

    def finish(self, expected: set[str] | None = None, index: bool = True) -> dict[str, str]:
        """Check completeness (of the ``expected`` tensors: all by default), flush, close; write the
        index of a sharded output unless ``index`` is False; returns the weight_map."""
        missing = (set(self.slots) if expected is None else expected) - self._written
        if missing:
            raise RuntimeError(
                f"{len(missing)} planned tensors were never written, e.g. {sorted(missing)[0]}"
            )
        self.close(sync=True)
        weight_map = {name: slot.file for name, slot in self.slots.items()}
        if index and len(self.files) > 1:
            record = {"metadata": {"total_size": self.total_size}, "weight_map": weight_map}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(record, indent=2) + "\n")
        return weight_map

    def close(self, sync: bool = False) -> None:
        self._kicker.close()  # joined before any fd it may use is closed
        t = time.perf_counter()
        if sync:
            for fd in self._fds.values():
                _start_writeback(fd)  # every shard's last writes queued at once, then waited for
            for fd in self._fds.values():
                os.fsync(fd)
            self.sync_s = time.perf_counter() - t
        for fd in [*self._fds.values(), *self._sources.values()]:
            os.close(fd)
        self._fds.clear()
        self._sources.clear()


def dtype_code(dtype: torch.dtype) -> str:
    code = code_of(dtype)
    if code is None:
        raise ValueError(f"safetensors cannot store {dtype}")
    return code


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data = data[n:]
        offset += n


def _allocate(fd: int, offset: int, length: int) -> bool:
    """Allocate a never-written range of ``fd`` as zeros without writing them (posix_fallocate);
    False where the call is missing or the filesystem refuses (the caller then writes zeros)."""
    if length == 0 or not hasattr(os, "posix_fallocate"):
        return length == 0
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError:
        return False
    return True


_SYNC_FILE_RANGE_WRITE = 2


@functools.cache
def _sync_file_range():
    """libc's sync_file_range (Linux), or None where there is no such call."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


class WritebackKicker:
    """A helper thread that starts the disk writes of the files it is given (_start_writeback)."""

    def __init__(self) -> None:
        self._pending: dict[int, None] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def kick(self, fd: int) -> None:
        with self._cond:
            if self._closed:
                return
            self._pending[fd] = None
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="otdus-writeback", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:  # closed, and every file asked for was started
                    return
                fds = list(self._pending)
                self._pending.clear()
            for fd in fds:
                _start_writeback(fd)

    def close(self) -> None:
        """Start what is still pending, then end the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()


def _start_writeback(fd: int) -> None:
    """Queue the disk writes of ``fd``'s dirty pages without waiting for them; a failure or a
    missing call only means no early start (the final fsync syncs all the same)."""
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def _copy_range(src: int, src_off: int, dst: int, dst_off: int, count: int) -> None:
    """Kernel-side copy where the OS supports it (copy_file_range), else chunked pread/pwrite."""
    while count > 0:
        step = min(count, COPY_CHUNK)
        n = 0
        if hasattr(os, "copy_file_range"):
            with contextlib.suppress(OSError):
                n = os.copy_file_range(src, dst, step, src_off, dst_off)
        if n <= 0:
            chunk = os.pread(src, step, src_off)
            if not chunk:
                raise OtdusError("source shard ended early while copying (truncated file?)")
            _pwrite_all(dst, memoryview(chunk), dst_off)
            n = len(chunk)
        src_off += n
        dst_off += n
        count -= n
