"""The interface between the expansion engine and the layer builders.

A builder makes the tensors of one new layer from its parent layers (one parent for copy-type
builders, the adjacent pair (f_i, f_{i+1}) for pair builders). Parents are read lazily, one
tensor at a time, so a builder holds only what its formulas need.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from otdus_cli.arch.families import Family

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from otdus_cli.plan.layer_map import OutputLayer


def _cpu() -> torch.device:
    import torch  # noqa: PLC0415 - planning and copying never need torch

    return torch.device("cpu")


class ParentLayer(Protocol):
    """One base layer, read lazily from the source checkpoint."""

    index: int

    def suffixes(self) -> list[str]:
        """Tensor names inside the layer, e.g. "self_attn.q_proj.weight"."""
        ...

    def get(self, suffix: str) -> torch.Tensor:
        """Load one tensor (source dtype, CPU)."""
        ...


@dataclass
class BuildContext:
    """What a builder may consult besides its parents."""

    family: Family
    config: dict  # the source config.json
    device: torch.device = field(default_factory=_cpu)
    options: dict[str, Any] = field(default_factory=dict)  # method-specific options
    seed: int = 0
    output_index: int = 0  # index of the new layer in the output stack
    stats: dict[str, Any] = field(default_factory=dict)  # builders record per-layer statistics here
    source_folder: Path | None = None  # the source checkpoint (pre-passes that run it: OT activation)


class LayerBuilder(Protocol):
    """Builds one new layer. Yields (suffix, tensor) for every suffix of parents[0].

    Tensors may be any float dtype and device; the writer casts to the output dtype. Zeroing of
    the family's zero-init targets is applied by the engine afterwards when --zero-init is on,
    so builders need not know about it unless their formulas depend on it.
    """

    parents_needed: int  # 1 (copy-type) or 2 (pair)

    def build(
        self, parents: Sequence[ParentLayer], ctx: BuildContext
    ) -> Iterator[tuple[str, torch.Tensor]]: ...


class PreparedBuilder(LayerBuilder, Protocol):
    """A builder that needs every source layer before it can build any new one (LESA: one SVD per
    projection type across the whole stack). The engine calls ``prepare`` once, before writing; it
    may keep intermediate results in ``scratch`` (inside the staging folder, removed afterwards) and
    returns a report recorded in the manifest under the builder's name."""

    def prepare(
        self,
        layers: Sequence[ParentLayer],
        new_layers: Sequence[OutputLayer],
        ctx: BuildContext,
        scratch: Path,
    ) -> dict[str, Any]: ...
