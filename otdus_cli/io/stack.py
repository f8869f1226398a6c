"""A checkpoint seen through its family template: tensors before the stack, decoder layers, after.

Reading only headers, it checks what every later step relies on: the layer count of config.json
matches the tensors present (compared before anything proportional to the count is built), and
layers of one kind (the family says which may differ, e.g. dense layers in a MoE stack) hold the
same tensors with the same dtypes and shapes. A layer's tensors a derived template finds stored outside
its prefix, under names numbered by the layer (arch/layer_storage.py), are read as part of the layer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from otdus_cli.arch.depth import stated_depth
from otdus_cli.arch.dims import check_dimensions
from otdus_cli.arch.families import DEPTH_FIELDS, Family
from otdus_cli.arch.layer_storage import NumberedName
from otdus_cli.arch.wrappers import text_config, text_model_prefix
from otdus_cli.errors import OtdusError
from otdus_cli.io.reader import CheckpointReader

if TYPE_CHECKING:
    import torch


class SourceLayer:
    """A decoder layer of a checkpoint, read lazily (implements methods.base.ParentLayer): its tensors
    under its prefix, by their names after it, and those stored outside it under a name numbered by the
    layer (a derived template's: arch/layer_storage.py), by their names within the layer's module."""

    def __init__(
        self,
        reader: CheckpointReader,
        prefix: str,
        index: int,
        suffixes: list[str],
        outside: dict[str, NumberedName] | None = None,
    ):
        self.reader = reader
        self.prefix = prefix
        self.index = index
        self.outside = dict(outside or {})
        self._suffixes = [*suffixes, *sorted(self.outside)]

    def suffixes(self) -> list[str]:
        return list(self._suffixes)

    def name(self, suffix: str) -> str:
        rule = self.outside.get(suffix)
        return rule.name(self.index) if rule is not None else self.prefix + suffix

    def get(self, suffix: str) -> torch.Tensor:
        """One tensor for a builder; non-finite weights would flow into every layer built from it."""
        import torch  # only builders read tensors

        tensor = self.reader.get(self.name(suffix))
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise OtdusError(
                f"source tensor {self.name(suffix)} holds {bad} NaN/Inf values; new layers would inherit "
                "them (refusing before any output is written)"
            )
        return tensor

    def shape(self, suffix: str) -> tuple[int, ...]:
        return self.reader.meta(self.name(suffix)).shape


@dataclass
class LayerStack:
    """A checkpoint as: tensors before the stack, the decoder layers, tensors after."""

    reader: CheckpointReader
    family: Family
    layers: list[SourceLayer]
    head: list[str]  # embeddings and anything else outside the stack, written first
    tail: list[str]  # final norm, lm_head ...
    # layers stored after the decoder stack (DeepSeek-V3's multi-token prediction module): not decoder
    # layers; written after the new last layer, renumbered (after_stack_name)
    after_stack: list[str]

    @property
    def config(self) -> dict:
        return self.reader.config

    @property
    def text_config(self) -> dict:
        """The decoder stack's settings (a multimodal wrapper's text config)."""
        return text_config(self.reader.config)

    def output_name(self, source: int, index: int, suffix: str) -> str:
        """Where an output that places base layer ``source`` at ``index`` stores its tensor ``suffix``:
        under the layer prefix of ``index``, or for a tensor stored outside the layer, under the name its
        rule numbers ``index`` with."""
        rule = self.layers[source].outside.get(suffix)
        return rule.name(index) if rule is not None else self.family.layer_prefix.format(i=index) + suffix

    def after_stack_name(self, name: str, new_depth: int) -> str:
        """``name`` of a layer stored after the stack, renumbered to follow a stack of ``new_depth``."""
        m = self.family.layer_regex().fullmatch(name)
        assert m is not None and int(m.group(1)) >= self.depth, name
        return self.family.layer_prefix.format(i=int(m.group(1)) - self.depth + new_depth) + m.group(2)

    @property
    def depth(self) -> int:
        return len(self.layers)


def read_stack(reader: CheckpointReader, family: Family) -> LayerStack:
    config = text_config(reader.config)
    depth = stated_depth(config)
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
        raise OtdusError("config.json has no valid num_hidden_layers (nor a text_config that has one)")
    # a multimodal wrapper keeps its text model under another prefix; the rest is copied as is
    found = text_model_prefix(reader.names)
    if found is not None and found + "layers.{i}." != family.layer_prefix:
        family = replace(family, layer_prefix=found + "layers.{i}.")
    if family.copy_only and not any(n.startswith(family.layer_prefix.format(i=0)) for n in reader.names):
        family = replace(family, layer_prefix=stored_layer_prefix(reader.names, depth, family))
    pattern = family.layer_regex()
    by_layer: dict[int, list[str]] = {}
    others: list[str] = []
    for name in reader.names:
        m = pattern.fullmatch(name)
        if m:
            by_layer.setdefault(int(m.group(1)), []).append(m.group(2))
        else:
            others.append(name)
    missing = next((i for i in range(depth) if i not in by_layer), None)
    if missing is not None:
        held = sum(1 for i in by_layer if i < depth)
        raise OtdusError(
            f"config.json says {depth} layers but the checkpoint holds tensors for {held} "
            f"(none for layer {missing})"
        )
    trailing = sum(int(config.get(name) or 0) for name, kind in DEPTH_FIELDS.items() if kind == "trailing")
    after_stack = sorted(
        family.layer_prefix.format(i=i) + s
        for i in by_layer
        if depth <= i < depth + trailing
        for s in by_layer[i]
    )
    extra = sorted(i for i in by_layer if i >= depth + trailing)
    if extra:
        raise OtdusError(
            f"checkpoint has tensors for layer {extra[0]} but config says {depth} layers"
            + (f" (and {trailing} stored after them)" if trailing else "")
        )
    outside = numbered_outside_tensors(family, config, depth, others)
    claimed = _claimed(outside)
    others = [n for n in others if n not in claimed]
    layers = [
        SourceLayer(reader, family.layer_prefix.format(i=i), i, sorted(by_layer[i]), outside.get(i))
        for i in range(depth)
    ]
    check_layers_alike(layers, family, config)
    others.sort()
    head = [n for n in others if "embed" in n]
    tail = [n for n in others if "embed" not in n]
    stack = LayerStack(reader, family, layers, head, tail, after_stack)
    check_dimensions(stack, config)
    return stack


def numbered_outside_tensors(
    family: Family, config: dict, depth: int, others: list[str]
) -> dict[int, dict[str, NumberedName]]:
    """The tensors among ``others`` (the checkpoint's names under no layer's prefix) that hold a layer's
    parameter under a name numbered by the layer (``family.numbered_names``: Inkling 2's
    ``attn_res.attn_queries.{i-1}``), by layer index: {index: {name within the layer: rule}}. OtdusError
    for one numbered so for no layer of the stack (a layer beyond the depth config.json states)."""
    if not family.numbered_names:
        return {}
    present = set(others)
    out: dict[int, dict[str, NumberedName]] = {}
    for i in range(depth):
        rules = family.numbered_names.get(family.layer_kind(config, i), {})
        found = {key: rule for key, rule in rules.items() if rule.name(i) in present}
        if found:
            out[i] = found
    for name in sorted(present - _claimed(out)):
        numbered = family.numbered_tensor(name)
        if numbered is not None:
            raise OtdusError(
                f"the checkpoint holds {name}, where transformers saves a layer's {numbered[1]}, but for "
                f"none of the {depth} layers config.json says"
            )
    return out


def _claimed(outside: dict[int, dict[str, NumberedName]]) -> set[str]:
    """The checkpoint names numbered_outside_tensors gave to layers."""
    return {rule.name(i) for i, rules in outside.items() for rule in rules.values()}


_NUMBERED = re.compile(r"(.+?\.)(\d+)\.")


def stored_layer_prefix(names: list[str], depth: int, family: Family) -> str:
    """Where a checkpoint stores its decoder layers when not where the template's class keeps them
    (a template without tensor roles only): transformers renames some layouts when loading (EXAONE 3's
    ``transformer.h.N`` becomes LlamaForCausalLM's ``model.layers.N``). The one numbered name whose
    numbers are exactly 0 .. depth-1; otherwise OtdusError saying what was looked for."""
    numbers: dict[str, set[int]] = {}
    for name in names:
        m = _NUMBERED.match(name)
        if m:
            numbers.setdefault(m.group(1), set()).add(int(m.group(2)))
    found = sorted(p for p, seen in numbers.items() if seen == set(range(depth)))
    if len(found) == 1:
        return found[0] + "{i}."
    expected = family.layer_prefix.format(i="N")
    what = f"several ({', '.join(p + 'N' for p in found[:3])})" if found else "none"
    raise OtdusError(
        f"{family.name}: no tensors under {expected}, where transformers' class keeps the decoder layers, "
        f"and names numbered 0-{depth - 1} elsewhere: {what}; otdus cannot tell which tensors are this "
        "checkpoint's decoder layers (save it again with this transformers, or add an exact template)"
    )


def check_layers_alike(layers: list[SourceLayer], family: Family, config: dict) -> None:
    """Layers of one kind must hold the same tensors with the same dtypes and shapes: a copy of a layer
    that lacks one would load with random weights, or not at all."""
    first: dict[str, SourceLayer] = {}
    for layer in layers:
        kind = family.layer_kind(config, layer.index)
        ref = first.setdefault(kind, layer)
        if ref is layer:
            continue
        mine, theirs = set(layer.suffixes()), set(ref.suffixes())
        if mine != theirs:
            lacks = sorted(theirs - mine)
            what = f"lacks {lacks[0]}" if lacks else f"has an extra tensor {sorted(mine - theirs)[0]}"
            raise OtdusError(
                f"layer {layer.index} {what}, unlike layer {ref.index}; the checkpoint is incomplete"
            )
        for suffix in layer.suffixes():
            a, b = ref.reader.meta(ref.name(suffix)), layer.reader.meta(layer.name(suffix))
            if (a.dtype, a.shape) != (b.dtype, b.shape):
                raise OtdusError(
                    f"layer {layer.index} {suffix} is {b.dtype} {list(b.shape)}, but layer {ref.index}'s is "
                    f"{a.dtype} {list(a.shape)}; the checkpoint is inconsistent"
                )
