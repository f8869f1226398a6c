"""A layer template derived from transformers itself, for a model_type without an exact template.

The model class is built from the config on the meta device (no weights, no remote code: only
model_types transformers ships); its decoder layer list and the config fields with one entry per
layer are read off it. Such a template knows no roles and no output projections, so it allows
copy-type methods only, without zero-init: which tensors make a layer an exact identity is
architecture knowledge that only an exact template (families.py) states for certain.
"""

from __future__ import annotations

import warnings

from otdus_cli.arch.wrappers import text_config
from otdus_cli.errors import OtdusError

# what a refused derivation tells the user to do
_NEEDS_TEMPLATE = "copy-type methods need an exact template for it (otdus_cli/arch/families.py)"
# module-name parts of towers that are not the text stack
_NOT_TEXT = ("vision", "visual", "audio", "image", "speech")


def derivable(model_type: str) -> bool:
    """transformers ships this model_type with a causal-LM class (a plain LM or a wrapper with one)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def derive_template(config: dict) -> dict:
    """What transformers' class for ``config`` says about its decoder stack:
    ``{"model_type", "class", "layer_list", "per_layer_fields"}``; OtdusError when it has none we can use."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type = config.get("model_type")
    text = text_config(config)
    depth = text.get("num_hidden_layers")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = AutoConfig.for_model(**config)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(loaded, trust_remote_code=False)
    except Exception as exc:
        raise OtdusError(
            f"model_type={model_type!r} has no exact template and transformers could not build it to derive "
            f"one ({type(exc).__name__}: {str(exc)[:120]})"
        ) from None
    if not isinstance(depth, int):
        field = type(loaded.get_text_config()).attribute_map.get("num_hidden_layers", "another field")
        raise OtdusError(
            f"model_type={model_type!r} ({type(model).__name__}) states its depth as {field}, not "
            f"num_hidden_layers, so a template derived from transformers cannot rewrite it; {_NEEDS_TEMPLATE}"
        )
    # the decoder layers: the one module list of `depth` entries outside vision / audio towers
    lists = [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList)
        and len(module) == depth
        and not any(part in name for part in _NOT_TEXT)
    ]
    if len(lists) != 1:
        found = f"{len(lists)} ({', '.join(lists[:3])})" if lists else "none"
        raise OtdusError(
            f"model_type={model_type!r} ({type(model).__name__}): otdus looks for its decoder layers as "
            f"the one list of {depth} modules outside vision and audio towers, and finds {found}; "
            f"{_NEEDS_TEMPLATE}"
        )
    layer_list = lists[0]
    # a hybrid stack (attention and recurrent layers, dense and MoE ...) places its kinds by rules
    # only an exact template knows
    kinds = [
        sorted((n, tuple(p.shape)) for n, p in layer.named_parameters())
        for layer in modules_of(model, layer_list)
    ]
    odd = next((i for i, kind in enumerate(kinds) if kind != kinds[0]), None)
    if odd is not None:
        raise OtdusError(
            f"model_type={model_type!r} ({type(model).__name__}): layer {odd} holds other tensors than "
            "layer 0 (a hybrid stack: attention / recurrent or dense / MoE layers), and which kind each new "
            f"layer must be is not in transformers' class; {_NEEDS_TEMPLATE}"
        )
    loaded_text = loaded.get_text_config()
    per_layer = sorted(
        name
        for name, value in loaded_text.to_dict().items()
        if isinstance(value, list) and len(value) == depth and name != "layer_types"
    )
    # a list of layer indices (cross-attention layers, KV sharing ...) would need renumbering by rule
    listing = sorted(
        name
        for name, value in text.items()
        if "layer" in name and isinstance(value, list) and name not in per_layer and name != "layer_types"
    )
    if listing:
        raise OtdusError(
            f"model_type={model_type!r}: config field {listing[0]} lists layers, and what its entries mean "
            f"(which layers it renumbers) is not in transformers' class; {_NEEDS_TEMPLATE}"
        )
    return {
        # layer_types is written explicitly only where the config class stores it (a field, not a property)
        "derives_layer_types": "layer_types" in loaded_text.to_dict(),
        "model_type": model_type,
        "class": type(model).__name__,
        "layer_list": layer_list,
        "per_layer_fields": per_layer,
    }


def modules_of(model, path: str) -> list:
    module = model
    for part in path.split("."):
        module = getattr(module, part)
    return list(module)
