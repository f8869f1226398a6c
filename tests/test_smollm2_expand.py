"""Function preservation at real scale: every expand method, placement and OT (and LESA) variant on
SmolLM2-135M (30 layers, vocabulary 49,152; the dequantised copy scripts/make_smollm2.py builds), loaded
by transformers. Each function-preserving expansion gives the base's exact logits and verify's PARITY
on WikiText-2 windows; the others move the logits. Two new layers each (the count does not change what
is checked), and verify on 510 tokens, to keep the CPU time modest."""

from __future__ import annotations

import shutil

import pytest
import torch

from otdus_cli.expand import expand
from otdus_cli.options import ExpandOptions
from otdus_cli.verify.compare import verify_expansion
from otdus_cli.verify.eval_set import make_eval_set
from tests.support.expansion_checks import assert_layers_match_sources, base_reference
from tests.support.tiny_models import load_causal_lm, logits

pytestmark = pytest.mark.slow

NEW = 2  # new layers per expansion (stack: always the whole depth again)
PAIR_METHODS = ("copy", "average", "interpose", "random", "ot")
POSITIONS = ("top", "bottom", "mid", "top-bottom")
# (method, position, extra options, function-preserving)
CASES = (
    [(m, p, {}, m == "ot") for m in PAIR_METHODS for p in POSITIONS]
    + [("llama-pro", "top", {}, True), ("solar", "top", {}, False), ("stack", "top", {}, False)]
    + [("ot", "top", {"ot": {"variant": v}}, True) for v in ("official", "structured")]
    + [("ot", "top", {"ot": {"variant": "activation", "calib_tokens": 512}}, True)]
    + [("ot", "top", {"ot": {"solver": "emd"}}, True)]
    # LESA with a short training and no leave-one-out check (its cost, not what is checked here); the
    # published variant zeroes nothing, so it changes the function
    + [
        ("lesa", "top", {"lesa": {"variant": v, "epochs": 2, "loo": 0}}, v == "pair")
        for v in ("pair", "published")
    ]
    + [(m, "top", {"zero_init": True}, True) for m in ("average", "random")]
)


def _id(case) -> str:
    method, position, extra, _ = case
    opts = [f"{k}={v}" for group in extra.values() if isinstance(group, dict) for k, v in group.items()]
    opts += [k for k, v in extra.items() if v is True]
    return "-".join([method, position, *opts])


@pytest.fixture(scope="module")
def eval_set(smollm2):
    return make_eval_set(smollm2, protocol="token", seq_len=256, max_tokens=512)


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_every_method_position_and_variant_on_smollm2(smollm2, eval_set, tmp_path, case):
    method, position, extra, preserving = case
    out = tmp_path / "out"
    layers = None if method == "stack" else NEW
    try:
        options = ExpandOptions(method=method, position=position, layers=layers, **extra)
        result = expand(str(smollm2), out, options)
        assert result.plan.function_preserving == preserving
        assert_layers_match_sources(smollm2, out, result.manifest)
        model = load_causal_lm(out)
        assert model.config.num_hidden_layers == (60 if method == "stack" else 30 + NEW)
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
        assert torch.equal(base_reference(smollm2)[1], logits(model)) == preserving
        del model
        if preserving:
            report = verify_expansion(smollm2, out, eval_set, threads=1)
            assert report.parity and report.exit_code == 0, report.verdict
            assert report.verdict.startswith("PARITY"), report.verdict
    finally:
        shutil.rmtree(out, ignore_errors=True)  # 0.27-0.54 GB each
