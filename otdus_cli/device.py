"""Where tensors are computed: the one rule that turns ``--device`` into a torch device.

* ``auto``: CUDA when a GPU is visible, else the CPU (never MPS: name it, ``mps``, to use it).
* ``cpu``, ``mps``, ``cuda``, ``cuda:N``: as named; a GPU that is not there (no CUDA, or N at least
  ``torch.cuda.device_count()``) is one ``error:`` line and exit 2, raised before any model is read.
* Several ranks (torchrun, srun; see distributed.py) and ``auto``/``cuda``: the rank with local rank L
  on a node of G visible GPUs computes on ``cuda:(L mod G)``. One rank per GPU is the fast layout;
  more ranks than GPUs share them round-robin (8 ranks on 2 GPUs: 4 on each, as 8 ranks on 1 GPU all
  use it). Sharing is allowed because a rank holds only the weights of the layers it is working on
  and every exchange runs over gloo on the CPU, so ranks on one GPU cannot deadlock each other; they
  only run slower and need the memory of several ranks. An explicit ``cuda:N`` is used by every rank.
* The chosen GPU is made the process's current CUDA device (``torch.cuda.set_device``), so a bare
  ``"cuda"`` inside a library (POT's torch backend makes one) lands on it, not on GPU 0.

Reports and manifests record :func:`device_kind` ("cpu", "cuda", "mps"): which GPU index a rank used
is a property of the launch, not of the result, so one process and N ranks record the same string
(the number of ranks is in the report's ``compute`` section).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from otdus_cli.errors import OtdusError

if TYPE_CHECKING:
    import torch

    from otdus_cli.distributed import World

__all__ = ["device_kind", "resolve_device"]

NAMES = "auto, cpu, cuda, cuda:N or mps"


def resolve_device(spec: str | torch.device | None, world: World | None = None) -> torch.device:
    """``spec`` (``None`` means auto) as this process's torch device, by the module's rule; a CUDA
    device becomes the current one. Raises :class:`OtdusError` for a device that is not there."""
    import torch  # heavy import; copy-type expansions never need it

    several = world is not None and world.size > 1
    name = "auto" if spec is None else str(spec)
    if name == "auto" and not torch.cuda.is_available():
        return torch.device("cpu")
    try:
        device = torch.device("cuda" if name == "auto" else name)
    except (RuntimeError, TypeError):
        raise OtdusError(f"unknown device {name!r} ({NAMES})") from None
    if device.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise OtdusError(f"device {name}: MPS is not available here")
        return device
    if device.type != "cuda":
        if device.type != "cpu":
            raise OtdusError(f"unknown device {name!r} ({NAMES})")
        return device
    if not torch.cuda.is_available():
        raise OtdusError(f"device {name}: no CUDA GPU is available here")
    count = torch.cuda.device_count()
    if device.index is None:
        index = world.local_rank % count if several else torch.cuda.current_device()
    elif device.index >= count:
        raise OtdusError(
            f"device {name}: this machine has {count} GPU(s) (cuda:0 to cuda:{count - 1}); "
            "CUDA_VISIBLE_DEVICES renumbers the visible ones from 0"
        )
    else:
        index = device.index
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def device_kind(device: str | torch.device) -> str:
    """What reports and manifests record: the device's kind, without a GPU index."""
    return str(device).split(":", 1)[0]
