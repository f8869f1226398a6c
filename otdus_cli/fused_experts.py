"""A widened output's new experts in a model that loads its experts fused.

transformers 5 loads a Mixtral-style checkpoint's per-expert tensors (``experts.K.w1.weight`` ...)
into one tensor per layer and projection (``mlp.experts.gate_up_proj``, experts on the first axis)
and renames the router (``block_sparse_moe.gate`` -> ``mlp.gate``). The new experts are then rows of
a tensor that also holds the base experts: no name rule (axolotl's, LLaMA-Factory's) selects them,
so :func:`otdus_cli.trainable.apply` trains those tensors behind a gradient mask that keeps the base
experts' rows. The mapping is found from the loaded names and shapes, never from a family table.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

PER_EXPERT = re.compile(r"^.*?\.layers\.(\d+)\..*\.experts\.(\d+)\.[^.]+(?:\.weight|\.bias)?$")
_LAYER = re.compile(r"^.*?\.layers\.(\d+)\.")
_FUSED = re.compile(r"\.experts\.[A-Za-z_]+$")  # a projection of all experts, no expert number
# what the note says when a name rule cannot select the new experts of a fused tensor
FUSED_NOTE = (
    "transformers 5 loads these experts fused (one mlp.experts tensor per layer, experts on its first "
    "axis), whose new rows no name rule can select: there, use otdus_cli.trainable.apply (a gradient "
    "mask keeps the base experts' rows; give those tensors weight_decay 0)"
)


@dataclass
class FusedNew:
    """What the manifest's listed names are in the loaded model."""

    rows: dict[str, list[int]] = field(default_factory=dict)  # fused tensor -> its new expert rows
    renamed: list[str] = field(default_factory=list)  # a listed tensor under the model's name (routers)
    unmatched: list[str] = field(default_factory=list)  # listed names with no counterpart


def map_listed(missing: Iterable[str], params: Mapping[str, Any], experts: int) -> FusedNew:
    """The counterparts of listed names the model lacks (``missing``) among its parameters
    ``params`` (name -> tensor); ``experts``: the widened expert count (the fused first axis)."""
    found = FusedNew()
    rows: dict[str, set[int]] = {}
    for name in missing:
        hit = PER_EXPERT.match(name)
        layer = hit.group(1) if hit else (m.group(1) if (m := _LAYER.match(name)) else None)
        in_layer = [n for n in params if layer is not None and f".layers.{layer}." in n]
        if hit:
            fused = [n for n in in_layer if _FUSED.search(n) and tuple(params[n].shape[:1]) == (experts,)]
            for n in fused:
                rows.setdefault(n, set()).add(int(hit.group(2)))
            if fused:
                continue
        else:  # a router renamed: the one parameter of its layer with the same last two parts
            tail = "." + ".".join(name.rsplit(".", 2)[-2:])
            same = [n for n in in_layer if n.endswith(tail) and n not in missing]
            if len(same) == 1:
                found.renamed.append(same[0])
                continue
        found.unmatched.append(name)
    found.rows = {n: sorted(r) for n, r in rows.items()}
    return found


def mask_rows(param: Any, rows: list[int]) -> None:
    """Let gradients reach only ``rows`` of ``param``'s first axis (the others keep their values
    under any optimizer step without weight decay)."""
    import torch

    keep = torch.zeros(param.shape[0], dtype=param.dtype, device=param.device)
    keep[rows] = 1
    keep = keep.view(-1, *([1] * (param.dim() - 1)))
    param.register_hook(lambda grad: grad * keep.to(grad.device, grad.dtype))
