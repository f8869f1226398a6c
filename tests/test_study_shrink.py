"""study's shrink arms: the base shrunk by `otdus shrink`, then healed on the study's batches with every
parameter trained; its step-0 loss is the shrunk model's own; the specs, recipes and refusals that
declare such arms."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from typer.testing import CliRunner

from otdus_cli.bundled import STORIES260K
from otdus_cli.cli import app
from otdus_cli.errors import OtdusError
from otdus_cli.options import ExpandOptions
from otdus_cli.shrink import ShrinkOptions, shrink
from otdus_cli.study import RunSpec, load_study_recipe, parse_method, study
from otdus_cli.study.runner import prepare_data
from otdus_cli.study.train import load_model, window_losses
from otdus_cli.study_settings import study_settings
from otdus_cli.verify.metrics import load_tokenizer
from tests.support.cli_checks import one_error_line

pytestmark = [pytest.mark.usefixtures("single_thread")]

runner = CliRunner()
SETTINGS = dict(
    seeds=[0],
    steps=2,
    lr=1e-3,
    batch=2,
    seq_len=64,
    eval_every=2,
    eval_windows=3,
    eval_fraction=0.2,
    train_new_only=False,
)


def test_shrink_arm_specs_carry_the_method_variant_and_selection():
    spec = parse_method("shrink:ot:structured@angular", shrink_overrides={"layers": 2})
    assert isinstance(spec.options, ShrinkOptions) and spec.label == "shrink:ot:structured@angular"
    o = spec.options
    assert (o.method, o.ot.variant, o.selection, o.layers) == ("ot", "structured", "angular", 2)
    drop = parse_method("shrink:drop", {"layers": 3}).options  # expand's overrides are not a shrink's
    assert drop.method == "drop" and drop.selection == "bi" and drop.layers is None
    assert isinstance(parse_method("ot:structured", {"layers": 3}).options, ExpandOptions)
    for spec, message in [
        ("shrink:average:structured", "only laco and ot have variants"),
        ("shrink:merge", "shrink arm 'merge'"),
        ("shrink:drop@best", "shrink arm 'drop@best'"),
    ]:
        with pytest.raises(OtdusError, match=message):
            parse_method(spec)


@pytest.fixture(scope="module")
def stories(tmp_path_factory) -> str:
    """Forty TinyStories stories: a training text of the study that is not the shrink's default
    calibration text."""
    from otdus_cli.bundled import read_bundled_text

    text = read_bundled_text("bundled:tinystories-train-2mib")
    path = tmp_path_factory.mktemp("text") / "stories.txt"
    path.write_text("<|endoftext|>".join(text.split("<|endoftext|>")[:41]))
    return str(path)


@pytest.fixture(scope="module")
def healed(stories):
    return study(
        "bundled:stories260k",
        stories,
        methods=["shrink:drop", RunSpec("laco", ShrinkOptions(method="laco", calib="bundled:wikitext-test"))],
        reference="shrink:drop",
        shrink_options={"remove": [3]},
        **SETTINGS,
    )


def test_a_shrink_arm_starts_at_the_shrunk_models_loss_and_heals_every_parameter(healed, stories, tmp_path):
    """Step 0 is the model `otdus shrink` writes, scored on the study's own held-out windows; training
    updates every parameter of it (a shrink adds no layer to train alone)."""
    shrink("bundled:stories260k", tmp_path / "drop", ShrinkOptions(method="drop", remove=[3]))
    model = load_model(str(tmp_path / "drop"), torch.device("cpu"))
    settings = study_settings(None, **SETTINGS)
    data = prepare_data(load_tokenizer(STORIES260K), stories, None, settings)
    losses = window_losses(model, data.held_out)
    drop = healed.summary("shrink:drop")
    assert drop.initial_loss == pytest.approx(math.fsum(losses) / len(losses), rel=1e-6)
    assert drop.initial_loss != healed.base_loss and not drop.function_preserving
    assert drop.num_hidden_layers == 4 and drop.options["remove"] == [3]
    assert drop.trainable_parameters == sum(p.numel() for p in model.parameters())
    laco = healed.summary("laco")
    assert laco.initial_loss != drop.initial_loss  # a merge is not the drop
    assert laco.vs_reference is not None and laco.vs_reference["reference"] == "shrink:drop"
    assert laco.options["select"] is None and laco.options["remove"] is None  # shrink_options: spec arms only
    assert laco.num_hidden_layers == 4  # bi selection: one layer, scored on the named text
    # the layers are scored on the study's training text, unless the arm names its own
    assert drop.options["calib"] == stories and laco.options["calib"] == "bundled:wikitext-test"
    assert healed.config["shrink_options"] == {"remove": [3]}
    for run in healed.runs:
        assert run.eval_steps == [0, 2] and run.final_loss != run.initial_loss


def test_shrink_arms_need_the_whole_model_trained():
    with pytest.raises(OtdusError, match=r"shrink:drop add no layers to train alone.*--train-all"):
        study(
            "bundled:stories260k",
            "bundled:tinystories-sample",
            methods=["ot", "shrink:drop"],
            **(SETTINGS | {"train_new_only": True}),
        )
    args = [
        "study",
        "bundled:stories260k",
        "--train",
        "bundled:tinystories-sample",
        "--methods",
        "shrink:drop",
    ]
    one_error_line(runner.invoke(app, args), 2, "add no layers to train alone")


def test_a_recipe_declares_shrink_runs_over_its_shrink_block(tmp_path):
    recipe = {
        "base": "bundled:stories260k",
        "reference": "drop",
        "shrink": {"layers": 2, "select": "angular"},
        "settings": {"train_new_only": False},
        "runs": [
            {"name": "drop", "shrink": {"method": "drop"}},
            {"name": "ot", "shrink": {"method": "ot", "select": "bi", "ot": {"variant": "structured"}}},
            {"name": "grown", "expand": {"method": "copy", "layers": 1}},
        ],
        "studies": [{"name": "s", "train_text": "bundled:tinystories-sample"}],
    }
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    drop, ot, grown = load_study_recipe(path).run_specs(shrink_overrides={"layers": 1})
    assert isinstance(drop.options, ShrinkOptions) and isinstance(grown.options, ExpandOptions)
    assert (drop.options.method, drop.options.selection, drop.options.layers) == ("drop", "angular", 1)
    assert (ot.options.selection, ot.options.ot.variant) == ("bi", "structured")
    assert grown.options.method == "copy" and grown.options.layers == 1
    recipe["runs"].append({"name": "both", "expand": {"method": "copy"}, "shrink": {"method": "drop"}})
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(OtdusError, match="run 'both': give one of expand, shrink, not several"):
        load_study_recipe(path)
    recipe["runs"][-1] = {"name": "bad", "shrink": {"method": "drop", "position": "top"}}
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(OtdusError, match="run 'bad': position"):
        load_study_recipe(path)


def test_the_study_command_runs_shrink_arms_removing_layers_by_its_layers_flag(stories):
    args = [
        "study",
        "bundled:stories260k",
        "--train",
        stories,
        "--methods",
        "shrink:drop@angular,shrink:average",
    ]
    quick = [
        "--layers",
        "2",
        "--train-all",
        "--reference",
        "shrink:drop@angular",
        "--seeds",
        "0",
        "--steps",
        "1",
    ]
    small = ["--batch", "2", "--seq-len", "64", "--eval-windows", "2", "--eval-every", "1", "--json"]
    done = runner.invoke(app, [*args, *quick, *small])
    assert done.exit_code == 0, done.output
    result = json.loads(done.stdout)["study"]
    assert result["config"]["shrink_options"] == {"layers": 2}
    assert [m["num_hidden_layers"] for m in result["methods"]] == [3, 3]
    assert [m["options"]["select"] for m in result["methods"]] == ["angular", None]
    assert "shrinking, then healing" in done.stderr
