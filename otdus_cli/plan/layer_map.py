"""Layer maps: for every output layer, where it comes from.

A plan is computed from the base depth, the method and the placement, before any tensor is read,
so `otdus plan` can show it and every bad request fails before output exists.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal, Protocol, get_args

from otdus_cli.errors import OtdusError

Position = Literal["top", "bottom", "mid", "top-bottom", "uniform"]
POSITIONS: tuple[str, ...] = get_args(Position)
# No growth operator in the literature goes beyond a few times the base depth; a bound keeps a typo
# (--layers 1000000000) from building a layer map until memory runs out.
MAX_GROWTH = 64


class Family(Protocol):
    """What a layer map reads of a family template (arch/families.py: Family): its layers' kinds."""

    @property
    def name(self) -> str: ...
    @property
    def layer_kind(self) -> Callable[[dict, int], str]: ...


class Placement(Protocol):
    """What a layer map reads of a method (methods/base.py: Method), passed in by the caller."""

    @property
    def layout(self) -> str: ...
    @property
    def pair(self) -> bool: ...
    @property
    def builder(self) -> str: ...
    @property
    def zero_init_default(self) -> bool: ...


@dataclass(frozen=True)
class OutputLayer:
    """One layer of the expanded stack.

    `source` is the base layer whose tensor names, shapes and per-layer config (layer_types...)
    the output layer inherits. Base layers (`new` false) are byte copies of `source`; new layers
    are built by `builder` from `parents`.
    """

    index: int
    source: int
    new: bool
    parents: tuple[int, ...]
    builder: str  # "base", "copy", "average", "random", "ot"
    zero_init: bool

    def to_json(self) -> dict:
        d = asdict(self)
        d["parents"] = list(self.parents)
        return d


def _count(base_layers: int, layers: int | None, ratio: float | None) -> int:
    if layers is not None and ratio is not None:
        raise OtdusError("give --layers or --ratio, not both")
    if ratio is not None:
        if not math.isfinite(ratio) or ratio <= 0:
            raise OtdusError(f"--ratio must be a positive number, got {ratio}")
        count = round(base_layers * ratio)
    else:
        count = base_layers // 2 if layers is None else layers
    if count < 1:
        raise OtdusError(f"the expansion adds {count} layers; it must add at least one")
    if count > MAX_GROWTH * base_layers:
        raise OtdusError(
            f"the expansion adds {count} layers to a {base_layers}-layer model; at most "
            f"{MAX_GROWTH * base_layers} ({MAX_GROWTH}x the base depth) are supported"
        )
    return count


def would_work(valid: list[int], requested: int) -> str:
    """A hint naming the valid --layers values nearest to the one requested."""
    nearest = sorted(sorted(valid, key=lambda v: (abs(v - requested), v))[:2])
    return " or ".join(f"--layers {v}" for v in nearest) + " would work"


def insertion_points(base_layers: int, count: int, position: str, pair: bool) -> list[int]:
    """Base indices i after which a new layer goes (built from f_i, and f_{i+1} for pair methods)."""
    L = base_layers
    gaps = L - 1  # a pair method can only use the gaps between two base layers
    limit = gaps if pair else L
    if position != "uniform" and count > limit:
        raise OtdusError(
            f"cannot insert {count} layers at position {position!r} into a {L}-layer model "
            f"(at most {limit}{' pairs' if pair else ''}); use --after for repeated positions"
        )
    if position == "top":
        # the pairs (L-k-1, L-k) .. (L-2, L-1); a copy method asked for all L layers takes every one
        return list(range(L - 1 - count, L - 1)) if count <= gaps else list(range(L))
    if position == "bottom":
        return list(range(count))
    if position == "mid":
        start = (limit - count) // 2
        return list(range(start, start + count))
    if position == "top-bottom":
        bottom = count // 2
        top = count - bottom
        points = list(range(bottom)) + list(range(L - 1 - top, L - 1))
        if len(set(points)) != count:
            raise OtdusError(
                f"{count} layers do not fit at top and bottom of a {L}-layer model without overlap"
            )
        return points
    if position == "uniform":
        if L % count:
            divisors = [d for d in range(1, L + 1) if L % d == 0]
            raise OtdusError(
                f"uniform placement needs the base depth {L} to be a multiple of the new layers {count}; "
                + would_work(divisors, count)
            )
        group = L // count
        points = [group * (j + 1) - 1 for j in range(count)]
        if pair and points[-1] == L - 1:
            raise OtdusError(
                "uniform placement puts a new layer after the last base layer, which a pair-based method "
                "cannot build (it has no f_{i+1}); use --position top/mid/bottom or --after"
            )
        return points
    raise OtdusError(f"unknown position {position!r}; choose one of {', '.join(POSITIONS)}")


def validate_after(base_layers: int, after: list[int], pair: bool) -> list[int]:
    for i in after:
        if not 0 <= i < base_layers:
            raise OtdusError(f"--after {i} is not a base layer index (0..{base_layers - 1})")
        if pair and i == base_layers - 1:
            raise OtdusError(
                f"--after {i}: a pair-based method cannot insert after the last layer "
                "(no f_{i+1} to pair with)"
            )
    return sorted(after)


def interleave(
    base_layers: int, points: list[int], builder: str, zero_init: bool, pair: bool
) -> list[OutputLayer]:
    """Base stack with new layers inserted after the given base indices (repeats allowed)."""
    out: list[OutputLayer] = []
    for i in range(base_layers):
        out.append(OutputLayer(len(out), i, False, (i,), "base", False))
        for _ in range(points.count(i)):
            parents = (i, i + 1) if pair else (i,)
            out.append(OutputLayer(len(out), i, True, parents, builder, zero_init))
    return out


def from_sources(sources: list[int], zero_init: bool) -> list[OutputLayer]:
    """A stack given as a list of base layers; repeats of a base layer are new copies."""
    seen: set[int] = set()
    out: list[OutputLayer] = []
    for j, i in enumerate(sources):
        if i in seen:
            out.append(OutputLayer(j, i, True, (i,), "copy", zero_init))
        else:
            seen.add(i)
            out.append(OutputLayer(j, i, False, (i,), "base", False))
    return out


def is_function_preserving(layer_map: list[OutputLayer], base_layers: int) -> bool:
    """True when the output computes the base function: base layers in order, every new layer an identity."""
    base_order = [lay.source for lay in layer_map if not lay.new]
    return base_order == list(range(base_layers)) and all(lay.zero_init for lay in layer_map if lay.new)


def plan_layers(
    base_layers: int,
    method: Placement,
    position: str = "top",
    layers: int | None = None,
    ratio: float | None = None,
    after: list[int] | None = None,
    zero_init: bool | None = None,
) -> list[OutputLayer]:
    """The output stack for a method and placement; raises OtdusError for impossible requests."""
    zero = method.zero_init_default if zero_init is None else zero_init
    if after:  # the layers placed explicitly: a count or layout saying otherwise contradicts them
        if method.layout in ("stack", "solar"):
            raise OtdusError(f"--method {method.name} places its new layers itself; leave out --after")
        asked = None if layers is None and ratio is None else _count(base_layers, layers, ratio)
        if asked is not None and asked != len(after):
            raise OtdusError(f"--after names {len(after)} new layer(s), --layers or --ratio asks for {asked}")
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


def layer_kinds(family: Family, config: dict, base_layers: int) -> list[str]:
    """Each base layer's kind (attention / recurrent, dense / MoE ...; one kind in a uniform stack)."""
    return [family.layer_kind(config, i) for i in range(base_layers)]


def mixed_kind_gaps(family: Family, config: dict, base_layers: int) -> list[int]:
    """Base layers i after which layers of different kinds meet (i and i + 1): a new layer built from
    both (a pair method) cannot be placed there."""
    kinds = layer_kinds(family, config, base_layers)
    return [i for i in range(base_layers - 1) if kinds[i] != kinds[i + 1]]


def check_parent_kinds(
    family: Family, config: dict, base_layers: int, layer_map: list[OutputLayer], method: str
) -> None:
    """A layer built from several parents (average, OT, LESA) needs them of one kind: the same tensors.
    OtdusError naming the first that is not, and the placements that would work."""
    kinds = layer_kinds(family, config, base_layers)
    for lay in layer_map:
        mixed = ", ".join(sorted({kinds[i] for i in lay.parents}))
        if len(set(kinds[i] for i in lay.parents)) > 1:
            mixed_gaps = set(mixed_kind_gaps(family, config, base_layers))
            fine = [i for i in range(base_layers - 1) if i not in mixed_gaps]
            where = f"--after with any of {index_ranges(fine)}" if fine else "no pair placement here"
            raise OtdusError(
                f"--method {method}: new layer {lay.index} would be built from layers "
                f"{', '.join(map(str, lay.parents))}, of different kinds in {family.name} ({mixed}); "
                f"place it between layers of one kind ({where}), or use a copy-type method (copy, "
                "llama-pro: a new layer takes its one parent's kind)"
            )


def index_ranges(values: list[int]) -> str:
    """0,1,2,4 -> '0-2, 4' (none: "")."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][-1] + 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
