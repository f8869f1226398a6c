"""Layer maps against the published placements and baselines, and what a plan refuses."""

import pytest

from otdus_cli.errors import OtdusError
from otdus_cli.methods.registry import get_method
from otdus_cli.plan.layer_map import is_function_preserving, plan_layers


def new_layers(layer_map):
    return [(lay.index, lay.parents) for lay in layer_map if lay.new]


def test_top_32_to_48_matches_the_paper():
    lm = plan_layers(32, get_method("ot"))
    assert len(lm) == 48
    assert [i for i, _ in new_layers(lm)] == list(range(16, 48, 2))
    assert [p for _, p in new_layers(lm)] == [(i, i + 1) for i in range(15, 31)]
    assert [lay.source for lay in lm if not lay.new] == list(range(32))
    assert is_function_preserving(lm, 32)


def test_bottom_mid_and_top_bottom_pairs():
    assert [p for _, p in new_layers(plan_layers(8, get_method("average"), "bottom", layers=3))] == [
        (0, 1),
        (1, 2),
        (2, 3),
    ]
    assert [p for _, p in new_layers(plan_layers(8, get_method("average"), "mid", layers=3))] == [
        (2, 3),
        (3, 4),
        (4, 5),
    ]
    tb = [p for _, p in new_layers(plan_layers(8, get_method("average"), "top-bottom", layers=4))]
    assert tb == [(0, 1), (1, 2), (5, 6), (6, 7)]


def test_llama_pro_32_to_40():
    lm = plan_layers(32, get_method("llama-pro"), layers=8)
    assert new_layers(lm) == [(4 + 5 * j, (3 + 4 * j,)) for j in range(8)]
    assert all(lay.zero_init for lay in lm if lay.new)
    assert is_function_preserving(lm, 32)


def test_solar_32_to_48():
    lm = plan_layers(32, get_method("solar"), layers=16)
    assert [lay.source for lay in lm] == list(range(24)) + list(range(8, 32))
    assert [lay.index for lay in lm if lay.new] == list(range(24, 40))
    assert not is_function_preserving(lm, 32)
    assert is_function_preserving(plan_layers(32, get_method("solar"), layers=16, zero_init=True), 32)


def test_interpose_and_stack():
    lm = plan_layers(4, get_method("interpose"), "bottom", layers=4)
    assert [lay.source for lay in lm] == [0, 0, 1, 1, 2, 2, 3, 3]
    st = plan_layers(3, get_method("stack"))
    assert [lay.source for lay in st] == [0, 1, 2, 0, 1, 2]
    assert [lay.new for lay in st] == [False] * 3 + [True] * 3


def test_explicit_after_allows_repeats_and_ratio():
    lm = plan_layers(6, get_method("copy"), after=[5, 2, 2])
    assert [lay.source for lay in lm] == [0, 1, 2, 2, 2, 3, 4, 5, 5]
    assert len(plan_layers(10, get_method("copy"), ratio=0.3)) == 13
    assert len(plan_layers(6, get_method("copy"), after=[1, 1], layers=2)) == 8  # a count that agrees


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(method="average", after=[4]), "cannot insert after the last layer"),
        (dict(method="ot", layers=5), "at most 4 pairs"),
        (dict(method="ot", position="uniform", layers=5), "pair-based"),
        (dict(method="copy", position="uniform", layers=2), "multiple"),
        (dict(method="solar", layers=2), "parity"),
        (dict(method="stack", layers=3), "multiple"),
        (dict(method="copy", after=[9]), "not a base layer"),
        (dict(method="copy", layers=0), "at least one"),
        # explicit places contradicted by a count or a method that places its layers itself
        (dict(method="copy", after=[3], layers=2), "--after names 1 new layer"),
        (dict(method="copy", after=[1, 3], ratio=0.2), "--after names 2 new layer"),
        (dict(method="solar", after=[2], layers=1), "places its new layers itself"),
        (dict(method="stack", after=[2]), "places its new layers itself"),
    ],
)
def test_impossible_requests_are_refused(kwargs, message):
    method = get_method(kwargs.pop("method"))
    with pytest.raises(OtdusError, match=message):
        plan_layers(5, method, **kwargs)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--method", "lesa"], "--method lesa cannot build mixtral layers (MoE layers:"),
        (["--ot-variant", "activation"], "--ot-variant activation aligns dense MLP neurons; mixtral is"),
    ],
)
def test_methods_refuse_a_family_when_the_plan_is_made(tmp_path, args, message):
    """`otdus plan` (which writes nothing and builds no layer) already refuses what the method cannot
    build: the method's refusals are checked at plan time."""
    from typer.testing import CliRunner

    from otdus_cli.cli import app
    from tests.support.cli_checks import one_error_line
    from tests.support.tiny_models import build_tiny

    src = build_tiny("mixtral", tmp_path / "moe")
    one_error_line(CliRunner().invoke(app, ["plan", str(src), "--layers", "1", *args]), message=message)
