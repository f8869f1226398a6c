"""scripts/make_synthetic.py writes checkpoints that transformers and safetensors load as real ones."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors import safe_open

from scripts import make_synthetic as ms


def _read_all(out: str) -> dict[str, torch.Tensor]:
    index_path = os.path.join(out, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors = {}
    for fn in files:
        with safe_open(os.path.join(out, fn), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for k in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensors[k] = f.get_tensor(k)
    return tensors


def test_tiny_sharded_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "tiny")
    summary = ms.write_checkpoint("tiny", out, max_shard_size="100KB", seed=3)
    assert summary["shards"] > 1

    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]

    tensors = _read_all(out)
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert all(torch.isfinite(t.float()).all() for t in tensors.values())
    # headers are 8-byte aligned, as safetensors writes them
    for fn in files:
        with open(os.path.join(out, fn), "rb") as f:
            assert struct.unpack("<Q", f.read(8))[0] % 8 == 0

    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    sd = model.state_dict()
    assert set(sd) == set(tensors)
    for k, t in tensors.items():
        assert torch.equal(sd[k].to(t.dtype), t), k
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 2]])).logits
    assert logits.shape == (1, 4, 512) and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "name", ["tiny-llama-tied", "tiny-qwen2", "tiny-qwen3", "tiny-gemma2", "tiny-mixtral"]
)
def test_tiny_families_load(tmp_path, name):
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / name)
    ms.write_checkpoint(name, out, dtype="f32", max_shard_size="5GB")
    assert os.listdir(out) and os.path.exists(os.path.join(out, "model.safetensors"))
    tensors = _read_all(out)
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert ("lm_head.weight" in tensors) == (not cfg["tie_word_embeddings"])
    if name == "tiny-mixtral":
        assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in tensors
        assert "model.layers.0.block_sparse_moe.gate.weight" in tensors
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_layers_seed_and_bounded_shards(tmp_path):
    a = str(tmp_path / "a")
    b = str(tmp_path / "b")
    ms.write_checkpoint("tiny", a, layers=2, seed=7, max_shard_size="1MB")
    ms.write_checkpoint("tiny", b, layers=3, seed=7, max_shard_size="60KB")
    ta, tb = _read_all(a), _read_all(b)
    with open(os.path.join(b, "config.json")) as f:
        assert json.load(f)["num_hidden_layers"] == 3
    assert "model.layers.2.mlp.down_proj.weight" in tb and "model.layers.2.mlp.down_proj.weight" not in ta
    # values depend on (seed, tensor name) only, not on sharding or depth
    for k, t in ta.items():
        assert torch.equal(t, tb[k]), k
    # distinct layers really differ
    assert not torch.equal(
        tb["model.layers.0.self_attn.q_proj.weight"], tb["model.layers.1.self_attn.q_proj.weight"]
    )


def test_size_parsing_and_sharding():
    assert ms.parse_size("5GB") == 5 * 10**9
    assert ms.parse_size("500MiB") == 500 * 2**20
    assert ms.parse_size("1000") == 1000
    specs = ms.tensor_specs(ms.CONFIGS["llama-3.1-8b"])
    shards = ms.plan_shards(specs, 2, ms.parse_size("5GB"))
    assert len(shards) == 4  # the hub's Llama-3.1-8B has four shards
    assert sum(s.numel for s in specs) == 8_030_261_248


def test_tokenizer_copy(tmp_path):
    src = tmp_path / "tok"
    src.mkdir()
    (src / "tokenizer.json").write_text("{}")
    (src / "tokenizer_config.json").write_text("{}")
    (src / "model.safetensors").write_text("not copied")
    out = str(tmp_path / "m")
    s = ms.write_checkpoint("tiny", out, layers=1, tokenizer_from=str(src))
    assert sorted(s["tokenizer_files"]) == ["tokenizer.json", "tokenizer_config.json"]
    assert os.path.exists(os.path.join(out, "generation_config.json"))


def test_tiny_models_get_the_bundled_tokenizer_so_they_verify(tmp_path):
    """Without --tokenizer-from a tiny model had no tokenizer: verify stopped on a sentencepiece error."""
    from transformers import AutoTokenizer

    out = str(tmp_path / "m")
    s = ms.write_checkpoint("tiny-mixtral", out, layers=1)
    assert "tokenizer.json" in s["tokenizer_files"]
    tok = AutoTokenizer.from_pretrained(out)
    with open(os.path.join(out, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    assert max(tok("Once upon a time")["input_ids"]) < vocab


def test_a_folder_without_tokenizer_files_names_the_fix(tmp_path):
    from otdus_cli.errors import OtdusError
    from otdus_cli.verify.metrics import load_tokenizer

    out = str(tmp_path / "m")
    ms.write_checkpoint("tiny", out, layers=1, tokenizer_from=None)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        os.remove(os.path.join(out, name))
    with pytest.raises(OtdusError, match="no tokenizer files .*--tokenizer-from"):
        load_tokenizer(out)
