"""study: reproducible numbers, function-preserving arms start exactly at the base's loss,
paired statistics, method specs and recipes."""

import json
import math
from pathlib import Path

import pytest

from otdus_cli.errors import OtdusError
from otdus_cli.study import StudyResult, load_study_recipe, parse_method, study
from otdus_cli.study.data import Documents, load_documents, split_documents
from otdus_cli.study.report import study_markdown, study_table

RECIPE = Path(__file__).parent.parent / "recipes" / "study-table6.yaml"
SMALL = dict(
    seeds=[0],
    steps=3,
    lr=1e-3,
    batch=2,
    seq_len=64,
    eval_every=2,
    eval_windows=3,
    eval_fraction=0.2,
    expand_options={"layers": 1},
)


# (parameters before, parameters after, curve) of each training run of the `first` study, in order
OBSERVED: list[tuple] = []


@pytest.fixture(scope="module")
def first():
    import otdus_cli.study.runner as runner

    real_train = runner.train

    def observed(model, *args, **kwargs):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        curve = real_train(model, *args, **kwargs)
        OBSERVED.append((before, {n: p.detach().clone() for n, p in model.named_parameters()}, curve))
        return curve

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner, "train", observed)
        return study(
            "bundled:stories260k",
            "bundled:tinystories-sample",
            methods=["average+zero", "average", "random"],
            reference="average+zero",
            **SMALL,
        )


# Paper Table 6 ablation plus the review's 2x2 (OT / Average x zero-init), the OT variants, sharper
# plans (exact assignment; Sinkhorn at reg 0.01), and LESA (the paper's remaining baseline), with
# zero-init and as published. Labels are names (recipes/study-table6.yaml), not method specs.
TABLE6_METHODS = (
    "ot",
    "ot+nozero",
    "average+zero",
    "average",
    "ot:structured",
    "ot:official",
    "ot/emd",
    "ot/reg0.01",
    "ot:activation/emd",
    "copy",
    "random",
    "lesa",
    "lesa:published",
)


def test_zero_init_starts_exactly_at_base_loss(first):
    zero = first.summary("average+zero")
    assert zero.function_preserving and zero.initial_equals_base
    assert first.runs[0].eval_loss[0] == first.base_loss  # bit-identical, not just close
    assert first.runs[0].eval_steps == [0, 2, 3]


def test_non_preserving_arms_do_not_start_at_base(first):
    avg = first.summary("average")
    assert not avg.function_preserving and not avg.initial_equals_base
    assert avg.initial_loss > first.base_loss + 0.05  # plain averaging clearly breaks the model
    rnd = first.summary("random")
    assert not rnd.function_preserving and rnd.initial_loss != first.base_loss


def test_reproducible_and_independent_of_other_arms(first):
    again = study(
        "bundled:stories260k", "bundled:tinystories-sample", methods=["average", "average+zero"], **SMALL
    )
    for label in ("average+zero", "average"):
        a = [r for r in first.runs if r.label == label][0]
        b = [r for r in again.runs if r.label == label][0]
        assert a.eval_loss == b.eval_loss and a.train_loss == b.train_loss
        assert a.final_window_loss == b.final_window_loss
    assert again.base_loss == first.base_loss
    # the default reference `ot` is not among these methods: no differences, and the result says why
    assert again.reference == "" and all(m.vs_reference is None for m in again.methods)
    assert any("'ot' is not among the methods" in note for note in again.notes)
    assert "'ot' is not among the methods" in study_markdown(again)


def test_only_new_layers_trained_and_report(first, tmp_path):
    zero = first.summary("average+zero")
    assert zero.num_hidden_layers == 6
    assert zero.trainable_parameters == 45_440  # one stories260K layer (of ~260K parameters in all)
    vs = first.summary("average").vs_reference
    assert vs["reference"] == "average+zero" and vs["n"] == 1
    # one seed: the interval comes from the evaluation windows (3 here), paired window by window
    assert vs["error"] == "windows" and vs["n_windows"] == 3 and vs["low"] < vs["mean"] < vs["high"]
    for r in first.runs:  # the final loss is the mean of the per-window losses
        assert len(r.final_window_loss) == 3
        assert r.final_loss == pytest.approx(sum(r.final_window_loss) / 3, rel=1e-15)
    assert not first.notes  # the held-out text gave the 3 windows asked, and the reference is there
    data = json.loads(first.to_json())
    assert data["methods"][0]["label"] == "average+zero" and math.isclose(data["base_ppl"], first.base_ppl)
    assert "average" in study_markdown(first)
    study_table(first)
    written = first.save(tmp_path / "out", plot=False)
    assert written[0].name == "study.json"
    assert StudyResult.load(tmp_path / "out").to_dict() == first.to_dict()


def test_only_new_layer_tensors_change_in_training(first):
    """Training the new layers only: every base tensor stays bitwise what it was, every tensor of the
    new layer moves (the real training loop, observed around the average+zero run)."""
    import torch

    before, after, curve = OBSERVED[0]
    new = {n for n in before if n.startswith("model.layers.4.")}  # 5 layers, one new at the top: index 4
    assert len(new) == 9 and len(before) == 6 * 9 + 2  # + embeddings (tied head) and the final norm
    for name in before:
        assert torch.equal(before[name], after[name]) == (name not in new), name
    assert curve.trainable_parameters == sum(before[n].numel() for n in new)


def test_parse_method_specs():
    spec = parse_method("ot:structured+nozero", {"layers": 2, "ot": {"reg": 0.1}})
    assert spec.options.method == "ot" and spec.options.zero_init is False
    assert spec.options.ot.variant == "structured" and spec.options.ot.reg == 0.1 and spec.options.layers == 2
    assert parse_method("average+zero").options.zero_init is True
    assert parse_method("copy").options.zero_init is None
    assert parse_method("interpose").options.method == "interpose"  # copy-type growth, issue 14
    assert parse_method("stack+zero").options.method == "stack"
    with pytest.raises(OtdusError):
        parse_method("average:structured")
    with pytest.raises(OtdusError):
        parse_method("ot+maybe")
    with pytest.raises(OtdusError):
        parse_method("nonsense")


def test_split_keeps_documents_disjoint():
    docs = Documents("d", ["a", "b", "c", "a", "e"])
    train, held = split_documents(docs, 0.4)
    assert train.documents == ["a", "b", "c"] and held.documents == ["e"]  # the repeated "a" is dropped
    sample = load_documents("bundled:tinystories-sample")
    assert len(sample.documents) >= 4 and all("<|endoftext|>" not in d for d in sample.documents)


def test_shipped_recipe_validates():
    recipe = load_study_recipe(RECIPE)
    labels = [s.label for s in recipe.run_specs()]
    assert labels[:4] == ["ot", "ot+nozero", "average+zero", "average"]
    by = {s.label: s.options for s in recipe.run_specs()}
    assert by["ot+nozero"].zero_init is False and by["ot:official"].ot.variant == "official"
    assert by["lesa"].lesa.variant == "pair" and by["lesa:published"].lesa.variant == "published"
    assert labels == list(TABLE6_METHODS)  # the recipe runs the Table 6 arms, in their order
    assert all(o.layers == 2 and o.position == "top" for o in by.values())
    assert [s.name for s in recipe.studies] == ["in-domain", "new-domain"]
    # the evidence recipe: 5 seeds and 128 shared evaluation windows, so that both error sources can be
    # estimated (even so, a sign test over 5 seeds cannot reach 0.05: 2 / 2^5 = 0.0625)
    assert len(recipe.settings["seeds"]) >= 5 and recipe.settings["eval_windows"] >= 128


def test_bad_recipe_setting_refused(tmp_path):
    bad = tmp_path / "r.yaml"
    bad.write_text(
        "base: bundled:stories260k\nsettings: {stepz: 3}\nruns: [{name: ot, expand: {method: ot}}]\n"
        "studies: [{name: s, train_text: bundled:tinystories-sample}]\n"
    )
    with pytest.raises(OtdusError, match="stepz"):
        load_study_recipe(bad)


def test_recipe_runs_subset_keeps_the_reference_and_lesa_starts_at_base(tmp_path):
    from otdus_cli.study import run_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "base: bundled:stories260k\nreference: average+zero\nexpand: {layers: 1}\n"
        "runs:\n  - {name: average+zero, expand: {method: average, zero_init: true}}\n"
        "  - {name: copy, expand: {method: copy}}\n"
        "  - {name: lesa, expand: {method: lesa, lesa: {epochs: 1}}}\n"
        "studies: [{name: s, train_text: bundled:tinystories-sample}]\n"
    )
    small = {k: v for k, v in SMALL.items() if k != "expand_options"}
    (result,) = run_recipe(recipe, runs=["lesa"], overrides=small).values()
    assert [m.label for m in result.methods] == ["average+zero", "lesa"]
    lesa = result.summary("lesa")
    assert lesa.function_preserving and lesa.initial_equals_base  # zero-init LESA: exactly the base
    with pytest.raises(OtdusError, match="unknown run"):
        run_recipe(recipe, runs=["lesa:paper"])


def test_evaluation_windows_spread_over_the_held_out_text():
    """The evaluation windows are evenly spaced over the whole held-out stream (windows from the
    first article or two alone are not a sample of the text); without spread, the first ones."""
    import bisect
    import itertools

    import torch

    from otdus_cli.bundled import STORIES260K
    from otdus_cli.study.data import tokenize_windows, window_documents
    from otdus_cli.verify.metrics import load_tokenizer

    tokenizer = load_tokenizer(str(STORIES260K))
    docs = load_documents("bundled:tinystories-sample")
    every = tokenize_windows(tokenizer, docs, 32)
    spread = tokenize_windows(tokenizer, docs, 32, 4, spread=True)
    n = every.shape[0]
    assert n > 8 and torch.equal(spread, every[[0, n // 4, n // 2, 3 * n // 4]])
    assert torch.equal(tokenize_windows(tokenizer, docs, 32, 4), every[:4])
    assert torch.equal(tokenize_windows(tokenizer, docs, 32, n + 5, spread=True), every)
    # each window's document: the one its first token comes from (its text, or the BOS opening it)
    windows, owners = window_documents(tokenizer, docs, 32, 4, spread=True)
    assert torch.equal(windows, spread) and len(set(owners)) > 1
    ends = list(
        itertools.accumulate(
            1 + len(tokenizer(d, add_special_tokens=False)["input_ids"]) for d in docs.documents
        )
    )
    starts = [k * n // 4 * 32 for k in range(4)]  # stream offset of each spread window
    assert owners == [bisect.bisect_right(ends, s) for s in starts]


def test_interpose_stack_recipe_grows_the_same_copies_in_two_places():
    """recipes/study-interpose-stack.yaml: 5 -> 10 layers by interposition (l0 l0' l1 l1' ...) and
    by stacking (l0..l4 l0'..l4'), plain copies both (nothing zeroed), compared with stacking, under
    exactly the Table 6 study's protocol (settings, texts, seeds), so the two are comparable."""
    from otdus_cli.methods.registry import get_method
    from otdus_cli.plan.layer_map import plan_layers

    recipe = load_study_recipe(RECIPE.parent / "study-interpose-stack.yaml")
    table6 = load_study_recipe(RECIPE)
    assert recipe.reference == "stack" and [s.label for s in recipe.run_specs()] == ["stack", "interpose"]
    assert recipe.settings == table6.settings and recipe.studies == table6.studies
    layouts = {}
    for spec in recipe.run_specs():
        o = spec.options
        plan = plan_layers(5, get_method(o.method), o.position, o.layers, o.ratio, o.after, o.zero_init)
        assert not any(layer.zero_init for layer in plan)
        layouts[spec.label] = [(layer.source, layer.new) for layer in plan]
    assert layouts["interpose"] == [(i, new) for i in range(5) for new in (False, True)]
    assert layouts["stack"] == [(i, False) for i in range(5)] + [(i, True) for i in range(5)]


def test_a_cache_the_caller_owns_keeps_the_arms_checkpoints(tmp_path):
    """study(expansions=...) trains the checkpoints the caller's cache holds, and leaves them there
    (scripts/init_smollm2.py measures them after the study)."""
    from otdus_cli.study.arms import ExpansionCache, resolve_runs

    cache = ExpansionCache("bundled:stories260k", tmp_path)
    r = study(
        "bundled:stories260k",
        "bundled:tinystories-sample",
        methods=["copy"],
        reference=None,
        expansions=cache,
        **SMALL,
    )
    (spec,) = resolve_runs(["copy"], SMALL["expand_options"])
    folder, manifest = cache.get(spec.options, 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]  # made by the study, not now
    assert (
        json.loads((folder / "config.json").read_text())["num_hidden_layers"] == r.runs[0].num_hidden_layers
    )
    assert manifest["new_parameters"]
