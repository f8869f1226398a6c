"""The RoPE settings of a config saved by transformers 5, also under the fields older readers take.

transformers 5 saves the base and the scaling only inside ``rope_parameters``; transformers 4.57 and
llama.cpp's converter read the top-level ``rope_theta`` (Gemma 3's sliding layers:
``rope_local_base_freq``) and ``rope_scaling``, find none and silently use 10,000 and no scaling (a
Llama 3.1 saved by transformers 5 loads in 4.57 with other rotary frequencies). Written beside
``rope_parameters``, these fields are read alike by both (transformers 5 keeps ``rope_parameters``).
"""

from __future__ import annotations

from typing import Any

# rope_parameters keyed by attention type (Gemma 3's) -> the top-level field of each type's base
_BY_LAYER_TYPE = {"full_attention": "rope_theta", "sliding_attention": "rope_local_base_freq"}


def legacy_rope_fields(stack: dict) -> dict[str, Any]:
    """The top-level RoPE fields a stack's config lacks and its ``rope_parameters`` state: the bases,
    and ``rope_scaling`` for a scaled RoPE stated for every layer (not one stated by attention type,
    as Gemma's: transformers 5 would take a top-level rope_scaling for every type's)."""
    params = stack.get("rope_parameters")
    if not isinstance(params, dict):
        return {}
    if "rope_theta" in params:
        found: dict[str, Any] = {"rope_theta": params["rope_theta"]}
        if params.get("rope_type", "default") != "default":
            found["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    else:  # by attention type: no rope_scaling, which transformers 5 would read over rope_parameters
        found = {
            field: params[kind]["rope_theta"]
            for kind, field in _BY_LAYER_TYPE.items()
            if isinstance(params.get(kind), dict) and "rope_theta" in params[kind]
        }
    return {
        k: v
        for k, v in found.items()
        if k not in stack and (k == "rope_scaling" or isinstance(v, int | float))
    }


def with_legacy_rope(config: dict) -> dict:
    """``config`` (a config.json dict) with :func:`legacy_rope_fields` added at the top and in every
    nested config that states ``rope_parameters`` (a wrapper's text config): what otdus writes, and
    how a source saved by transformers 5 must be read under 4.57 to mean what it means under 5."""
    out = config | legacy_rope_fields(config)
    for key, value in config.items():
        if isinstance(value, dict) and "rope_parameters" in value:
            out[key] = value | legacy_rope_fields(value)
    return out
