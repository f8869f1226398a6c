"""`otdus shrink --method laco`: LaCo's layer merge (Yang, Cao & Zhao 2024, arXiv 2402.11187).

Reserving-Differences-while-Seeking-Common (RDSC) merges a group of C consecutive layers l..l+C-1 into
layer l. Two variants, as OT-DUS offers the paper's flow and the released script's:

* ``paper`` (default): the paper's formula on every tensor of the layer,
  theta* = theta_l + sum_{k=1}^{C-1} (theta_{l+k} - theta_l).
  For one merged layer (C = 2) it is theta_{l+1}: ``laco --remove 2`` keeps layer 2 in layer 1's place,
  which computes exactly what ``drop --remove 1`` does.
* ``official``: what the released notebooks (Llama-2-13B, Baichuan-13B) compute. They add
  (theta_{l+k} - merged) to the merged projection in place, k = 1..C-1, so each step sets it to
  theta_{l+k}: the result is layer l+C-1's seven projections (q, k, v, o, gate, up, down) with layer
  l's norms, not the paper's formula. Refused for mixture-of-experts layers (the notebooks merge
  dense projections only).

In a group of plan/shrink_map.py the kept layer comes first (LaCo's l), the removed ones after it in
order (l+1 .. l+C-1). LaCo's own selection (``--select laco``) is plan/laco_select.py's loop.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict

from otdus_cli.methods.base import BuildContext, Flag, Method, ParentLayer

if TYPE_CHECKING:
    import torch

    from otdus_cli.arch.families import Family

LacoVariant = Literal["paper", "official"]
# the projections the released notebooks merge (the others: layer l's tensors)
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


class LacoOptions(BaseModel):
    """Options of `otdus shrink --method laco`."""

    model_config = ConfigDict(extra="forbid")

    variant: Annotated[
        LacoVariant,
        Flag(
            "--laco-variant",
            "LaCo merge. paper: theta_l + sum_k (theta_{l+k} - theta_l) on every tensor (one merged layer: "
            "theta_{l+1}); official: the released notebooks' in-place update, i.e. layer l+C-1's "
            "projections with layer l's norms.",
        ),
    ] = "paper"


def projection_suffixes(family: Family) -> set[str]:
    """The tensors of a layer that are one of the seven projections (fused ones included)."""
    fused = [name for name, parts in family.fused.items() if set(parts) <= set(PROJECTIONS)]
    paths = [family.roles[r] for r in (*PROJECTIONS, *fused) if r in family.roles]
    return {f"{path}.{kind}" for path in paths for kind in ("weight", "bias")}


class LacoBuilder:
    """LaCo's merge of a group (the kept layer first), in the variant of ``ctx.options``."""

    parents_needed = None

    def build(self, parents: Sequence[ParentLayer], ctx: BuildContext) -> Iterator[tuple[str, torch.Tensor]]:
        variant = ctx.options.variant if ctx.options is not None else "paper"
        if variant == "official":
            projections = projection_suffixes(ctx.family)
            for suffix in parents[0].suffixes():
                yield suffix, (parents[-1] if suffix in projections else parents[0]).get(suffix)
            return
        for suffix in parents[0].suffixes():
            base = parents[0].get(suffix).float()
            merged = base.clone()
            for p in parents[1:]:
                merged += p.get(suffix).float() - base
            yield suffix, merged


def _refuses_options(family: Family, options: Any) -> str | None:
    if options.variant == "official" and family.moe:
        return (
            f"--laco-variant official reproduces the released notebooks, which merge dense projections; "
            f"{family.name} is a mixture of experts (use --laco-variant paper)"
        )
    return None


LACO = Method(
    "laco",
    "LaCo: the kept layer plus the removed layers' differences from it",
    "shrink",
    builder="laco",
    label="LaCo",
    options=LacoOptions,
    make_builder=LacoBuilder,
    refuses_options=_refuses_options,
)
