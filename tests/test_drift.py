"""study/drift.py: the distance an expansion moves its base's function, on the bundled stories260K."""

import math

import pytest
import torch

from otdus_cli.bundled import BUNDLED_MODELS
from otdus_cli.errors import OtdusError
from otdus_cli.expand import expand
from otdus_cli.options import ExpandOptions
from otdus_cli.study.drift import function_distance

BASE = str(BUNDLED_MODELS["bundled:stories260k"])


@pytest.fixture(scope="module")
def windows() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(1, 512, (3, 24), generator=g)


def _expanded(tmp_path, name: str, **options) -> str:
    out = tmp_path / name
    expand(BASE, out, ExpandOptions(layers=2, position="top", **options))
    return str(out)


def test_zero_init_arm_is_exactly_zero(tmp_path, windows):
    d = function_distance(BASE, _expanded(tmp_path, "ot", method="ot"), windows)
    assert d.base_layers == 5 and d.expanded_layers == 7
    assert d.layer_relative_l2 == [0.0] * 5
    assert d.final_relative_l2 == 0.0 and d.kl == 0.0
    assert d.expanded_loss == d.base_loss
    assert d.tokens == 3 * 23


def test_copy_moves_the_layers_above_its_insert_only(tmp_path, windows):
    d = function_distance(BASE, _expanded(tmp_path, "copy", method="copy"), windows)
    # top pairs of 5 layers: new layers after base layers 2 and 3 (copies of them), so layers 0-1
    # are untouched and 2 onwards move
    assert d.layer_points == [0, 1, 3, 5, 6]
    assert d.layer_relative_l2[:2] == [0.0, 0.0]
    assert all(x > 0 for x in d.layer_relative_l2[2:])
    assert d.final_relative_l2 > 0 and d.kl > 0
    assert not math.isclose(d.expanded_loss, d.base_loss)


def test_a_folder_otdus_did_not_expand_is_refused(windows):
    with pytest.raises(OtdusError, match="no otdus layer map"):
        function_distance(BASE, BASE, windows)
