"""Builders that need no alignment: the plain average of a pair, and a fresh random layer."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from otdus_cli.methods.base import BuildContext, ParentLayer


class AverageBuilder:
    """The paper's Avg-DeUS: 1/2 (f_i + f_{i+1}) for every tensor (zero-init is a separate switch)."""

    parents_needed = 2

    def build(self, parents: Sequence[ParentLayer], ctx: BuildContext) -> Iterator[tuple[str, torch.Tensor]]:
        a, b = parents
        for suffix in a.suffixes():
            yield suffix, (a.get(suffix).float() + b.get(suffix).float()) * 0.5


class RandomBuilder:
    """A freshly initialised layer at the base's init scale, as transformers initialises one.

    Matrices ~ N(0, initializer_range^2); norm scales at their neutral value (1, or 0 for
    Gemma-style (1 + w) norms); biases zero. Seeded per output layer, so runs are reproducible.
    """

    parents_needed = 1

    def build(self, parents: Sequence[ParentLayer], ctx: BuildContext) -> Iterator[tuple[str, torch.Tensor]]:
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
