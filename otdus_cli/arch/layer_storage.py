"""Whether a checkpoint keeps each decoder layer's tensors where otdus can copy them, for a derived template.

otdus copies a layer by copying the tensors stored under its prefix (``model.layers.3.``) and copies
everything else as it is (but for tensors with a slice per layer: arch/layer_slices.py). Some classes
keep a layer's parameter elsewhere in the checkpoint, under a name numbered by the layer: Inkling 2
saves ``layers.{i}.attention_input.query`` as ``model.llm.attn_res.attn_queries.{i-1}`` and
``layers.{i}.mlp_input.query`` as ``model.llm.attn_res.mlp_queries.{i}``. Such a name is learned from
transformers' own saving (arch/saved_names.py) as a NumberedName, the tensor is read as part of its
layer (io/stack.py), and a layer placed at output index j writes it under the name of index j, checked
against transformers' saving at every output index. A parameter stored outside its layer in any other
way (merged with other tensors, under a name no layer index numbers) would leave new layers without it:
transformers would initialise it at random on load, a silently different model; such a plan is refused
at plan time, naming the tensors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from otdus_cli.errors import OtdusError

_NUMBER = re.compile(r"(\d+)")


@dataclass(frozen=True)
class NumberedName:
    """Where a checkpoint stores a layer's tensor outside the layer: ``before`` + (the layer's index +
    ``offset``) + ``after`` (Inkling 2's attention_input.query: ``model.llm.attn_res.attn_queries.``,
    -1, "")."""

    before: str
    offset: int
    after: str

    def name(self, index: int) -> str:
        return f"{self.before}{index + self.offset}{self.after}"

    def index_of(self, name: str) -> int | None:
        """The index of the layer whose tensor this rule names ``name``; None where it names none."""
        m = re.fullmatch(re.escape(self.before) + r"(\d+)" + re.escape(self.after), name)
        return None if m is None else int(m.group(1)) - self.offset


def numbered_name(saved: str, index: int, other: str, other_index: int) -> NumberedName | None:
    """The rule that names a tensor ``saved`` at layer ``index`` and ``other`` at ``other_index``: the
    one number in which the two names differ, the layer's index plus a constant; None where they differ
    otherwise (then no index numbers it)."""
    parts, others = _NUMBER.split(saved), _NUMBER.split(other)
    if len(parts) != len(others):
        return None
    differ = [k for k, (a, b) in enumerate(zip(parts, others, strict=True)) if a != b]
    if len(differ) != 1 or differ[0] % 2 == 0:  # one number (odd places of the split), text alike
        return None
    k = differ[0]
    offset = int(parts[k]) - index
    if int(others[k]) - other_index != offset or str(int(parts[k])) != parts[k]:
        return None
    return NumberedName("".join(parts[:k]), offset, "".join(parts[k + 1 :]))


def numbered_outside(model, layer_list: str, kinds: list[str]) -> dict[str, dict[str, NumberedName]]:
    """For each layer kind of ``model`` (transformers' class on the meta device, its decoder layers the
    module list ``layer_list``), the parameters transformers saves outside the layer, each under a name
    of its own numbered by the layer's index, as its NumberedName: {kind: {name within the layer: rule}};
    learned from the names it saves the kind's first layer's parameters under and those of a layer at
    another index. The layer's own saved prefix is the one most of its parameters are numbered under
    (``model.llm.layers.{i}.`` for Inkling 2); a parameter saved merged with others, or under a name no
    index numbers, has no rule (check_layers_stored_whole refuses it)."""
    from collections import Counter

    from otdus_cli.arch.modules import modules_of
    from otdus_cli.arch.saved_names import revert_names, saved_names

    layers = modules_of(model, layer_list)
    other = 2 * len(layers) + 1  # an index of no layer: the names differ only where the index enters
    out: dict[str, dict[str, NumberedName]] = {}
    for kind in dict.fromkeys(kinds):
        index = kinds.index(kind)
        params = dict(layers[index].named_parameters())
        here = {f"{layer_list}.{index}.{n}": p for n, p in params.items()}
        if set(revert_names(model, here)) == set(here):
            continue  # saved under the module names (most classes: one call, no name converted)
        saved = saved_names(model, here)
        there = saved_names(model, {f"{layer_list}.{other}.{n}": p for n, p in params.items()})
        rules = {}
        for n in params:
            # a parameter saved under its own name: the module's
            a = saved.get(f"{layer_list}.{index}.{n}", [f"{layer_list}.{index}.{n}"])
            b = there.get(f"{layer_list}.{other}.{n}", [f"{layer_list}.{other}.{n}"])
            rule = numbered_name(a[0], index, b[0], other) if len(a) == len(b) == 1 else None
            if rule is not None:
                rules[n] = rule
        layer = Counter(r.before for r in rules.values() if r.offset == 0 and r.after.startswith("."))
        inside = layer.most_common(1)[0][0] if layer else None
        outside = {
            n: r
            for n, r in rules.items()
            if not (r.before == inside and r.offset == 0 and r.after[:1] == ".")
        }
        if outside:
            out[kind] = outside
    return out


def check_numbered_names(source, written_model, layer_list: str, layer_map: list) -> None:
    """Each output layer's tensors stored outside its layer (``source``'s layers' NumberedNames) go
    under the names transformers saves them under at the layer's output index, as ``written_model``
    (its class for the written config, on the meta device) says: the rule learned from two indices is
    checked at every index it is used at; OtdusError naming the first it misses."""
    from otdus_cli.arch.saved_names import saved_names

    for lay in layer_map:
        for key, rule in source.layers[lay.source].outside.items():
            module = f"{layer_list}.{lay.index}.{key}"
            try:
                param = written_model.get_parameter(module)
            except AttributeError:
                found = []
            else:
                found = saved_names(written_model, {module: param}).get(module, [module])
            if found != [rule.name(lay.index)]:
                raise OtdusError(
                    f"{source.family.name}: output layer {lay.index} (a copy of layer {lay.source}) would "
                    f"store {key} as {rule.name(lay.index)}, the name learned from transformers' saving of "
                    f"other layers, but transformers saves it at this index as "
                    f"{', '.join(found) or 'no tensor of its own'}; otdus cannot renumber it"
                )


def check_layers_stored_whole(source, base_model, layer_list: str) -> None:
    """Every parameter of a decoder layer of ``base_model`` (transformers' class on the meta device) is
    stored under that layer's prefix in ``source``'s checkpoint, under its own name or the name
    transformers saves it under (arch/saved_names.py), or outside it under a name numbered by the layer
    (read as part of the layer: io/stack.py); OtdusError naming the first that is not. One layer of each
    kind is asked (layers of one kind hold the same tensors: io/stack.py checks it)."""
    from otdus_cli.arch.modules import modules_of
    from otdus_cli.arch.saved_names import revert_names
    from otdus_cli.plan.layer_map import layer_kinds

    family = source.family
    layers = modules_of(base_model, layer_list)
    first: dict[str, int] = {}
    for i, kind in enumerate(layer_kinds(family, source.text_config, source.depth)):
        first.setdefault(kind, i)
    names = set(source.reader.names)
    for i in first.values():
        stored, prefix = set(source.layers[i].suffixes()), source.layers[i].prefix
        module_prefix = f"{layer_list}.{i}."
        # a checkpoint saved under the module names (transformers 4) holds them as they are
        rest = {module_prefix + n: p for n, p in layers[i].named_parameters() if n not in stored}
        if not rest:
            continue
        saved = revert_names(base_model, rest)
        elsewhere = [n for n in saved if _under(n, prefix, module_prefix) not in stored]
        if not elsewhere:
            continue
        outside = [n for n in elsewhere if n in names]
        owner = _owner(base_model, rest, (outside or elsewhere)[0])
        what = f"layer {i}'s {owner[len(module_prefix) :]}" if owner else f"a parameter of layer {i}"
        if outside:
            raise OtdusError(
                f"{family.name}: transformers' {type(base_model).__name__} loads {what} from "
                f"{', '.join(outside[:3])}, outside the layer's tensors ({prefix}*), and not as one tensor "
                "of its own under a name numbered by the layer's index, which otdus would renumber; otdus "
                "copies a layer by its tensors, so new layers would load it at random (a different model): "
                "expanding it needs an exact template"
            )
        raise OtdusError(
            f"{family.name}: the checkpoint holds {what} under none of the names transformers loads it "
            f"from ({elsewhere[0]}), so a copied layer would load it at random; save the model again with "
            "this transformers"
        )


def _under(name: str, *prefixes: str) -> str | None:
    """``name`` relative to the first of ``prefixes`` it starts with; None if none."""
    return next((name[len(p) :] for p in prefixes if name.startswith(p)), None)


def _owner(model, params: dict, saved: str) -> str | None:
    """Which of ``params`` transformers saves under ``saved`` (each reverted alone)."""
    from otdus_cli.arch.saved_names import saved_names

    return next((n for n, names in saved_names(model, params).items() if saved in names), None)
