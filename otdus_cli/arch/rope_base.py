"""The RoPE base of a config saved by transformers 5, also under the fields older readers take.

transformers 5 saves the base only inside ``rope_parameters``; transformers 4.57 and llama.cpp's
converter read the top-level ``rope_theta`` (Gemma 3's sliding layers: ``rope_local_base_freq``),
find none and silently use 10,000. Written beside ``rope_parameters``, these fields are read alike
by both (transformers 5 keeps ``rope_parameters``).
"""

from __future__ import annotations

# rope_parameters keyed by attention type (Gemma 3's) -> the top-level field of each type's base
_BY_LAYER_TYPE = {"full_attention": "rope_theta", "sliding_attention": "rope_local_base_freq"}


def legacy_rope_fields(stack: dict) -> dict[str, float]:
    """The top-level base fields a stack's config lacks and its ``rope_parameters`` state."""
    params = stack.get("rope_parameters")
    if not isinstance(params, dict):
        return {}
    if "rope_theta" in params:
        found = {"rope_theta": params["rope_theta"]}
    else:
        found = {
            field: params[kind]["rope_theta"]
            for kind, field in _BY_LAYER_TYPE.items()
            if isinstance(params.get(kind), dict) and "rope_theta" in params[kind]
        }
    return {k: v for k, v in found.items() if isinstance(v, int | float) and k not in stack}
