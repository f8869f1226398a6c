"""A layer template derived from transformers itself, for a model_type without an exact template.

The model class is built from the config on the meta device (no weights, no remote code: only
model_types transformers ships); its decoder layer list, each layer's kind (attention / linear
attention / Mamba, dense / MoE: the classes of its parts) and the config fields that follow the layers
(one entry per layer, a dict keyed by layer index, a pattern of kinds transformers repeats to the depth,
lists of layer indices, one layer's index) are read off it. A new layer copies its source's kind; the
rewritten config is built again by transformers at plan time to check that every output layer comes
out of the kind planned (check_planned_kinds), and the checkpoint to hold each layer's tensors under its
prefix, or outside it under names numbered by the layer, which are renumbered (arch/layer_storage.py).
Its zero-init targets are proved on a tiny instance (arch/identity.py); the roles OT-DUS and LESA need,
where a kind's tensors are an exact template's, are matched and proved in arch/derived_roles.py.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import re
import warnings

from otdus_cli.arch.causal_lm import build_causal_lm, causal_lm_class_name
from otdus_cli.arch.config_rules import layer_keyed
from otdus_cli.arch.depth import depth_field, stated_depth
from otdus_cli.arch.hf_config import transformers_config
from otdus_cli.arch.layer_storage import numbered_outside
from otdus_cli.arch.modules import NOT_TEXT, modules_of
from otdus_cli.arch.plan_differences import POSITION_DIFFERS
from otdus_cli.arch.wrappers import text_config
from otdus_cli.errors import OtdusError
from otdus_cli.quiet import quiet_transformers

# what a refused derivation tells the user to do
_NEEDS_TEMPLATE = "expanding it needs an exact template (otdus_cli/arch/families.py)"
# what a refused zero-init tells the user to do instead
WITHOUT_ZERO_INIT = (
    "without zero-init a new layer changes the model's function until trained: use --method copy, "
    "interpose, solar or stack, or add --no-zero-init"
)


def derivable(model_type: str) -> bool:
    """transformers ships this model_type with a causal-LM class (a plain LM, a wrapper with one, or a
    composite's text model: arch/causal_lm.py)."""
    return causal_lm_class_name(model_type) is not None


def derive_template(config: dict) -> dict:
    """What transformers' class for ``config`` says about its decoder stack: ``{"model_type", "class",
    "layer_list", "kinds", "tensors", "per_layer_fields", "index_fields", "derives_layer_types",
    "numbered_names"}`` (the last: arch/layer_storage.py's numbered_outside); OtdusError when it has none
    we can use."""
    model_type = config.get("model_type")
    text = text_config(config)
    depth = stated_depth(text)
    model, loaded = _meta_model(config)
    if not isinstance(depth, int):
        raise OtdusError(
            f"model_type={model_type!r} ({type(model).__name__}) states its depth in no field otdus can read "
            f"off its config class (num_hidden_layers, its attribute_map alias, or a per-layer list); "
            f"{_NEEDS_TEMPLATE}"
        )
    layer_list = _layer_list(model, depth, model_type)
    shared = _shared_weights(modules_of(model, layer_list))
    if shared is not None:
        name, first, other = shared
        raise OtdusError(
            f"model_type={model_type!r} ({type(model).__name__}): its layers {first} and {other} share one "
            f"module's weights ({name}; a checkpoint stores them once, under layer {first}), so a layer "
            f"cannot be copied on its own; {_NEEDS_TEMPLATE}"
        )
    layers = modules_of(model, layer_list)
    kinds = layer_kinds(layers)
    numbered = numbered_outside(model, layer_list, kinds)
    loaded_text = loaded.get_text_config().to_dict()
    per_layer = sorted(
        name
        for name, value in {**loaded_text, **text}.items()
        if (_per_layer(name, value, depth) or _repeated_pattern(config, name, value, depth, kinds))
        and name != "layer_types"
    )
    # lists of layer indices (mlp_only_layers ...): a copy is listed where its source layer is; a list of
    # other things of another length (Nemotron-H's mtp_layers_block_type: the kinds of the layers after the
    # stack) does not follow the depth (check_planned_kinds proves what transformers builds either way)
    index_fields, listing, from_one = [], [], []
    for name, value in text.items():
        if "layer" not in name or name in per_layer or name == "layer_types":
            continue
        if "index" in name and isinstance(value, int) and not isinstance(value, bool):
            index_fields.append(name)  # one layer's index (ERNIE 4.5 MoE's moe_layer_end_index)
            continue
        if not isinstance(value, list):
            continue
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
            continue
        first = 1 if _numbered_from_one(config, name, value, kinds) else 0
        from_one += [name] if first else []
        (index_fields if all(first <= i < depth + first for i in value) else listing).append(name)
    # the depth again under another name (xLSTM's num_blocks, the length of its block list): one past the
    # last layer's index, which the index rewrite carries to the new depth
    index_fields += [name for name in _depth_aliases(text, depth) if name not in per_layer]
    if listing:
        raise OtdusError(
            f"model_type={model_type!r}: config field {sorted(listing)[0]} lists layer numbers beyond its "
            f"{depth} layers, which otdus cannot renumber; {_NEEDS_TEMPLATE}"
        )
    return {
        # layer_types is written explicitly only where the config class stores it (a field, not a property)
        "derives_layer_types": "layer_types" in loaded_text,
        "model_type": model_type,
        "class": type(model).__name__,
        "layer_list": layer_list,
        "kinds": kinds,
        # each kind's tensors (of its first layer) and their shapes: what derived_roles.py matches
        "tensors": {
            kind: {name: list(p.shape) for name, p in layers[kinds.index(kind)].named_parameters()}
            for kind in dict.fromkeys(kinds)
        },
        "per_layer_fields": per_layer,
        "index_fields": sorted(index_fields),
        "numbered_from_one": sorted(from_one),
        "numbered_names": numbered,
    }


def _numbered_from_one(config: dict, name: str, value: list[int], kinds: list[str]) -> bool:
    """Whether the list of layers ``name`` counts them from 1 (Qwen4-Exp's ple_layer_ids): the layers whose
    kind changes when it lists none are those it lists, less one."""
    if not value:
        return False
    changed = copy.deepcopy(config)
    text_config(changed)[name] = []
    try:
        without = config_layer_kinds(changed)
    except OtdusError:
        return False
    moved = {i for i, (kind, other) in enumerate(zip(kinds, without, strict=False)) if kind != other}
    return bool(moved) and moved == {i - 1 for i in value}


def _depth_aliases(text: dict, depth: int) -> list[str]:
    """The fields of ``text`` (a stack's settings) besides its depth field that hold the depth too: those
    its config class sets to the depth when they are absent (xLSTM's num_blocks follows
    num_hidden_layers), learned by loading the config without the field at another depth."""
    from otdus_cli.arch.config_rules import DEPTH_FIELDS

    field = depth_field(text)
    if field is None:
        return []
    found = []
    for name, value in text.items():
        if name == field or name in DEPTH_FIELDS or type(value) is not int or value != depth:
            continue
        probe = {k: v for k, v in text.items() if k != name} | {field: depth + 1}
        try:
            loaded = transformers_config(probe)
        except Exception:  # a config the class rejects at another depth: no alias shown
            continue
        if getattr(loaded, name, None) == depth + 1:
            found.append(name)
    return found


def _shared_weights(layers: list) -> tuple[str, int, int] | None:
    """A tensor two layers hold as one (Zamba's hybrid layers all run one shared transformer block): its
    name within a layer, and the first two layers that hold it; None when every layer owns its own."""
    owner: dict[int, int] = {}
    for index, layer in enumerate(layers):
        for name, param in layer.named_parameters():
            first = owner.setdefault(id(param), index)
            if first != index:
                return name, first, index
    return None


def _per_layer(name: str, value: object, depth: int) -> bool:
    """A list of one entry per layer, a dict keyed by layer index (Gemma 4's per_layer_config), or a
    string of one letter per layer named so (a pattern: not a 4-layer model's model_type "gpt2")."""
    if isinstance(value, list):
        return len(value) == depth
    if isinstance(value, dict):  # named so: not id2label, keyed by label numbers
        return "layer" in name and layer_keyed(value, depth)
    return isinstance(value, str) and len(value) == depth and ("pattern" in name or "layer" in name)


def _repeated_pattern(config: dict, name: str, value: object, depth: int, kinds: list[str]) -> bool:
    """A list of layer kinds of another length than the depth, which transformers repeats (or cuts) to
    the depth (RecurrentGemma's block_types: ``(block_types * 100)[:num_hidden_layers]``): proved on the
    meta device, where the list repeated to the depth builds the same layers, and that list reversed
    builds others (so it is the field that sets them: not Nemotron-H's mtp_layers_block_type, the kinds
    of layers after the stack). Written as the full list, one entry per output layer, like a per-layer
    field; the written config's kinds are checked again at plan time (check_planned_kinds)."""
    if not isinstance(value, list) or not value or len(value) == depth:
        return False
    if not all(isinstance(v, str) for v in value):
        return False
    full = (value * (depth // len(value) + 1))[:depth]
    if full == full[::-1]:
        return False  # a reversal that changes nothing proves nothing

    def built(pattern: list[str]) -> list[str] | None:
        changed = copy.deepcopy(config)
        text_config(changed)[name] = pattern
        try:
            return config_layer_kinds(changed)
        except OtdusError:
            return None

    return built(full) == kinds and built(full[::-1]) not in (None, kinds)


@quiet_transformers  # building some classes logs advice (BERT's "add is_decoder=True") on stderr
def _meta_model(config: dict, rewritten: bool = False):
    """transformers' model for ``config`` on the meta device, and its config; OtdusError saying which
    config failed: the base's (no template can be derived) or the ``rewritten`` one otdus would write."""
    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = transformers_config(config)
            with torch.device("meta"):
                model = build_causal_lm(loaded)
    except Exception as exc:
        why = f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
        if rewritten:
            raise OtdusError(
                f"model_type={config.get('model_type')!r}: transformers cannot build the rewritten config "
                f"otdus would write for this layer map ({why}); nothing was written"
            ) from None
        raise OtdusError(
            f"model_type={config.get('model_type')!r} has no exact template and transformers could not build "
            f"its config to derive one ({why})"
        ) from None
    return model, loaded


def layer_lists(model, depth: int) -> list[str]:
    """The outermost module lists of ``depth`` entries outside vision / audio towers (the decoder layers,
    where there is one): a list inside an entry of another is that layer's parts (LongCat-Flash's two
    attentions and two MLPs per layer), not a stack of its own."""
    return [name for name, length in _outer_lists(model, depth) if length == depth]


def _outer_lists(model, depth: int | None = None) -> list[tuple[str, int]]:
    """The module lists outside vision / audio towers and their lengths, those inside an entry of another
    (of ``depth`` entries, or of any length where None) left out."""
    import torch

    lists = [
        (name, len(module))
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList) and not any(part in name for part in NOT_TEXT)
    ]
    outer = [name for name, length in lists if depth is None or length == depth]
    return [(name, n) for name, n in lists if not any(name.startswith(o + ".") for o in outer)]


def _layer_list(model, depth: int, model_type: object, rewritten: bool = False) -> str:
    """The decoder layers: the one module list of ``depth`` entries outside vision / audio towers;
    OtdusError naming what the model holds instead (``rewritten``: built from the config otdus would
    write)."""
    lists = layer_lists(model, depth)
    if len(lists) == 1:
        return lists[0]
    parents = {name.rpartition(".")[0] for name in lists}
    if len(lists) > 1 and len(parents) == 1:
        parent = parents.pop()
        found = (
            f"{len(lists)} lists side by side in {parent or 'the model'} "
            f"({', '.join(name.rpartition('.')[2] for name in lists)}): layer i is the i-th entry of each, "
            f"while otdus copies a layer as one module, its tensors under one name"
        )
    elif lists:
        found = f"{len(lists)} ({', '.join(lists[:3])})"
    else:
        held = [f"{name} ({length})" for name, length in _outer_lists(model)]
        found = (
            f"none: its module lists are {', '.join(held[:6])}" if held else "none: it holds no module list"
        )
        loaded = getattr(model.config.get_text_config(), "num_hidden_layers", None)
        if rewritten:
            found += (
                f"; transformers takes the depth of the rewritten config, which states {depth} layers, from "
                "other fields as well, which otdus does not rewrite"
            )
        elif isinstance(loaded, int) and loaded != depth:
            found += (
                f"; transformers' {type(model.config).__name__} reads the {depth} layers config.json states "
                f"as {loaded} (it rewrites its depth fields on loading), which otdus cannot write back"
            )
    raise OtdusError(
        f"model_type={model_type!r} ({type(model).__name__}): otdus looks for its decoder layers as the one "
        f"list of {depth} modules outside vision and audio towers, and finds {found}; {_NEEDS_TEMPLATE}"
    )


def layer_kinds(layers: list) -> list[str]:
    """Each layer's kind: the classes of its parts that are not norms (``Qwen3NextGatedDeltaNet+
    Qwen3NextSparseMoeBlock``); layers of one kind hold the same tensors (names and shapes), so a kind
    named alike with other tensors gets a short hash of them."""
    signatures = [tuple(sorted((n, tuple(p.shape)) for n, p in layer.named_parameters())) for layer in layers]
    names = ["+".join(_parts(layer)) or type(layer).__name__ for layer in layers]
    by_name: dict[str, set] = {}
    for name, signature in zip(names, signatures, strict=True):
        by_name.setdefault(name, set()).add(signature)
    return [
        name if len(by_name[name]) == 1 else f"{name}#{hashlib.sha1(repr(sig).encode()).hexdigest()[:6]}"
        for name, sig in zip(names, signatures, strict=True)
    ]


def _parts(module) -> list[str]:
    """The classes of ``module``'s children that hold parameters, norms left out; a child named as a norm
    that holds other sublayers (DBRX's norm_attn_norm: a norm, the attention, a norm) is not one, and its
    own parts are named instead."""
    parts: list[str] = []
    for name, child in _named_children(module):
        if not any(True for _ in child.parameters()):
            continue
        if "norm" not in name.lower():
            parts.append(type(child).__name__)
        elif _holds_sublayers(child):
            parts += _parts(child)
    return parts


def _holds_sublayers(module) -> bool:
    return any(
        "norm" not in n.lower() and any(True for _ in c.parameters()) for n, c in _named_children(module)
    )


def _named_children(module) -> list[tuple[str, object]]:
    """``module``'s children, each entry of a child module list under the list's name (LongCat-Flash's
    ``self_attn``: two attentions; ``input_layernorm``: two norms)."""
    import torch

    return [
        (name, entry)
        for name, child in module.named_children()
        for entry in (child if isinstance(child, torch.nn.ModuleList) else [child])
    ]


def config_layer_kinds(config: dict, rewritten: bool = False, model=None) -> list[str]:
    """The layer kinds of the model transformers builds from ``config`` (on the meta device, unless
    given as ``model``; a ``rewritten`` one: otdus's output config)."""
    if model is None:
        model, _ = _meta_model(config, rewritten)
    depth = stated_depth(text_config(config))
    return layer_kinds(modules_of(model, _layer_list(model, depth, config.get("model_type"), rewritten)))


def check_planned_kinds(
    family, config: dict, written_config: dict, layer_map: list, written_model=None
) -> None:
    """The rewritten config builds, in transformers, the layer kinds the plan copies: each output layer
    the kind of its source (OtdusError naming the first that differs, and the placements that keep every
    layer's kind: arch/kind_placements.py). ``config``: the base's; ``written_model``: the model of
    ``written_config`` on the meta device, where the caller built it already."""
    from otdus_cli.arch.kind_placements import kind_keeping_placements

    text = text_config(config)
    planned = [family.layer_kind(text, lay.source) for lay in layer_map]
    built = config_layer_kinds(written_config, rewritten=True, model=written_model)
    if len(built) != len(planned):
        raise OtdusError(
            f"the rewritten config builds {len(built)} layers in transformers, not {len(planned)}"
        )
    wrong = next((j for j, (a, b) in enumerate(zip(planned, built, strict=True)) if a != b), None)
    if wrong is None:
        return
    fields = ", ".join(family.per_layer_fields + family.index_fields) or "none"
    why = (
        f"{family.name}: output layer {wrong} would be a {planned[wrong]} layer (a copy of base layer "
        f"{layer_map[wrong].source}), but transformers builds a {built[wrong]} layer there from the "
        f"rewritten config (per-layer fields rewritten: {fields})"
    )
    new = sum(lay.new for lay in layer_map)
    found = kind_keeping_placements(
        family, config, new, built, functools.partial(config_layer_kinds, rewritten=True)
    )
    if found:
        raise OtdusError(
            f"{why}; place the new layers elsewhere: {' or '.join(found)} keeps every layer's kind"
        )
    raise OtdusError(
        f"{why}; no placement of {new} new layers keeps every layer's kind (otdus tried copies after each "
        "base layer, --method stack and solar): transformers sets the kinds from each layer's index (a "
        "period or range the config states) in a way the rewritten config cannot change; try another "
        "number of layers, or add an exact template"
    )


def check_derived_plan(source, written_config: dict, layer_map: list) -> dict:
    """A derived template's plan, checked before anything is written (OtdusError otherwise): every output
    layer is of its source's kind in what transformers builds from ``written_config``, and its tensors
    stored outside the layer go under the names transformers saves them under at its index; with zero-init,
    every proved target is stored in the checkpoint under the name transformers' class gives it, and the
    expanded tiny instance gives the base's logits bit for bit (arch/identity.py: prove_plan). Returns
    the tensors outside the layers that hold a slice per layer (arch/layer_slices.py)."""
    from otdus_cli.arch.identity import expert_forms, prove_plan
    from otdus_cli.arch.layer_slices import check_sliced_sources, depth_sliced_tensors
    from otdus_cli.arch.layer_storage import check_layers_stored_whole, check_numbered_names
    from otdus_cli.plan.layer_map import index_ranges, layer_kinds

    family = source.family
    base_model, _ = _meta_model(source.config)
    layer_list = _layer_list(base_model, source.depth, family.name)
    check_layers_stored_whole(source, base_model, layer_list)
    written_model, _ = _meta_model(written_config, rewritten=True)
    check_numbered_names(source, written_model, layer_list, layer_map)
    sliced = depth_sliced_tensors(source, base_model, written_model, layer_list, source.config)
    check_sliced_sources(family, layer_map, sliced)
    check_planned_kinds(family, source.config, written_config, layer_map, written_model)
    if not any(lay.zero_init for lay in layer_map) or family.zero_init_proof is None:
        return sliced
    proved = family.zero_init_proof["kinds"]
    unproved = family.zero_init_proof.get("unproved", {})
    for lay in layer_map:
        kind = family.layer_kind(source.text_config, lay.source)
        if lay.zero_init and kind not in proved:
            kinds = layer_kinds(family, source.text_config, source.depth)
            others = index_ranges([i for i, k in enumerate(kinds) if k in proved])
            why = unproved.get(kind, "no zeroing was proved to make that kind an identity")
            works = f"copy a layer of a kind zero-init works for (base layers {others}); " if others else ""
            raise OtdusError(
                f"zero-init for {family.name}: new layer {lay.index} copies base layer {lay.source}, a "
                f"{kind} layer, and {why}; {works}{WITHOUT_ZERO_INIT}"
            )
        names = [*proved[kind]["zeroed"], *proved[kind].get("set_to", {})] if lay.zero_init else []
        forms = proved[kind].get("stored", {}) if lay.zero_init else {}
        stored = source.layers[lay.source].suffixes()
        for name in names:
            patterns = forms.get(name) or expert_forms(name)
            if not any(re.fullmatch(form, suffix) for form in patterns for suffix in stored):
                raise OtdusError(
                    f"zero-init for {family.name}: layer {lay.source} of the checkpoint holds {name} of its "
                    f"{kind} layers under none of the names transformers holds or saves it under, so otdus "
                    "cannot tell which tensor to set (save the model again with this transformers); or add "
                    "--no-zero-init"
                )
    sources = [lay.source for lay in layer_map]
    why = prove_plan(source.config, written_config, family, sources, [lay.zero_init for lay in layer_map])
    if why:
        last = source.depth - 1
        moved = any(not lay.new and lay.index != lay.source for lay in layer_map)
        # a reason of its own (arch/plan_differences.py) names the placements that keep the logits
        if why == POSITION_DIFFERS and moved and _works_after_last(source, sum(lay.new for lay in layer_map)):
            why += f"; new layers after the last one (--after {last}) leave every base layer's index as it is"
        raise OtdusError(f"zero-init for {family.name}: {why}; {WITHOUT_ZERO_INIT}")
    return sliced


def _works_after_last(source, count: int) -> bool:
    """Whether ``count`` zero-init copies of the last layer, after it, keep the base's logits on the tiny
    instance (so a refusal may suggest that placement: not where the depth itself enters the layers)."""
    from otdus_cli.arch.config_rules import family_config
    from otdus_cli.arch.identity import prove_plan
    from otdus_cli.plan.layer_map import interleave

    family, last = source.family, source.depth - 1
    proved = family.zero_init_proof["kinds"]
    kind = family.layer_kind(source.text_config, last)
    if kind not in proved:
        return False
    layer_map = interleave(source.depth, [last] * count, "copy", zero_init=True, pair=False)
    try:
        written = family_config(family, source.config, layer_map)
    except OtdusError:
        return False
    sources = [lay.source for lay in layer_map]
    return prove_plan(source.config, written, family, sources, [lay.new for lay in layer_map]) is None
