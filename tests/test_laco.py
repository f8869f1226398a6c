"""LaCo's merge (methods/laco.py): the paper's formula and the released notebooks' variant, checked on
the tensors written; the one-layer identity the docs state; the variant's refusal on MoE layers.
LaCo's selection (``--select laco``) is tested in tests/test_laco_select.py."""

from __future__ import annotations

import pytest
import torch

from otdus_cli.bundled import STORIES260K
from otdus_cli.errors import OtdusError
from otdus_cli.io.reader import CheckpointReader
from otdus_cli.shrink import ShrinkOptions, shrink
from tests.support.tiny_models import load_causal_lm, logits

pytestmark = [pytest.mark.usefixtures("single_thread")]


def _layer(folder, i: int) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(folder)
    prefix = f"model.layers.{i}."
    return {n.removeprefix(prefix): reader.get(n) for n in reader.names if n.startswith(prefix)}


def test_the_paper_variant_is_the_formula_on_every_tensor(tmp_path):
    shrink("bundled:stories260k", tmp_path / "out", ShrinkOptions(method="laco", remove=[2, 3]))
    got = _layer(tmp_path / "out", 1)
    src = [_layer(STORIES260K, i) for i in (1, 2, 3)]
    for suffix, tensor in got.items():
        base = src[0][suffix]
        expected = base + (src[1][suffix] - base) + (src[2][suffix] - base)
        torch.testing.assert_close(tensor, expected, rtol=0, atol=1e-6)


def test_the_official_variant_is_the_last_layer_s_projections_with_the_kept_layer_s_norms(tmp_path):
    options = ShrinkOptions(method="laco", remove=[2, 3], laco={"variant": "official"})
    result = shrink("bundled:stories260k", tmp_path / "out", options)
    assert result.manifest["options"]["laco"]["variant"] == "official"
    got = _layer(tmp_path / "out", 1)
    kept, last = _layer(STORIES260K, 1), _layer(STORIES260K, 3)
    norms = {"input_layernorm.weight", "post_attention_layernorm.weight"}
    assert set(got) == set(kept) and norms < set(got)
    for suffix, tensor in got.items():
        assert torch.equal(tensor, (kept if suffix in norms else last)[suffix]), suffix
    paper = tmp_path / "paper"
    shrink("bundled:stories260k", paper, ShrinkOptions(method="laco", remove=[2, 3]))
    assert not torch.equal(_layer(paper, 1)["mlp.up_proj.weight"], got["mlp.up_proj.weight"])


def test_laco_merging_one_layer_is_dropping_the_kept_one(tmp_path):
    """theta_l + (theta_{l+1} - theta_l) = theta_{l+1}: laco --remove 2 computes what drop --remove 1 does."""
    shrink("bundled:stories260k", tmp_path / "laco", ShrinkOptions(method="laco", remove=[2]))
    shrink("bundled:stories260k", tmp_path / "drop", ShrinkOptions(method="drop", remove=[1]))
    torch.testing.assert_close(
        logits(load_causal_lm(tmp_path / "laco")),
        logits(load_causal_lm(tmp_path / "drop")),
        rtol=0,
        atol=1e-4,
    )


def test_the_official_variant_is_refused_on_mixture_of_experts_layers(tiny_models, tmp_path):
    options = ShrinkOptions(method="laco", remove=[2], laco={"variant": "official"})
    with pytest.raises(OtdusError, match="--laco-variant official reproduces the released notebooks"):
        shrink(str(tiny_models["mixtral"]), tmp_path / "out", options)
    assert not (tmp_path / "out").exists()
