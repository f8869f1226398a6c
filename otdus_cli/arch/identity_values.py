"""What a zero-init layer of a derived template holds in a tensor it sets instead of its source's.

Mostly one number everywhere: 0 for a tensor that writes into the residual stream, 1 for a residual
scale (arch/identity.py). One tensor needs a value per entry: the expert-choice bias of a router that
also chooses experts without weights, which add their input back to the stream (LongCat-Flash's
zero-computation experts: ``e_score_correction_bias``, added to the router's scores before its top-k).
A new layer never chooses those when their entries sit ``low`` below the others (0): the scores lie in
[0, 1] (softmax or sigmoid; the proof also runs with the router's weights scaled until its scores
saturate, which a router adding the bias to unbounded logits fails). The experts with weights are
counted in the layer's own tensors (a fused expert tensor's first axis, or its per-expert tensors), so
the value fits the checkpoint's expert count, not the tiny instance's it was proved on.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ExpertChoiceBias:
    """0 for the experts with weights (the first ones), ``low`` for the experts after them."""

    # patterns within a layer of the expert tensor whose experts have weights (fused, or per expert)
    counted_by: tuple[str, ...]
    low: float = -2.0

    def weighted(self, shapes: Mapping[str, tuple[int, ...]]) -> int:
        """How many experts have weights, in a layer whose tensors have ``shapes`` (suffix -> shape)."""
        for pattern in self.counted_by:
            found = [shape for name, shape in shapes.items() if re.fullmatch(pattern, name)]
            if len(found) == 1 and len(found[0]) == 3:  # fused: experts along the first axis
                return found[0][0]
            if found:  # one tensor per expert
                return len(found)
        raise ValueError(f"no tensor of the layer matches {self.counted_by[0]}")

    def record(self) -> dict:
        return {
            "experts with weights": 0.0,
            "experts without weights": self.low,
            "counted by": self.counted_by[0],
        }


IdentityValue = float | ExpertChoiceBias


def value_tensor(value: IdentityValue, shape: tuple[int, ...], shapes: Mapping[str, tuple[int, ...]]):
    """The float32 tensor of ``shape`` holding ``value``, in a layer whose tensors have ``shapes``."""
    import torch

    if isinstance(value, ExpertChoiceBias):
        out = torch.zeros(shape)
        out[value.weighted(shapes) :] = value.low
        return out
    return torch.full(shape, float(value))


def holds(tensor: torch.Tensor, value: IdentityValue, shapes: Mapping[str, tuple[int, ...]]) -> bool:
    """Whether ``tensor`` holds ``value`` exactly (in its own dtype)."""
    import torch

    expected = value_tensor(value, tuple(tensor.shape), shapes).to(tensor.dtype)
    return torch.equal(tensor, expected)


def record_value(value: IdentityValue) -> float | dict:
    """``value`` as the manifest records it."""
    return value.record() if isinstance(value, ExpertChoiceBias) else value


def describe_value(value: IdentityValue) -> str:
    """``value`` in words."""
    if isinstance(value, ExpertChoiceBias):
        return f"0 for the experts with weights and {value.low:g} for the others"
    return f"{value:g}"
