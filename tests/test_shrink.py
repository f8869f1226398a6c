"""`otdus shrink` and `otdus plan --shrink`: layers removed or merged, written as transformers loads them.

The layer map in the manifest is checked against the tensors written (copies byte for byte; merged
layers against the formulas computed here from the source's tensors), the scores against
transformers' own hidden states, and a merge of a layer with its exact copy against the model
before the copy was made.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from otdus_cli.bundled import STORIES260K
from otdus_cli.cli import app
from otdus_cli.errors import OtdusError
from otdus_cli.expand import expand
from otdus_cli.io.reader import CheckpointReader
from otdus_cli.methods.registry import SHRINK_METHODS
from otdus_cli.options import ExpandOptions
from otdus_cli.plan.shrink_map import (
    LayerScores,
    merge_groups,
    removal_count,
    select_removed,
    shrink_layers,
)
from otdus_cli.shrink import ShrinkOptions, make_shrink_plan, shrink
from otdus_cli.source import open_source
from tests.support.cli_checks import no_output_left, one_error_line
from tests.support.tiny_models import DENSE_TYPES, MOE_TYPES, load_causal_lm, logits

pytestmark = [pytest.mark.usefixtures("single_thread")]

runner = CliRunner()
METHODS = list(SHRINK_METHODS)
PREFIX = "model.layers.{i}."


def _tensors(folder) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(folder)
    return {name: reader.get(name) for name in reader.names}


def _layer(tensors: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    prefix = PREFIX.format(i=i)
    return {n[len(prefix) :]: t for n, t in tensors.items() if n.startswith(prefix)}


def check_layer_map(source_dir, out_dir, manifest: dict) -> None:
    """The manifest's layer map is what the tensors hold: every kept layer a byte copy of its source
    layer, every merged layer the method's formula over its parents (ot: built from them), nothing
    outside the stack changed, and no tensor of a removed layer left."""
    src, out = _tensors(source_dir), _tensors(out_dir)
    depth = len(manifest["layers"])
    assert manifest["num_hidden_layers"] == depth
    assert not [n for n in out if n.startswith("model.layers.") and int(n.split(".")[2]) >= depth]
    for name, tensor in src.items():
        if not name.startswith("model.layers."):
            assert torch.equal(out[name], tensor), name
    for lay in manifest["layers"]:
        got = _layer(out, lay["index"])
        parents = [_layer(src, p) for p in lay["parents"]]
        assert set(got) == set(parents[0])
        for suffix, tensor in got.items():
            stack = [p[suffix].float() for p in parents]
            if not lay["new"]:
                assert lay["builder"] == "base" and lay["parents"] == [lay["source"]]
                assert torch.equal(tensor, parents[0][suffix]), suffix
            elif lay["builder"] == "average":
                torch.testing.assert_close(tensor.float(), sum(stack) / len(stack), rtol=0, atol=1e-6)
            elif lay["builder"] == "laco":
                expected = stack[0] + sum(t - stack[0] for t in stack[1:])
                torch.testing.assert_close(tensor.float(), expected, rtol=0, atol=1e-6)
            else:
                assert lay["builder"] == "ot" and tensor.shape == parents[0][suffix].shape
                assert torch.isfinite(tensor).all()
    removed = manifest["shrink"]["removed"]
    kept = [lay["source"] for lay in manifest["layers"]]
    assert sorted(set(range(manifest["source"]["num_hidden_layers"])) - set(kept)) == removed
    merged = [sorted(lay["parents"]) for lay in manifest["layers"] if lay["new"]]
    assert [sorted(g) for g in manifest["shrink"]["merged"]] == merged


# -- the layer map ------------------------------------------------------------------------------


def test_removal_counts_and_their_refusals():
    assert removal_count(8, None, None) == 1
    assert removal_count(8, 3, None) == 3
    assert removal_count(8, None, 0.25) == 2
    for layers, ratio, message in [
        (8, None, "leaves none"),
        (9, None, "leaves none"),
        (None, 1.0, "between 0 and 1"),
        (None, 0.01, "at least one"),
        (2, 0.5, "not both"),
    ]:
        with pytest.raises(OtdusError, match=message):
            removal_count(8, layers, ratio)


def test_merge_groups_join_each_run_to_the_kept_layer_before_it():
    assert merge_groups(6, [2]) == [(1, 2)]
    assert merge_groups(6, [2, 3]) == [(1, 2, 3)]
    assert merge_groups(6, [0]) == [(1, 0)]  # a run at the bottom joins the layer after it
    assert merge_groups(6, [0, 1, 4]) == [(2, 0, 1), (3, 4)]
    drop = shrink_layers(6, [1, 4], "base")
    assert [(lay.index, lay.source, lay.new) for lay in drop] == [
        (0, 0, False),
        (1, 2, False),
        (2, 3, False),
        (3, 5, False),
    ]
    merged = shrink_layers(6, [1, 4], "laco")
    assert [(lay.source, lay.parents, lay.builder) for lay in merged] == [
        (0, (0, 1), "laco"),
        (2, (2,), "base"),
        (3, (3, 4), "laco"),
        (5, (5,), "base"),
    ]


def test_selections_pick_by_the_scores_and_refuse_layers_that_do_not_exist():
    scores = LayerScores(
        [0.5, 0.1, 0.3, 0.05, 0.9], {1: [0.4, 0.2, 0.3, 0.1, 0.6], 2: [0.5, 0.3, 0.2, 0.7]}, 0, ""
    )
    assert select_removed(5, 2, "bi", scores=scores) == [1, 3]  # the two lowest Block Influence
    assert select_removed(5, 2, "angular", scores=scores) == [2, 3]  # the closest block of two
    assert select_removed(5, None, "explicit", [4, 0]) == [0, 4]
    with pytest.raises(OtdusError, match=r"--remove 5: the model has layers 0..4"):
        select_removed(5, None, "explicit", [5])
    with pytest.raises(OtdusError, match="at least one must stay"):
        select_removed(5, None, "explicit", [0, 1, 2, 3, 4])
    with pytest.raises(OtdusError, match="--layers asks for 1"):
        select_removed(5, 1, "explicit", [1, 2])


def test_scores_are_those_of_transformers_hidden_states():
    """Block Influence and angular distances from verify's streamed pass equal the ones computed from
    transformers' own hidden states on the same calibration windows: over one layer and over blocks
    of the removal count (the only sizes measured), and the angular selection is the block closest
    by transformers' own distances."""
    from otdus_cli.methods.ot.calibration import calibration_windows
    from otdus_cli.shrink import scores_of

    windows = calibration_windows(STORIES260K, "bundled:tinystories-sample", 1024, 512)
    model = load_causal_lm(STORIES260K)
    last: list[torch.Tensor] = []
    hook = model.model.layers[-1].register_forward_hook(
        lambda module, args, out: last.append(out[0] if isinstance(out, tuple) else out)
    )
    with torch.no_grad():
        states = model(input_ids=windows, output_hidden_states=True).hidden_states
    hook.remove()
    # hidden_states[-1] has the final norm applied: the last layer's own output is taken by the hook
    hidden = [*states[:-1], last[0]]

    def distance(i: int, j: int) -> float:
        cos = torch.nn.functional.cosine_similarity(hidden[i].double(), hidden[j].double(), dim=-1)
        return float((torch.arccos(cos.clamp(-1, 1)) / torch.pi).mean())

    for block in (2, 3):
        scores = scores_of(STORIES260K, "bundled:tinystories-sample", 1024, block)
        assert sorted(scores.angular) == [1, block]
        for i in range(5):
            cos = torch.nn.functional.cosine_similarity(hidden[i].double(), hidden[i + 1].double(), dim=-1)
            assert scores.block_influence[i] == pytest.approx(float(1 - cos.mean()), abs=1e-5)
            assert scores.angular[1][i] == pytest.approx(distance(i, i + 1), abs=1e-5)
        expected = [distance(i, i + block) for i in range(6 - block)]
        assert scores.angular[block] == pytest.approx(expected, abs=1e-5)
        start = min(range(len(expected)), key=expected.__getitem__)
        assert select_removed(5, block, "angular", scores=scores) == list(range(start, start + block))
        assert scores.tokens == windows.numel() and len(scores.block_influence) == 5


def test_ignored_options_follow_the_methods_declarations():
    """The manifest's ignored options: another method's whole option group, the options the shrink
    sets itself, what the chosen method's own declaration ignores for these values (OT's exact solver
    has no Sinkhorn settings), and the calibration text only where nothing reads it."""
    from otdus_cli.shrink import ignored_options

    drop = ignored_options(ShrinkOptions(method="drop", layers=1))
    assert drop["ot.reg"] == "only --method ot uses OT options, not drop"
    assert "calib" not in drop  # the bi selection scores on it
    emd = ignored_options(ShrinkOptions(method="ot", remove=[2], ot={"solver": "emd"}))
    assert emd == {
        "laco.variant": "only --method laco uses LaCo options, not ot",
        "ot.calib": "the shrink's calib and calib_tokens apply",
        "ot.calib_tokens": "the shrink's calib and calib_tokens apply",
        "ot.reg": "--solver emd is exact (no Sinkhorn)",
        "ot.tol": "--solver emd is exact (no Sinkhorn)",
        "ot.max_iter": "--solver emd is exact (no Sinkhorn)",
        "calib": "--select explicit scores nothing",
        "calib_tokens": "--select explicit scores nothing",
        **dict.fromkeys(
            ("laco_merge", "laco_interval", "laco_threshold", "laco_top", "laco_bottom"),
            "only --select laco reads it",
        ),
    }
    activation = ShrinkOptions(method="ot", remove=[2], calib_tokens=512, ot={"variant": "activation"})
    assert "calib" not in ignored_options(activation)  # the activation variant calibrates on it
    assert activation.method_options().calib_tokens == 512 and activation.method_variant() == "activation"


# -- outputs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_each_method_shrinks_stories260k_into_a_model_transformers_loads(tmp_path, method):
    result = shrink(
        "bundled:stories260k", tmp_path / "out", ShrinkOptions(method=method, layers=2, select="angular")
    )
    manifest = json.loads((tmp_path / "out" / "otdus.json").read_text())
    assert manifest == result.manifest | {"files": manifest["files"]}
    assert manifest["operation"] == "shrink" and manifest["method"] == method
    assert manifest["shrink"]["select"] == "angular" and len(manifest["shrink"]["removed"]) == 2
    assert manifest["shrink"]["scores"]["tokens"] > 0
    check_layer_map(STORIES260K, tmp_path / "out", manifest)
    model = load_causal_lm(tmp_path / "out")
    assert model.config.num_hidden_layers == 3 and len(model.model.layers) == 3
    assert torch.isfinite(logits(model)).all()
    card = (tmp_path / "out" / "README.md").read_text()
    assert "depth-pruning" in card and "removed: source layers" in card


@pytest.mark.compat
@pytest.mark.parametrize("method", ["average", "laco", "ot"])
def test_merging_a_layer_with_its_own_copy_gives_back_the_model_before_the_copy(tmp_path, method):
    """interpose duplicates layer 2; merging the copy back (into layer 2, its kept neighbour) with any
    merge method must give layer 2 again: the average and LaCo of equal layers are the layer, and OT's
    exact assignment between equal layers is the identity."""
    expand("bundled:stories260k", tmp_path / "deep", ExpandOptions(method="interpose", after=[2]))
    options = ShrinkOptions(method=method, remove=[3], ot={"variant": "structured", "solver": "emd"})
    shrink(str(tmp_path / "deep"), tmp_path / "back", options)
    base = logits(load_causal_lm(STORIES260K))
    back = logits(load_causal_lm(tmp_path / "back"))
    torch.testing.assert_close(back, base, rtol=0, atol=1e-5)
    assert not torch.equal(logits(load_causal_lm(tmp_path / "deep")), base)  # the test can fail


def test_ot_merges_three_layers_with_equal_weights(tmp_path):
    """A group of three equal layers merged by OT (two aligned pairs, combined) is that layer."""
    expand("bundled:stories260k", tmp_path / "deep", ExpandOptions(method="copy", after=[2, 2]))
    options = ShrinkOptions(method="ot", remove=[3, 4], ot={"variant": "structured", "solver": "emd"})
    result = shrink(str(tmp_path / "deep"), tmp_path / "back", options)
    assert result.manifest["shrink"]["merged"] == [[2, 3, 4]]
    torch.testing.assert_close(
        logits(load_causal_lm(tmp_path / "back")), logits(load_causal_lm(STORIES260K)), rtol=0, atol=1e-5
    )


@pytest.mark.compat
@pytest.mark.parametrize("model_type", DENSE_TYPES + MOE_TYPES)
def test_every_family_shrinks_with_every_method(tiny_models, tmp_path, model_type):
    source = tiny_models[model_type]
    config = json.loads((source / "config.json").read_text())
    depth = config["num_hidden_layers"]
    for method in METHODS:
        out = tmp_path / method
        family = open_source(str(source)).family
        if SHRINK_METHODS[method].refusal(family):
            with pytest.raises(OtdusError, match="cannot merge"):
                shrink(str(source), out, ShrinkOptions(method=method, remove=[2]))
            continue
        result = shrink(str(source), out, ShrinkOptions(method=method, remove=[2]))
        check_layer_map(source, out, result.manifest)
        if method == "ot" and model_type in MOE_TYPES:  # experts matched by the OT flow's MoE step
            assert "experts" in result.manifest["transport"]["1"]["modules"]
        written = json.loads((out / "config.json").read_text())
        kept = [i for i in range(depth) if i != 2]
        assert written["num_hidden_layers"] == depth - 1
        if isinstance(config.get("layer_types"), list):
            assert written["layer_types"] == [config["layer_types"][i] for i in kept]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = load_causal_lm(out)
        assert model.config.num_hidden_layers == depth - 1
        assert torch.isfinite(logits(model)).all()


def test_layers_of_different_kinds_are_not_merged(tiny_models, tmp_path):
    source = str(tiny_models["deepseek_v3"])  # layer 0 dense, the others mixture-of-experts
    with pytest.raises(
        OtdusError, match=r"layers 0, 1 would be merged into one, but they are of different kinds"
    ):
        make_shrink_plan(open_source(source), ShrinkOptions(method="average", remove=[0]))
    plan = make_shrink_plan(open_source(source), ShrinkOptions(method="drop", remove=[0]))
    assert [lay.source for lay in plan.layer_map] == [1, 2, 3]


# -- the command line ---------------------------------------------------------------------------


def test_shrink_help_shows_the_library_defaults():
    """The defaults --help names are ShrinkOptions' own."""
    text = " ".join(runner.invoke(app, ["shrink", "--help"], env={"COLUMNS": "300"}).stdout.split())
    defaults = ShrinkOptions()
    assert defaults.method == "drop" and "[default: drop]" in text
    assert defaults.selection == "bi" and "[default: bi; explicit with --remove]" in text
    assert defaults.calib == "bundled:tinystories-sample" and "[default: bundled:tinystories-sample]" in text
    assert defaults.calib_tokens == 4096 and "[default: 4096]" in text
    assert removal_count(5, defaults.layers, defaults.ratio) == 1 and "[default: 1; laco: no cap]" in text
    assert f"[default: {defaults.ot.variant}]" in text and "--calib-tokens" in text
    assert f"(LaCo's C). [default: {defaults.laco_merge}]" in text
    assert f"(LaCo's I). [default: {defaults.laco_interval}]" in text
    assert f"(LaCo's T). [default: {defaults.laco_threshold}]" in text
    assert f"(LaCo's L). [default: {defaults.laco_bottom}]" in text and defaults.laco_top is None


def test_plan_shrink_shows_what_shrink_writes_and_writes_nothing(tmp_path):
    args = ["bundled:stories260k", "--layers", "2", "--select", "bi", "--calib-tokens", "1024"]
    planned = runner.invoke(app, ["plan", *args[:1], "--shrink", "laco", *args[1:], "--json"])
    assert planned.exit_code == 0, planned.output
    plan = json.loads(planned.stdout)
    bi = plan["scores"]["block_influence"]
    assert plan["removed"] == sorted(sorted(range(5), key=lambda i: bi[i])[:2])
    assert list(tmp_path.iterdir()) == []
    done = runner.invoke(app, ["shrink", *args, "--method", "laco", "--out", str(tmp_path / "out"), "--json"])
    assert done.exit_code == 0, done.output
    summary = json.loads(done.stdout)
    assert summary["removed"] == plan["removed"] and summary["layers"] == plan["layers"]
    assert summary["merged"] == [list(lay["parents"]) for lay in plan["layers"] if lay["new"]]
    shown = runner.invoke(app, ["plan", "bundled:stories260k", "--shrink", "drop", "--remove", "1,3"])
    assert shown.exit_code == 0 and "removes layers 1, 3" in shown.stdout


def test_plan_shrink_takes_laco_selection_flags_as_shrink_does(tmp_path):
    """`plan --shrink --select laco` plans with the --laco-* flags shrink takes (without them the
    released defaults cannot run on a 5-layer model), and plans what shrink then writes; alone,
    a --laco-* flag is one error line."""
    args = [
        "bundled:stories260k",
        "--select",
        "laco",
        "--laco-merge",
        "2",
        "--laco-threshold",
        "0.1",
        "--layers",
        "1",
    ]
    args += ["--calib-tokens", "1024"]
    planned = runner.invoke(app, ["plan", args[0], "--shrink", "average", *args[1:], "--json"])
    assert planned.exit_code == 0, planned.output
    plan = json.loads(planned.stdout)
    assert plan["select"] == "laco" and plan["laco"] is not None and len(plan["merged"][0]) == 2
    done = runner.invoke(
        app, ["shrink", *args, "--method", "average", "--out", str(tmp_path / "out"), "--json"]
    )
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["layers"] == plan["layers"]
    alone = runner.invoke(app, ["plan", "bundled:stories260k", "--laco-merge", "2"])
    one_error_line(alone, 2, "--laco-merge plans a shrink: give --shrink METHOD too")


def test_plan_help_gives_the_ot_variant_default_of_a_shrink_too():
    """plan's --ot-variant is expand's flag; a merge (--shrink ot) defaults to another variant."""
    shown = runner.invoke(app, ["plan", "--help"], env={"COLUMNS": "400"})
    assert "[default: paper; with --shrink: structured]" in " ".join(shown.stdout.split())


def test_a_recipe_shrinks_as_its_flags_would(tmp_path):
    recipe = tmp_path / "shrink.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model": "bundled:stories260k",
                "out": str(tmp_path / "out"),
                "shrink": {"method": "ot", "remove": [3], "ot": {"variant": "structured"}},
            }
        )
    )
    done = runner.invoke(app, ["shrink", "--recipe", str(recipe), "--json"])
    assert done.exit_code == 0, done.output
    manifest = json.loads((tmp_path / "out" / "otdus.json").read_text())
    assert manifest["options"]["ot"]["variant"] == "structured" and manifest["shrink"]["merged"] == [[2, 3]]
    assert manifest["transport"]["2"]["variant"] == "structured"


@pytest.mark.parametrize(
    ("remove", "message"),
    [([], "List should have at least 1 item"), ([1, 1], "names a layer twice ([1, 1])")],
)
def test_a_recipe_removing_no_layer_or_one_twice_is_refused(tmp_path, remove, message):
    recipe = tmp_path / "shrink.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {"model": "bundled:stories260k", "out": str(tmp_path / "out"), "shrink": {"remove": remove}}
        )
    )
    one_error_line(runner.invoke(app, ["shrink", "--recipe", str(recipe)]), 2, f"shrink.remove: {message}")
    assert not (tmp_path / "out").exists()


SHRINK_RECIPES = sorted((Path(__file__).parent.parent / "recipes").glob("shrink-*.yaml"))
SMOLLM2_RECIPES = [
    r for r in SHRINK_RECIPES if yaml.safe_load(r.read_text())["model"] == "models/smollm2-135m"
]


@pytest.mark.parametrize("recipe", [r for r in SHRINK_RECIPES if r not in SMOLLM2_RECIPES])
def test_the_shipped_shrink_recipes_plan(recipe):
    """Every shipped shrink recipe on a bundled model is valid and plans on it (offline)."""
    from otdus_cli.shrink import load_shrink_recipe, plan_shrink

    loaded = load_shrink_recipe(recipe)
    plan = plan_shrink(loaded.model, loaded.shrink)
    assert len(plan.layer_map) == plan.source.depth - len(plan.removed) and plan.removed


@pytest.mark.slow
@pytest.mark.parametrize("recipe", SMOLLM2_RECIPES)
def test_the_shipped_smollm2_shrink_recipes_plan(recipe, smollm2):
    """The SmolLM2-135M shrink recipes (models/smollm2-135m, which `make smollm2` builds) plan on it."""
    from otdus_cli.shrink import load_shrink_recipe, plan_shrink

    loaded = load_shrink_recipe(recipe)
    plan = plan_shrink(str(smollm2), loaded.shrink)
    assert plan.source.depth == 30 and len(plan.layer_map) == 30 - loaded.shrink.layers


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--remove", "0,1,2,3,4"], "--remove names all 5 layers"),
        (["--remove", "5"], "--remove 5: the model has layers 0..4"),
        (["--layers", "5"], "removing 5 of 5 layers leaves none"),
        (["--ratio", "1.5"], "--ratio 1.5: Input should be less than 1"),
        (["--remove", "2", "--select", "angular"], "goes with --select explicit"),
        (["--remove", "2", "--ratio", "0.2"], "leave out --ratio"),
        (["--method", "ot", "--ot-variant", "official", "--solver", "emd", "--remove", "2"], "no emd solver"),
    ],
)
def test_bad_requests_are_one_line_and_exit_two_with_nothing_written(tmp_path, args, message):
    result = runner.invoke(app, ["shrink", "bundled:stories260k", "--out", str(tmp_path / "out"), *args])
    one_error_line(result, 2, message)
    no_output_left(tmp_path)


def test_plan_shrink_refuses_an_expand_method_s_flag_by_its_own_name():
    """`plan --shrink` shows every method's plan flags; one of a method no shrink has is refused by
    its own name (it once reached OT's options and was reported as --ot-variant)."""
    result = runner.invoke(
        app, ["plan", "bundled:stories260k", "--shrink", "ot", "--remove", "2", "--lesa-variant", "published"]
    )
    one_error_line(result, 2, "--lesa-variant is an option of --method lesa, which no shrink has")


def test_a_calibration_text_too_short_to_score_is_refused(tmp_path):
    (tmp_path / "short.txt").write_text("Once upon a time there was a cat.\n")
    args = ["--out", str(tmp_path / "out"), "--calib", str(tmp_path / "short.txt")]
    result = runner.invoke(app, ["shrink", "bundled:stories260k", *args])
    one_error_line(result, 2, "fewer than the 512 scoring the layers needs; give a longer text")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["short.txt"]


def test_merging_layers_of_different_kinds_is_refused_on_the_command_line(tiny_models, tmp_path):
    source = str(tiny_models["deepseek_v3"])
    result = runner.invoke(
        app, ["shrink", source, "--out", str(tmp_path / "out"), "--method", "laco", "--remove", "0"]
    )
    one_error_line(result, 2, "of different kinds")
    no_output_left(tmp_path)


def test_verify_reports_the_change_against_the_source_and_what_was_removed(tmp_path):
    shrink("bundled:stories260k", tmp_path / "out", ShrinkOptions(method="average", remove=[3]))
    args = ["verify", str(tmp_path / "out"), "--protocol", "token", "--seq-len", "64", "--max-tokens", "512"]
    report = runner.invoke(app, [*args, "--text", "bundled:tinystories-sample", "--json", "--device", "cpu"])
    assert report.exit_code == 0, report.output
    data = json.loads(report.stdout)
    assert data["shrink"]["removed"] == [3] and data["shrink"]["merged"] == [[2, 3]]
    assert data["expanded"]["token_perplexity"] != data["base"]["token_perplexity"]
    text = runner.invoke(app, [*args, "--text", "bundled:tinystories-sample", "--device", "cpu", "--quiet"])
    assert text.exit_code == 0, text.output
    assert (
        "shrink: source layer 3 removed (explicit selection), merged into one layer each: 2, 3" in text.stdout
    )
    assert "shrunk" in text.stdout


def test_verify_static_on_a_shrink_names_what_was_removed_and_expects_no_parity(tmp_path):
    """--static runs nothing: it says which layers a shrink removed or merged, that no parity is
    expected, and whether the kept layers are the source layers the manifest names, not that the
    function-preservation proof failed."""
    shrink("bundled:stories260k", tmp_path / "drop", ShrinkOptions(method="drop", remove=[2]))
    shrink("bundled:stories260k", tmp_path / "laco", ShrinkOptions(method="laco", remove=[3, 4]))
    dropped = runner.invoke(app, ["verify", str(tmp_path / "drop"), "--static"])
    assert dropped.exit_code == 0, dropped.output
    text = " ".join(dropped.stdout.split())
    assert "shrink: source layer 2 dropped (explicit selection); no parity expected" in text
    assert (
        "static check of a shrink: 4 of 4 kept layers hold the source layers the layer map names, "
        "0 merged layers built from several; embeddings, final norm and head the source's" in text
    )
    assert "not shown function-preserving" not in text
    merged = runner.invoke(app, ["verify", str(tmp_path / "laco"), "--static"])
    assert merged.exit_code == 0, merged.output
    text = " ".join(merged.stdout.split())
    assert "source layers 3, 4 removed (explicit selection), merged into one layer each: 2, 3, 4" in text
    assert "2 of 2 kept layers hold the source layers the layer map names, 1 merged layer built" in text
    as_json = runner.invoke(app, ["verify", str(tmp_path / "laco"), "--static", "--json"])
    assert as_json.exit_code == 0, as_json.output
    data = json.loads(as_json.stdout)
    assert data["shrink"]["removed"] == [3, 4] and data["shrink"]["merged"] == [[2, 3, 4]]
    assert data["claims_preserving"] is False and data["exit_code"] == 0


def test_verify_static_on_a_shrink_names_a_kept_layer_that_is_not_its_source_layer(tmp_path):
    """A kept layer edited after the shrink no longer holds the source layer the manifest names: the
    static check says which (a shrink claims no parity, so the exit code stays 0)."""
    from safetensors.torch import load_file, save_file

    shrink("bundled:stories260k", tmp_path / "drop", ShrinkOptions(method="drop", remove=[2]))
    weights = tmp_path / "drop" / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.3.mlp.down_proj.weight"] += 1.0  # output layer 3: source layer 4
    save_file(tensors, weights, metadata={"format": "pt"})
    edited = runner.invoke(app, ["verify", str(tmp_path / "drop"), "--static"])
    assert edited.exit_code == 0, edited.output
    text = " ".join(edited.stdout.split())
    assert "3 of 4 kept layers hold the source layers the layer map names" in text
    assert "layers 3 differ from the source layers the map names" in text


@pytest.mark.slow
def test_shrink_runs_under_a_memory_limit_smaller_than_the_checkpoint(tmp_path):
    """Scores streamed one layer at a time and a three-layer OT merge built one module at a time: the
    whole shrink fits in a memory limit the checkpoint's bytes alone exceed (as expand's and verify's
    memory test, tests/test_verify_cli.py). One intra-op thread: the OT merge peaks at ~0.76 GB with
    one, at ~0.91 GB with two (each thread's allocator keeps its own free memory), which left too
    little room under the limit for every run to pass (one make test-long run of two failed there)."""
    from tests.support.memory_limits import run_limited, write_random_checkpoint

    size = write_random_checkpoint(tmp_path / "big", layers=20, hidden=1024, inter=4096)
    limit = 1_000_000_000
    assert size > 1.3 * limit
    for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        (tmp_path / "big" / f).write_bytes((STORIES260K / f).read_bytes())
    args = ["-m", "otdus_cli.cli", "shrink", str(tmp_path / "big"), "--out", str(tmp_path / "small")]
    options = ["--method", "ot", "--ot-variant", "structured", "--layers", "2", "--select", "angular"]
    done = run_limited(
        [*args, *options, "--calib-tokens", "512", "--device", "cpu", "--json"],
        limit,
        {"OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout)
    assert summary["num_hidden_layers"] == 18 and len(summary["merged"]) == 1
    assert len(summary["merged"][0]) == 3
    manifest = json.loads((tmp_path / "small" / "otdus.json").read_text())
    assert manifest["layers"] == summary["layers"] and manifest["shrink"]["merged"] == summary["merged"]
    assert CheckpointReader(tmp_path / "small").config["num_hidden_layers"] == 18


@pytest.mark.distributed
@pytest.mark.slow  # two ranks, each importing torch: make test-long (expand's twin stays in make test)
def test_shrink_on_two_ranks_writes_the_bytes_of_one_process(tmp_path):
    """Rank 0 measures the scores once; both ranks plan with them and build a merged layer each."""
    from tests.support.ranks import one_process, same_output, two_ranks

    args = ["--method", "ot", "--ot-variant", "structured", "--remove", "1,3", "--max-shard-size", "300KB"]
    scored = ["--method", "laco", "--layers", "2", "--select", "bi", "--calib-tokens", "1024", "--json"]
    for name, flags in (("explicit", [*args, "--json"]), ("scored", scored)):
        (tmp_path / name).mkdir()
        single = one_process(["shrink", "bundled:stories260k", "--out", str(tmp_path / name / "one"), *flags])
        double = two_ranks(["shrink", "bundled:stories260k", "--out", str(tmp_path / name / "two"), *flags])
        assert single.returncode == 0 and double.returncode == 0, double.stderr[-12000:]
        assert json.loads(double.stdout)["removed"] == json.loads(single.stdout)["removed"]
        same_output(tmp_path / name / "one", tmp_path / name / "two")
