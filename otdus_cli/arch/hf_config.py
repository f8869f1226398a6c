"""A config.json dict as transformers' config object, read the way from_pretrained reads it."""

from __future__ import annotations

import warnings

# how transformers writes floats JSON cannot hold (Mamba's time_step_limit: [0.0, inf])
_SPECIAL_FLOATS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def decoded(value: object) -> object:
    """``value`` with every {"__float__": "Infinity"} (transformers' encoding) turned into its float."""
    if isinstance(value, dict):
        if set(value) == {"__float__"} and value["__float__"] in _SPECIAL_FLOATS:
            return _SPECIAL_FLOATS[value["__float__"]]
        return {k: decoded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decoded(v) for v in value]
    return value


def transformers_config(config: dict):
    """transformers' config object for a config.json dict (its model_type's class; no remote code)."""
    from transformers import AutoConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoConfig.for_model(**decoded(config))
