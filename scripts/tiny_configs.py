"""Tiny configs for any causal LM transformers builds (used by scripts/coverage.py, `make coverage`).

For a model_type, the sets of config fields to try in turn (:func:`attempts`): the test suite's tiny
configs where it has one, then general small sizes (dense, MoE, latent attention, state-space layers,
partial rotary). A config class with nested sub-configs (a multimodal wrapper) gets the text model's
attempts as its text config and each other sub-config (vision, audio towers) shrunk on its own
(:func:`tiny_tower`). A validator that names the one value it accepts ("X must be 0") gets it
(:func:`satisfy`). What still cannot be built is explained in plain words (:func:`why_not_built`).
"""

from __future__ import annotations

import re

from tests.support.tiny_models import COMMON as TESTED_COMMON
from tests.support.tiny_models import HYBRID_BASE
from tests.support.tiny_models import HYBRID_CONFIGS as TESTED_HYBRIDS  # hybrid stacks, GPT-2 and Bloom
from tests.support.tiny_models import TINY_CONFIGS as TESTED_CONFIGS
from tests.support.tiny_models import WRAPPERS as TESTED_WRAPPERS  # multimodal: tiny vision towers too

TINY = {**TESTED_COMMON, **HYBRID_BASE}  # the tests' tiny sizes, with head_dim and token ids
# small expert counts and latent ranks for MoE / MLA configs (tried first; dropped if a config refuses them)
TINY_MOE = dict(
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    n_group=1,
    topk_group=1,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=8,  # = head_dim, which MLA's rotary part uses
    qk_nope_head_dim=8,
    v_head_dim=8,
)
# encoder-decoder classes' decoder settings (BART family, Whisper, PLBart: their causal LM is the decoder)
TINY_DECODER = dict(
    d_model=32,
    decoder_layers=4,
    encoder_layers=2,
    decoder_attention_heads=4,
    encoder_attention_heads=4,
    decoder_ffn_dim=48,
    encoder_ffn_dim=48,
)
# multi-head latent attention (and other classes) wanting as many key-value heads as query heads
TINY_MLA = dict(num_key_value_heads=4)
# state-space (Mamba-2) layers: heads * head size = expand * hidden_size (2 * 32), under each family's names
TINY_SSM = dict(
    mamba_expand=2,
    mamba_n_heads=4,
    mamba_d_head=16,
    mamba_d_ssm=64,
    mamba_d_state=8,
    mamba_n_groups=1,
    mamba_d_conv=2,
    mamba_chunk_size=8,
    expand=2,
    num_heads=4,
    head_dim=16,
    state_size=8,
    n_groups=1,
    conv_kernel=2,
    chunk_size=8,
)
# per-layer token embeddings (Gemma 3n, Gemma 4: a second vocabulary-sized table) and KV-cache sharing
# across the last layers (more than a tiny stack has)
TINY_PER_LAYER = dict(vocab_size_per_layer_input=96, hidden_size_per_layer_input=8, num_kv_shared_layers=0)
# rotary embedding on part of each head (CodeGen, GPT-J: rotary_dim; 64 by default, more than a tiny head)
TINY_PARTIAL_ROTARY = dict(rotary_dim=4)
# what some config classes leave unset (or set for a large model) that their model needs (data; why)
NEEDS: dict[str, tuple[dict, str]] = {
    **dict.fromkeys(
        ("opt", "biogpt", "xglm"),
        (
            dict(num_key_value_heads=None),
            "its attention has a KV head per query head and ignores num_key_value_heads, which the tiny "
            "fields would otherwise save as 2 (and the methods that read heads would believe)",
        ),
    ),
    "reformer": (
        dict(
            is_decoder=True,
            axial_pos_shape=[8, 8],
            axial_pos_embds_dim=[16, 16],
            attn_layers=["local", "lsh", "local", "lsh"],
            local_attn_chunk_length=4,
            lsh_attn_chunk_length=4,
            num_buckets=2,
        ),
        "its causal LM takes a decoder config only, and the axial position shape must multiply to the length",
    ),
    "xmod": (dict(default_language="en_XX"), "its model refuses input until a language adapter is chosen"),
    "cohere_compass_text": (
        dict(
            rope_parameters={
                kind: {"rope_type": "default", "rope_theta": 10000.0}
                for kind in ("full_attention", "sliding_attention")
            }
        ),
        "its config leaves rope_parameters empty, and the model reads one entry per layer type",
    ),
    "dots1": (
        dict(n_shared_experts=1),
        "its config leaves n_shared_experts unset, and the model multiplies by it",
    ),
    "dbrx": (
        dict(
            d_model=32,
            n_heads=4,
            n_layers=4,
            attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
            ffn_config=dict(hidden_size=32, ffn_hidden_size=48, moe_num_experts=4, moe_top_k=2),
        ),
        "its attention config has no rope_theta or clip_qkv default, and the model reads both (and d_model)",
    ),
    "qwen4_exp_text": (
        dict(
            indexer_n_heads=2,
            indexer_kv_heads=1,
            indexer_head_dim=8,
            indexer_budget=8,
            indexer_compress_ratio=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
        ),
        "its config leaves the sparse-attention indexer's sizes unset, and the model divides by them",
    ),
    "dots3_note_text": (
        dict(
            num_key_value_heads=4,
            swa_num_attention_heads=4,
            swa_num_key_value_heads=4,
            swa_q_lora_rank=16,
            swa_kv_lora_rank=16,
            swa_head_dim=16,
            swa_qk_nope_head_dim=8,
            swa_v_head_dim=8,
            index_head_dim=8,
            index_n_heads=2,
            index_topk=4,
            shared_experts_intermediate_size=16,
        ),
        "its sliding-window layers take their widths from swa_* fields (full size by default)",
    ),
    "jamba": (
        dict(attn_layer_period=4, attn_layer_offset=2),
        "a real Jamba's 32 layers hold 4 attention periods of 8; a tiny stack of 4 holds one of period 4",
    ),
    "lfm2_moe": (
        dict(layer_types=["conv", "full_attention", "conv", "full_attention"], num_dense_layers=1),
        "its config leaves layer_types unset, and the model reads it",
    ),
}
# the sizes of a tiny vision or audio tower, under the names towers use; each set only where the tower
# config has that field
TOWER = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    depth=1,
    num_blocks=1,
    num_layers=1,
    encoder_layers=1,
    num_decoder_layers=1,
    num_attention_heads=2,
    num_heads=2,
    num_key_value_heads=2,
    attention_heads=2,
    head_dim=8,
    mlp_dim=32,
    ffn_dim=32,
    d_model=16,
    d_ff=32,
    d_kv=8,
    embed_dim=16,
)
# tower fields whose size is the text model's hidden size (the tower's output feeds the text model)
TOWER_TO_TEXT = ("out_hidden_size", "adapter_out_dim", "vision_output_dim", "projector_output_dim")
MAX_TOWER_WIDTH = 64  # a tower field named *_dim(s) above this is a width to shrink
DEPTHS = ("num_hidden_layers", "depth", "num_blocks", "num_layers", "encoder_layers")


def attempts(model_type: str) -> list[dict]:
    """Config fields to try for ``model_type``, in order (the first that builds a small model wins)."""
    no_head_dim = {k: v for k, v in TINY.items() if k != "head_dim"}  # for classes that compute it
    any_depth = {k: v for k, v in TINY.items() if k != "num_hidden_layers"}  # configs whose kinds fix it
    tested = [  # the test suite's tiny configs, where it has one
        *([{**TESTED_COMMON, **TESTED_CONFIGS[model_type]}] if model_type in TESTED_CONFIGS else []),
        *([TESTED_HYBRIDS[model_type]] if model_type in TESTED_HYBRIDS else []),
        *([TESTED_WRAPPERS[model_type]] if model_type in TESTED_WRAPPERS else []),
    ]
    bases = (TINY, no_head_dim, {**TINY, **TINY_MOE})
    needs = [{**base, **NEEDS[model_type][0]} for base in bases] if model_type in NEEDS else []
    return [
        *tested,
        *needs,
        {**TINY, **TINY_MOE},
        {**TINY, **TINY_MOE, **TINY_MLA},
        {**TINY, **TINY_DECODER},
        {**no_head_dim, **TINY_MOE},
        TINY,
        no_head_dim,
        {**any_depth, **TINY_MOE},
        {k: v for k, v in any_depth.items() if k != "head_dim"},
        {**TINY, **TINY_SSM},
        {**TINY, **TINY_MOE, **TINY_SSM},
        {**no_head_dim, **TINY_PARTIAL_ROTARY},
        {**TINY, **TINY_PER_LAYER},
        {**TINY, **TINY_MOE, **TINY_PER_LAYER},
        {k: v for k, v in no_head_dim.items() if k != "max_position_embeddings"},  # XLNet: no length limit
    ]


def wrapper_attempts(model_type: str) -> list[dict]:
    """For a config class with nested sub-configs: the text config's own attempts as ``text_config`` (or
    whatever the class calls it), every other sub-config a tiny tower; [] for a flat config class."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    if not getattr(cls, "sub_configs", None):
        return []
    try:
        default = cls()
    except Exception:
        return []
    text = default.get_text_config(decoder=True)
    subs, text_name = {}, None
    for name, sub_cls in cls.sub_configs.items():
        sub = getattr(default, name, None)
        if sub is None:
            try:
                sub = sub_cls()
            except Exception:
                continue
        if sub is text:
            text_name = name
        else:
            subs[name] = sub
    # a width one part names of another (the text model's, a sibling tower's) becomes that part's tiny one
    widths = {getattr(sub, "hidden_size", None): TOWER["hidden_size"] for sub in subs.values()}
    widths[getattr(text, "hidden_size", None)] = TINY["hidden_size"]
    widths.pop(None, None)
    parts = {name: tiny_tower(sub, widths) for name, sub in subs.items()}
    parts |= _special_tokens_in_vocab(default)
    if text is default:  # the text model's fields at the top level (GIT, Phi-4 multimodal)
        return [{**fields, **parts} for fields in attempts(model_type)]
    if text_name is None or not text.model_type or text.model_type == model_type:
        return []
    return [
        {text_name: {"model_type": text.model_type, **fields}, **parts}
        for fields in attempts(text.model_type)
    ]


# the token ids coverage feeds a model are below this (scripts/coverage.py: logits_of); the wrapper's
# special tokens (image, video, audio placeholders ...) go above it, inside the tiny vocabulary
FED_IDS_BELOW = 90


def _special_tokens_in_vocab(default) -> dict:
    """A wrapper's special token ids (``image_token_id`` ...) beyond the tiny vocabulary, moved into its
    top (ids no input of coverage holds): a forward from embeddings alone looks them up (Gemma 4's
    placeholder masks), which fails outside the table. Ids are shared once the top is full."""
    vocab = TINY["vocab_size"]
    names = sorted(
        k
        for k, v in default.to_dict().items()
        if re.search(r"_token_(id|index)$", k) and type(v) is int and v >= vocab
    )
    top = range(vocab - 1, FED_IDS_BELOW - 1, -1)
    return {name: top[k % len(top)] for k, name in enumerate(names)}


def tiny_tower(config, widths: dict[int, int] | None = None) -> dict:
    """A sub-config's fields with its sizes made tiny: the :data:`TOWER` sizes where it has those fields,
    other widths equal to its hidden or intermediate size (adapters' input) made the same tiny size, or
    to another part's (``widths``: default -> tiny: what it hands the text model, a sibling's width),
    per-layer lists cut to the new depth, layer indexes kept to layer 0."""
    fields = config.to_dict()
    depth = next((fields[k] for k in DEPTHS if isinstance(fields.get(k), int)), None)
    tiny = {k: v for k, v in TOWER.items() if k in fields}
    new_depth = next((tiny[k] for k in DEPTHS if k in tiny), None)
    for name, value in fields.items():
        if not isinstance(value, list) or not value or depth is None or new_depth is None:
            continue
        if len(value) == depth:
            tiny[name] = value[:new_depth]
        elif "index" in name and all(isinstance(i, int) and 0 <= i < depth for i in value):
            tiny[name] = [0]
    same_as = {
        **(widths or {}),
        fields.get("intermediate_size"): TOWER["intermediate_size"],
        fields.get("hidden_size"): TOWER["hidden_size"],
    }
    for name, value in fields.items():
        if name not in tiny and type(value) is int and value in same_as and ("dim" in name or "size" in name):
            tiny[name] = same_as[value]
    for name, value in fields.items():  # any other width (mm_embed_dim, output_proj_dims)
        if (
            name not in tiny
            and type(value) is int
            and value > MAX_TOWER_WIDTH
            and re.search(r"_dims?$", name)
        ):
            tiny[name] = TOWER["hidden_size"]
    tiny.update({k: TINY["hidden_size"] for k in TOWER_TO_TEXT if k in fields})
    return {"model_type": config.model_type, **tiny} if config.model_type else tiny


SATISFY_TRIES = 3  # validator demands met per set of fields (each names one value)


def make_config(model_type: str, fields: dict):
    """The config of these fields, changed where a validator names the one value it accepts."""
    from transformers import AutoConfig

    for _ in range(SATISFY_TRIES):
        try:
            return AutoConfig.for_model(model_type, **fields)
        except Exception as exc:
            fields = satisfy(fields, exc)
            if fields is None:
                raise
    return AutoConfig.for_model(model_type, **fields)


def smaller_vocabularies(config, fields: dict) -> dict | None:
    """The fields with the config's other vocabularies (Gemma 3n's per-layer embeddings, Inkling's
    unpadded size, BLT's hash n-grams) as small as its vocabulary; None where it has none larger."""
    vocab = fields.get("vocab_size", TINY["vocab_size"])
    other = {
        k: vocab
        for k, v in config.to_dict().items()
        if "vocab" in k and k != "vocab_size" and type(v) is int and v > vocab
    }
    return {**fields, **other} if other else None


_MUST_BE = re.compile(r"(\w+) must be (-?\d+), got")
_MUST_MATCH = re.compile(r"(\w+) must match (\w+)")
_SHOULD_EQUAL = re.compile(r"`?(\w+)`? \(-?\d+\) should be equal to [^(]*\((-?\d+)\)")


def satisfy(fields: dict, error: Exception) -> dict | None:
    """The fields changed so the validator that raised ``error`` accepts them, where its message names
    the value it wants ("hidden_size_per_layer_input must be 0, got 256", "num_key_value_heads must
    match num_attention_heads"), in the fields or a nested sub-config's; None where it names none."""
    message = str(error)
    nested = {k: v for k, v in fields.items() if isinstance(v, dict)}
    if found := _MUST_BE.search(message) or _SHOULD_EQUAL.search(message):
        name, value = found.group(1), int(found.group(2))
        wanted = {name: value}
    elif found := _MUST_MATCH.search(message):
        name, other = found.groups()
        # the part (top level or a sub-config) that has both fields, else one that has the other
        parts = [(k, part) for k, part in [(None, fields), *nested.items()] if other in part]
        key, part = next(((k, p) for k, p in parts if name in p), parts[0] if parts else (None, fields))
        wanted = {name: part[other]} if other in part else {}
    else:
        return None
    if not wanted:
        return None
    if (
        found.re is not _MUST_MATCH
    ):  # the sub-config that has the field (a wrapper's text config), else the top
        key = next((k for k, part in nested.items() if name in part and name not in fields), None)
    part = nested[key] if key else fields
    if part.get(name) == wanted[name]:
        return None
    return {**fields, key: {**part, **wanted}} if key else {**fields, **wanted}


# why coverage builds no tiny model of these, in words (what no general rule above covers)
_DRAFT = (
    "a draft model for speculative decoding: its forward needs the main model's shared key-value states, "
    "so it does not run on token ids alone"
)
_MUSICGEN = (
    "transformers' causal-LM mapping pairs this composite config (text encoder, audio encoder, decoder) with "
    "a causal LM class that reads only the decoder's config, so it builds no model from it"
)
NOT_BUILT: dict[str, str] = {
    "gemma3n": (
        "its vision tower is a timm model (TimmWrapperModel), which needs the timm and pillow packages; "
        "neither is a dependency of otdus or of its tests, so they are not installed here"
    ),
    "gemma4_assistant": _DRAFT,
    "gemma4_unified_assistant": _DRAFT,
    "musicgen": _MUSICGEN,
    "musicgen_melody": _MUSICGEN,
}


def why_not_built(model_type: str, error: Exception) -> str:
    """Why no tiny ``model_type`` model was built, in plain words, then the error itself."""
    raw = f"{type(error).__name__}: {' '.join(str(error).split())}"
    if model_type in NOT_BUILT:
        return f"{NOT_BUILT[model_type]} ({raw})"
    if isinstance(error, ImportError):
        return f"needs a package that is not installed here ({raw})"
    if broken := _default_fails(model_type):
        import transformers

        return (
            f"transformers {transformers.__version__} builds no model from this config class's own defaults "
            f"either ({broken}), a gap in transformers rather than in the tiny sizes"
            + ("" if broken == raw else f" ({raw})")
        )
    if "still has" in str(error):
        return f"coverage's tiny sizes do not reach all of its size fields ({raw})"
    return raw


def _default_fails(model_type: str) -> str | None:
    """The error transformers raises building ``model_type``'s causal LM from its config class's defaults
    (on the meta device: no memory); None when it builds."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type))
    except Exception as exc:
        return f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    return None
