"""Tensors outside the layers with a slice per layer: Gemma 4 and Gemma 3n per-layer inputs.

Tiny models built by the installed transformers: each output layer's slice of embed_tokens_per_layer and
per_layer_model_projection is its source layer's (the new layers' their parent's), the output reloads,
and a zero-init expansion gives the base's logits bit for bit, trained layer scales (Gemma 4's
layer_scalar buffer, away from 1) included. Key-value sharing (the last num_kv_shared_layers layers reuse
earlier layers' keys and values) follows the layer map or is refused in one line.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from otdus_cli.expand import expand
from otdus_cli.options import ExpandOptions
from tests.support.cli_checks import no_output_left, one_error_line
from tests.support.tiny_models import COMMON, HYBRID_BASE, load_causal_lm, logits

pytestmark = pytest.mark.usefixtures("single_thread")

# per-layer token embeddings of width 8 per layer (Gemma 3n, Gemma 4), no key-value sharing
TINY = {
    **COMMON,
    **HYBRID_BASE,
    "vocab_size_per_layer_input": 96,
    "hidden_size_per_layer_input": 8,
    "num_kv_shared_layers": 0,
}
WIDTH = 8
SLICED = {"model.embed_tokens_per_layer.weight": 1, "model.per_layer_model_projection.weight": 0}
ALTERNATING = ["sliding_attention", "full_attention"] * 2


def _save(model_type: str, folder: Path, **fields) -> torch.Tensor:
    """A tiny model saved by transformers, its vectors and stored buffers (norms, Gemma 4's layer_scalar)
    perturbed so an identity is not luck; its logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.for_model(model_type, **{**TINY, **fields})
        model = AutoModelForCausalLM.from_config(config).eval()
    stored = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for tensor in stored.values():
            if tensor.dim() == 1 and tensor.is_floating_point():
                tensor.add_(torch.randn_like(tensor) * 0.1)
    assert any(name.endswith("layer_scalar") for name in stored) == model_type.startswith("gemma4")
    model.save_pretrained(folder)
    return logits(model, use_cache=False)


def _slices(folder: Path) -> dict[str, list[torch.Tensor]]:
    """Each sliced tensor's slices, one per layer."""
    tensors = load_file(folder / "model.safetensors")
    return {name: list(tensors[name].split(WIDTH, dim=axis)) for name, axis in SLICED.items()}


def _expand_cli(src: Path, out: Path, *args: str):
    from typer.testing import CliRunner

    from otdus_cli.cli import app

    return CliRunner().invoke(app, ["expand", str(src), "--out", str(out), *args])


@pytest.mark.parametrize("model_type", ["gemma4_text", "gemma3n_text"])
def test_a_copy_takes_its_source_layers_slices(tmp_path, model_type):
    src, out = tmp_path / "src", tmp_path / "out"
    _save(model_type, src)
    result = expand(str(src), out, ExpandOptions(method="copy", layers=2))
    sources = [lay.source for lay in result.plan.layer_map]
    assert sources == [0, 1, 1, 2, 2, 3]
    before, after = _slices(src), _slices(out)
    for name in SLICED:
        assert len(after[name]) == len(sources)
        for j, i in enumerate(sources):
            assert torch.equal(after[name][j], before[name][i]), (name, j)
    recorded = json.loads((out / "otdus.json").read_text())["layer_slices"]
    assert recorded == {name: {"axis": axis, "width": WIDTH} for name, axis in SLICED.items()}
    grown = load_causal_lm(out)
    assert grown.config.num_hidden_layers == 6 and torch.isfinite(logits(grown, use_cache=False)).all()


def test_zero_init_keeps_the_logits_bit_for_bit(tmp_path):
    """llama-pro on Gemma 4: the new layers' per-layer projection, attention and MLP outputs zeroed, their
    layer_scalar (trained, here perturbed from 1) at 1; every slice its source's."""
    src, out = tmp_path / "src", tmp_path / "out"
    base = _save("gemma4_text", src)
    result = expand(str(src), out, ExpandOptions(method="llama-pro", layers=2))
    layer_map = result.plan.layer_map
    assert [(lay.source, lay.zero_init) for lay in layer_map if lay.new] == [(1, True), (3, True)]
    assert torch.equal(logits(load_causal_lm(out), use_cache=False), base)
    written = load_file(out / "model.safetensors")
    for lay in layer_map:
        if lay.new:
            prefix = f"model.layers.{lay.index}."
            assert not written[prefix + "per_layer_projection.weight"].any()
            assert torch.equal(written[prefix + "layer_scalar"], torch.ones(1))
    before, after = _slices(src), _slices(out)
    for name in SLICED:
        assert all(torch.equal(after[name][lay.index], before[name][lay.source]) for lay in layer_map)


def test_the_static_check_compares_each_base_layers_slice(tmp_path):
    """verify's static check: the per-layer tensors hold each base layer's slice where the expansion holds
    that layer; a base layer's slice changed refutes it."""
    from safetensors.torch import save_file

    from otdus_cli.verify.proof import static_check

    src, out = tmp_path / "src", tmp_path / "out"
    _save("gemma4_text", src)
    expand(str(src), out, ExpandOptions(method="llama-pro", layers=2))
    proof = static_check(src, out)
    assert proof.preserving and proof.outside_equal, proof.reason
    tensors = load_file(out / "model.safetensors")
    tensors["model.embed_tokens_per_layer.weight"][:, 3 * WIDTH] += 1  # base layer 2, at index 3
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    proof = static_check(src, out)
    assert not proof.preserving and proof.reason == "embeddings, final norm or head differ from the base's"


def test_slices_are_written_a_chunk_at_a_time(tmp_path, monkeypatch):
    """Written in chunks of a few rows, the output holds the same bytes as in one piece."""
    from otdus_cli.arch import layer_slices

    src = tmp_path / "src"
    _save("gemma4_text", src)
    expand(str(src), tmp_path / "whole", ExpandOptions(method="copy", layers=2))
    monkeypatch.setattr(layer_slices, "CHUNK_BYTES", 700)  # 96 rows of 32 floats: 6 rows a chunk
    expand(str(src), tmp_path / "chunked", ExpandOptions(method="copy", layers=2))
    whole, chunked = (load_file(tmp_path / d / "model.safetensors") for d in ("whole", "chunked"))
    assert all(torch.equal(whole[name], chunked[name]) for name in whole)


def test_gemma3n_zero_init_is_refused_naming_why(tmp_path):
    """Gemma 3n's layers add a LAuReL branch that passes the normed input on (and mix their output into
    the AltUp streams): no zeroing makes one an identity, so zero-init is refused in one line naming it."""
    _save("gemma3n_text", tmp_path / "src")
    result = _expand_cli(tmp_path / "src", tmp_path / "out", "--method", "llama-pro")
    line = one_error_line(result, message="zero-init for derived:gemma3n_text")
    assert "per_layer_projection.weight" in line and "does not make layer 0" in line
    assert "laurel (Gemma3nTextLaurelBlock) still outputs more than zero (it adds its own input back" in line
    no_output_left(tmp_path)


def test_key_value_sharing_follows_the_layer_map(tmp_path):
    """The last num_kv_shared_layers layers reuse the keys and values of earlier ones: copies among them
    count with them; a zero-init copy below them would hand them its own keys and values, so llama-pro is
    refused there, naming the placement after the last layer, which keeps the logits bit for bit."""
    src = tmp_path / "src"
    base = _save("gemma4_text", src, num_kv_shared_layers=2, layer_types=ALTERNATING)
    expand(str(src), tmp_path / "copy", ExpandOptions(method="copy", layers=2))  # copies of layers 1 and 2
    written = json.loads((tmp_path / "copy" / "config.json").read_text())
    assert (written["num_hidden_layers"], written["num_kv_shared_layers"]) == (6, 3)
    assert torch.isfinite(logits(load_causal_lm(tmp_path / "copy"), use_cache=False)).all()
    result = _expand_cli(src, tmp_path / "out", "--method", "llama-pro")
    line = one_error_line(result, message="zero-init for derived:gemma4_text")
    assert "--after 3" in line
    no_output_left(tmp_path)
    expand(str(src), tmp_path / "top", ExpandOptions(method="copy", after=[3, 3], zero_init=True))
    written = json.loads((tmp_path / "top" / "config.json").read_text())
    assert written["num_kv_shared_layers"] == 4
    assert torch.equal(logits(load_causal_lm(tmp_path / "top"), use_cache=False), base)


def test_a_copy_of_an_earlier_layer_among_the_sharing_ones_is_refused():
    from otdus_cli.arch.config_rules import rewrite_config
    from otdus_cli.errors import OtdusError
    from otdus_cli.plan.layer_map import from_sources

    config = {"model_type": "gemma4_text", "num_hidden_layers": 4, "num_kv_shared_layers": 2}
    with pytest.raises(OtdusError, match="puts output layer 3, a copy of base layer 1, among them"):
        rewrite_config(config, from_sources([0, 1, 2, 1, 3], zero_init=False), derives_layer_types=False)


def test_a_layer_built_from_others_has_no_slice_and_is_refused():
    from otdus_cli.arch.family_lookup import derived_family
    from otdus_cli.arch.layer_slices import DepthSliced, check_sliced_sources
    from otdus_cli.errors import OtdusError
    from otdus_cli.plan.layer_map import interleave

    family = derived_family({**TINY, "model_type": "gemma4_text"})
    sliced = {"model.embed_tokens_per_layer.weight": DepthSliced(1, WIDTH)}
    layer_map = interleave(4, [1], "average", zero_init=False, pair=True)
    with pytest.raises(OtdusError, match="output layer 2 is built by average from base layers 1, 2"):
        check_sliced_sources(family, layer_map, sliced)


def test_the_proof_instance_of_a_full_size_config_shrinks_the_per_layer_table():
    """Gemma 4 E2B's widths (its per-layer table: 262144 tokens x 256 a layer): the tiny instance the
    proofs run on holds a per-layer table of the shrunk vocabulary and width, not the full one."""
    from otdus_cli.arch.tiny import MAX_PROOF_PARAMETERS, tiny_instance

    e2b = dict(hidden_size=1536, intermediate_size=6144, vocab_size=262144, head_dim=256)
    per_layer = dict(vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256)
    config = {**TINY, **e2b, **per_layer, "model_type": "gemma4_text"}
    model, instance, _ = tiny_instance(config)
    assert instance == "the config with its widths shrunk"
    assert list(model.model.embed_tokens_per_layer.weight.shape) == [256, 4 * 16]
    assert sum(p.numel() for p in model.parameters()) < MAX_PROOF_PARAMETERS
