"""Which base layer each expanded layer copies, and where the two stacks must agree.

The layer map is the manifest's ``layers`` list (``otdus.json`` in the expanded folder), or a function
``expanded index -> base index it copies (None for a new layer)``:

* a base layer copied in order (``new`` false, ``source`` = the next base layer) corresponds to the
  base's state after that base layer;
* a new layer corresponds to the base's state after the base layers consumed so far (a zero-init
  layer is an exact identity, so nothing may change);
* once base layers appear out of order (SOLAR-style repeats), there is no corresponding base state and
  the rest of the stack is not compared layer by layer.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from otdus_cli.errors import OtdusError
from otdus_cli.manifest import read_manifest

LayerMap = Sequence[dict] | Callable[[int], "int | None"]


@dataclass(frozen=True)
class LayerEntry:
    index: int
    source: int | None
    new: bool
    zero_init: bool = False
    parents: tuple[int, ...] = ()
    builder: str | None = None
    widened_noise: float | None = None  # otdus widen: the noise alpha of its expert copies


def manifest_base_path(folder: str | os.PathLike[str]) -> str | None:
    """The base model folder recorded in an expanded checkpoint's manifest, if any."""
    manifest = read_manifest(folder) or {}
    source = manifest.get("source")
    return source.get("path") if isinstance(source, dict) else None


def layer_entries(layer_map: LayerMap, num_layers: int) -> list[LayerEntry]:
    if callable(layer_map):
        out = []
        for j in range(num_layers):
            src = layer_map(j)
            out.append(LayerEntry(j, src, src is None, zero_init=src is None))
        return out
    out = []
    for j, raw in enumerate(layer_map):
        if not isinstance(raw, dict) or "new" not in raw:
            raise OtdusError(f"manifest layer entry {j} is malformed (needs at least 'new')")
        index = int(raw.get("index", j))
        if index != j:
            raise OtdusError(f"manifest layer entries are out of order at {j} (index {index})")
        src = raw.get("source")
        out.append(
            LayerEntry(
                j,
                None if src is None else int(src),
                bool(raw["new"]),
                bool(raw.get("zero_init", False)),
                tuple(int(p) for p in raw.get("parents") or ()),
                raw.get("builder"),
                float(raw.get("noise") or 0.0) if raw.get("widened") else None,
            )
        )
    if len(out) != num_layers:
        raise OtdusError(f"the layer map lists {len(out)} layers, the expanded checkpoint has {num_layers}")
    return out


def correspondence(entries: Sequence[LayerEntry], base_layers: int) -> list[int | None]:
    """For each expanded layer j, the base layer whose output its output should equal (-1 = the
    embeddings), or None when there is no such point."""
    consumed = -1
    broken = False
    out: list[int | None] = []
    for e in entries:
        if broken:
            out.append(None)
        elif not e.new:
            if e.source == consumed + 1 and e.source < base_layers:
                consumed += 1
                out.append(consumed)
            else:
                broken = True
                out.append(None)
        else:
            out.append(consumed)
    return out


def default_function_preserving(entries: Sequence[LayerEntry], base_layers: int) -> bool:
    base_order = [e.source for e in entries if not e.new]
    noisy = any(e.widened_noise for e in entries)  # widened with noise: a different function
    return base_order == list(range(base_layers)) and all(e.zero_init for e in entries if e.new) and not noisy


def describe(entry: LayerEntry | None, index: int) -> str:
    if entry is None:
        return f"layer {index}"
    if entry.new:
        parts = [f"new layer {index}"]
        detail = []
        if entry.builder:
            detail.append(entry.builder)
        if entry.parents:
            detail.append("from " + "+".join(str(p) for p in entry.parents))
        if entry.zero_init:
            detail.append("zero-init")
        if detail:
            parts.append("(" + ", ".join(detail) + ")")
        return " ".join(parts)
    return f"layer {index} (copy of base layer {entry.source})"
