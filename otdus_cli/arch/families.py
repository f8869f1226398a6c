"""Architecture knowledge as data: one template per model family.

A template says where decoder layers live, what each layer tensor is (its role, used by the
OT-DUS builder), which tensors are zeroed to make a new layer an exact identity, and which
config fields depend on depth, and the traits of its layers that some methods cannot build (the
methods say which, in their own modules). Adding a dense family means adding a template here; an
MoE family also needs its expert layout (arch/experts.py) for the methods that read experts.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from otdus_cli.arch.identity_values import IdentityValue
from otdus_cli.arch.layer_storage import NumberedName

# Role names shared by every family. Values in a template are the tensor path inside a layer,
# without the trailing ".weight" / ".bias".
LLAMA_ROLES = {
    "attn_norm": "input_layernorm",
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "mlp_norm": "post_attention_layernorm",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}

# Zeroing these makes a layer's attention and MLP contributions vanish: the residual passes through.
DENSE_ZERO = (r"self_attn\.o_proj\.(weight|bias)", r"mlp\.down_proj\.(weight|bias)")
MOE_ZERO = (
    r"self_attn\.o_proj\.(weight|bias)",
    r"(mlp|block_sparse_moe)\.experts\.\d+\.(down_proj|w2)\.(weight|bias)",  # per-expert (on-disk format)
    r"(mlp|block_sparse_moe)\.experts\.down_proj",  # fused experts (newer saves)
    r"mlp\.shared_experts?\.down_proj\.(weight|bias)",
    r"mlp\.down_proj\.(weight|bias)",  # dense layers of mixed stacks
)


# Traits of a family's layers that some methods cannot build (Method.refuses, methods/*): data about
# the layers, named here; each method says in its own module why it cannot build them.
MOE = "moe"  # mixture-of-experts layers (Family.moe)
POST_NORM = "post-norm"  # no norm before attention or the MLP; each sublayer's output is normed
PARALLEL_BLOCKS = "parallel-blocks"  # attention and MLP run in parallel from one norm
UNGATED_MLP = "ungated-mlp"  # an MLP without gate (c_fc, c_proj)
EXPERT_BIASES = "expert-biases"  # fused experts with biases
SHARED_FUSED_EXPERTS = "shared-fused-experts"  # fused experts beside a shared expert
CROSS_ATTENTION = "cross-attention"  # cross-attention layers between the self-attention ones
LATENT_ATTENTION = "latent-attention"  # multi-head latent attention (no q/k/v projections)


def uniform_layers(config: dict, index: int) -> str:
    """Every decoder layer holds the same tensors."""
    return "decoder"


def qwen_moe_layers(config: dict, index: int) -> str:
    """Qwen2/3-MoE: a layer has experts unless listed in mlp_only_layers or off the sparse step
    (the rule of transformers' Qwen2MoeDecoderLayer); the others hold a dense MLP."""
    only = config.get("mlp_only_layers") or []
    step = config.get("decoder_sparse_step") or 1
    experts = config.get("num_experts") or 0
    sparse = index not in only and experts > 0 and (index + 1) % step == 0
    return "sparse" if sparse else "dense"


@dataclass(frozen=True)
class Family:
    """Template for one architecture family."""

    name: str
    model_types: tuple[str, ...]
    roles: dict[str, str]
    zero_init: tuple[str, ...] = DENSE_ZERO
    layer_prefix: str = "model.layers.{i}."
    norm_offset: float = 0.0  # Gemma's RMSNorm multiplies by (1 + w)
    moe: bool = False
    # fused tensors: role -> the roles stacked along its rows, in order (sizes from the config)
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # transformers derives per-layer attention types (layer_types) from other fields of this
    # family's config; only then is transformers asked at plan time (its import takes seconds).
    # tests/test_config_rules.py checks the flag against the installed transformers.
    derives_layer_types: bool = False
    # which layers must hold identical tensors (names, dtypes, shapes): those of the same kind
    layer_kind: Callable[[dict, int], str] = uniform_layers
    # traits of its layers some methods cannot build (the constants above; MOE follows ``moe``)
    traits: frozenset[str] = frozenset()
    # a template not written here (generic, or derived from transformers): copy-type methods, and the
    # methods that compute layers from roles (OT-DUS, LESA) only on the kinds in role_kinds
    copy_only: bool = False
    # the layer kinds ``roles`` describe: None for an exact template (every layer); for a derived one the
    # kinds whose tensors matched an exact template's roles, proved on a tiny instance (derived_roles.py)
    role_kinds: frozenset[str] | None = None
    # a derived template: how its roles were matched and proved, and why the other kinds have none
    roles_proof: dict | None = None
    # a derived template whose checkpoints store its roles under other names than transformers' class
    # holds their modules (EXAONE 3's attn.attention.q_proj for self_attn.q_proj): the modules' paths
    role_modules: dict[str, str] | None = None
    # config fields with one entry per layer besides DEPTH_FIELDS' (found by a derived template)
    per_layer_fields: tuple[str, ...] = ()
    # DEPTH_FIELDS transformers derives from other fields when config.json lacks them (Llama 4's
    # moe_layers, no_rope_layers): read from transformers and written explicitly, like layer_types
    derived_fields: tuple[str, ...] = ()
    # config fields listing layer indices besides DEPTH_FIELDS' (found by a derived template)
    index_fields: tuple[str, ...] = ()
    # those of them that count the layers from 1 (Qwen4-Exp's ple_layer_ids), found as index_fields are
    numbered_from_one: tuple[str, ...] = ()
    # a derived template: how its zero-init targets were proved (IdentityProof.record), or why they
    # could not be (then zero_init is empty)
    zero_init_proof: dict | None = None
    zero_init_note: str = ""
    # a derived template: tensors a zero-init layer holds at a value other than 0, (pattern, value) (a
    # residual scale at 1; an expert-choice bias: arch/identity_values.py)
    identity_values: tuple[tuple[str, IdentityValue], ...] = ()
    # a derived template: its output configs are built by transformers at plan time to check that each
    # output layer is of its source layer's kind (arch/derived.py: check_planned_kinds)
    derived: bool = False
    # a derived template: per layer kind, the tensors of a layer transformers saves under a name numbered
    # by the layer's index (name within the layer -> rule); those a checkpoint holds outside the layer's
    # prefix are read as part of the layer (io/stack.py) and renumbered (arch/layer_storage.py)
    numbered_names: dict[str, dict[str, NumberedName]] = field(default_factory=dict)

    def has(self, trait: str) -> bool:
        return trait in self.traits or (trait == MOE and self.moe)

    def is_zero_target(self, suffix: str) -> bool:
        return any(re.fullmatch(p, suffix) for p in self.zero_init)

    def identity_value(self, suffix: str) -> IdentityValue | None:
        """The value other than 0 a zero-init layer holds in tensor ``suffix``, or None."""
        return next((value for p, value in self.identity_values if re.fullmatch(p, suffix)), None)

    def zero_init_value(self, suffix: str) -> IdentityValue | None:
        """What a zero-init layer holds in tensor ``suffix`` everywhere instead of its source's: 0 for a
        zero-init target, its identity value, or None (the source's tensor). expand writes it and the plan
        proof (arch/identity.py) runs the model with it."""
        return 0.0 if self.is_zero_target(suffix) else self.identity_value(suffix)

    def numbered_tensor(self, name: str) -> tuple[int, str] | None:
        """(layer index, name within the layer) of checkpoint tensor ``name`` where ``numbered_names``
        numbers it as a layer's tensor stored outside the layer; None otherwise."""
        rules = {(key, rule) for kind in self.numbered_names.values() for key, rule in kind.items()}
        for key, rule in sorted(rules, key=str):
            index = rule.index_of(name)
            if index is not None:
                return index, key
        return None

    def layer_regex(self) -> re.Pattern[str]:
        return re.compile(re.escape(self.layer_prefix).replace(r"\{i\}", r"(\d+)") + r"(.+)")


# --- Families added for architecture breadth. Each was checked on a tiny model built by
# transformers itself (tests/test_arch_breadth.py): copies, zero-init identity, config rules, loading.

# MoE layers: attention and norms by role (q_norm/k_norm where Qwen3-MoE and OLMoE have them); the
# expert block is read through arch/experts.py's ExpertLayout
MOE_ROLES = {
    **{role: LLAMA_ROLES[role] for role in ("attn_norm", "q", "k", "v", "o", "mlp_norm")},
    "q_norm": "self_attn.q_norm",
    "k_norm": "self_attn.k_norm",
}

# Post-norm blocks (OLMo 2/3, EXAONE 4): no norm before attention or the MLP; each sublayer's output is
# normed before the residual add, and a norm of zeros is zero, so zeroed o/down still add nothing.
POST_NORM_ROLES = {
    **{role: path for role, path in LLAMA_ROLES.items() if role not in ("attn_norm", "mlp_norm")},
    "attn_out_norm": "post_attention_layernorm",
    "mlp_out_norm": "post_feedforward_layernorm",
    "q_norm": "self_attn.q_norm",
    "k_norm": "self_attn.k_norm",
}


def first_k_dense_layers(config: dict, index: int) -> str:
    """DeepSeek-V3: the first first_k_dense_replace layers hold a dense MLP, the others experts."""
    return "dense" if index < int(config.get("first_k_dense_replace") or 0) else "sparse"


def llama4_layers(config: dict, index: int) -> str:
    """Llama 4: experts on the layers listed in moe_layers, else on every interleave_moe_layer_step-th
    (transformers' Llama4TextConfig); the others hold a dense MLP."""
    listed = config.get("moe_layers")
    if listed is None:
        step = int(config.get("interleave_moe_layer_step") or 1)
        return "sparse" if index % step == step - 1 else "dense"
    return "sparse" if index in listed else "dense"


def cross_attention_layers(config: dict, index: int) -> str:
    """Mllama (Llama 3.2 Vision): the layers listed in cross_attention_layers attend to the image."""
    return "cross" if index in (config.get("cross_attention_layers") or []) else "self"


BREADTH_FAMILIES: tuple[Family, ...] = (
    Family(
        "olmo2", ("olmo2", "olmo3"), POST_NORM_ROLES, derives_layer_types=True, traits=frozenset({POST_NORM})
    ),
    Family("exaone4", ("exaone4",), POST_NORM_ROLES, derives_layer_types=True, traits=frozenset({POST_NORM})),
    # Granite's multipliers (embedding, residual, attention, logits) scale whole sublayer outputs
    Family("granite", ("granite",), LLAMA_ROLES),
    Family("smollm3", ("smollm3",), LLAMA_ROLES, derives_layer_types=True),
    Family("ministral", ("ministral",), LLAMA_ROLES, derives_layer_types=True),
    Family(
        "cohere",
        ("cohere", "cohere2"),
        {
            "attn_norm": "input_layernorm",
            **{r: LLAMA_ROLES[r] for r in ("q", "k", "v", "o", "gate", "up", "down")},
        },
        derives_layer_types=True,
        traits=frozenset({PARALLEL_BLOCKS}),
    ),
    Family(
        "glm4",
        ("glm4",),
        {
            **{role: path for role, path in LLAMA_ROLES.items() if role not in ("gate", "up")},
            "attn_out_norm": "post_self_attn_layernorm",
            "mlp_out_norm": "post_mlp_layernorm",
            "gate_up": "mlp.gate_up_proj",
        },
        fused={"gate_up": ("gate", "up")},
    ),
    Family(
        "starcoder2",
        ("starcoder2",),
        {
            **{r: LLAMA_ROLES[r] for r in ("attn_norm", "q", "k", "v", "o", "mlp_norm")},
            "up": "mlp.c_fc",
            "down": "mlp.c_proj",
        },
        zero_init=(r"self_attn\.o_proj\.(weight|bias)", r"mlp\.c_proj\.(weight|bias)"),
        traits=frozenset({UNGATED_MLP}),
    ),
    # attention sinks (self_attn.sinks) only reweight the softmax, whose output o_proj zeroes
    Family(
        "gpt_oss",
        ("gpt_oss",),
        {},
        zero_init=(r"self_attn\.o_proj\.(weight|bias)", r"mlp\.experts\.down_proj(_bias)?"),
        moe=True,
        derives_layer_types=True,
        traits=frozenset({EXPERT_BIASES}),
    ),
    # Llama 4: dense and MoE layers interleaved (moe_layers), NoPE layers (no_rope_layers) with chunked
    # attention on the others (layer_types); a copy keeps its source's kind through those lists. The MoE
    # output is the shared expert's plus the routed experts' (each ends in a down projection).
    Family(
        "llama4",
        ("llama4_text",),
        {},
        zero_init=(
            r"self_attn\.o_proj\.weight",
            r"feed_forward\.down_proj\.weight",
            r"feed_forward\.experts\.down_proj",
            r"feed_forward\.shared_expert\.down_proj\.weight",
        ),
        moe=True,
        derives_layer_types=True,
        layer_kind=llama4_layers,
        derived_fields=("moe_layers", "no_rope_layers"),
        traits=frozenset({SHARED_FUSED_EXPERTS}),
    ),
    # Mllama (Llama 3.2 Vision): cross-attention layers (listed in cross_attention_layers, renumbered
    # through the layer map) add gated image attention and MLP; text-only inputs skip them
    Family(
        "mllama",
        ("mllama_text_model",),
        {},
        zero_init=(
            r"self_attn\.o_proj\.weight",
            r"cross_attn\.o_proj\.weight",
            r"mlp\.down_proj\.weight",
        ),
        layer_kind=cross_attention_layers,
        traits=frozenset({CROSS_ATTENTION}),
    ),
    Family(
        "deepseek_v3",
        ("deepseek_v3",),
        {},
        zero_init=MOE_ZERO,
        moe=True,
        layer_kind=first_k_dense_layers,
        traits=frozenset({LATENT_ATTENTION}),
    ),
)

FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama",), LLAMA_ROLES),
    Family("mistral", ("mistral",), LLAMA_ROLES),
    Family("qwen2", ("qwen2",), LLAMA_ROLES, derives_layer_types=True),
    Family(
        "qwen3",
        ("qwen3",),
        {**LLAMA_ROLES, "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"},
        derives_layer_types=True,
    ),
    Family(
        "gemma2",
        ("gemma2",),
        {
            **LLAMA_ROLES,
            "mlp_norm": "pre_feedforward_layernorm",
            "attn_out_norm": "post_attention_layernorm",
            "mlp_out_norm": "post_feedforward_layernorm",
        },
        norm_offset=1.0,
        derives_layer_types=True,
    ),
    Family(
        "gemma3",
        ("gemma3_text",),
        {
            **LLAMA_ROLES,
            "mlp_norm": "pre_feedforward_layernorm",
            "attn_out_norm": "post_attention_layernorm",
            "mlp_out_norm": "post_feedforward_layernorm",
            "q_norm": "self_attn.q_norm",
            "k_norm": "self_attn.k_norm",
        },
        norm_offset=1.0,
        derives_layer_types=True,
    ),
    Family(
        "phi3",
        ("phi3",),
        {
            "attn_norm": "input_layernorm",
            "qkv": "self_attn.qkv_proj",
            "o": "self_attn.o_proj",
            "mlp_norm": "post_attention_layernorm",
            "gate_up": "mlp.gate_up_proj",
            "down": "mlp.down_proj",
        },
        fused={"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")},
    ),
    Family("mixtral", ("mixtral",), MOE_ROLES, zero_init=MOE_ZERO, moe=True),
    Family(
        "qwen2_moe",
        ("qwen2_moe",),
        MOE_ROLES,
        zero_init=MOE_ZERO,
        moe=True,
        derives_layer_types=True,
        layer_kind=qwen_moe_layers,
    ),
    Family("qwen3_moe", ("qwen3_moe",), MOE_ROLES, zero_init=MOE_ZERO, moe=True, layer_kind=qwen_moe_layers),
    Family("olmoe", ("olmoe",), MOE_ROLES, zero_init=MOE_ZERO, moe=True),
    *BREADTH_FAMILIES,
)

# Config fields whose meaning depends on depth, and how each is rewritten (docs/output.md, config.json).
#   per_layer: a list with one entry per layer (or a dict keyed by layer index); a new layer inherits
#     its source layer's entry.
#   index_list: a list of layer indices; an output layer is listed if its source layer was. One index
#     (an int: a range's first or last layer) maps to the first (last) output layer of its source.
#   threshold: "the first t layers"; becomes the number of output layers whose source is below t.
#   refuse: a field we cannot rewrite faithfully; refuse the expansion if present and non-trivial.
#   inverse_sqrt_depth: a factor the model divides by sqrt(depth) (MiniCPM3's scale_depth scales each
#     residual branch by scale_depth / sqrt(num_hidden_layers)): rewritten so that quotient, and with it
#     every layer's computation, stays the same.
#   last_count: "the last t layers" (Gemma 3n / 4's num_kv_shared_layers: the last t layers reuse the
#     key-value states of earlier ones); becomes the number of output layers whose source is among them,
#     which must be the last output layers.
#   trailing: the number of layers stored after the stack (DeepSeek-V3's multi-token prediction
#     module, model.layers.{L}...): unchanged; io/stack.py keeps them after the new last layer.
#   group_size: layers count in groups of this many by index (RWKV's rescale_every: in eval mode the
#     weights of group g are divided by 2 ** g and the stream halved after each group): rewritten to
#     the smallest size that keeps every base layer in its group and the number of whole groups, where
#     one does (the same number of new layers in every group); else kept (arch/plan_differences.py).
DEPTH_FIELDS: dict[str, str] = {
    "layer_types": "per_layer",
    "no_rope_layers": "per_layer",
    "mlp_only_layers": "index_list",
    "cross_attention_layers": "index_list",
    "moe_layers": "index_list",
    "max_window_layers": "threshold",
    "first_k_dense_replace": "threshold",
    "num_kv_shared_layers": "last_count",
    "num_nextn_predict_layers": "trailing",
    "scale_depth": "inverse_sqrt_depth",
    "rescale_every": "group_size",
}
