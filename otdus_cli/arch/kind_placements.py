"""Which placements of new layers keep every layer's kind, for a derived template whose plan was refused.

Where transformers sets a layer's kind from its index (a period, a range the config states) and the
rewritten config cannot say otherwise, a copy keeps its kind only where the index it lands on builds
that kind. The kinds transformers builds at the new depth (from the refused plan's config) guide a
search for copies after base layers that fit them; every candidate, with ``--method stack`` (of as
many layers, and of the whole stack) and ``solar``, which copy whole runs of layers, is then checked
the way a plan is: its rewritten config built on the meta device (arch/derived.py:
check_planned_kinds).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from otdus_cli.arch.depth import stated_depth
from otdus_cli.arch.wrappers import text_config
from otdus_cli.errors import OtdusError


@dataclass(frozen=True)
class _Copies:
    """How the copy-type methods tried here place their layers (plan/layer_map.py: Placement): copy
    after insertion points ("placed"), stack and solar by their layouts of the same names; none zeroed."""

    layout: str
    pair: bool = False
    builder: str = "copy"
    zero_init_default: bool = False


def kind_keeping_placements(
    family, config: dict, new: int, built: list[str], kinds_built: Callable[[dict], list[str]]
) -> list[str]:
    """The expand flags of placements of ``new`` layers that keep every layer's kind (each checked in
    transformers), given the kinds ``built`` at the new depth from the refused plan's config;
    ``kinds_built``: the kinds transformers builds from a rewritten config (arch/derived.py, which
    calls this: config_layer_kinds)."""
    from otdus_cli.plan.layer_map import layer_kinds, plan_layers

    text = text_config(config)
    depth = stated_depth(text)
    kinds = layer_kinds(family, text, depth)
    candidates = []
    after = copies_fitting(kinds, built, new)
    if after is not None:
        candidates.append((f"--after {','.join(map(str, after))}", _Copies("placed"), {"after": after}))
    # stack copies whole runs of layers (the whole stack at most): whole periods of kinds
    for method, layers in dict.fromkeys([("stack", new), ("stack", depth), ("solar", new)]):
        candidates.append((f"--method {method} --layers {layers}", _Copies(method), {"layers": layers}))
    found = []
    for flags, method, placement in candidates:
        try:
            layer_map = plan_layers(depth, method, **placement)
            if _keeps_kinds(family, config, layer_map, kinds, kinds_built):
                found.append(flags)
        except OtdusError:
            continue
    return found


def _keeps_kinds(
    family, config: dict, layer_map: list, kinds: list[str], kinds_built: Callable[[dict], list[str]]
) -> bool:
    from otdus_cli.arch.config_rules import family_config

    written = family_config(family, config, layer_map)
    return kinds_built(written) == [kinds[lay.source] for lay in layer_map]


def copies_fitting(kinds: list[str], built: list[str], new: int) -> list[int] | None:
    """Base layers to put ``new`` copies after (``--after``: a copy of layer i right after it), so that
    each output layer's source is of the kind ``built`` there; the copies as far up the stack as they fit;
    None when none fit."""
    depth = len(kinds)
    if len(built) != depth + new:
        return None

    @functools.cache
    def place(i: int, used: int) -> tuple[int, ...] | None:
        """Copies of base layers i.. (their counts) with ``used`` copies placed below layer i."""
        if i == depth:
            return () if used == new else None
        for extra in range(new - used + 1):  # fewest copies here first: the rest go further up
            start = i + used
            if all(built[start + k] == kinds[i] for k in range(extra + 1)):
                rest = place(i + 1, used + extra)
                if rest is not None:
                    return (extra, *rest)
            else:
                break
        return None

    counts = place(0, 0)
    if counts is None:
        return None
    return [i for i, extra in enumerate(counts) for _ in range(extra)]
