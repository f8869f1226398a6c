"""otdus_cli/arch/config_values.py: the sizes and epsilons of a config, refused when they describe no
model, and never refused in a config transformers writes for a family the suite covers."""

from __future__ import annotations

import json
import math
import warnings

import pytest

from otdus_cli.arch.config_values import check_config_values
from otdus_cli.errors import OtdusError
from tests.support.tiny_models import COMMON, TINY_CONFIGS, WRAPPERS


def _written(model_type: str, fields: dict) -> dict:
    """config.json as save_pretrained writes it for ``fields``."""
    from transformers import AutoConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return json.loads(AutoConfig.for_model(model_type, **fields).to_json_string())


@pytest.mark.compat
@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_a_config_transformers_writes_passes(model_type):
    check_config_values(_written(model_type, {**COMMON, **TINY_CONFIGS[model_type]}))


@pytest.mark.compat
@pytest.mark.parametrize("model_type", sorted(WRAPPERS))
def test_a_wrappers_config_and_its_sub_configs_pass(model_type):
    try:
        config = _written(model_type, WRAPPERS[model_type])
    except (ValueError, TypeError) as exc:  # a wrapper this transformers does not build from these fields
        pytest.skip(f"{model_type}: {exc}")
    check_config_values(config)


def test_per_layer_and_per_part_values_and_a_zero_head_dim_are_sizes():
    check_config_values({"intermediate_size": [64, 128], "num_hidden_layers": {"vision": 2, "language": 4}})
    check_config_values({"head_dim": 0, "rms_norm_eps": 1})  # GLM-5-Next without RoPE; an int epsilon


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"num_attention_heads": -4}, "config.json: num_attention_heads must be a positive integer, got -4"),
        ({"n_head": True}, "n_head must be a positive integer, got true"),
        ({"intermediate_size": []}, "intermediate_size must be a positive integer, got []"),
        ({"num_hidden_layers": {"vision": 0}}, 'num_hidden_layers must be a positive integer, got {"vision"'),
        ({"head_dim": -8}, "head_dim must be a non-negative integer, got -8"),
        ({"layer_norm_epsilon": math.nan}, "layer_norm_epsilon must be a positive finite number, got NaN"),
        ({"norm_eps": 0}, "norm_eps must be a positive finite number, got 0"),
        (
            {"text_config": {"vision_config": {"hidden_size": 0}}},
            "config.json text_config vision_config: hidden_size must be a positive integer, got 0",
        ),
    ],
)
def test_a_value_that_describes_no_model_is_one_line_naming_it(config, message):
    with pytest.raises(OtdusError) as caught:
        check_config_values(config)
    assert str(caught.value).startswith("config.json") and message in str(caught.value)
