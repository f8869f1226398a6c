"""Study settings: one validated model (defaults for the library, the recipes and the CLI), the plateau
stop rule, the per-method learning-rate sweep on a validation split, and scoring every held-out window."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from otdus_cli.cli import app
from otdus_cli.errors import OtdusError
from otdus_cli.study import StudySettings, load_study_recipe, study
from otdus_cli.study.evidence import DOSE
from otdus_cli.study_settings import PlateauRule, plateau_reached, study_settings

RECIPES = Path(__file__).parent.parent / "recipes"


def _curve(means, spread=0.0, n=8):
    """Per-window losses at each evaluation: each evaluation's mean, windows spread around it."""
    return [[m + spread * (1 if k % 2 else -1) * (k + 1) / n for k in range(n)] for m in means]


def test_plateau_rule_stops_when_the_last_window_brings_no_real_improvement():
    rule = PlateauRule(window=2, tolerance=0.01, noise=0.0)
    assert not plateau_reached(rule, _curve([3.0, 2.5]))  # too few evaluations to judge
    assert not plateau_reached(rule, _curve([3.0, 2.5, 2.2]))  # still falling by 0.3
    assert plateau_reached(rule, _curve([3.0, 2.5, 2.499, 2.495]))  # 0.005 < 0.01 over two evaluations
    assert plateau_reached(rule, _curve([3.0, 2.5, 2.6, 2.7]))  # rising counts as no improvement
    # the best of the last `window` evaluations counts, not only the last one
    assert not plateau_reached(rule, _curve([3.0, 2.5, 2.3, 2.6]))


def test_plateau_rule_noise_floor_is_a_paired_standard_error():
    """A drop of 0.02 is real when every window falls alike, noise when the windows disagree."""
    rule = PlateauRule(window=1, tolerance=0.0, noise=2.0)
    same = [[1.0, 2.0, 3.0, 4.0], [0.98, 1.98, 2.98, 3.98]]
    assert not plateau_reached(rule, same)  # SE 0: any fall counts
    mixed = [[1.0, 2.0, 3.0, 4.0], [0.9, 2.06, 2.9, 4.06]]  # mean fall 0.02, SE 0.046
    assert plateau_reached(rule, mixed)
    assert not plateau_reached(rule.model_copy(update={"noise": 0.25}), mixed)


def test_settings_validate_and_name_what_is_wrong():
    s = study_settings(seeds=[0], until_plateau={"max_steps": 10}, lr_sweep=[1e-3, 3e-3], eval_windows="all")
    assert s.until_plateau.max_steps == 10 and s.until_plateau.window == PlateauRule().window
    assert s.uses_validation and s.max_steps == 10 and not StudySettings().uses_validation
    for bad, word in [
        ({"stepz": 3}, "stepz"),
        ({"until_plateau": {"windw": 2}}, "windw"),
        ({"lr_sweep": [1e-3, 1e-3]}, "lr_sweep"),
        ({"eval_windows": 0}, "eval_windows"),
        ({"seeds": [1, 1]}, "seeds"),
    ]:
        with pytest.raises(OtdusError, match=word):
            study_settings(bad)


def test_recipes_carry_the_plateau_rule_and_the_sweep(tmp_path):
    recipe = load_study_recipe(RECIPES / "study-plateau.yaml")
    for name in ("in-domain", "new-domain"):
        s = recipe.study_settings(name)
        assert s.until_plateau is not None and len(s.lr_sweep) >= 3 and s.eval_windows == "all"
    assert recipe.primary.against == ["average", "copy", "average+zero"]
    arms = [r.name for r in recipe.runs]
    assert all(level in arms for level, _ in DOSE) and len(DOSE) >= 5  # the dose-response's levels
    bad = tmp_path / "r.yaml"
    bad.write_text(
        "base: bundled:stories260k\nsettings: {until_plateau: {max_step: 3}}\n"
        "runs: [{name: ot, expand: {method: ot}}]\n"
        "studies: [{name: s, train_text: bundled:tinystories-sample}]\n"
    )
    with pytest.raises(OtdusError, match="max_step"):
        load_study_recipe(bad)


TINY = dict(
    seeds=[0, 1],
    batch=2,
    seq_len=32,
    validation_fraction=0.25,
    validation_windows=6,
    eval_windows="all",
    lr_sweep=[3e-4, 3e-3],
    until_plateau={"eval_every": 2, "window": 2, "tolerance": 0.0, "noise": 0.0, "max_steps": 6},
    expand_options={"layers": 1},
    threads=1,
)


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """Two tiny studies that differ only in their held-out text."""
    folder = tmp_path_factory.mktemp("texts")
    a, b = folder / "a.txt", folder / "b.txt"
    a.write_text("Once upon a time there was a small red boat on a lake. " * 12)
    b.write_text("The cat sat by the door and looked at the rain all day long. " * 12)
    return [
        study(
            "bundled:stories260k", "bundled:tinystories-sample", str(text), methods=["average+zero"], **TINY
        )
        for text in (a, b)
    ]


def test_sweep_chooses_each_methods_rate_on_validation_and_never_on_held_out(swept):
    first, second = swept
    m = first.summary("average+zero")
    best = min(m.lr_sweep, key=lambda x: x["validation_loss"])
    assert [x["lr"] for x in m.lr_sweep] == TINY["lr_sweep"] and m.lr == best["lr"]
    assert all(r.lr == m.lr for r in first.runs)
    # the first seed's scored run is the sweep's run at the chosen rate
    seed0 = next(r for r in first.runs if r.seed == 0)
    assert seed0.validation_loss[-1] == best["validation_loss"] and seed0.eval_steps[-1] == best["steps"]
    # another held-out text changes the scores, not one decision: rates, stops and curves are the same
    assert second.summary("average+zero").lr_sweep == m.lr_sweep
    for x, y in zip(first.runs, second.runs, strict=True):
        assert x.validation_loss == y.validation_loss and x.validation_steps == y.validation_steps
        assert x.final_loss != y.final_loss
    assert first.config["lr_sweep"] == TINY["lr_sweep"] and first.config["until_plateau"]["max_steps"] == 6


def test_every_held_out_window_is_scored_at_start_and_stop(swept):
    from otdus_cli.bundled import STORIES260K
    from otdus_cli.study.data import load_documents, window_documents
    from otdus_cli.verify.metrics import load_tokenizer

    r = swept[0]
    every = window_documents(load_tokenizer(str(STORIES260K)), load_documents(r.data["eval"]), 32)[0]
    assert r.data["eval_windows"] == every.shape[0] > 6
    # the validation split comes from the training text: 5 stories -> 4 trained on, 1 for validation
    assert (r.data["train_documents"], r.data["validation_documents"]) == (4, 1)
    m = r.summary("average+zero")
    assert m.function_preserving and m.initial_equals_base  # step 0 on every held-out window = base
    for run in r.runs:
        assert len(run.final_window_loss) == every.shape[0]
        assert run.eval_steps == [0, run.validation_steps[-1]] and run.eval_loss[0] == r.base_loss


def test_plateau_rule_stops_training(tmp_path):
    """A tolerance no improvement can reach stops at the first evaluation the rule can judge; a
    window the run never fills runs to max_steps and says it did not plateau."""
    common = dict(TINY, seeds=[0], lr_sweep=None, eval_windows=2, lr=1e-3)
    stop = dict(eval_every=2, window=2, tolerance=10.0, noise=0.0, max_steps=20)
    never = dict(eval_every=2, window=9, tolerance=0.0, noise=0.0, max_steps=6)
    runs = {}
    for name, rule in (("stop", stop), ("never", never)):
        r = study(
            "bundled:stories260k",
            "bundled:tinystories-sample",
            methods=["average+zero"],
            **dict(common, until_plateau=rule),
        )
        runs[name] = r.runs[0]
    assert runs["stop"].validation_steps == [0, 2, 4] and runs["stop"].plateaued is True
    assert runs["never"].validation_steps == [0, 2, 4, 6] and runs["never"].plateaued is False
    assert len(runs["never"].train_loss) == 6


def test_cli_takes_the_sweep_and_reads_its_defaults_from_the_settings(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "base: bundled:stories260k\nreference: average+zero\nexpand: {layers: 1}\n"
        "settings: {seeds: [0], batch: 2, seq_len: 32, validation_fraction: 0.25, validation_windows: 4,\n"
        "  eval_windows: 4, threads: 1, until_plateau: {eval_every: 2, window: 1, max_steps: 4}}\n"
        "runs: [{name: average+zero, expand: {method: average, zero_init: true}}]\n"
        "studies: [{name: s, train_text: bundled:tinystories-sample}]\n"
    )
    args = ["study", "--recipe", str(recipe), "--lr-sweep", "1e-3,2e-3", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (out,) = json.loads(result.stdout).values()
    assert [x["lr"] for x in out["methods"][0]["lr_sweep"]] == [1e-3, 2e-3]
    bad = CliRunner().invoke(app, ["study", "--recipe", str(recipe), "--lr-sweep", "1e-3,-1"])
    assert bad.exit_code == 2 and "positive numbers" in bad.output
