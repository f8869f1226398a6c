"""The methods of `otdus shrink`: what becomes of the layers a shrink removes.

``drop`` leaves them out (ShortGPT, Gromov et al., mergekit's passthrough slices). The others build
one layer from each merge group (plan/shrink_map.py: a run of removed layers with the kept layer
beside it), one tensor at a time, from any number of parents:

* ``average``: the plain mean of the group's layers (expand's average builder, any number of parents);
* ``laco``: LaCo's Reserving-Differences-while-Seeking-Common merge (Yang et al. 2024; methods/laco.py,
  with the released notebooks' variant): the kept layer plus every other layer's difference from it,
  theta_0 + sum_k (theta_k - theta_0);
* ``ot``: OT-DUS's transport flow (methods/ot/; MoE layers through its expert matching) aligns each
  other layer of the group to one anchor, the group's last layer, and the aligned layers are averaged
  with it, all with equal weights. Only the variants that align both sides of every block merge:
  ``structured`` (the default here) and ``activation`` move a neuron's gate/up rows with its down
  column and a head's q/k/v rows with its o columns. ``paper`` and ``official`` align the inputs of
  q/k/v/gate/up but leave those of o_proj and down_proj (the paper's table gives them T_in = I: they
  are zeroed in an expansion), so the average of a layer and its permuted twin mixes unrelated
  neurons (docs/ot.md, "Merging layers"); they are refused. The OT builder makes the pair
  average p_j = 1/2 (aligned_j + anchor); for a group of k layers the equal-weight mean is
  (aligned_1 + ... + aligned_{k-1} + anchor) / k = (2 sum_j p_j - (k - 2) anchor) / k.
  Merged layers are never zero-initialised (a merged layer must compute, not be an identity).

Each is registered with one line in methods/registry.py (SHRINK_METHODS).
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from otdus_cli.methods.base import BuildContext, Flag, Method, ParentLayer
from otdus_cli.methods.ot import OT, OTOptions
from otdus_cli.methods.ot.options import OTVariant
from otdus_cli.methods.simple import MeanBuilder

if TYPE_CHECKING:
    import torch

    from otdus_cli.arch.families import Family
    from otdus_cli.plan.layer_map import OutputLayer

# the OT variants that align both sides of every block (what a merge without zeroing needs)
MERGING_VARIANTS = ("structured", "activation")
_ONE_SIDED = {
    "paper": "its flow aligns the inputs of q/k/v/gate/up but not those of o_proj and down_proj (the "
    "paper's table leaves them unaligned, harmless only where they are zeroed, as in an expansion)",
    "official": "the released script's plans leave the inputs of o_proj and down_proj unaligned and, "
    "unscaled, shrink the aligned layer's share about n-fold",
}


class OTMergeBuilder:
    """Each other layer of a group aligned to the group's last layer by the OT-DUS flow, then all
    averaged with equal weights (module docstring).

    Memory is that of one pair's build: for a group of three or more, the pairs are built one after
    the other, each pair's tensors spilled to the scratch folder (float32), then combined one tensor
    at a time."""

    parents_needed = None

    def __init__(self) -> None:
        self.pair_builder = OT.make_builder()
        self.scratch: Path | None = None

    def prepare(
        self,
        layers: Sequence[ParentLayer],
        new_layers: Sequence[OutputLayer],
        ctx: BuildContext,
        scratch: Path,
    ) -> dict[str, Any] | None:
        """Keep the scratch folder; the activation variant's pre-pass over every (other, anchor) pair."""
        self.scratch = scratch
        pairs = [
            dataclasses.replace(lay, parents=(j, max(lay.parents)))
            for lay in new_layers
            for j in sorted(lay.parents)[:-1]
        ]
        return self.pair_builder.prepare(layers, pairs, ctx, scratch)

    def build(self, parents: Sequence[ParentLayer], ctx: BuildContext) -> Iterator[tuple[str, torch.Tensor]]:
        import torch

        ordered = sorted(parents, key=lambda p: p.index)
        anchor, others = ordered[-1], ordered[:-1]
        if len(others) == 1:  # a pair: the OT builder's own output and statistics
            yield from self.pair_builder.build([others[0], anchor], ctx)
            return
        if self.scratch is None:
            raise RuntimeError("OTMergeBuilder.build: prepare() gives the scratch folder first")
        folder = self.scratch / f"ot-merge-{ctx.output_index}"
        folder.mkdir(parents=True, exist_ok=True)
        try:
            suffixes: list[str] = []
            modules: dict[str, Any] = {}
            for j, a in enumerate(others):
                pair_ctx = dataclasses.replace(ctx, stats={})
                for suffix, tensor in self.pair_builder.build([a, anchor], pair_ctx):
                    torch.save(tensor.detach().to("cpu", torch.float32), folder / f"{j}-{suffix}.pt")
                    del tensor
                    if j == 0:
                        suffixes.append(suffix)
                ctx.stats["variant"] = pair_ctx.stats.get("variant")
                for module, info in (pair_ctx.stats.get("modules") or {}).items():
                    modules[f"{a.index}->{anchor.index} {module}"] = info
            k = len(parents)
            for suffix in suffixes:
                total: torch.Tensor | None = None
                for j in range(len(others)):
                    pair = torch.load(folder / f"{j}-{suffix}.pt", weights_only=True)
                    (folder / f"{j}-{suffix}.pt").unlink()
                    total = pair.mul_(2.0) if total is None else total.add_(pair, alpha=2.0)
                    del pair
                assert total is not None
                yield suffix, total.sub_(anchor.get(suffix).to(torch.float32), alpha=k - 2).div_(k)
                del total
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        ctx.stats["parents"] = [p.index for p in ordered]
        ctx.stats["modules"] = modules


class MergeOTOptions(OTOptions):
    """OT's options in a shrink: the same flags, the variant that merges (structured) by default."""

    variant: Annotated[
        OTVariant,
        Flag(
            "--ot-variant",
            "OT-DUS variant of the merge: structured (ours: a neuron's gate/up rows and down column, a "
            "head's q/k/v rows and o columns move together) or activation (structured's flow, plans from "
            "activations on --calib text); paper and official align only one side of o_proj/down_proj "
            "and cannot merge. Sources: docs/ot.md.",
            plan=True,
        ),
    ] = "structured"


def _merge_refuses(family: Family, ot: OTOptions) -> str | None:
    if ot.variant not in MERGING_VARIANTS:
        return (
            f"--ot-variant {ot.variant} cannot merge layers: {_ONE_SIDED[ot.variant]}; use "
            f"--ot-variant {' or '.join(MERGING_VARIANTS)}"
        )
    return OT.refuses_options(family, ot) if OT.refuses_options is not None else None


DROP = Method("drop", "the removed layers are left out (ShortGPT, Gromov et al.)", "shrink", builder="base")
AVERAGE = Method(
    "average",
    "each merge group becomes the plain mean of its layers",
    "shrink",
    builder="average",
    make_builder=MeanBuilder,
)
OT_MERGE = dataclasses.replace(
    OT,
    summary="OT-DUS's transport flow aligns the group's layers to its last one, then all are averaged",
    layout="shrink",
    options=MergeOTOptions,
    refuses_options=_merge_refuses,
    zero_init_default=False,
    pair=False,
    make_builder=OTMergeBuilder,
)

__all__ = ["MERGING_VARIANTS", "MergeOTOptions", "OTOptions"]
