"""Whether a checkpoint keeps each decoder layer whole under its layer's names, for a derived template.

otdus copies a layer by copying the tensors stored under its prefix (``model.layers.3.``) and copies
everything else as it is (but for tensors with a slice per layer: arch/layer_slices.py). A class that
keeps a layer's parameter elsewhere in the checkpoint (Inkling 2 saves ``layers.{i}.attention_input.query``
as ``model.llm.attn_res.attn_queries.{i-1}``) would leave new layers without their tensors: transformers
would initialise them at random on load, a silently different model. Such a plan is refused at plan time,
naming the tensors.
"""

from __future__ import annotations

from otdus_cli.errors import OtdusError


def check_layers_stored_whole(source, base_model, layer_list: str) -> None:
    """Every parameter of a decoder layer of ``base_model`` (transformers' class on the meta device) is
    stored under that layer's prefix in ``source``'s checkpoint, under its own name or the name
    transformers saves it under (arch/saved_names.py); OtdusError naming the first that is not. One layer
    of each kind is asked (layers of one kind hold the same tensors: io/stack.py checks it)."""
    from otdus_cli.arch.derived import modules_of
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
                f"{', '.join(outside[:3])}, outside the layer's tensors ({prefix}*); otdus copies a "
                "layer by its tensors, so new layers would load it at random (a different model): "
                "expanding it needs an exact template that renumbers such tensors"
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
