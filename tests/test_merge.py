"""The OT merge of `otdus shrink` (methods/merge.py) on a planted twin: layer 2 made a copy of layer 1
with its MLP neurons and its attention heads permuted computes layer 1's function, so merging it into
layer 1 must give the model that dropping it gives. Every variant offered for merging recovers it; the
variants that align only one side of o_proj/down_proj are refused with one line."""

from __future__ import annotations

import pytest

from otdus_cli.errors import OtdusError
from otdus_cli.methods.merge import MERGING_VARIANTS
from otdus_cli.shrink import ShrinkOptions, shrink
from tests.support.planted_twin import planted_twin
from tests.support.tiny_models import load_causal_lm, logits

pytestmark = [pytest.mark.usefixtures("single_thread")]


@pytest.fixture(scope="module")
def twin_and_drop(tmp_path_factory):
    """The planted twin and its logits with layer 2 dropped (what the merge must give)."""
    root = tmp_path_factory.mktemp("twin")
    planted_twin(root / "twin")
    shrink(str(root / "twin"), root / "drop", ShrinkOptions(method="drop", remove=[2]))
    return root / "twin", logits(load_causal_lm(root / "drop"))


@pytest.mark.parametrize("variant", MERGING_VARIANTS)
def test_the_ot_merge_of_a_planted_twin_computes_what_dropping_it_does(tmp_path, twin_and_drop, variant):
    twin, dropped = twin_and_drop
    options = ShrinkOptions(
        method="ot", remove=[2], calib_tokens=512, ot={"variant": variant, "solver": "emd"}
    )
    shrink(str(twin), tmp_path / "merged", options)
    merged = logits(load_causal_lm(tmp_path / "merged"))
    assert (merged - dropped).abs().max() <= 1e-4
    # the test can fail: the plain average of the twins is another function
    shrink(str(twin), tmp_path / "average", ShrinkOptions(method="average", remove=[2]))
    assert (logits(load_causal_lm(tmp_path / "average")) - dropped).abs().max() > 0.1


def test_the_default_ot_merge_is_one_that_merges():
    assert ShrinkOptions(method="ot").ot.variant in MERGING_VARIANTS


@pytest.mark.parametrize("variant", ["paper", "official"])
def test_variants_that_align_one_side_are_refused(tmp_path, twin_and_drop, variant):
    twin, _ = twin_and_drop
    with pytest.raises(
        OtdusError, match=f"--ot-variant {variant} cannot merge layers: .*o_proj and down_proj"
    ):
        shrink(str(twin), tmp_path / "out", ShrinkOptions(method="ot", remove=[2], ot={"variant": variant}))
    assert not (tmp_path / "out").exists()
