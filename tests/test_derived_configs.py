"""Derived templates where a config or a checkpoint addresses layers outside the layer list.

Tiny models built by the installed transformers with the sizes `make coverage` uses:
Gemma 4's per_layer_config (a dict keyed by layer index), ERNIE 4.5 MoE's moe_layer_end_index (one
layer's index) and RecurrentGemma's block_types (a pattern repeated to the depth) follow the layer map,
so the output reloads with the base's logits and the planned kinds. (Tensors outside the layers with a
slice per layer, Gemma 4's per-layer embeddings: tests/test_layer_slices.py; a layer's parameters stored
outside it under names numbered by the layer, Inkling 2's: tests/test_layer_storage.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from otdus_cli.arch.derived import layer_kinds
from otdus_cli.expand import expand
from otdus_cli.options import ExpandOptions
from tests.support.cli_checks import no_output_left, one_error_line
from tests.support.tiny_models import COMMON, HYBRID_BASE, load_causal_lm, logits, save_perturbed

pytestmark = pytest.mark.usefixtures("single_thread")

# tiny sizes with small expert counts (scripts/tiny_configs.py's TINY and TINY_MOE: tests may not import it)
TINY = {
    **COMMON,
    **HYBRID_BASE,
    **dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    **dict(shared_expert_intermediate_size=16, n_routed_experts=4, n_group=1, topk_group=1),
}


def _expand_cli(src: Path, out: Path, *args: str):
    from typer.testing import CliRunner

    from otdus_cli.cli import app

    return CliRunner().invoke(app, ["expand", str(src), "--out", str(out), *args])


def _kinds_of(model) -> list[str]:
    depth = model.config.get_text_config().num_hidden_layers
    (layers,) = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == depth]
    return layer_kinds(list(layers))


@pytest.mark.parametrize(
    ("model_type", "fields", "changed"),
    [
        # no per-layer embeddings: the full-attention layer's head_dim sits in per_layer_config
        ("gemma4_text", {"hidden_size_per_layer_input": 0}, "per_layer_config"),
        # experts on layers moe_layer_start_index <= i <= moe_layer_end_index
        ("ernie4_5_moe", {}, "moe_layer_end_index"),
        # a pattern of kinds transformers repeats to the depth: written whole
        ("recurrent_gemma", {}, "block_types"),
    ],
)
def test_config_fields_naming_layers_follow_the_layer_map(tmp_path, model_type, fields, changed):
    src = tmp_path / "src"
    base = save_perturbed(model_type, {**TINY, **fields}, src, use_cache=False)
    result = expand(str(src), tmp_path / "out", ExpandOptions(method="llama-pro", layers=2))
    sources = [lay.source for lay in result.plan.layer_map]
    assert sources == [0, 1, 1, 2, 3, 3]
    before = json.loads((src / "config.json").read_text())
    after = json.loads((tmp_path / "out" / "config.json").read_text())
    if changed == "per_layer_config":  # each output layer has its source layer's entry
        assert before[changed] == {"3": {"head_dim": 512}}
        assert after[changed] == {"4": {"head_dim": 512}, "5": {"head_dim": 512}}
    elif changed == "block_types":  # 4 layers: recurrent, recurrent, attention, recurrent
        assert before[changed] == ["recurrent", "recurrent", "attention"]
        assert after[changed] == ["recurrent"] * 3 + ["attention"] + ["recurrent"] * 2
    else:  # the last MoE layer is the last copy of base layer 3
        assert (before[changed], after[changed]) == (3, 5)
        assert after["moe_layer_start_index"] == 1
    grown = load_causal_lm(tmp_path / "out")
    family = result.plan.source.family
    # a dict keyed by small numbers that are not layers (id2label: 2 labels) is kept as it is
    assert "id2label" not in family.per_layer_fields
    assert after.get("id2label") == before.get("id2label")
    assert _kinds_of(grown) == [family.layer_kind({}, i) for i in sources]
    assert torch.equal(logits(grown, use_cache=False), base)


def test_a_rewritten_config_transformers_rejects_is_named_so():
    """The refusal says it is the config otdus would write that fails, not the base's (here: the
    per-layer head_dim of a full-attention layer left on a sliding-attention one)."""
    from otdus_cli.arch.derived import config_layer_kinds
    from otdus_cli.errors import OtdusError

    bad = {**TINY, "model_type": "gemma4_text"}
    bad["per_layer_config"] = {"2": {"head_dim": 512}}
    bad["layer_types"] = ["sliding_attention"] * 3 + ["full_attention"]
    with pytest.raises(OtdusError, match="transformers cannot build the rewritten config"):
        config_layer_kinds(bad, rewritten=True)


def test_a_norm_named_module_holding_the_attention_is_named_by_its_parts():
    """DBRX keeps each layer's attention inside norm_attn_norm (a norm, the attention, a norm): the
    layer's kind names the attention, not only its FFN; plain norms stay out of the name."""
    from transformers import AutoConfig, AutoModelForCausalLM

    ffn = dict(hidden_size=32, ffn_hidden_size=48, moe_num_experts=4, moe_top_k=2)
    attn = dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0)
    config = AutoConfig.for_model("dbrx", d_model=32, n_heads=4, n_layers=4, attn_config=attn, ffn_config=ffn)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert set(layer_kinds(list(model.transformer.blocks))) == {"DbrxAttention+DbrxFFN"}


def test_a_refused_placement_names_placements_that_keep_the_kinds(tmp_path):
    """ERNIE 4.5 MoE with experts on every other layer (moe_layer_interval=2): two copies side by side
    cannot keep the alternation, so copy is refused, naming the placements that do keep it, each checked
    in transformers; each named one expands."""
    src = tmp_path / "src"
    fields = {**TINY, "moe_layer_interval": 2, "moe_layer_start_index": 0}
    save_perturbed("ernie4_5_moe", fields, src, use_cache=False)
    result = _expand_cli(src, tmp_path / "out", "--method", "copy", "--layers", "2")
    line = one_error_line(result, message="place the new layers elsewhere: --method stack --layers 4 or ")
    assert "--method solar --layers 2 keeps every layer's kind" in line and "--position top" not in line
    no_output_left(tmp_path)
    for method, layers in (("stack", 4), ("solar", 2)):
        expand(str(src), tmp_path / method, ExpandOptions(method=method, layers=layers))


def test_copies_are_placed_where_the_kinds_built_at_the_new_depth_fit():
    from otdus_cli.arch.kind_placements import copies_fitting

    # a b a b -> a b a a b b: copies of layers 2 and 3 after them (as far up as they fit)
    assert copies_fitting(list("abab"), list("abaabb"), 2) == [2, 3]
    assert copies_fitting(list("aabab"), list("aabaabb"), 2) == [3, 4]
    # an alternation built at the new depth: no copy next to its source fits
    assert copies_fitting(list("abab"), list("ababab"), 2) is None
    assert copies_fitting(list("ab"), list("abab"), 1) is None  # not the new depth
