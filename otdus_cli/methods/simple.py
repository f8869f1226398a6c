"""The methods that need no alignment: the plain average of a pair (its builder is also a shrink's
average merge), a fresh random layer, and the copy-type methods (the engine moves their bytes; they
differ only in placement)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from otdus_cli.methods.base import BuildContext, Method, ParentLayer

if TYPE_CHECKING:
    import torch


class MeanBuilder:
    """The plain mean of the parents' tensors: a shrink's average merge of a group of any size from
    two on, and (PairMeanBuilder) the paper's Avg-DeUS, 1/2 (f_i + f_{i+1}); zero-init is a
    separate switch. Summed in parent order, then divided by the count (for a pair, exactly the
    same floats as multiplying by 1/2)."""

    parents_needed: int | None = None

    def build(self, parents: Sequence[ParentLayer], ctx: BuildContext) -> Iterator[tuple[str, torch.Tensor]]:
        first, second, *rest = parents
        for suffix in first.suffixes():
            total = first.get(suffix).float() + second.get(suffix).float()  # a new tensor: added in place
            for p in rest:
                total += p.get(suffix).float()
            yield suffix, total.div_(len(parents))


class PairMeanBuilder(MeanBuilder):
    """Avg-DeUS: the mean of exactly two parents (f_i, f_{i+1})."""

    parents_needed = 2


class RandomBuilder:
    """A freshly initialised layer at the base's init scale, as transformers initialises one.

    Matrices ~ N(0, initializer_range^2); norm scales at their neutral value (1, or 0 for
    Gemma-style (1 + w) norms); biases zero. Seeded per output layer, so runs are reproducible.
    """

    parents_needed = 1

    def build(self, parents: Sequence[ParentLayer], ctx: BuildContext) -> Iterator[tuple[str, torch.Tensor]]:
        import torch  # copy-type methods never need torch

        (a,) = parents
        std = float(ctx.config.get("initializer_range", 0.02))
        gen = torch.Generator().manual_seed(ctx.seed * 1_000_003 + ctx.output_index)
        for suffix in a.suffixes():
            shape = _shape(a, suffix)
            if len(shape) >= 2:
                yield suffix, torch.randn(shape, generator=gen) * std
            elif "norm" in suffix and not suffix.endswith(".bias"):  # a LayerNorm's bias is a shift: 0
                yield suffix, torch.full(shape, 1.0 - ctx.family.norm_offset)
            else:
                yield suffix, torch.zeros(shape)


def _shape(layer: ParentLayer, suffix: str) -> tuple[int, ...]:
    shape_of = getattr(layer, "shape", None)
    return tuple(shape_of(suffix)) if shape_of else tuple(layer.get(suffix).shape)


AVERAGE = Method(
    "average",
    "plain average 1/2 (f_i + f_{i+1}) (the paper's Avg-DeUS)",
    "placed",
    builder="average",
    pair=True,
    make_builder=PairMeanBuilder,
)
RANDOM = Method(
    "random",
    "a freshly initialised layer (N(0, initializer_range²), neutral norms)",
    "placed",
    builder="random",
    make_builder=RandomBuilder,
    seeded_by_study=True,
)
COPY = Method("copy", "a copy of f_i inserted after it", "placed")
INTERPOSE = Method("interpose", "each layer of the range duplicated in place (l1 l1 l2 l2 ...)", "placed")
LLAMA_PRO = Method(
    "llama-pro",
    "LLaMA PRO: after every L/k layers, a copy of the group's last layer",
    "uniform",
    zero_init_default=True,
)
SOLAR = Method("solar", "SOLAR DUS: layers 0..L-m-1 followed by m..L-1 (32 -> 48: 0-23, 8-31)", "solar")
STACK = Method("stack", "the whole stack repeated (--layers a multiple of L; default L)", "stack")
