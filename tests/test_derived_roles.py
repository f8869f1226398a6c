"""OT-DUS and LESA on templates derived from transformers, where a layer kind's roles were matched by name
against an exact template's and proved on a tiny instance (arch/derived_roles.py); refused in one line
where they were not, per layer kind in a hybrid stack.

ERNIE 4.5, Seed-OSS and Gemma (llama-like layers under their own class names, Gemma's norms scaling by
1 + w; transformers 5 and 4.57.6 both ship them), VaultGemma and GLM (Gemma 2's and GLM-4's layers
without their output norms), HunYuan dense (Qwen3's roles, its q/k norms named query_layernorm and
key_layernorm), EXAONE 3 (llama's layers, which transformers 5 saves under other names:
transformer.h.N.attn.attention.q_proj ...), GLM-4.5 (glm4_moe: dense first layers with roles, MoE
layers without), Qwen3.5 (linear attention; a gated full attention whose q_proj holds twice the heads'
rows), GPT-2 (other names), Arcee and Nemotron (llama's layers with an ungated MLP: up and down
alone), OPT, BioGPT and XGLM (StarCoder2's layers under other names; MBart's, with a cross-attention,
refused), OLMo (llama's layers, norms without weight), HyperCLOVA X (llama's layers and a norm on each
sublayer's output outside them), NanoChat (norms without weight, an ungated MLP of fc1 and fc2) and
Apertus (Qwen3's layers under other norm names, an ungated MLP whose activation holds two scalars).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from otdus_cli.arch.derived_roles import _permutation_error, match_template, shape_error
from otdus_cli.arch.families import UNGATED_MLP
from otdus_cli.arch.family_lookup import family_for
from otdus_cli.errors import OtdusError
from otdus_cli.expand import expand
from otdus_cli.options import ExpandOptions
from otdus_cli.verify.compare import verify_expansion
from tests.support.cli_checks import one_error_line
from tests.support.tiny_models import COMMON, HYBRID_CONFIGS, load_causal_lm, logits, save_perturbed

pytestmark = pytest.mark.usefixtures("single_thread")

# the template whose roles the layers take, and the norms' offset: llama's roles under other class names;
# Gemma's norms scale by 1 + w (the proof finds the offset); VaultGemma's layers are Gemma 2's and GLM's
# are GLM-4's, each without the output norms; HunYuan's are Qwen3's with its q/k norms under other names
TEMPLATE = {
    "ernie4_5": ("llama", 0.0),
    "seed_oss": ("llama", 0.0),
    "gemma": ("llama", 1.0),
    "vaultgemma": ("gemma2", 1.0),
    "glm": ("glm4", 0.0),
    "hunyuan_v1_dense": ("qwen3", 0.0),
    "arcee": ("llama", 0.0),
    "nemotron": ("llama", 1.0),
    "olmo": ("llama", 0.0),
}
# llama's layers with an MLP of up and down alone (act(up x) into down): Arcee's RMSNorm, Nemotron's
# LayerNorm with a bias that scales by 1 + w
UNGATED = ("arcee", "nemotron")
# llama's layers whose norms hold no weight (OLMo's LayerNorm without parameters)
WEIGHTLESS = ("olmo",)
TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # inside the tiny vocabulary
LLAMA_LIKE = tuple(TEMPLATE)
# GLM-4.5 with two dense layers first (a pair OT can build from), then MoE layers
GLM4_MOE = {**HYBRID_CONFIGS["glm4_moe"], "num_hidden_layers": 5, "first_k_dense_replace": 2}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor]]:
    root = tmp_path_factory.mktemp("derived_roles")
    extra = {"hunyuan_v1_dense": {"head_dim": 8}}  # its config class leaves it None
    fields = {mt: dict(COMMON, **TOKEN_IDS, **extra.get(mt, {})) for mt in LLAMA_LIKE}
    fields["glm4_moe"] = GLM4_MOE
    return {mt: (root / mt, save_perturbed(mt, f, root / mt)) for mt, f in fields.items()}


def _random_ids_plan():
    """Token perplexity over random ids (the tiny models have no tokenizer)."""
    from otdus_cli.verify.metrics import EvalSet, Window

    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, 90, (n,), generator=gen).tolist() for n in (20, 20, 13)]
    return EvalSet("token", "random ids", [Window(w, w[1:], 0, 0) for w in ids], [0], [0], 20)


@pytest.mark.compat
@pytest.mark.parametrize("method", ["ot", "lesa"])
@pytest.mark.parametrize("model_type", LLAMA_LIKE)
def test_ot_and_lesa_on_a_derived_llama_like_template(models, tmp_path, model_type, method):
    src, base = models[model_type]
    result = expand(str(src), tmp_path / "out", ExpandOptions(method=method, layers=2))
    family = result.plan.source.family
    assert family.name == f"derived:{model_type}" and family.roles
    manifest = json.loads((tmp_path / "out" / "otdus.json").read_text())
    assert manifest["function_preserving"]
    proof = manifest["source"]["roles_proof"]
    template, offset = TEMPLATE[model_type]
    assert proof["template"] == template and "unmatched" not in proof
    assert proof["norm_offset"] == family.norm_offset == offset
    assert set(proof["kinds"]) == set(family.role_kinds) and len(proof["kinds"]) == 1
    assert family.has(UNGATED_MLP) == (model_type in UNGATED)
    (kind,) = proof["kinds"].values()
    weightless = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
    assert kind.get("weightless_norms") == (weightless if model_type in WEIGHTLESS else None)
    assert "extras" not in kind
    # the new layers are computed (not copies of a parent): their q projections differ from both parents'
    new = [lay for lay in result.plan.layer_map if lay.new]
    assert all(lay.builder == method for lay in new)
    from otdus_cli.io.reader import CheckpointReader

    out, base_reader = CheckpointReader(tmp_path / "out"), CheckpointReader(src)
    prefix = family.layer_prefix
    q = family.roles["q"] + ".weight"
    built = out.get(prefix.format(i=new[0].index) + q)
    assert not any(torch.equal(built, base_reader.get(prefix.format(i=i) + q)) for i in new[0].parents)
    assert torch.equal(logits(load_causal_lm(tmp_path / "out")), base)
    report = verify_expansion(src, tmp_path / "out", _random_ids_plan())
    assert report.verdict.startswith("PARITY") and report.logits_equal, report.verdict


def test_roles_under_the_names_transformers_saves_them(tmp_path):
    """EXAONE 3: transformers 5 builds llama's modules but saves them as transformer.h.N.attn.attention...;
    the roles are read under the saved names, and OT's activation pre-pass hooks the modules by their
    names in the class (the bundled stories260K tokenizer gives it calibration text)."""
    from otdus_cli.arch.families import LLAMA_ROLES
    from otdus_cli.bundled import STORIES260K
    from otdus_cli.methods.ot.options import OTOptions

    src = tmp_path / "exaone"
    base = save_perturbed("exaone", {**COMMON, "vocab_size": 512, "max_position_embeddings": 256}, src)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        (src / name).write_bytes((STORIES260K / name).read_bytes())
    options = ExpandOptions(method="ot", layers=1, ot=OTOptions(variant="activation", calib_tokens=2048))
    result = expand(str(src), tmp_path / "out", options)
    family = result.plan.source.family
    assert family.roles["q"] == "attn.attention.q_proj" and family.role_modules == LLAMA_ROLES
    assert result.manifest["source"]["roles_proof"]["modules"] == LLAMA_ROLES
    assert torch.equal(logits(load_causal_lm(tmp_path / "out")), base)


def test_ot_between_the_kinds_with_roles_of_a_hybrid_stack(models, tmp_path):
    """GLM-4.5: its dense layers have llama's roles; OT between them keeps the logits bit for bit, while a
    pair of MoE layers is refused in one line naming the pairs that would work; LESA, which learns from
    every layer, is refused."""
    src, base = models["glm4_moe"]
    result = expand(str(src), tmp_path / "out", ExpandOptions(method="ot", after=[0]))
    proof = result.manifest["source"]["roles_proof"]
    assert list(proof["kinds"]) == ["Glm4MoeAttention+Glm4MoeMLP"]
    assert "expert layout" in proof["unmatched"]["Glm4MoeAttention+Glm4MoeMoE"]
    assert torch.equal(logits(load_causal_lm(tmp_path / "out")), base)
    with pytest.raises(OtdusError, match=r"--after with any of 0\)") as refused:
        expand(str(src), tmp_path / "moe", ExpandOptions(method="ot", after=[2]))
    assert "Glm4MoeAttention+Glm4MoeMoE layers have no roles" in str(refused.value)
    with pytest.raises(OtdusError, match=r"base layers 2-4 of derived:glm4_moe .* have no roles"):
        expand(str(src), tmp_path / "lesa", ExpandOptions(method="lesa", after=[0]))
    assert not (tmp_path / "moe").exists() and not (tmp_path / "lesa").exists()


@pytest.mark.parametrize(
    ("model_type", "why"),
    [
        # full attention matches qwen3's names, but its q_proj also holds the output gate's rows
        ("qwen3_5_text", r"self_attn\.q_proj\.weight has shape \[64, 32\], not the \[32, 32\]"),
        ("gpt2", r"its tensors are no exact template's roles"),
    ],
)
def test_ot_is_refused_in_one_line_where_no_kind_has_roles(tmp_path, model_type, why):
    from typer.testing import CliRunner

    from otdus_cli.cli import app

    save_perturbed(model_type, HYBRID_CONFIGS[model_type], tmp_path / "src")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["expand", str(tmp_path / "src"), "--out", str(out), "--method", "ot"])
    line = one_error_line(result, message="no kind of its layers has an exact template's roles")
    assert "use copy, interpose, llama-pro, solar or stack" in line
    import re

    assert re.search(why, " ".join(result.output.split())), result.output
    assert not out.exists()


def test_the_permutation_proof_catches_a_wrong_head_split():
    """The proof has teeth: with the heads split at half their size (8 heads of 4 dims instead of 4 of
    8, as a config that misstates head_dim would read them) permuting them changes a llama layer's output
    (rotary embeddings pair dimensions within a head); with the true split it does not."""
    from otdus_cli.arch.families import FAMILIES
    from otdus_cli.arch.tiny import tiny_instance

    config = {**COMMON, "model_type": "llama", "head_dim": 8}
    model, _, _ = tiny_instance(config)
    layer = model.model.layers[1]
    llama = next(f for f in FAMILIES if f.name == "llama")
    ids = torch.randint(0, 90, (1, 8), generator=torch.Generator().manual_seed(0))
    assert _permutation_error(model, layer, llama, config, ids) is None
    wrong = {**config, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 4}
    assert "changes the layer's output" in _permutation_error(model, layer, llama, wrong, ids)


def test_names_and_shapes_decide_the_match():
    """Every tensor must be a role's (a per-layer extra is not); every role must be there (but the output
    norms and the MLP's gate); shapes are the config's as the methods read it."""
    from otdus_cli.arch.families import LLAMA_ROLES

    layer = {f"{p}.weight": [4] for p in LLAMA_ROLES.values()}
    assert match_template(layer)[0].name == "llama"
    assert match_template({**layer, "self_attn.sinks": [4]})[0] is None
    # without its gate, an ungated MLP (up and down alone); without up or down, no match
    ungated = match_template({k: v for k, v in layer.items() if "gate" not in k})[0]
    assert ungated.name == "llama" and "gate" not in ungated.roles and ungated.has(UNGATED_MLP)
    assert match_template({k: v for k, v in layer.items() if "up_proj" not in k})[0] is None
    # a tensor outside the attention and the MLP (a sublayer of its own) is an extra; inside, it is not;
    # of the templates that match, the one with the fewest extras (Gemma 2's layer is not llama's + 2)
    assert match_template({**layer, "per_layer_projection.weight": [4]})[0].name == "llama"
    assert match_template({**layer, "mlp.act_fn.alpha": [4]})[0] is None
    assert match_template({**layer, "mlp.act_fn.alpha": [1]})[0].name == "llama"  # one element: no unit's
    gemma2 = {f"{p}.weight": [4] for p in family_for({"model_type": "gemma2"}).roles.values()}
    assert match_template(gemma2)[0].name == "gemma2"
    fam = family_for({**COMMON, "model_type": "llama"})
    shapes = {
        "self_attn.q_proj.weight": [32, 32],
        "self_attn.k_proj.weight": [16, 32],
        "self_attn.v_proj.weight": [16, 32],
        "self_attn.o_proj.weight": [32, 32],
        "mlp.gate_proj.weight": [48, 32],
        "mlp.up_proj.weight": [48, 32],
        "mlp.down_proj.weight": [32, 48],
        "input_layernorm.weight": [32],
        "post_attention_layernorm.weight": [32],
    }
    assert shape_error(fam, shapes, COMMON) is None
    assert "self_attn.k_proj.weight has shape [16, 32]" in shape_error(
        fam, shapes, {**COMMON, "num_key_value_heads": 4}
    )


def test_tensors_outside_attention_and_mlp_are_averaged_extras(tmp_path):
    """HyperCLOVA X (transformers 5): llama's layer plus a norm on each sublayer's output (post_norm1,
    post_norm2) outside its attention and MLP; they are its extras, which OT and LESA average, and the
    proof on the tiny instance still decides its roles."""
    src = tmp_path / "hyperclovax"
    base = save_perturbed("hyperclovax", {**COMMON, **TOKEN_IDS}, src)
    for method in ("ot", "lesa"):
        result = expand(str(src), tmp_path / method, ExpandOptions(method=method, layers=2))
        proof = result.manifest["source"]["roles_proof"]
        assert proof["template"] == "llama" and "unmatched" not in proof
        (kind,) = proof["kinds"].values()
        assert kind["extras"] == ["post_norm1.weight", "post_norm2.weight"]
        assert torch.equal(logits(load_causal_lm(tmp_path / method)), base)
    # computed, not copied: the new layers' post_norm1 is the average of their parents'
    from otdus_cli.io.reader import CheckpointReader

    new = next(lay for lay in result.plan.layer_map if lay.new)
    norm = "model.layers.{}.post_norm1.weight"
    r, a = CheckpointReader(tmp_path / "lesa"), CheckpointReader(src)
    want = (a.get(norm.format(new.parents[0])) + a.get(norm.format(new.parents[1]))) * 0.5
    assert torch.equal(r.get(norm.format(new.index)), want)


# transformers 5's alone: (template, roles under other names, roles left out, extras)
ROLES_UNDER_OTHER_NAMES = {
    # NanoChat: StarCoder2's layers (llama's attention, an MLP of up and down alone), its MLP's named fc1
    # and fc2, norms without weight
    "nanochat": ("starcoder2", {"up": "mlp.fc1", "down": "mlp.fc2"}, {"gate", "attn_norm", "mlp_norm"}, None),
    # Apertus: Qwen3's layers, its norms under other names, an MLP of up and down alone whose activation
    # (xIELU) holds two scalars
    "apertus": (
        "qwen3",
        {"attn_norm": "attention_layernorm", "mlp_norm": "feedforward_layernorm"},
        {"gate"},
        ["mlp.act_fn.alpha_p", "mlp.act_fn.alpha_n"],
    ),
}


@pytest.mark.parametrize("model_type", ROLES_UNDER_OTHER_NAMES)
def test_roles_under_other_names_with_an_ungated_mlp(tmp_path, model_type):
    """OT (zero-init, and computed without it) and LESA build them; the outputs load, zero-init's with the
    base's logits."""
    template, renamed, left_out, extras = ROLES_UNDER_OTHER_NAMES[model_type]
    src = tmp_path / model_type
    base = save_perturbed(model_type, {**COMMON, **TOKEN_IDS}, src)
    for method, zero_init in (("ot", True), ("ot", False), ("lesa", True)):
        out = tmp_path / f"{method}-{zero_init}"
        result = expand(str(src), out, ExpandOptions(method=method, layers=2, zero_init=zero_init))
        family = result.plan.source.family
        proof = result.manifest["source"]["roles_proof"]
        assert proof["template"] == template and renamed.items() <= family.roles.items()
        assert not left_out & set(family.roles) and family.has(UNGATED_MLP)
        (kind,) = proof["kinds"].values()
        assert kind.get("extras") == extras
        got = logits(load_causal_lm(out))
        assert torch.equal(got, base) if zero_init else got.isfinite().all() and not torch.equal(got, base)


# OPT's, BioGPT's and XGLM's decoder layers are StarCoder2's (an MLP of fc1 and fc2 alone, biases,
# LayerNorms) under other names (out_proj, self_attn_layer_norm, final_layer_norm); their configs name no
# KV heads, and XGLM's saves its heads and width as attention_heads and d_model
DECODERS = {"opt": {"ffn_dim": 48, "word_embed_proj_dim": 32}, "biogpt": {}, "xglm": {"ffn_dim": 48}}


@pytest.mark.compat
@pytest.mark.parametrize("model_type", DECODERS)
def test_decoder_layers_under_other_names(tmp_path, model_type):
    fields = {k: v for k, v in COMMON.items() if k != "num_key_value_heads"}
    fields |= TOKEN_IDS | DECODERS[model_type]
    src = tmp_path / model_type
    base = save_perturbed(model_type, fields, src)
    for method, zero_init in (("ot", True), ("ot", False), ("lesa", True)):
        out = tmp_path / f"{method}-{zero_init}"
        result = expand(str(src), out, ExpandOptions(method=method, layers=2, zero_init=zero_init))
        family = result.plan.source.family
        assert result.manifest["source"]["roles_proof"]["template"] == "starcoder2"
        assert (family.roles["o"], family.roles["mlp_norm"], family.roles["up"]) == (
            "self_attn.out_proj",
            "final_layer_norm",
            "fc1",
        )
        got = logits(load_causal_lm(out))
        assert torch.equal(got, base) if zero_init else got.isfinite().all() and not torch.equal(got, base)


def test_a_second_attention_is_named_in_the_refusal(tmp_path):
    """MBart's decoder layer: OPT's layer plus a cross-attention (encoder_attn), whose heads would need
    roles of their own: refused in one line that says so."""
    from typer.testing import CliRunner

    from otdus_cli.cli import app

    sizes = dict(
        d_model=32, decoder_layers=4, decoder_attention_heads=4, decoder_ffn_dim=48, encoder_layers=1
    )
    fields = {**sizes, "vocab_size": 96, "max_position_embeddings": 64, **TOKEN_IDS}
    save_perturbed("mbart", fields, tmp_path / "src", use_cache=False)  # its cache wants encoder states
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["expand", str(tmp_path / "src"), "--out", str(out), "--method", "ot"])
    one_error_line(result, message="it holds a second attention (encoder_attn: an encoder-decoder's cross")
    assert not out.exists()


def test_plan_says_whose_roles_and_refuses_a_pair_without(models, tmp_path):
    from typer.testing import CliRunner

    from otdus_cli.cli import app

    src = str(models["glm4_moe"][0])
    text = CliRunner().invoke(app, ["plan", src, "--method", "ot", "--after", "0"])
    assert text.exit_code == 0, text.output
    assert (
        "roles: llama's, matched by name and proved on a tiny instance for the Glm4MoeAttention+Glm4MoeMLP"
        in (" ".join(text.output.split()))
    )
    as_json = CliRunner().invoke(app, ["plan", src, "--method", "ot", "--after", "0", "--json"])
    assert json.loads(as_json.stdout)["roles_proof"]["kinds"] == {"Glm4MoeAttention+Glm4MoeMLP": {"layer": 0}}
    refused = CliRunner().invoke(app, ["plan", src, "--method", "ot", "--after", "3"])
    one_error_line(refused, message="place it between layers with roles (--after with any of 0)")
