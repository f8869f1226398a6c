"""`make coverage`'s tiny configs (scripts/tiny_configs.py): multimodal wrappers get tiny towers, validators
get the values they name, and what stays unbuilt or refused says why in words."""

from __future__ import annotations

import warnings

import pytest

from scripts import coverage, tiny_configs


def _config(model_type: str, **fields):
    from transformers import AutoConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoConfig.for_model(model_type, **fields)


def test_a_wrappers_vision_tower_is_shrunk_with_its_per_layer_fields():
    """Qwen3.5's vision tower (27 blocks of width 1152 by default) becomes one block of width 16 handing
    the text model 32 wide features; GOT-OCR2's global-attention block indexes keep to its one layer."""
    from transformers.models.got_ocr2.configuration_got_ocr2 import GotOcr2VisionConfig
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig

    tower = tiny_configs.tiny_tower(Qwen3_5VisionConfig(), {4096: 32})
    assert tower["depth"] == 1 and tower["hidden_size"] == 16 and tower["num_heads"] == 2
    assert tower["out_hidden_size"] == 32 and tower["model_type"] == "qwen3_5_vision"
    got = tiny_configs.tiny_tower(GotOcr2VisionConfig())
    assert got["num_hidden_layers"] == 1 and got["global_attn_indexes"] == [0] and got["mlp_dim"] == 32


def test_a_validator_gets_the_value_its_message_names():
    """XLNet's validator wants d_head = d_model // n_head and says so; the fields changed that way build."""
    fields = dict(hidden_size=32, num_attention_heads=4, vocab_size=96)
    with pytest.raises(Exception) as refused:
        _config("xlnet", **fields)
    fixed = tiny_configs.satisfy(fields, refused.value)
    assert fixed == {**fields, "d_head": 8}
    assert _config("xlnet", **fixed).d_head == 8
    assert tiny_configs.satisfy(fixed, ValueError("something else went wrong")) is None


def test_a_nested_text_config_gets_the_value_its_validator_names():
    error = ValueError("hidden_size_per_layer_input must be 0, got 256")
    fields = {"text_config": {"model_type": "t", "hidden_size_per_layer_input": 256}, "vision_config": {}}
    fixed = tiny_configs.satisfy(fields, error)
    assert fixed["text_config"]["hidden_size_per_layer_input"] == 0 and fixed["vision_config"] == {}


@pytest.mark.parametrize("model_type", ["qwen3_5", "granitemoehybrid", "gptj"])
def test_architectures_coverage_could_not_build_are_built_tiny(model_type, tmp_path, single_thread):
    """The Qwen3.5 wrapper (vision tower not shrunk before: 8954M parameters), Granite 4 (mamba heads
    not dividing expand * hidden) and GPT-J (rotary_dim 64 on heads of 8) build under the size limit."""
    logits = coverage.build(model_type, tmp_path)
    assert logits.shape[-1] == 96 and (tmp_path / "config.json").exists()
    weights = sum(p.stat().st_size for p in tmp_path.glob("*.safetensors"))
    assert weights < coverage.MAX_PARAMETERS  # bytes of float32: far fewer parameters


def test_an_unbuilt_model_type_says_why_in_words():
    """A config class whose own defaults transformers cannot build says so; a timm tower names the
    packages it needs."""
    reason = tiny_configs.why_not_built("cohere_compass_text", KeyError("full_attention"))
    assert "builds no model from this config class's own defaults either" in reason
    reason = tiny_configs.why_not_built("gemma3n", ImportError("TimmWrapperModel requires the PIL library"))
    assert "needs the timm and pillow packages" in reason and "requires the PIL library" in reason


def test_a_refused_placement_is_replaced_by_one_that_keeps_the_layer_kinds(tmp_path, single_thread):
    """Jamba's kinds follow the layer index (attention every 4th, experts every 2nd): 2 copied layers
    anywhere break the pattern and otdus refuses them; a whole-stack copy keeps it, and the row says so
    with otdus's refusal kept whole."""
    kind, family, detail, columns = coverage.check("jamba", tmp_path)
    assert (kind, family) == ("derived", "derived:jamba"), detail
    kept = "; expands with --method stack --layers 4 (otdus at --layers 2: derived:jamba: output layer"
    assert kept in detail
    assert "place the new layers elsewhere" in detail and columns["zero-init"] == "bitwise"
