"""Which config.json field states a stack's depth, learned from transformers' config class.

Most configs say ``num_hidden_layers``; older ones keep their own name (GPT-2 and Bloom ``n_layer``,
MPT ``n_layers``, XGLM ``num_layers`` ...), which the config class maps through its ``attribute_map``;
a few (Nemotron-H) compute the depth as a property, the length of their per-layer kind list.
"""

from __future__ import annotations

import functools
import json
import warnings

DEPTH = "num_hidden_layers"


def config_class(model_type: object):
    """transformers' config class of ``model_type``; None where it knows none."""
    if not isinstance(model_type, str):
        return None
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        return CONFIG_MAPPING[model_type]
    except Exception:  # a model_type transformers does not know (or no transformers)
        return None


def depth_field(config: dict) -> str | None:
    """The field of ``config`` (a stack's settings) that holds its depth: ``num_hidden_layers``, else
    the integer "layer" field that sets the length of the decoder layer list transformers' class builds
    (found by building it on the meta device with the field one larger: BART's decoder_layers, though
    its attribute_map maps num_hidden_layers to encoder_layers), else the config class's attribute_map
    name for it; None when the config states no depth of its own (Nemotron-H: the length of its
    ``layers_block_type``; see implied_depth_field)."""
    if DEPTH in config:
        return DEPTH
    cls = config_class(config.get("model_type"))
    if cls is None:
        return None
    learned = _field_setting_the_layer_list(json.dumps(config, sort_keys=True))
    if learned is not None:
        return learned
    mapped = getattr(cls, "attribute_map", {}).get(DEPTH)
    if isinstance(mapped, str) and isinstance(config.get(mapped), int):
        return mapped
    return None


@functools.lru_cache(maxsize=32)
def _field_setting_the_layer_list(config_json: str) -> str | None:
    config = json.loads(config_json)
    lengths = _module_list_lengths(config)
    if lengths is None:
        return None
    found = []
    for name, value in config.items():
        if "layer" not in name or not isinstance(value, int) or isinstance(value, bool) or value < 1:
            continue
        grown = _module_list_lengths({**config, name: value + 1})
        if grown is not None and grown.count(value + 1) > lengths.count(value + 1):
            found.append(name)
    return found[0] if len(found) == 1 else None


def _module_list_lengths(config: dict) -> list[int] | None:
    """The lengths of the module lists (outside vision / audio towers) of the causal LM transformers
    builds from ``config`` on the meta device; None when it cannot build one."""
    try:
        import torch

        from otdus_cli.arch.causal_lm import build_causal_lm
        from otdus_cli.arch.hf_config import transformers_config
        from otdus_cli.arch.modules import NOT_TEXT

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = transformers_config(config)
            with torch.device("meta"):
                model = build_causal_lm(loaded)
    except Exception:
        return None
    return [
        len(module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList) and not any(part in name for part in NOT_TEXT)
    ]


def implied_depth_field(config: dict) -> str | None:
    """The per-layer list whose length is the depth of a config class that computes its depth as a
    property (Nemotron-H: ``layers_block_type``), found as the config class's own name for
    ``layer_types`` (its attribute_map) or the one list of that length; None otherwise."""
    if depth_field(config) is not None:
        return None
    cls = config_class(config.get("model_type"))
    if cls is None or not isinstance(getattr(cls, DEPTH, None), property):
        return None
    depth = _loaded_depth(config)
    mapped = getattr(cls, "attribute_map", {}).get("layer_types")
    if isinstance(mapped, str) and isinstance(config.get(mapped), list) and len(config[mapped]) == depth:
        return mapped
    found = [k for k, v in config.items() if isinstance(v, list) and len(v) == depth]
    return found[0] if len(found) == 1 else None


def stated_depth(config: dict) -> int | None:
    """The depth ``config`` states, under whatever name its config class gives it."""
    field = depth_field(config)
    if field is not None:
        value = config.get(field)
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    listed = implied_depth_field(config)
    return len(config[listed]) if listed is not None else None


def _loaded_depth(config: dict) -> int | None:
    from otdus_cli.arch.hf_config import transformers_config

    try:
        depth = transformers_config(config).get_text_config().num_hidden_layers
    except Exception:
        return None
    return depth if isinstance(depth, int) else None
