"""Where a checkpoint keeps its decoder stack: at the top (a causal LM) or inside a multimodal wrapper.

Only the text stack is expanded; everything else (vision tower, projector, audio parts) is copied byte
for byte. Like the family templates this is data: a new wrapper layout is a new entry here.
"""

from __future__ import annotations

from otdus_cli.errors import OtdusError

# Tensor-name prefixes of a text model, before "layers.{i}.": a causal LM, transformers 5 wrappers
# (model.language_model.layers.N), older wrapper saves (language_model.model.layers.N; what
# transformers 5 still writes for Gemma 3, LLaVA, Mistral 3).
TEXT_MODEL_PREFIXES = ("model.", "model.language_model.", "language_model.model.")

# config.json keys holding a wrapper's text settings (num_hidden_layers, layer_types ...)
TEXT_CONFIG_KEYS = ("text_config",)

# model_types (of a wrapper, or of its text config) whose decoder layers are those of a known family:
# same tensors, same zero-init targets, same config rules
TEXT_FAMILY_ALIASES = {
    "qwen2_vl": "qwen2",
    "qwen2_vl_text": "qwen2",
    "qwen2_5_vl": "qwen2",
    "qwen2_5_vl_text": "qwen2",
    "qwen3_vl": "qwen3",
    "llama4": "llama4_text",
    "mllama": "mllama_text_model",
    "qwen3_vl_text": "qwen3",
}

# Wrapper config fields whose list length K means text layers 0 .. K-1 take inputs by their position
# in the stack, which no config field of the expanded model could move: Qwen3-VL adds its vision
# tower's deepstack features (from the vision blocks listed, indices into the vision tower, not the
# text stack) to the hidden states after text layers 0 .. K-1. An expansion keeps those layers in
# place (arch/config_rules.py: check_leading_layers), or is refused.
LEADING_LAYER_FIELDS: dict[tuple[str, str], str] = {
    ("vision_config", "deepstack_visual_indexes"): "visual features are added after text layers",
}


def text_config_key(config: dict) -> str | None:
    """The key of the wrapper's text settings, or None when the stack's settings are at the top."""
    for key in TEXT_CONFIG_KEYS:
        part = config.get(key)
        if isinstance(part, dict) and "num_hidden_layers" in part:
            return key
    return None


def text_config(config: dict) -> dict:
    """The settings of the decoder stack: the wrapper's text config, or the config itself."""
    key = text_config_key(config)
    return config[key] if key else config


def depth_parts(config: dict) -> list[str | None]:
    """Where config.json states the stack's depth: the top level (None; an older Qwen2-VL save keeps
    the text settings there, in a wrapper config) and/or the text config, in that order."""
    key = text_config_key(config)
    return ([None] if "num_hidden_layers" in config or key is None else []) + ([key] if key else [])


def text_model_prefix(names: list[str]) -> str | None:
    """The prefix of the text model's tensors (before "layers.{i}.") among a checkpoint's names; None
    when no layers are stored under any of TEXT_MODEL_PREFIXES (the family's own prefix then holds)."""
    found = [p for p in TEXT_MODEL_PREFIXES if any(n.startswith(p + "layers.0.") for n in names)]
    if len(found) > 1:
        raise OtdusError(f"the checkpoint holds decoder layers under both {found[0]} and {found[1]}")
    return found[0] if found else None
