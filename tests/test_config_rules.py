"""Depth-dependent config fields are rewritten per reference.md section 5, and transformers accepts them."""

import pytest

from otdus_cli.arch.config_rules import rewrite_config
from otdus_cli.errors import OtdusError
from otdus_cli.methods.registry import get_method
from otdus_cli.plan.layer_map import plan_layers


def layer_map(base, method="copy", **kw):
    return plan_layers(base, get_method(method), **kw)


def test_per_layer_index_list_and_threshold_fields():
    cfg = {
        "model_type": "llama",
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "no_rope_layers": [1, 1, 1, 0],
        "mlp_only_layers": [0, 3],
        "max_window_layers": 2,
    }
    out = rewrite_config(cfg, layer_map(4, after=[0, 3]))  # sources 0 0 1 2 3 3
    assert out["num_hidden_layers"] == 6
    assert (
        out["layer_types"]
        == ["sliding_attention"] * 2 + ["full_attention", "sliding_attention"] + ["full_attention"] * 2
    )
    assert out["no_rope_layers"] == [1, 1, 1, 1, 0, 0]
    assert out["mlp_only_layers"] == [0, 1, 4, 5]
    assert out["max_window_layers"] == 3
    assert cfg["num_hidden_layers"] == 4  # the source config is untouched


def test_qwen2_layer_types_are_derived_then_written_explicitly():
    cfg = {
        "model_type": "qwen2",
        "num_hidden_layers": 4,
        "use_sliding_window": True,
        "sliding_window": 8,
        "max_window_layers": 2,
    }
    out = rewrite_config(cfg, layer_map(4, "solar", layers=2))  # sources 0 1 2 1 2 3
    assert out["layer_types"] == [
        "full_attention",
        "full_attention",
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "sliding_attention",
    ]
    assert out["max_window_layers"] == 2


def test_threshold_without_layer_types_cannot_be_interleaved():
    cfg = {"model_type": "llama", "num_hidden_layers": 4, "first_k_dense_replace": 2}
    with pytest.raises(OtdusError, match="first_k_dense_replace"):
        rewrite_config(cfg, layer_map(4, "solar", layers=2))


def test_sparse_step_keeps_moe_slots():
    cfg = {
        "model_type": "qwen2_moe",
        "num_hidden_layers": 4,
        "num_experts": 4,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [],
    }
    # sources 0 1 2 3 0 1 2 3: MoE layers 1 and 3 land on slots 1, 3, 5, 7 (all MoE slots)
    out = rewrite_config(cfg, layer_map(4, "stack"))
    assert out["mlp_only_layers"] == []
    with pytest.raises(OtdusError, match="decoder_sparse_step"):
        rewrite_config(cfg, layer_map(4, after=[0]))  # sources 0 0 1 ...: MoE layer 1 lands on dense slot 2


def test_mtp_layer_count_is_kept():
    """The multi-token prediction layers stay after the stack (io/stack.py): their count is unchanged."""
    cfg = {"model_type": "llama", "num_hidden_layers": 4, "num_nextn_predict_layers": 1}
    out = rewrite_config(cfg, layer_map(4))
    assert out["num_nextn_predict_layers"] == 1 and out["num_hidden_layers"] == 6


def test_families_that_skip_transformers_at_plan_time_really_have_no_derived_layer_types():
    """Family.derives_layer_types False means: this transformers never derives a non-uniform
    layer_types list for the family (so rewriting the depth cannot change any layer's type)."""
    import warnings

    from transformers import AutoConfig

    from otdus_cli.arch.family_lookup import family_for
    from tests.support.tiny_models import COMMON, TINY_CONFIGS

    for model_type, extra in TINY_CONFIGS.items():
        family = family_for({"model_type": model_type})
        for depth in (5, 12):
            kwargs = {**COMMON, **extra, "num_hidden_layers": depth, "sliding_window": 16}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = AutoConfig.for_model(model_type, **kwargs)
            types = getattr(config, "layer_types", None)
            if not family.derives_layer_types:
                assert types is None or len(set(types)) == 1, (model_type, types)


# -- otdus's depth rules: the config check that needs no transformers ------------------------------
def test_depth_rules_accept_a_rewrite_and_refuse_what_a_rewrite_must_not_do():
    from otdus_cli.arch.config_rules import check_depth_rules

    cfg = {
        "model_type": "llama",
        "num_hidden_layers": 4,
        "hidden_size": 16,
        "vocab_size": 10,
        "layer_types": ["full_attention", "sliding_attention"] * 2,
        "mlp_only_layers": [1],
    }
    out = rewrite_config(cfg, layer_map(4, "solar", layers=2))
    check_depth_rules(out, cfg, 6)
    for bad, message in (
        ({**out, "num_hidden_layers": 5}, "loads with 5 layers, expected 6"),
        ({**out, "layer_types": out["layer_types"][:5]}, "has 5 layer_types for 6 layers"),
        ({**out, "mlp_only_layers": [6]}, "mlp_only_layers lists layer 6 of 6"),
        ({**out, "max_window_layers": 7}, "max_window_layers=7 exceeds the 6 layers"),
        ({**out, "hidden_size": 8}, "changed hidden_size, which does not depend on depth"),
        ({k: v for k, v in out.items() if k != "vocab_size"}, "changed vocab_size"),
    ):
        with pytest.raises(OtdusError, match=message):
            check_depth_rules(bad, cfg, 6)


def test_depth_rules_follow_a_wrappers_text_config():
    """A multimodal wrapper states the depth in text_config: the rules check it there, and anything
    else (the vision settings, the wrapper's own fields) must come out as the source's."""
    from otdus_cli.arch.config_rules import check_depth_rules

    cfg = {
        "model_type": "llava",
        "vision_config": {"hidden_size": 32, "num_hidden_layers": 2},
        "text_config": {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 16},
    }
    out = rewrite_config(cfg, layer_map(4, "solar", layers=2))
    assert out["text_config"]["num_hidden_layers"] == 6 and out["vision_config"] == cfg["vision_config"]
    check_depth_rules(out, cfg, 6)
    text = out["text_config"]
    for bad, message in (
        ({**out, "text_config": {**text, "num_hidden_layers": 4}}, "loads with 4 layers, expected 6"),
        ({**out, "text_config": {**text, "hidden_size": 8}}, "changed text_config.hidden_size"),
        ({**out, "vision_config": {"hidden_size": 32, "num_hidden_layers": 6}}, "changed vision_config"),
        ({k: v for k, v in out.items() if k != "text_config"}, "lost its text_config"),
    ):
        with pytest.raises(OtdusError, match=message):
            check_depth_rules(bad, cfg, 6)


def test_a_field_naming_one_layer_follows_the_layer_map():
    """A range's first layer becomes the first output layer from it on, its last the last output layer up
    to it (ERNIE 4.5 MoE: moe_layer_start_index <= i <= moe_layer_end_index); -1 (the last) stays, and
    an index past the stack stays as far past it."""
    cfg = {
        "model_type": "ernie4_5_moe",
        "num_hidden_layers": 4,
        "moe_layer_start_index": 1,
        "moe_layer_end_index": 2,
        "loop_layer_index_end": -1,
        "loop_layer_index_start": 6,
    }
    names = ("moe_layer_start_index", "moe_layer_end_index", "loop_layer_index_end", "loop_layer_index_start")
    out = rewrite_config(cfg, layer_map(4, after=[0, 2]), index_fields=names)  # sources 0 0 1 2 2 3
    assert [out[n] for n in names] == [2, 4, -1, 8]
    out = rewrite_config(cfg, layer_map(4, after=[3, 3]), index_fields=names)  # sources 0 1 2 3 3 3
    assert [out[n] for n in names] == [1, 2, -1, 8]


@pytest.mark.compat
def test_the_rope_base_is_read_alike_by_transformers_4_and_5(stories, tmp_path):
    """A transformers 5 save keeps the RoPE base only in rope_parameters; 4.57 (and llama.cpp) read
    the top-level rope_theta and would silently take 10,000: the output states it in both places."""
    import json

    from transformers import AutoConfig

    from otdus_cli.expand import expand
    from otdus_cli.options import ExpandOptions

    config = json.loads((stories / "config.json").read_text())
    del config["rope_theta"]
    config["rope_parameters"] = {"rope_theta": 500000.0, "rope_type": "default"}
    (stories / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    expand(str(stories), out, ExpandOptions(method="copy", layers=1))
    written = json.loads((out / "config.json").read_text())
    assert written["rope_theta"] == 500000.0 and written["rope_parameters"] == config["rope_parameters"]
    loaded = AutoConfig.from_pretrained(out)
    params = getattr(loaded, "rope_parameters", None) or {}
    assert (getattr(loaded, "rope_theta", None) or params["rope_theta"]) == 500000.0
    # Gemma 3's bases by attention type: its sliding layers' base is rope_local_base_freq in 4.57
    gemma = {
        "model_type": "gemma3_text",
        "num_hidden_layers": 2,
        "rope_parameters": {
            "full_attention": {"rope_theta": 1000000.0, "rope_type": "default"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
    }
    rewritten = rewrite_config(gemma, layer_map(2, after=[1]))
    assert rewritten["rope_theta"] == 1000000.0 and rewritten["rope_local_base_freq"] == 10000.0


@pytest.mark.compat
def test_a_scaled_rope_is_read_alike_by_transformers_4_and_5(stories, tmp_path):
    """Llama 3.1's scaled RoPE saved by transformers 5 lives only in rope_parameters; 4.57 reads
    rope_scaling and, finding none, would load the output with unscaled rotary frequencies. The
    output states it in both places, so the rotary embedding is the same in either version."""
    import json

    import torch
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from otdus_cli.expand import expand
    from otdus_cli.options import ExpandOptions

    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    scaling |= {"original_max_position_embeddings": 64, "rope_type": "llama3"}
    config = json.loads((stories / "config.json").read_text())
    del config["rope_theta"]
    config["rope_parameters"] = {"rope_theta": 500000.0} | scaling
    (stories / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    expand(str(stories), out, ExpandOptions(method="copy", layers=1))
    written = json.loads((out / "config.json").read_text())
    assert written["rope_scaling"] == scaling and written["rope_parameters"] == config["rope_parameters"]
    inv_freq = LlamaRotaryEmbedding(AutoConfig.from_pretrained(out)).inv_freq.tolist()
    theta = (500000.0 ** (-torch.arange(0, 8, 2, dtype=torch.int64).float() / 8)).tolist()  # head dim 8
    assert inv_freq[0] == theta[0] and inv_freq[-1] == pytest.approx(theta[-1] / 8, rel=1e-6)  # scaled
