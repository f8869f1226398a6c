"""Function-preserving growth of architectures without an exact template, hybrid stacks included.

Tiny models built here by the installed transformers: Qwen3.5 (dense and MoE: linear and full attention
layers), Qwen3-Next (its MoE and dense MLP layers too), GLM-4.5 (glm4_moe: dense first layers, then
MoE), Nemotron-H (Mamba, attention and MLP blocks; its depth is the length of layers_block_type),
Falcon-H1 (attention and Mamba side by side), GPT-2 and Bloom (depth as n_layer). LLaMA PRO's zero-init
keeps the logits bit for bit, with the zeroed tensors proved on a tiny instance (arch/identity.py) and
recorded in the manifest; the reloaded model's layer kinds are the plan's; verify says PARITY; OT is
refused in one line where no layer kind has roles (tests/test_derived_roles.py: where some do).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from otdus_cli.arch.derived import layer_kinds
from otdus_cli.errors import OtdusError
from otdus_cli.expand import expand
from otdus_cli.options import ExpandOptions
from otdus_cli.verify.compare import verify_expansion
from tests.support.cli_checks import one_error_line
from tests.support.eval_sets import random_eval_set
from tests.support.tiny_models import HYBRID_BASE as _BASE
from tests.support.tiny_models import HYBRID_CONFIGS as CONFIGS
from tests.support.tiny_models import HYBRID_LAYER_TYPES as _TYPES
from tests.support.tiny_models import build_tiny, load_causal_lm, logits, save_perturbed

pytestmark = pytest.mark.usefixtures("single_thread")


def _kinds_of(model) -> list[str]:
    """The kinds of the reloaded model's decoder layers (its one module list of that depth)."""
    depth = model.config.get_text_config().num_hidden_layers
    (layers,) = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == depth]
    return layer_kinds(list(layers))


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor]]:
    root = tmp_path_factory.mktemp("hybrid")
    return {mt: (root / mt, save_perturbed(mt, CONFIGS[mt], root / mt)) for mt in CONFIGS}


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_llama_pro_keeps_the_logits_and_the_layer_kinds(hybrids, tmp_path, model_type):
    src, base = hybrids[model_type]
    # bottom: the new layers copy the first layers (GLM-4.5's dense one; Qwen3.5's linear attention)
    result = expand(
        str(src), tmp_path / "out", ExpandOptions(method="llama-pro", layers=2, position="bottom")
    )
    manifest = json.loads((tmp_path / "out" / "otdus.json").read_text())
    assert manifest["function_preserving"]
    proof = manifest["source"]["zero_init_proof"]
    family = result.plan.source.family
    base_kinds = [
        family.layer_kind(result.plan.source.text_config, i) for i in range(result.plan.source.depth)
    ]
    assert set(proof["kinds"]) == set(base_kinds)
    assert all(entry["zeroed"] for entry in proof["kinds"].values())
    grown = load_causal_lm(tmp_path / "out")
    assert torch.equal(logits(grown), base)
    planned = [base_kinds[lay.source] for lay in result.plan.layer_map]
    assert _kinds_of(grown) == planned
    assert grown.config.get_text_config().num_hidden_layers == len(planned) == result.plan.source.depth + 2
    ids = random_eval_set(vocab=90, seed=1, lengths=(20, 20, 13), low=3)  # the tiny models have no tokenizer
    report = verify_expansion(src, tmp_path / "out", ids)
    assert report.verdict.startswith("PARITY") and report.logits_equal, report.verdict


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "gpt2"])
def test_ot_is_refused_in_one_line(hybrids, tmp_path, model_type):
    from typer.testing import CliRunner

    from otdus_cli.cli import app

    out = tmp_path / "out"
    args = ["expand", str(hybrids[model_type][0]), "--out", str(out), "--method", "ot"]
    result = CliRunner().invoke(app, args)
    line = one_error_line(result, message="no kind of its layers has an exact template's roles")
    assert line.endswith("use copy, interpose, llama-pro, solar or stack")
    assert not out.exists()


def test_the_residual_writers_are_zeroed_not_what_feeds_them(hybrids, tmp_path):
    """Qwen3.5's gated delta net: its gate (in_proj_z) zeroed would also give an identity; the output
    projection is the one that writes into the residual stream."""
    result = expand(
        str(hybrids["qwen3_5_text"][0]), tmp_path / "out", ExpandOptions(method="llama-pro", layers=2)
    )
    kinds = result.manifest["source"]["zero_init_proof"]["kinds"]
    zeroed = sorted(name for entry in kinds.values() for name in entry["zeroed"])
    assert zeroed == sorted(
        [
            "linear_attn.out_proj.weight",
            "mlp.down_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.down_proj.weight",
        ]
    )


def test_per_layer_kind_fields_are_rewritten(hybrids, tmp_path):
    """Each field transformers reads the layer kinds from follows the layer map: Nemotron-H's
    layers_block_type (its depth), Qwen3-Next's layer_types and mlp_only_layers, GLM-4.5's
    first_k_dense_replace, GPT-2's n_layer."""

    def grown(model_type: str, **options) -> dict:
        out = tmp_path / model_type
        expand(str(hybrids[model_type][0]), out, ExpandOptions(method="copy", **options))
        return json.loads((out / "config.json").read_text())

    nemotron = grown("nemotron_h", after=[0, 3])
    kinds = json.loads((hybrids["nemotron_h"][0] / "config.json").read_text())["layers_block_type"]
    assert nemotron["layers_block_type"] == [kinds[i] for i in (0, 0, 1, 2, 3, 3)]
    assert "num_hidden_layers" not in nemotron
    qwen = grown("qwen3_next", after=[0, 1])
    assert qwen["layer_types"] == [_TYPES[i] for i in (0, 0, 1, 1, 2, 3)]
    assert qwen["mlp_only_layers"] == [0, 1]
    assert grown("glm4_moe", after=[0])["first_k_dense_replace"] == 2
    assert grown("gpt2", layers=2)["n_layer"] == 6


def test_depth_fields_are_read_from_the_config_class():
    from otdus_cli.arch.depth import depth_field, implied_depth_field, stated_depth

    assert depth_field({"model_type": "gpt2", "n_layer": 3}) == "n_layer"
    assert depth_field({"model_type": "bloom", "n_layer": 3}) == "n_layer"
    assert depth_field({"model_type": "llama", "num_hidden_layers": 3}) == "num_hidden_layers"
    # BART's attribute_map says encoder_layers; its causal LM (the decoder) is built from decoder_layers
    assert depth_field({"model_type": "bart", "encoder_layers": 2, "decoder_layers": 3}) == "decoder_layers"
    nemotron = {"model_type": "nemotron_h", "layers_block_type": ["mamba", "attention", "mlp"]}
    assert depth_field(nemotron) is None and implied_depth_field(nemotron) == "layers_block_type"
    assert stated_depth(nemotron) == 3


def test_a_pair_of_different_kinds_is_refused_at_plan_time_naming_the_alternatives(tmp_path):
    """DeepSeek-V3 (dense layer 0, MoE after): averaging layers 0 and 1 would mix kinds; the refusal
    says where a pair method may go, and `otdus plan` names the gap for copy methods."""
    from typer.testing import CliRunner

    from otdus_cli.cli import app

    src = build_tiny("deepseek_v3", tmp_path / "ds")
    runner = CliRunner()
    refused = runner.invoke(app, ["plan", str(src), "--method", "average", "--after", "0"])
    line = one_error_line(refused, message="of different kinds in deepseek_v3 (dense, sparse)")
    assert "--after with any of 1-2" in line and "copy, llama-pro" in line
    shown = runner.invoke(app, ["plan", str(src), "--method", "copy", "--layers", "1", "--json"])
    plan = json.loads(shown.stdout)
    assert plan["mixed_kind_gaps"] == [0]
    assert plan["layer_kinds"] == ["dense", "sparse", "sparse", "sparse", "sparse"]


def test_zero_init_is_proved_for_the_plan_not_only_for_the_new_layers(tmp_path):
    """DiffLLaMA's attention depends on its layer's index: a zeroed new layer is an identity, but a base
    layer moved to another index computes otherwise, so zero-init is refused for a placement before the
    last layer (it did write an output with other logits, called function-preserving), and kept after it."""
    fields = {k: v for k, v in _BASE.items() if "token_id" not in k}
    save_perturbed("diffllama", {**fields, "num_hidden_layers": 4}, tmp_path / "src")
    with pytest.raises(OtdusError, match=r"hands on\); new layers after the last one \(--after 3\)"):
        expand(str(tmp_path / "src"), tmp_path / "out", ExpandOptions(method="llama-pro", layers=2))
    assert not (tmp_path / "out").exists()
    expand(str(tmp_path / "src"), tmp_path / "last", ExpandOptions(method="llama-pro", after=[3, 3]))
    assert torch.equal(logits(load_causal_lm(tmp_path / "last")), logits(load_causal_lm(tmp_path / "src")))


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_shrink_drops_a_layer_and_the_layer_kinds_follow(hybrids, tmp_path, model_type):
    """`otdus shrink --method drop` on every hybrid stack: the per-layer kind fields lose the removed
    layer, transformers builds the layers the kept ones were, and a merge is written only where the
    stack has an exact template and the merged layers are of one kind (else one refusal)."""
    from otdus_cli.shrink import ShrinkOptions, shrink

    source = hybrids[model_type][0]
    kinds = _kinds_of(load_causal_lm(source))
    shrink(str(source), tmp_path / "drop", ShrinkOptions(method="drop", remove=[1]))
    assert _kinds_of(load_causal_lm(tmp_path / "drop")) == [kinds[i] for i in (0, 2, 3)]
    try:
        shrink(str(source), tmp_path / "avg", ShrinkOptions(method="average", remove=[1]))
    except OtdusError as exc:  # layers 0 and 1 are merged: refused when it cannot be done exactly
        assert "no exact template" in str(exc) or "of different kinds" in str(exc), exc
        assert kinds[0] != kinds[1] or "no exact template" in str(exc)
        assert not (tmp_path / "avg").exists()
    else:
        assert kinds[0] == kinds[1]
        assert _kinds_of(load_causal_lm(tmp_path / "avg")) == [kinds[i] for i in (0, 2, 3)]


def test_shrink_renumbers_the_layer_index_lists(hybrids, tmp_path):
    """Qwen3-Next lists its dense-MLP layers by index (mlp_only_layers [0]): dropping layer 0 leaves
    none, and the reloaded layers are the kept ones' kinds (the index list was once left as it was)."""
    from otdus_cli.shrink import ShrinkOptions, shrink

    source = hybrids["qwen3_next"][0]
    kinds = _kinds_of(load_causal_lm(source))
    shrink(str(source), tmp_path / "drop", ShrinkOptions(method="drop", remove=[0]))
    config = json.loads((tmp_path / "drop" / "config.json").read_text())
    assert config["mlp_only_layers"] == [] and config["num_hidden_layers"] == 3
    assert _kinds_of(load_causal_lm(tmp_path / "drop")) == kinds[1:]
