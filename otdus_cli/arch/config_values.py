"""The sizes and epsilons of config.json, checked where the config is read (io/reader.py).

transformers builds a model from whatever config.json says; a head count of -4 or an infinite
``rms_norm_eps`` makes shapes, slices and norms that mean nothing, and otdus would copy the config to
its output. Every field below, where a config (or one of its sub-configs: ``text_config``,
``vision_config`` ...) sets it, must be a positive integer (a list of them where a family gives one
per layer, or per part: LXMERT's layer counts) or, for an epsilon, a positive finite number. Fields
that may be 0 in real checkpoints (an expert count of a dense model, a shared expert's size where
there is none) are not listed.
"""

from __future__ import annotations

import json
import math

from otdus_cli.errors import OtdusError

# sizes, counts of heads and layers (under the names the families use for them)
POSITIVE_INTEGERS = (
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "vocab_size",
    "n_embd",
    "n_head",
    "n_layer",
    "num_heads",
    "num_layers",
)
# 0 is a size here: GLM-5-Next's head_dim is its rotary part's, which a model without RoPE does not have
NON_NEGATIVE_INTEGERS = ("head_dim",)
EPSILONS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "norm_epsilon")


def _integer(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _positive_finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < math.inf


def _shown(value: object) -> str:
    return json.dumps(value)[:60]


def check_config_values(config: dict, where: str = "config.json") -> None:
    """Refuse (OtdusError, one line naming the field) a size, count or epsilon that is not positive
    (and an integer, or finite), in ``config`` and in each of its ``*_config`` sub-configs."""
    for fields, least, what in (
        (POSITIVE_INTEGERS, 1, "positive"),
        (NON_NEGATIVE_INTEGERS, 0, "non-negative"),
    ):
        for field in fields:
            value = config.get(field)
            values = list(value.values()) if isinstance(value, dict) else value
            values = values if isinstance(values, list) else [values]
            if value is not None and not (values and all(_integer(v, least) for v in values)):
                raise OtdusError(f"{where}: {field} must be a {what} integer, got {_shown(value)}")
    for field in EPSILONS:
        value = config.get(field)
        if value is not None and not _positive_finite(value):
            raise OtdusError(f"{where}: {field} must be a positive finite number, got {_shown(value)}")
    for key, sub in config.items():
        if key.endswith("_config") and isinstance(sub, dict):
            check_config_values(sub, f"{where} {key}")
