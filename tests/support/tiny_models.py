"""Tiny random models of every family the suite covers, built in-process with transformers' own classes
and saved with save_pretrained, so they have exactly the tensor names, config fields and on-disk layout
of real checkpoints; and the two ways tests read them back (a loaded model, its logits)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)

# model_type -> extra config fields (small, but exercising each family's particular features)
TINY_CONFIGS: dict[str, dict] = {
    "llama": {"tie_word_embeddings": False},
    "mistral": {"sliding_window": 16},
    "qwen2": {
        "use_sliding_window": True,
        "sliding_window": 16,
        "max_window_layers": 2,
        "tie_word_embeddings": True,
    },
    "qwen3": {"head_dim": 8},
    "gemma2": {"head_dim": 8, "sliding_window": 16, "query_pre_attn_scalar": 8},
    "gemma3_text": {"head_dim": 8, "sliding_window": 16, "query_pre_attn_scalar": 8, "num_hidden_layers": 6},
    "phi3": {"pad_token_id": 0},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 24,
    },
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "head_dim": 8},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    **{
        # architecture breadth: tests/test_arch_breadth.py
        "olmo2": {},
        "olmo3": {"sliding_window": 16},
        "exaone4": {"head_dim": 8, "sliding_window": 16},
        "granite": {"residual_multiplier": 0.5, "embedding_multiplier": 2.0, "logits_scaling": 2.0},
        "smollm3": {"pad_token_id": 0},
        "ministral": {"head_dim": 8, "sliding_window": 16},
        "cohere": {"use_qk_norm": True},
        "cohere2": {"sliding_window": 16},
        "glm4": {"pad_token_id": 0, "head_dim": 8},
        "starcoder2": {"sliding_window": 16},
        "gpt_oss": {"head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16},
        # dense and MoE layers interleaved, NoPE layers every second, chunked attention on the others
        "llama4_text": {
            "head_dim": 8,
            "num_local_experts": 4,
            "intermediate_size_mlp": 40,
            "interleave_moe_layer_step": 2,
            "no_rope_layer_interval": 2,
            "attention_chunk_size": 8,
        },
        "deepseek_v3": {
            "q_lora_rank": 16,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 4,
            "qk_nope_head_dim": 4,
            "v_head_dim": 8,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            "moe_intermediate_size": 16,
            "n_group": 1,
            "topk_group": 1,
        },
    },
}
DENSE_TYPES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"]
MOE_TYPES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]
# where a check runs on every family, these run in `make test` and the others in `make test-long`: one
# of each template kind (Llama's layout, Gemma's norms and soft-capping, Phi-3's fused projections,
# fused experts, a shared expert), so a family-wide break still shows in the quick suite (make
# test-long runs under transformers 5 only: the others' compat cases run there without 4.57.6)
QUICK_TYPES = {"llama", "gemma3_text", "phi3", "mixtral", "qwen2_moe"}


def quick_or_slow(model_types: list[str]) -> list:
    """``model_types`` as pytest parameters, those outside QUICK_TYPES marked slow."""
    return [t if t in QUICK_TYPES else pytest.param(t, marks=pytest.mark.slow) for t in model_types]


BREADTH_DENSE_TYPES = [
    "olmo2",
    "olmo3",
    "exaone4",
    "granite",
    "smollm3",
    "ministral",
    "cohere",
    "cohere2",
    "glm4",
    "starcoder2",
]
BREADTH_MOE_TYPES = ["gpt_oss", "deepseek_v3", "llama4_text"]


def build_tiny(model_type: str, folder: Path, max_shard_size: str | None = None, seed: int = 0) -> Path:
    """Save a tiny random model of `model_type` (weights drawn so no tensor is trivially zero)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.for_model(model_type, **{**COMMON, **TINY_CONFIGS[model_type]})
        model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms start at exactly 1 (or 0 for Gemma); perturb them so mistakes show
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return folder


# multimodal wrappers: a tiny vision tower around a tiny text model (test_wrappers.py, scripts/coverage.py)
_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
WRAPPERS: dict[str, dict] = {
    "gemma3": dict(
        text_config={**COMMON, **TINY_CONFIGS["gemma3_text"], "model_type": "gemma3_text"},
        vision_config=dict(_VISION, image_size=28, patch_size=14),
        mm_tokens_per_image=4,
        image_token_index=90,
        boi_token_index=91,
        eoi_token_index=92,
    ),
    "qwen2_5_vl": dict(
        text_config={
            **COMMON,
            "model_type": "qwen2_5_vl_text",
            "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
        },
        vision_config=dict(
            depth=1,
            hidden_size=16,
            out_hidden_size=32,
            num_heads=2,
            intermediate_size=32,
            fullatt_block_indexes=[0],
        ),
        image_token_id=90,
        video_token_id=91,
        vision_start_token_id=92,
    ),
    # deepstack: the vision blocks listed feed visual features into text layers 0 and 1
    "qwen3_vl": dict(
        text_config={
            **COMMON,
            "model_type": "qwen3_vl_text",
            "head_dim": 8,
            "rope_scaling": {"rope_type": "default", "mrope_section": [1, 1, 2], "mrope_interleaved": True},
        },
        vision_config=dict(
            depth=3,
            hidden_size=16,
            out_hidden_size=32,
            num_heads=2,
            intermediate_size=32,
            patch_size=4,
            temporal_patch_size=2,
            spatial_merge_size=2,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0, 2],
        ),
        image_token_id=90,
        video_token_id=91,
        vision_start_token_id=92,
        vision_end_token_id=93,
    ),
    # Llama 3.2 Vision: cross-attention layers 1 and 3 inside the text stack
    "mllama": dict(
        text_config={
            **COMMON,
            "cross_attention_layers": [1, 3],
            "pad_token_id": 0,
            "rope_scaling": {"rope_type": "default"},  # transformers 4.57 has no default
        },
        vision_config=dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_global_layers=1,
            attention_heads=2,
            image_size=28,
            patch_size=14,
            vision_output_dim=32,
            intermediate_layers_indices=[0],
            max_num_tiles=1,
            supported_aspect_ratios=[[1, 1]],
        ),
        image_token_index=90,
    ),
    # Llama 4: dense / MoE layers interleaved, NoPE and chunked attention (llama4_text above)
    "llama4": dict(
        text_config={**COMMON, **TINY_CONFIGS["llama4_text"]},
        vision_config=dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
            projector_input_dim=32,
            projector_output_dim=32,
            vision_output_dim=32,
            pixel_shuffle_ratio=0.5,
        ),
        image_token_index=90,
        boi_token_index=91,
        eoi_token_index=92,
    ),
    "llava": dict(
        text_config={**COMMON, "model_type": "llama"},
        vision_config=dict(
            _VISION, model_type="clip_vision_model", image_size=28, patch_size=14, projection_dim=16
        ),
        image_token_index=90,
    ),
    "mistral3": dict(
        text_config={**COMMON, "model_type": "mistral", "head_dim": 8},
        vision_config=dict(_VISION, model_type="pixtral", image_size=28, patch_size=14, head_dim=8),
        image_token_index=90,
        spatial_merge_size=1,
    ),
}


def load_causal_lm(folder: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()


def logits(
    model, seed: int = 0, vocab: int | None = None, length: int = 24, use_cache: bool = True
) -> torch.Tensor:
    """Logits on random ids; ``use_cache=False`` for classes whose cache misbehaves on a bare forward."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab or model.config.vocab_size, (2, length), generator=gen)
    with torch.no_grad():
        return model(input_ids=ids, **({} if use_cache else {"use_cache": False})).logits


def save_perturbed(model_type: str, fields: dict, folder: Path, use_cache: bool = True) -> torch.Tensor:
    """A tiny random ``model_type`` model of config ``fields`` saved by transformers, its vectors (norms,
    biases) perturbed so that an identity is not luck; returns its logits (:func:`logits`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1 and p.is_floating_point():
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return logits(model, use_cache=use_cache)


# hybrid stacks (linear attention, Mamba, dense and MoE layers), GPT-2 and Bloom: tests/test_hybrid.py
HYBRID_BASE = {k: v for k, v in COMMON.items() if k != "num_hidden_layers"} | dict(
    head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2
)
_HYBRID_MOE = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16
)
_HYBRID_LINEAR = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=2,
)
HYBRID_LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
HYBRID_CONFIGS: dict[str, dict] = {
    "qwen3_5_text": {
        **HYBRID_BASE,
        **_HYBRID_LINEAR,
        "num_hidden_layers": 4,
        "layer_types": HYBRID_LAYER_TYPES,
    },
    "qwen3_5_moe_text": {
        **HYBRID_BASE,
        **_HYBRID_LINEAR,
        **_HYBRID_MOE,
        "num_hidden_layers": 4,
        "layer_types": HYBRID_LAYER_TYPES,
    },
    "qwen3_next": {
        **HYBRID_BASE,
        **_HYBRID_LINEAR,
        **_HYBRID_MOE,
        "num_hidden_layers": 4,
        "layer_types": HYBRID_LAYER_TYPES,
        "mlp_only_layers": [0],
    },
    "glm4_moe": {
        **HYBRID_BASE,
        "num_hidden_layers": 4,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "num_nextn_predict_layers": 0,
    },
    "nemotron_h": {
        **HYBRID_BASE,
        "layers_block_type": ["mamba", "attention", "mamba", "mlp"],
        "mamba_num_heads": 4,
        "mamba_head_dim": 8,
        "ssm_state_size": 8,
        "n_groups": 1,
        "mamba_d_conv": 2,
        "expand": 1,
    },
    "falcon_h1": {
        **HYBRID_BASE,
        "num_hidden_layers": 4,
        "mamba_d_ssm": 32,
        "mamba_n_heads": 4,
        "mamba_d_head": 8,
        "mamba_d_state": 8,
        "mamba_n_groups": 1,
        "mamba_d_conv": 2,
    },
    "gpt2": dict(vocab_size=96, n_embd=32, n_layer=4, n_head=4, n_positions=64),
    "bloom": dict(vocab_size=96, hidden_size=32, n_layer=4, n_head=4),
}

# the streamed evaluator's breadth (tests/test_verify_breadth.py): checkpoints and forwards unlike LLaMA's
_MLA = dict(
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    num_key_value_heads=4,
)
_ROUTED = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_group=1, topk_group=1)
VERIFY_BREADTH: dict[str, dict] = {
    "olmo_hybrid": {**HYBRID_BASE, "num_hidden_layers": 4},
    "sarvam_moe": {**HYBRID_BASE, **_ROUTED, "num_hidden_layers": 4, "first_k_dense_replace": 1},
    "roberta-prelayernorm": {**COMMON, "is_decoder": True},
    "ctrl": dict(vocab_size=96, n_embd=32, n_layer=4, n_head=4, dff=48, n_positions=64),
    "glm_moe_dsa": {
        **HYBRID_BASE,
        **_ROUTED,
        **_MLA,
        "num_hidden_layers": 4,
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": 8,
    },
    "hy_v4": {
        **HYBRID_BASE,
        **_ROUTED,
        **_MLA,
        "num_hidden_layers": 4,
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": 8,
    },
    "cpmant": dict(
        vocab_size=96,
        hidden_size=32,
        dim_ff=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        dim_head=8,
        prompt_length=4,
        prompt_types=3,
        segment_types=4,
        position_bias_num_buckets=32,
        position_bias_max_distance=64,
    ),
    "mllama": {
        "text_config": {
            **COMMON,
            "pad_token_id": 0,
            "cross_attention_layers": [1],
            "rope_scaling": {"rope_type": "default"},  # 4.57 builds no rotary embedding without one
        }
    },
}
