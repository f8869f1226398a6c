"""The families added for architecture breadth (issue 17), each on a tiny model built by transformers.

For every family: a zero-init copy gives bit-identical logits and loads with transformers' own class,
copy-type methods move every byte, depth-dependent config fields follow the layer map, and methods
a family's layers cannot take are refused at plan time with one line.
"""

from __future__ import annotations

import json

import pytest
import torch

from otdus_cli.expand import expand
from otdus_cli.io.reader import CheckpointReader
from otdus_cli.options import ExpandOptions
from tests.support.cli_checks import one_error_line
from tests.support.expansion_checks import assert_layers_match_sources, base_reference, check_expansion
from tests.support.tiny_models import BREADTH_DENSE_TYPES, BREADTH_MOE_TYPES, load_causal_lm, logits

pytestmark = [pytest.mark.compat]

BREADTH_TYPES = BREADTH_DENSE_TYPES + BREADTH_MOE_TYPES


@pytest.mark.parametrize("model_type", BREADTH_TYPES)
def test_zero_init_copy_is_exact_and_loads(tiny_models, tmp_path, model_type, single_thread):
    manifest = check_expansion(tiny_models[model_type], tmp_path / "out", "copy", zero_init=True)
    assert manifest["function_preserving"]


@pytest.mark.parametrize("model_type", BREADTH_TYPES)
def test_interpose_copies_every_byte(tiny_models, tmp_path, model_type, single_thread):
    check_expansion(tiny_models[model_type], tmp_path / "out", "interpose")


def test_layer_templates_name_real_tensors(tiny_models):
    """Every role and zero-init target of a template names a tensor the real layer holds (a template
    with a wrong path would silently copy or zero nothing)."""
    from otdus_cli.arch.family_lookup import family_for

    for model_type in BREADTH_TYPES:
        folder = tiny_models[model_type]
        config = json.loads((folder / "config.json").read_text())
        family = family_for(config)
        suffixes = {
            n.split(".", 3)[3] for n in CheckpointReader(folder).names if n.startswith("model.layers.1.")
        }
        for role, path in family.roles.items():
            assert f"{path}.weight" in suffixes, (model_type, role)
        zeroed = [s for s in suffixes if family.is_zero_target(s)]
        assert any("o_proj" in s for s in zeroed) and any("down" in s or "c_proj" in s for s in zeroed), (
            model_type,
            zeroed,
        )


@pytest.mark.parametrize(
    ("model_type", "variant"),
    [
        ("glm4", "paper"),
        ("glm4", "structured"),
        ("granite", "paper"),
        ("starcoder2", "paper"),
        ("starcoder2", "structured"),
    ],
)
def test_ot_is_an_exact_identity(tiny_models, tmp_path, model_type, variant, single_thread):
    opts = ExpandOptions(method="ot", layers=2)
    opts.ot.variant = variant
    result = expand(str(tiny_models[model_type]), tmp_path / "out", opts)
    assert result.plan.function_preserving
    assert torch.equal(base_reference(tiny_models[model_type])[1], logits(load_causal_lm(tmp_path / "out")))
    assert_layers_match_sources(tiny_models[model_type], tmp_path / "out", result.manifest)


@pytest.mark.parametrize(
    ("model_type", "why"),
    [
        ("olmo2", "post-norm layers"),
        ("cohere2", "attention and MLP run in parallel"),
        ("gpt_oss", "fused experts with biases"),
        ("deepseek_v3", "multi-head latent attention"),
    ],
)
def test_ot_refused_where_the_layer_lacks_its_roles(tiny_models, tmp_path, model_type, why):
    from typer.testing import CliRunner

    from otdus_cli.cli import app

    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["expand", str(tiny_models[model_type]), "--out", str(out)])
    one_error_line(result, message=why)
    assert not out.exists()


def test_ot_and_lesa_build_an_ungated_mlp(tiny_models, tmp_path, single_thread):
    """StarCoder2's MLP is up (c_fc) and down (c_proj) alone: OT aligns its neurons as (c_fc row, c_proj
    column) pairs and LESA predicts c_fc without a gate; with zero-init off the new layers are computed
    (c_fc differs from both parents'), and the output loads with transformers' own class."""
    from otdus_cli.methods.lesa import LesaOptions

    src = tiny_models["starcoder2"]
    reader = CheckpointReader(src)
    for method in ("ot", "lesa"):
        out = tmp_path / method
        options = ExpandOptions(method=method, layers=1, zero_init=False, lesa=LesaOptions(epochs=2))
        result = expand(str(src), out, options)
        lay = next(lay for lay in result.plan.layer_map if lay.new)
        built = CheckpointReader(out).get(f"model.layers.{lay.index}.mlp.c_fc.weight")
        assert all(
            not torch.equal(built, reader.get(f"model.layers.{i}.mlp.c_fc.weight")) for i in lay.parents
        )
        assert logits(load_causal_lm(out)).isfinite().all()


def test_random_layers_of_a_layernorm_family_have_neutral_norms(tiny_models, tmp_path):
    """LayerNorm has a bias: a fresh layer's norm is weight 1, bias 0 (the bias is not a scale)."""
    result = expand(
        str(tiny_models["starcoder2"]), tmp_path / "out", ExpandOptions(method="random", layers=1)
    )
    new = next(lay["index"] for lay in result.manifest["layers"] if lay["new"])
    r = CheckpointReader(tmp_path / "out")
    for norm in ("input_layernorm", "post_attention_layernorm"):
        assert torch.equal(r.get(f"model.layers.{new}.{norm}.weight"), torch.ones(32)), norm
        assert not r.get(f"model.layers.{new}.{norm}.bias").any(), norm


def test_per_layer_and_threshold_fields_follow_the_layer_map(tiny_models, tmp_path):
    """SmolLM3's no_rope_layers is per layer; DeepSeek-V3's first_k_dense_replace counts the dense prefix."""
    src = json.loads((tiny_models["smollm3"] / "config.json").read_text())
    assert len(set(src["no_rope_layers"])) == 2  # the tiny model has RoPE and no-RoPE layers
    result = expand(str(tiny_models["smollm3"]), tmp_path / "a", ExpandOptions(method="interpose", layers=2))
    sources = [lay["source"] for lay in result.manifest["layers"]]
    written = json.loads((tmp_path / "a" / "config.json").read_text())
    assert written["no_rope_layers"] == [src["no_rope_layers"][i] for i in sources]

    options = ExpandOptions(method="interpose", after=[0])
    result = expand(str(tiny_models["deepseek_v3"]), tmp_path / "b", options)
    assert [lay["source"] for lay in result.manifest["layers"]] == [0, 0, 1, 2, 3]
    assert json.loads((tmp_path / "b" / "config.json").read_text())["first_k_dense_replace"] == 2


def test_multi_token_prediction_layers_stay_after_the_stack(tiny_models, tmp_path):
    """DeepSeek-V3 stores its MTP module as layer L (num_nextn_predict_layers=1): it is no decoder layer,
    so it is never copied into the stack and comes out byte for byte as layer L' of the new depth."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    src.mkdir()
    for path in tiny_models["deepseek_v3"].iterdir():
        (src / path.name).write_bytes(path.read_bytes())
    tensors = load_file(src / "model.safetensors")
    torch.manual_seed(1)
    mtp = {n.replace("model.layers.3.", "model.layers.4."): torch.randn_like(t) for n, t in tensors.items()}
    mtp = {n: t for n, t in mtp.items() if n.startswith("model.layers.4.")}
    mtp |= {f"model.layers.4.{n}.weight": torch.randn(32) for n in ("enorm", "hnorm", "shared_head.norm")}
    mtp["model.layers.4.eh_proj.weight"] = torch.randn(32, 64)
    save_file({**tensors, **mtp}, src / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())  # as DeepSeek-V3's own config.json says
    (src / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))

    result = expand(str(src), tmp_path / "out", ExpandOptions(method="copy", layers=2, zero_init=True))
    assert result.manifest["num_hidden_layers"] == 6
    assert not [n for n in result.manifest["new_parameters"] if "eh_proj" in n or "enorm" in n]
    out = CheckpointReader(tmp_path / "out")
    for name, tensor in mtp.items():
        moved = name.replace("model.layers.4.", "model.layers.6.")
        assert torch.equal(out.get(moved), tensor), name
    assert not [n for n in out.names if n.startswith(("model.layers.4.eh", "model.layers.7."))]
    assert torch.equal(
        base_reference(tiny_models["deepseek_v3"])[1], logits(load_causal_lm(tmp_path / "out"))
    )

    # a stack layer missing is named, though the MTP layer makes the count of stored layers right
    without_layer_2 = {n: t for n, t in tensors.items() if not n.startswith("model.layers.2.")}
    save_file({**without_layer_2, **mtp}, src / "model.safetensors")
    with pytest.raises(Exception, match="holds tensors for 3 \\(none for layer 2\\)"):
        expand(str(src), tmp_path / "out2", ExpandOptions(method="copy", layers=2))
    # a layer past the stack and its MTP layers is still refused
    save_file({**tensors, **mtp, "model.layers.5.enorm.weight": torch.ones(32)}, src / "model.safetensors")
    with pytest.raises(Exception, match="layer 5 but config says 4 layers"):
        expand(str(src), tmp_path / "out2", ExpandOptions(method="copy", layers=2))
