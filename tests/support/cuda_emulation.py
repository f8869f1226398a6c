"""CUDA emulated on the CPU, for placement tests on machines without a GPU.

Inside :func:`emulated_cuda`, ``torch.cuda`` reports ``gpus`` devices, a tensor put on ``cuda:N``
(a factory's ``device=``, ``.to``, ``.cuda``, ``empty_like``) is an :class:`EmulatedCudaTensor`: it
computes on the CPU but reports ``cuda:N``, and an operation that mixes it with a tensor of another
device raises as on a real GPU (a CPU tensor of zero dimensions may meet it, as on a GPU; copies,
``.to`` and indexing with CPU indices may cross devices, as on a GPU). ``.numpy()`` of one raises.
A bare ``"cuda"`` means the current device (``torch.cuda.set_device``). Only placement is checked:
the arithmetic is the CPU's, so numerics on a real GPU need a real GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import ot.backend
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

# operations that may take tensors of two devices on a real GPU
_CROSSING = {
    torch.Tensor.copy_,
    torch.Tensor.to,
    torch.Tensor.cpu,
    torch.Tensor.cuda,
    torch.Tensor.__getitem__,
    torch.Tensor.__setitem__,
    torch.Tensor.index_put_,
    torch.Tensor.index_put,
    torch.index_put,
    torch.Tensor.set_,
}


class EmulatedCudaTensor(torch.Tensor):
    """A CPU tensor that says it is on ``self.emulated`` (a CUDA device)."""

    emulated: torch.device

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self.emulated

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def get_device(self) -> int:  # type: ignore[override]
        return self.emulated.index

    def numpy(self, *args, **kwargs):  # type: ignore[override]
        raise TypeError(f"can't convert {self.emulated} device type tensor to numpy (emulated CUDA)")

    def __reduce_ex__(self, proto):
        raise RuntimeError("emulated CUDA tensors are not saved: move them to the CPU first")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if func in (torch.Tensor.__repr__, torch.Tensor.__format__):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        crossing = func in _CROSSING or name in ("__get__", "__set__")  # attributes: .T, .data = ...
        device = _device_of(args, kwargs, check=not crossing, what=name)
        if func in (torch.histc, torch.Tensor.histc) and not args[0].is_floating_point():
            # CUDA's histc takes integers (transformers' MoE code uses it there), the CPU's does not
            args = (args[0].float(), *args[1:])
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        return tree_map(lambda t: _wrap(t, device) if type(t) is torch.Tensor else t, out)


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor) if isinstance(t, EmulatedCudaTensor) else t


def _wrap(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return t
    out = t.as_subclass(EmulatedCudaTensor)
    out.emulated = device
    return out


def _device_of(args, kwargs, check: bool, what: str) -> torch.device:
    """The device of an operation's tensors; raises when two devices meet (CPU scalars aside)."""
    devices = []
    for t in tree_flatten((args, kwargs))[0]:
        if isinstance(t, EmulatedCudaTensor):
            devices.append(t.emulated)
        elif isinstance(t, torch.Tensor) and t.device.type != "meta":
            devices.append(torch.device("cpu") if t.dim() == 0 else t.device)
    cuda = {d for d in devices if d.type == "cuda"}
    if check and (len(cuda) > 1 or (cuda and len(set(devices)) > 1 and _cpu_operand(args, kwargs))):
        found = sorted({str(d) for d in devices})
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, "
            f"{found[0]} and {found[1]}! (emulated CUDA, in {what})"
        )
    return next(iter(cuda)) if cuda else torch.device("cpu")


def _cpu_operand(args, kwargs) -> bool:
    return any(
        type(t) is torch.Tensor and t.device.type == "cpu" and t.dim() > 0
        for t in tree_flatten((args, kwargs))[0]
    )


class _Cuda:
    """The patched ``torch.cuda`` state: device count, current device, memory counters."""

    def __init__(self, gpus: int):
        self.gpus, self.current = gpus, 0

    def target(self, device) -> torch.device | None:
        """The emulated CUDA device ``device`` names (None: not CUDA)."""
        if device is None:
            return None
        d = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if d.type != "cuda":
            return None
        index = self.current if d.index is None else d.index
        if index >= self.gpus:
            raise RuntimeError(f"CUDA error: invalid device ordinal (emulated: {self.gpus} GPUs, asked {d})")
        return torch.device("cuda", index)

    def set_device(self, device) -> None:
        target = self.target(device)
        if target is None:
            raise ValueError(f"Expected a cuda device, but got: {device}")
        self.current = target.index


_RealGenerator = torch.Generator


class _Generator(_RealGenerator):
    """``torch.Generator("cuda")`` (POT's torch backend makes one) as a CPU generator."""

    def __new__(cls, device="cpu"):
        return super().__new__(cls, "cpu" if torch.device(device).type == "cuda" else device)

    def __init__(self, device="cpu"):
        pass


class _Mode(TorchFunctionMode):
    """Turns CUDA placement requests into CPU tensors that report the CUDA device."""

    def __init__(self, cuda: _Cuda):
        super().__init__()
        self.cuda = cuda

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.to:
            copy = bool(kwargs.pop("copy", False))
            device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            target = self.cuda.target(device)
            src = args[0]
            if device is None:
                target = src.emulated if isinstance(src, EmulatedCudaTensor) else None
            elif target is None:
                return func(_plain(src), *args[1:], **kwargs, copy=copy)
            if target is None:
                return func(*args, **kwargs, copy=copy)
            plain = _plain(src).to(dtype=dtype or src.dtype, copy=copy)
            return _wrap(plain, target)
        if func is torch.Tensor.cuda:
            target = self.cuda.target(args[1] if len(args) > 1 else kwargs.get("device", "cuda"))
            return _wrap(_plain(args[0]), target)
        if func is torch.Tensor.cpu:
            return _plain(args[0]).clone() if isinstance(args[0], EmulatedCudaTensor) else args[0]
        target = self.cuda.target(kwargs.get("device"))
        if target is not None:
            kwargs["device"] = "cpu"
            out = func(*args, **kwargs)
            return tree_map(lambda t: _wrap(t, target) if type(t) is torch.Tensor else t, out)
        return func(*args, **kwargs)


@contextlib.contextmanager
def emulated_cuda(gpus: int = 1) -> Iterator[_Cuda]:
    """``gpus`` emulated CUDA devices for the duration (see the module doc)."""
    cuda = _Cuda(gpus)
    peak = [0]
    patches = {
        "is_available": lambda: True,
        "device_count": lambda: cuda.gpus,
        "set_device": cuda.set_device,
        "current_device": lambda: cuda.current,
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "_lazy_init": lambda: None,
        "is_initialized": lambda: True,
        "is_bf16_supported": lambda *a, **k: True,
        "get_device_name": lambda device=None: "emulated CUDA (CPU)",
        "get_device_capability": lambda device=None: (9, 0),  # an H200
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: peak[0],
        "memory_reserved": lambda device=None: 0,
        "max_memory_reserved": lambda device=None: peak[0],
        "reset_peak_memory_stats": lambda device=None: None,
        "mem_get_info": lambda device=None: (64 << 30, 80 << 30),
        "manual_seed": lambda seed: None,
        "manual_seed_all": lambda seed: None,
        "seed": lambda: None,
        "seed_all": lambda: None,
    }
    saved = {name: getattr(torch.cuda, name) for name in patches}
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    # Module.to/to_empty then replace parameters (keeping their emulated device) instead of setting
    # .data, which would keep the Parameter's CPU device
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    for name, fn in patches.items():
        setattr(torch.cuda, name, fn)
    torch.Generator = _Generator
    # POT keeps one backend instance per process: a fresh one sees the emulated GPUs
    backends = dict(ot.backend._BACKENDS)
    ot.backend._BACKENDS.clear()
    try:
        with _Mode(cuda):
            yield cuda
    finally:
        ot.backend._BACKENDS.clear()
        ot.backend._BACKENDS.update(backends)
        torch.Generator = _RealGenerator
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
