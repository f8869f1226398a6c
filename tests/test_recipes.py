"""Every shipped recipe validates and plans the depth it promises; flags override recipe values."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from otdus_cli.cli import app
from otdus_cli.methods.registry import get_method
from otdus_cli.options import load_recipe
from otdus_cli.plan.layer_map import plan_layers

# expand recipes (study-*.yaml recipes list study runs, tests/test_study.py covers them; shrink-*.yaml
# recipes are `otdus shrink`'s, tests/test_shrink.py)
RECIPES = sorted(
    p
    for p in (Path(__file__).parent.parent / "recipes").glob("*.yaml")
    if not p.name.startswith(("study-", "shrink-"))
)
# base depth -> expected output depth for the hub models the recipes name
EXPECTED = {
    "llama-3.1-8b-otdus-top.yaml": (32, 48),
    "llama-3.2-1b-otdus-top.yaml": (16, 24),
    "qwen3-8b-otdus-top.yaml": (36, 54),
    "solar-10.7b-style.yaml": (32, 48),
    "llama-pro-8b.yaml": (32, 40),
    "stories260k-ablation-average-zero.yaml": (5, 7),
    "llama-3.1-8b-lesa.yaml": (32, 48),
    "stories260k-lesa.yaml": (5, 7),
    "stories260k-grow-step1.yaml": (5, 7),
    "stories260k-grow-step2.yaml": (7, 9),  # step 1's output
    "mixtral-8x7b-otdus-top.yaml": (32, 48),
    "qwen3-30b-a3b-otdus-top.yaml": (48, 72),
    "smollm2-135m-otdus-top.yaml": (30, 45),
    "smollm2-135m-llama-pro.yaml": (30, 45),
}


def test_expected_covers_every_recipe():
    assert {r.name for r in RECIPES} == set(EXPECTED)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_plans_its_depth(path):
    recipe = load_recipe(path)
    base, expected = EXPECTED[path.name]
    e = recipe.expand
    layer_map = plan_layers(base, get_method(e.method), e.position, e.layers, e.ratio, e.after, e.zero_init)
    assert len(layer_map) == expected


def test_recipe_runs_and_flags_override(tmp_path):
    runner = CliRunner()
    recipe = Path(__file__).parent.parent / "recipes" / "stories260k-ablation-average-zero.yaml"
    result = runner.invoke(
        app, ["expand", "--recipe", str(recipe), "--out", str(tmp_path / "o"), "--layers", "1", "--json"]
    )
    assert result.exit_code == 0, result.output
    import json

    summary = json.loads(result.stdout)
    assert summary["num_hidden_layers"] == 6 and summary["function_preserving"]
    assert summary["options"]["method"] == "average" and summary["options"]["zero_init"] is True


def test_lesa_recipes_hold_the_published_setting_and_flags_override(tmp_path):
    import json

    published = load_recipe(Path(__file__).parent.parent / "recipes" / "llama-3.1-8b-lesa.yaml").expand
    assert (
        published.method == "lesa" and published.lesa.variant == "published" and published.zero_init is None
    )
    # the LESA notebook's new layers: between base layers (15, 16) ... (30, 31)
    layer_map = plan_layers(32, get_method("lesa"), published.position, published.layers, None, None, None)
    assert [lay.parents for lay in layer_map if lay.new] == [(i, i + 1) for i in range(15, 31)]
    recipe = Path(__file__).parent.parent / "recipes" / "stories260k-lesa.yaml"
    args = ["expand", "--recipe", str(recipe), "--out", str(tmp_path / "o"), "--json"]
    result = CliRunner().invoke(app, [*args, "--lesa-epochs", "1", "--lesa-variant", "published"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["options"]["lesa"] | {"epochs": 1} == summary["options"]["lesa"]  # the flag won
    assert summary["lesa"]["variant"] == "published" and not summary["function_preserving"]
    assert summary["lesa"]["projections"]["q"]["loo"]["held_out"] == [1, 2, 3]  # the recipe's loo: 3
