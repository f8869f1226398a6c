"""Layer-by-layer evaluation must compute exactly what the full transformers model computes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from otdus_cli.errors import OtdusError
from otdus_cli.verify.batching import group_windows
from otdus_cli.verify.head_pass import iter_logits
from otdus_cli.verify.self_check import forward_logits_layer_by_layer
from otdus_cli.verify.streaming import StreamedModel
from tests.support.tiny_models import DENSE_TYPES, HYBRID_BASE, MOE_TYPES, load_causal_lm, save_perturbed

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.compat]

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


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])  # Gemma 3: embed_scale buffer in bf16
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_streamed_low_precision_equals_transformers_own(tiny_models, model_type, dtype):
    folder = tiny_models[model_type]
    streamed = StreamedModel(folder, dtype=dtype)
    inputs = _inputs(streamed.config.vocab_size)[:2]
    model = load_causal_lm(folder, dtype=dtype)
    for ids, out in zip(inputs, streamed.logits(inputs), strict=True):
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
        assert out.dtype == ref.dtype == dtype
        assert torch.equal(out, ref), f"max |diff| {(out.float() - ref.float()).abs().max().item():.3g}"


@pytest.mark.parametrize("model_type", DENSE_TYPES + MOE_TYPES)
def test_forward_with_layers_loaded_in_turn_equals_the_layer_by_layer_path(tiny_models, model_type):
    # the self-check's reference for models too large to load whole: the family's own forward, each
    # decoder layer loaded when reached; and the full transformers model agrees with both
    folder = tiny_models[model_type]
    streamed = StreamedModel(folder)
    ids = _inputs(streamed.config.vocab_size)[0]
    real_forward = forward_logits_layer_by_layer(streamed, ids)
    assert all(p.is_meta for p in streamed.model.parameters())  # everything freed again
    assert torch.equal(real_forward, streamed.logits([ids])[0])
    assert torch.equal(real_forward, _reference(folder, [ids])[0])


def test_buffers_are_the_constructors_values(tiny_models):
    # rotary frequencies and Gemma 3's embedding scale as transformers computes them, never left over
    # memory: a loaded shell holds exactly the buffers of the model transformers loads itself
    folder = tiny_models["gemma3_text"]
    streamed = StreamedModel(folder)
    streamed.weights.load_shell("all")
    mine = dict(streamed.model.named_buffers())
    theirs = dict(load_causal_lm(folder).named_buffers())
    assert any("inv_freq" in name for name in mine) and any("embed_scale" in name for name in mine)
    assert mine.keys() == theirs.keys()
    for name, value in mine.items():
        assert torch.equal(value, theirs[name]), name


def test_layers_are_loaded_one_at_a_time(tiny_models):
    streamed = StreamedModel(tiny_models["qwen3"])
    acts = streamed.start(_inputs(streamed.config.vocab_size)[:1])
    assert all(p.is_meta for layer in streamed.weights.layers for p in layer.parameters())
    seen = []
    original = streamed.weights.load_layer

    def spy(i):
        seen.append(
            [not p.is_meta for layer in streamed.weights.layers for p in layer.parameters()].count(True)
        )
        return original(i)

    streamed.weights.load_layer = spy
    for i in range(streamed.num_layers):
        streamed.apply_layer(i, acts)
    assert seen == [0] * streamed.num_layers  # nothing else materialised when the next layer loads
    assert all(p.is_meta for layer in streamed.weights.layers for p in layer.parameters())


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


@pytest.mark.parametrize("model_type", ["gemma2", "llama"])  # soft-capping; untied head
def test_logits_in_position_chunks_match_the_full_forward(tiny_models, model_type):
    folder = tiny_models[model_type]
    streamed = StreamedModel(folder)
    inputs = _inputs(streamed.config.vocab_size, seed=3)
    acts = streamed.run(inputs)
    per_position = streamed.config.vocab_size * 4
    chunks = list(iter_logits(streamed, acts, max_logits_bytes=5 * per_position))  # 5 positions each
    assert len(chunks) == sum(-(-n // 5) for n in LENGTHS)
    assert all(logits.shape[1] <= 5 for _, _, logits in chunks)
    for i, ref in enumerate(_reference(folder, inputs)):
        mine = [(p0, logits[0]) for group, p0, logits in chunks if group == [i]]
        assert [p0 for p0, _ in mine] == list(range(0, len(inputs[i]), 5))
        joined = torch.cat([t for _, t in mine])
        assert joined.shape == ref.shape and torch.allclose(joined, ref, atol=1e-5, rtol=1e-5)


def _on_device(module) -> bool:
    return not module.weight.is_meta


def test_shell_stages_never_hold_an_untied_embedding_and_head_together(tiny_models):
    streamed = StreamedModel(tiny_models["llama"])  # untied
    emb, head = streamed.model.get_input_embeddings(), streamed.model.get_output_embeddings()
    acts = streamed.start(_inputs(streamed.config.vocab_size)[:1])
    assert not _on_device(emb) and not _on_device(head)  # freed for the layer loop
    streamed.weights.load_shell("embed")
    assert _on_device(emb) and not _on_device(head)
    for i in range(streamed.num_layers):
        streamed.apply_layer(i, acts)
    for _ in iter_logits(streamed, acts):
        assert _on_device(head) and not _on_device(emb)
    tied = StreamedModel(tiny_models["qwen2"])  # tied: one matrix serves both stages
    tied.weights.load_shell("head")
    assert _on_device(tied.model.get_input_embeddings()) and _on_device(tied.model.get_output_embeddings())


# per-layer token embeddings (Gemma 4's second, smaller vocabulary table)
PER_LAYER_INPUTS = dict(vocab_size_per_layer_input=96, hidden_size_per_layer_input=8, num_kv_shared_layers=0)
# Inkling's input embeddings norm their output: a module with a parameter of its own inside the embedding
INKLING = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
    sliding_window_size=16, rel_extent=16, mlp_layer_types=["dense", "dense"], max_position_embeddings=64,
)  # fmt: skip


def test_the_head_stage_loads_every_tensor_outside_the_input_embeddings(tmp_path):
    """The head stage leaves the input embeddings on meta, with the modules inside them (Inkling's
    embedding norm), and loads every other tensor from the checkpoint. The norm's parameter used to be
    put on the device and its meta predecessor dropped, and the next parameter made (the final norm's)
    could take over its id(), by which the skipped tensors were told apart: left unloaded, its
    uninitialised memory made verify's self-check fail in some runs and not others."""
    from transformers import CONFIG_MAPPING

    if "inkling_text" not in CONFIG_MAPPING:
        pytest.skip("transformers has no inkling_text here")
    save_perturbed("inkling_text", INKLING, tmp_path / "inkling", use_cache=False)
    stored = load_file(tmp_path / "inkling" / "model.safetensors")
    streamed = StreamedModel(tmp_path / "inkling")
    embeddings = streamed.model.get_input_embeddings()
    assert len(list(embeddings.parameters())) == 2  # the table and its norm's weight
    inside = {f"model.embed_tokens.{name}" for name, _ in embeddings.named_parameters()}
    for _ in range(5):  # each load makes new parameters: an id() reused would be one run's luck
        streamed.weights.load_shell("head")
        for name, param in streamed.model.named_parameters():
            if name in inside:
                assert param.is_meta, name
            else:
                assert torch.equal(param, stored[name]), name
        streamed.weights.free_shell()
    ids = _inputs(streamed.config.vocab_size)
    for ref, out in zip(_reference(tmp_path / "inkling", ids), streamed.logits(ids), strict=True):
        assert torch.equal(out, ref)


def test_per_layer_inputs_made_from_the_tokens_are_each_window_s_own(tmp_path):
    """Gemma 4 hands every decoder layer inputs made from the window's tokens (per-layer embeddings):
    a window must not get those recorded for another window of its length, as it did when recorded
    arguments were kept per batch shape (its logits were off by up to 0.5; the self-check, on the
    first window only, could not see it)."""
    from transformers import CONFIG_MAPPING

    if "gemma4_text" not in CONFIG_MAPPING:
        pytest.skip("transformers has no gemma4_text here")
    fields = {**HYBRID_BASE, "num_hidden_layers": 2, **PER_LAYER_INPUTS}
    save_perturbed("gemma4_text", fields, tmp_path / "gemma4", use_cache=False)
    streamed = StreamedModel(tmp_path / "gemma4")  # one window a batch: two batches of one shape
    inputs = _inputs(streamed.config.vocab_size, seed=4)
    for ref, out in zip(_reference(tmp_path / "gemma4", inputs), streamed.logits(inputs), strict=True):
        assert torch.equal(out, ref), f"max |diff| {(out - ref).abs().max().item():.3g}"


def test_a_stored_copy_of_a_tied_head_is_used_as_transformers_uses_it(tiny_models, tmp_path):
    # tie_word_embeddings, yet the checkpoint also holds a different lm_head.weight: transformers 5
    # loads it as stored (untied), 4.57 ties it back to the embeddings; the evaluator must agree
    folder = shutil.copytree(tiny_models["qwen2"], tmp_path / "both")
    state = load_file(folder / "model.safetensors")
    assert "lm_head.weight" not in state
    state["lm_head.weight"] = torch.randn_like(state["model.embed_tokens.weight"])
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    streamed = StreamedModel(folder)
    ids = _inputs(streamed.config.vocab_size)[0]
    assert torch.equal(streamed.logits([ids])[0], _reference(folder, [ids])[0])
