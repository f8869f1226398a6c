"""Layer-by-layer evaluation must compute exactly what the full transformers model computes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import DENSE_TYPES, load_causal_lm
from safetensors.torch import load_file, save_file

from otdus_cli.errors import OtdusError
from otdus_cli.verify.streaming import StreamedModel, group_windows

LENGTHS = (40, 40, 23)  # longer than the tiny models' sliding windows (16); two equal lengths batch together


def _inputs(vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


def _reference(folder, inputs) -> list[torch.Tensor]:
    model = load_causal_lm(folder)
    with torch.no_grad():
        return [model(input_ids=torch.tensor([ids]), use_cache=False).logits[0] for ids in inputs]


@pytest.mark.parametrize("model_type", DENSE_TYPES)
def test_streamed_logits_equal_full_forward(tiny_models, model_type):
    folder = tiny_models[model_type]
    streamed = StreamedModel(folder, device="cpu", dtype="float32")
    inputs = _inputs(streamed.config.vocab_size)
    got = streamed.logits(inputs)
    for ref, out in zip(_reference(folder, inputs), got, strict=True):
        assert out.shape == ref.shape
        assert torch.equal(out, ref), f"{model_type}: max |diff| {(out - ref).abs().max().item():.3g}"


def test_streamed_batched_windows_equal_full_forward(tiny_models):
    folder = tiny_models["gemma2"]  # soft-capping, sliding layers, scaled embeddings
    streamed = StreamedModel(folder, batch_size=4)
    inputs = _inputs(streamed.config.vocab_size, seed=1)
    for ref, out in zip(_reference(folder, inputs), streamed.logits(inputs), strict=True):
        assert torch.equal(out, ref)


def test_streamed_recomputes_masks_beyond_the_budget(tiny_models):
    folder = tiny_models["gemma2"]  # eager attention: explicit float masks
    streamed = StreamedModel(folder, kwargs_budget=0)
    inputs = _inputs(streamed.config.vocab_size, seed=2)
    acts = streamed.start(inputs)
    assert all(kw is None for kw in acts.layer_kwargs)
    for ref, out in zip(_reference(folder, inputs), streamed.logits(inputs), strict=True):
        assert torch.equal(out, ref)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_streamed_moe_from_per_expert_checkpoint(tiny_models, model_type):
    # on disk: one matrix per expert; transformers 5 fuses them into 3-D expert tensors
    folder = tiny_models[model_type]
    streamed = StreamedModel(folder)
    inputs = _inputs(streamed.config.vocab_size)[:2]
    for ref, out in zip(_reference(folder, inputs), streamed.logits(inputs), strict=True):
        assert torch.equal(out, ref)


def test_streamed_sharded_checkpoint(sharded_llama):
    streamed = StreamedModel(sharded_llama)
    inputs = _inputs(streamed.config.vocab_size)[:1]
    assert torch.equal(streamed.logits(inputs)[0], _reference(sharded_llama, inputs)[0])


def test_streamed_bfloat16_runs(tiny_models):
    streamed = StreamedModel(tiny_models["llama"], dtype="bf16")
    out = streamed.logits(_inputs(streamed.config.vocab_size)[:1])[0]
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_layers_are_loaded_one_at_a_time(tiny_models):
    streamed = StreamedModel(tiny_models["qwen3"])
    acts = streamed.start(_inputs(streamed.config.vocab_size)[:1])
    assert all(p.is_meta for layer in streamed.layers for p in layer.parameters())
    seen = []
    original = streamed.load_layer

    def spy(i):
        seen.append([not p.is_meta for layer in streamed.layers for p in layer.parameters()].count(True))
        return original(i)

    streamed.load_layer = spy
    for i in range(streamed.num_layers):
        streamed.apply_layer(i, acts)
    assert seen == [0] * streamed.num_layers  # nothing else materialised when the next layer loads
    assert all(p.is_meta for layer in streamed.layers for p in layer.parameters())


def test_missing_or_foreign_tensors_are_clear_errors(tiny_models, tmp_path):
    src = tiny_models["llama"]
    broken = shutil.copytree(src, tmp_path / "broken")
    state = load_file(broken / "model.safetensors")
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(OtdusError, match="down_proj"):
        StreamedModel(broken)
    state = load_file(src / "model.safetensors")
    state["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(state, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(OtdusError, match="no place"):
        StreamedModel(broken)
    config = json.loads((src / "config.json").read_text())
    config["model_type"] = "no_such_family"
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(OtdusError):
        StreamedModel(broken)


def test_group_windows():
    assert group_windows([5, 3, 5, 5, 3], 2) == [[0, 2], [3], [1, 4]]
    assert group_windows([5, 5], 1) == [[0], [1]]
