"""The methods `otdus expand` offers, described as data: how each places and builds new layers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from otdus_cli.errors import OtdusError
from otdus_cli.methods.base import LayerBuilder
from otdus_cli.plan.layer_map import (
    OutputLayer,
    _count,
    from_sources,
    insertion_points,
    interleave,
    validate_after,
    would_work,
)


@dataclass(frozen=True)
class Method:
    name: str
    summary: str
    zero_init_default: bool
    # "placed": new layers go after insertion points (position / --after); "uniform": fixed LLaMA PRO
    # placement; "solar" / "stack": the whole output stack is a list of base layers.
    layout: str
    builder: str  # "copy" (byte copy of the parent), "average", "random", "ot", "lesa"
    pair: bool = False  # built from (f_i, f_{i+1})
    # variants whose published recipe zeroes nothing: zero-init is off by default for them
    zero_init_off_for: tuple[str, ...] = ()

    @property
    def function_preserving_by_default(self) -> bool:
        return self.zero_init_default

    def zero_init_for(self, variant: str | None) -> bool:
        """The zero-init default of this method in ``variant``."""
        return self.zero_init_default and variant not in self.zero_init_off_for


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method(
            "ot",
            "OT-DUS: neurons of f_i aligned to f_{i+1} by optimal transport, then averaged",
            True,
            "placed",
            "ot",
            pair=True,
        ),
        Method(
            "lesa",
            "LESA: per projection, an MLP predicts f_i+1/2's SVD coefficients from f_i and f_{i+1}",
            True,
            "placed",
            "lesa",
            pair=True,
            zero_init_off_for=("published",),
        ),
        Method(
            "average",
            "plain average 1/2 (f_i + f_{i+1}) (the paper's Avg-DeUS)",
            False,
            "placed",
            "average",
            pair=True,
        ),
        Method("copy", "a copy of f_i inserted after it", False, "placed", "copy"),
        Method(
            "interpose", "each chosen layer duplicated in place (l1 l1 l2 l2 ...)", False, "placed", "copy"
        ),
        Method("random", "a freshly initialised layer", False, "placed", "random"),
        Method(
            "llama-pro",
            "LLaMA PRO: after every L/k layers, a copy of the group's last layer",
            True,
            "uniform",
            "copy",
        ),
        Method("solar", "SOLAR DUS: layers 0..L-m-1 followed by m..L-1", False, "solar", "copy"),
        Method("stack", "the whole stack repeated", False, "stack", "copy"),
    )
}


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise OtdusError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}") from None


def plan_layers(
    base_layers: int,
    method: Method,
    position: str = "top",
    layers: int | None = None,
    ratio: float | None = None,
    after: list[int] | None = None,
    zero_init: bool | None = None,
) -> list[OutputLayer]:
    """The output stack for a method and placement; raises OtdusError for impossible requests."""
    zero = method.zero_init_default if zero_init is None else zero_init
    if method.layout == "stack":
        count = _count(base_layers, base_layers if layers is None and ratio is None else layers, ratio)
        if count % base_layers:
            raise OtdusError(
                f"stack repeats the whole {base_layers}-layer stack: --layers must be a multiple of it"
            )
        return from_sources(list(range(base_layers)) * (count // base_layers + 1), zero)
    count = _count(base_layers, layers, ratio)
    if method.layout == "solar":
        if count > base_layers or (base_layers - count) % 2:
            same_parity = list(range(base_layers % 2 or 2, base_layers + 1, 2))
            raise OtdusError(
                f"SOLAR adds L - 2m layers: with L={base_layers}, --layers must be at most {base_layers} "
                f"and have the same parity as {base_layers} (got {count}); {would_work(same_parity, count)}"
            )
        m = (base_layers - count) // 2
        return from_sources(list(range(base_layers - m)) + list(range(m, base_layers)), zero)
    if after:
        points = validate_after(base_layers, after, method.pair)
    elif method.layout == "uniform":
        points = insertion_points(base_layers, count, "uniform", method.pair)
    else:
        points = insertion_points(base_layers, count, position, method.pair)
    return interleave(base_layers, points, method.builder, zero, method.pair)


def make_builder(name: str) -> LayerBuilder:
    """The tensor builder for a non-copy builder name (copies are done byte for byte by the engine)."""
    factories: dict[str, Callable[[], LayerBuilder]] = {}
    from otdus_cli.methods.simple import AverageBuilder, RandomBuilder

    factories["average"] = AverageBuilder
    factories["random"] = RandomBuilder
    if name == "ot":
        from otdus_cli.methods.ot import OTBuilder

        factories["ot"] = OTBuilder
    if name == "lesa":
        from otdus_cli.methods.lesa import LesaBuilder

        factories["lesa"] = LesaBuilder
    return factories[name]()
