"""Every registered method's options reach the user the same ways: as `otdus expand` flags (the
fields marked Flag), as recipe keys ``expand.<method>.<field>``, and as study arms' settings, and
each survives a recipe round trip. A method's option group merges key by key with the one it
overrides, so no method's options can be dropped (a study run's ``lesa`` group once replaced the
recipe's, turning its ``lesa.epochs: 2`` back into 10)."""

from __future__ import annotations

import typing
from typing import Any

import pytest
import typer.main
import yaml

from otdus_cli.cli import app
from otdus_cli.cli.checkpoint import LayoutFlags, _options
from otdus_cli.cli.flags import method_flags
from otdus_cli.methods.registry import METHODS
from otdus_cli.options import load_recipe, option_groups
from otdus_cli.study import StudyRecipe

GROUPS = option_groups()


def _other_value(info: Any) -> Any:
    """A valid value of an options field other than its default."""
    kind = typing.get_args(info.annotation) if info.annotation is not None else ()
    if typing.get_origin(info.annotation) is typing.Literal:
        return next(v for v in reversed(kind) if v != info.default)
    if info.default is None:
        return 3  # an optional count (LESA's rank)
    if isinstance(info.default, bool):
        return not info.default
    if isinstance(info.default, int):
        return info.default + 1
    if isinstance(info.default, float):
        return info.default / 2
    return f"{info.default}-other"


def _changed(group: str) -> dict[str, Any]:
    return {name: _other_value(info) for name, info in GROUPS[group].model_fields.items()}


def test_the_methods_with_options():
    assert list(GROUPS) == ["ot", "lesa"]
    assert all(METHODS[name].options is model for name, model in GROUPS.items())


@pytest.mark.parametrize("group", list(GROUPS))
def test_every_changed_option_is_valid(group):
    """The values the checks below use pass the model's own rules (so a failure below is a drop)."""
    assert GROUPS[group](**_changed(group)).model_dump() == _changed(group)


@pytest.mark.parametrize("group", list(GROUPS))
def test_flags_reach_the_options(group):
    """Each flagged field is an `expand` flag whose value lands in ExpandOptions.<group>.<field>."""
    flags = [f for f in method_flags() if f.group == group]
    assert flags, f"{group} has no flag"
    command = typer.main.get_command(app).commands["expand"]
    shown = {name for p in command.params for name in p.opts}
    changed = _changed(group)
    args = ["--method", group]
    for f in flags:
        assert f.flag.name in shown, f.flag.name
        args += [f.flag.name, str(changed[f.field])]
    params = command.make_context("expand", ["bundled:stories260k", *args]).params
    given = {f.key: params[f.param] for f in method_flags()}
    _, options, _ = _options("bundled:stories260k", LayoutFlags(method=group), given)
    got = getattr(options, group)
    for f in flags:
        assert getattr(got, f.field) == changed[f.field], f.key


@pytest.mark.parametrize("group", list(GROUPS))
def test_recipe_keys_round_trip(group, tmp_path):
    changed = _changed(group)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"model": "m", "expand": {"method": group, group: changed}}))
    recipe = load_recipe(path)
    assert getattr(recipe.expand, group).model_dump() == changed
    # and back: the recipe written from the loaded options loads to the same options
    path.write_text(yaml.safe_dump(recipe.model_dump()))
    assert load_recipe(path) == recipe


@pytest.mark.parametrize("group", list(GROUPS))
def test_study_arms_keep_every_option(group):
    """A study recipe's option group and a run's own group for the same method merge key by key."""
    changed = _changed(group)
    fields = list(changed)
    first, rest = fields[0], fields[1:]
    recipe = StudyRecipe.model_validate(
        {
            "base": "m",
            "expand": {"method": group, group: {k: changed[k] for k in rest}},
            "runs": [
                {"name": "own", "expand": {group: {first: changed[first]}}},
                {"name": "shared"},
            ],
            "studies": [{"name": "s", "train_text": "t"}],
        }
    )
    own, shared = (getattr(spec.options, group).model_dump() for spec in recipe.run_specs())
    assert own == changed
    assert shared == {**GROUPS[group]().model_dump(), **{k: changed[k] for k in rest}}


def test_a_rule_across_options_reads_the_same_in_every_recipe(tmp_path):
    """A model rule's message (OT's official variant has no emd solver) without pydantic's
    "Value error, " prefix, in expand recipes, study recipes and study runs alike."""
    from otdus_cli.errors import OtdusError
    from otdus_cli.study import load_study_recipe

    rule = "expand.ot: --ot-variant official reproduces the released code's POT Sinkhorn"
    expand_recipe = tmp_path / "e.yaml"
    expand_recipe.write_text("model: m\nexpand: {ot: {variant: official, solver: emd}}\n")
    with pytest.raises(OtdusError) as caught:
        load_recipe(expand_recipe)
    assert str(caught.value).startswith(f"recipe {expand_recipe}: {rule}"), caught.value
    study_recipe = tmp_path / "s.yaml"
    study_recipe.write_text(
        "base: m\nruns: [{name: official, expand: {ot: {variant: official, solver: emd}}}]\n"
        "studies: [{name: s, train_text: t}]\n"
    )
    with pytest.raises(OtdusError) as caught:
        load_study_recipe(study_recipe)
    assert str(caught.value).startswith("run 'official': ot: --ot-variant official reproduces"), caught.value
