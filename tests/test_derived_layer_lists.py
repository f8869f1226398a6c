"""Where a derived template finds transformers' class and its decoder layers (arch/causal_lm.py,
arch/derived.py: layer_lists), beyond the causal-LM mapping's model_types and one plain list.

Tiny models built here by the installed transformers: Emu3's text model (model_type emu3_text_model,
which the mapping names only by its composite, emu3) expands function-preserving and verify says
PARITY; LongCat-Flash's layers hold module lists of their own (two attentions, two MLPs, their norms),
so its layer list is the outermost list of its depth; xLSTM states its depth twice (num_hidden_layers,
num_blocks), and both follow the new depth. Where no single list of the depth exists, the refusal names
what the model holds: XLM's parallel lists, Dory's depth its config class halves on loading, HRM's two
stacks.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from otdus_cli.arch.derived import layer_kinds
from otdus_cli.arch.family_lookup import family_for
from otdus_cli.errors import OtdusError
from otdus_cli.expand import expand
from otdus_cli.io.reader import CheckpointReader
from otdus_cli.options import ExpandOptions
from otdus_cli.verify.compare import verify_expansion
from tests.support.eval_sets import random_eval_set
from tests.support.tiny_models import COMMON, load_causal_lm, logits

pytestmark = pytest.mark.usefixtures("single_thread")

# LongCat-Flash: MLA attention, a MoE with zero-computation experts beside two dense MLPs per layer
LONGCAT = dict(
    vocab_size=96,
    hidden_size=32,
    ffn_hidden_size=48,
    expert_ffn_hidden_size=16,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=4,
    moe_topk=2,
    zero_expert_num=2,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    head_dim=8,  # the rotary part's width (qk_rope_head_dim)
    max_position_embeddings=64,
)
# Emu3's text model: token ids within the tiny vocabulary
EMU3 = {**COMMON, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _save(model_class: str, config_type: str, fields: dict, folder: Path) -> torch.Tensor:
    """A tiny random model of transformers' ``model_class`` saved to ``folder``, its vectors perturbed so
    an identity is not luck; its logits."""
    import transformers

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = getattr(transformers, config_type)(**fields)
        model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1 and p.is_floating_point():
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return logits(model, use_cache=False)


def _reload_emu3(folder: Path):
    """transformers' AutoModelForCausalLM cannot read the config Emu3ForCausalLM saves (emu3_text_model,
    for the base as for the output): the class its ``architectures`` names reads it."""
    from transformers import Emu3ForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Emu3ForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def _kinds_of(model, depth: int) -> list[str]:
    (layers,) = [m for m in model.model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == depth]
    return layer_kinds(list(layers))


def test_a_composite_models_text_model_is_derived_and_grows_function_preserving(tmp_path):
    src = tmp_path / "emu3"
    base = _save("Emu3ForCausalLM", "Emu3TextConfig", EMU3, src)
    assert json.loads((src / "config.json").read_text())["model_type"] == "emu3_text_model"
    copied = expand(str(src), tmp_path / "copy", ExpandOptions(method="copy", layers=2))
    assert copied.manifest["source"]["family"] == "derived:emu3_text_model"
    assert _reload_emu3(tmp_path / "copy").config.num_hidden_layers == 6
    a, b = CheckpointReader(src), CheckpointReader(tmp_path / "copy")
    for j, lay in enumerate(copied.manifest["layers"]):
        prefix, source = f"model.layers.{j}.", f"model.layers.{lay['source']}."
        for name in (n for n in a.names if n.startswith(source)):
            grown = b.get(prefix + name[len(source) :])
            assert torch.equal(a.get(name).view(torch.uint8), grown.view(torch.uint8))

    expand(str(src), tmp_path / "pro", ExpandOptions(method="llama-pro", layers=2))  # zero-init copies
    assert torch.equal(logits(_reload_emu3(tmp_path / "pro"), use_cache=False), base)
    report = verify_expansion(src, tmp_path / "pro", random_eval_set(vocab=90, seed=1, low=3))
    assert report.verdict.startswith("PARITY") and report.logits_equal, report.verdict


def test_lists_inside_a_layer_are_its_parts_not_the_layer_list(tmp_path):
    src = tmp_path / "longcat"
    _save("LongcatFlashForCausalLM", "LongcatFlashConfig", LONGCAT, src)
    result = expand(str(src), tmp_path / "out", ExpandOptions(method="copy", after=[0, 1]))
    family = result.plan.source.family
    assert family.layer_prefix == "model.layers.{i}."
    kind = "LongcatFlashMoE+LongcatFlashMLA+LongcatFlashMLA+LongcatFlashMLP+LongcatFlashMLP"
    assert [family.layer_kind({}, i) for i in range(2)] == [kind, kind]
    grown = load_causal_lm(tmp_path / "out")
    assert grown.config.num_layers == 4 and _kinds_of(grown, 4) == [kind] * 4
    a, b = CheckpointReader(src), CheckpointReader(tmp_path / "out")
    for j, i in enumerate([0, 0, 1, 1]):
        for name in (n for n in a.names if n.startswith(f"model.layers.{i}.")):
            copy = b.get(f"model.layers.{j}." + name.split(".", 3)[3])
            assert torch.equal(a.get(name).view(torch.uint8), copy.view(torch.uint8))
    logits(grown, use_cache=False)


def _refusal(config_type: str, fields: dict) -> str:
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = getattr(transformers, config_type)(**fields).to_dict()
    with pytest.raises(OtdusError) as caught:
        family_for(config)
    return str(caught.value)


def test_parallel_per_layer_lists_are_named_in_the_refusal():
    why = _refusal("XLMConfig", dict(vocab_size=96, emb_dim=32, n_layers=3, n_heads=4, is_decoder=True))
    assert "finds 4 lists side by side in transformer (attentions, layer_norm1, ffns, layer_norm2)" in why
    assert "layer i is the i-th entry of each" in why


def test_a_depth_the_config_class_rewrites_on_loading_is_named_in_the_refusal():
    """Dory's config.json counts attention and MLP blocks apart (num_hidden_layers twice the layers);
    its config class halves it on loading."""
    why = _refusal("DoryConfig", {**COMMON, "n_input_layers": 1, "n_output_layers": 1})
    assert "finds none: its module lists are model.layers (4)" in why
    assert "DoryConfig reads the 8 layers config.json states as 4" in why


def test_the_module_lists_found_are_named_where_none_has_the_depth():
    """HRM's num_hidden_layers counts layer calls (two stacks run in cycles), not layers."""
    why = _refusal("HrmTextConfig", {**COMMON, "num_hidden_layers": 2})
    assert "its module lists are model.L_module.layers (2), model.H_module.layers (2)" in why


def test_the_depth_under_a_second_name_follows_the_new_depth(tmp_path):
    """xLSTM states its depth twice (num_hidden_layers; num_blocks, the length of its block list, which
    its config class sets from num_hidden_layers when absent): both are rewritten, and zero-init keeps the
    logits bit for bit."""
    src = tmp_path / "xlstm"
    fields = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_heads=4, pad_token_id=0)
    base = _save("xLSTMForCausalLM", "xLSTMConfig", fields, src)
    assert json.loads((src / "config.json").read_text())["num_blocks"] == 4
    expand(str(src), tmp_path / "out", ExpandOptions(method="llama-pro", layers=2))
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["num_blocks"] == written["num_hidden_layers"] == 6
    grown = load_causal_lm(tmp_path / "out")
    assert len(grown.backbone.blocks) == 6
    assert torch.equal(logits(grown, use_cache=False), base)
