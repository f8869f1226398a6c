"""docs/init-smollm2.md is what scripts/init_smollm2.py renders from its stored results
(docs/init-smollm2.json): a hand edit, or results regenerated without rendering, fails here; no figure
is typed into the renderer's prose; the verdicts follow the rules stated on the page; and the recipe
declares what the page says it does."""

from __future__ import annotations

import copy
import json
import re

import pytest

from otdus_cli.study import load_study_recipe
from scripts.init_smollm2 import CLOSE, DATA, DOC, OPEN, RECIPE, merge, render

# names that carry digits and are no figures (step 0: the expansion as written, before any training)
NAMES = re.compile(
    r"SmolLM2-135M(-Instruct)?|smollm2(-135m)?|stories260K|WikiText-2|Q4_1|L2|float32|bfloat16|init-smollm2"
    r"|study-smollm2-init|[Ss]tep[- ]0\b"
)
MARKED = re.compile(re.escape(OPEN) + r".*?" + re.escape(CLOSE), re.S)


def hand_typed(page: str) -> list[str]:
    """The digits of ``page`` (rendered with mark=True) outside the figures taken from the data."""
    prose = NAMES.sub("", MARKED.sub("", page))
    return re.findall(r"\S*\d\S*", prose)


@pytest.fixture(scope="module")
def data() -> dict:
    return json.loads(DATA.read_text())


def test_the_page_is_what_its_stored_results_render(data):
    assert render(data) == DOC.read_text(), "run: python -m scripts.init_smollm2 --render"


def test_the_renderer_types_no_figure(data):
    assert hand_typed(render(data, mark=True)) == []


def test_a_hand_typed_figure_is_found(data):
    page = render(data, mark=True)
    edited = page.replace("## Setup", "## Setup\n\nHealing takes 12 steps.", 1)
    assert hand_typed(edited) == ["12"]
    assert render(data) != render(data).replace("## Setup", "## Setup\n\nHealing takes 12 steps.", 1)


def test_distance_verdicts_follow_their_figures(data):
    page = render(data)
    kl = {k: v["kl"] for k, v in data["distances"].items()}
    order = " < ".join(f"`{x}`" for x in sorted(kl, key=kl.get))
    assert f"From least to most moved by KL on the distance windows: {order}." in page
    # make the most-moved arm the least moved: the sentence follows
    changed = copy.deepcopy(data)
    top = max(kl, key=kl.get)
    changed["distances"][top]["kl"] = -1.0
    assert f"From least to most moved by KL on the distance windows: `{top}` <" in render(changed)


def test_starting_above_the_base_lists_exactly_those_arms(data):
    study = data["study"]
    above = [m["label"] for m in study["methods"] if m["initial_loss"] > study["base_loss"]]
    assert (
        f"* Starting above the base's held-out loss: {', '.join(f'`{x}`' for x in above) or 'none'};"
        in render(data)
    )


def test_the_recipe_declares_ot_against_average_on_arms_without_zero_init():
    recipe = load_study_recipe(RECIPE)
    assert recipe.primary is not None and recipe.primary.reference == "ot"
    assert recipe.primary.against == ["average"]
    specs = recipe.run_specs()
    assert not any(s.options.zero_init for s in specs)
    assert {s.label for s in specs} >= {"ot", "average", "copy", "random", "lesa:published"}
    assert recipe.base == "models/smollm2-135m"


def _part(data: dict, labels: list[str], with_reference: bool) -> dict:
    """The stored result cut down to ``labels``' arms, as a part run by --runs (--alone) would hold."""
    part = copy.deepcopy(data)
    study = part["study"]
    study["methods"] = [m for m in study["methods"] if m["label"] in labels]
    study["runs"] = [r for r in study["runs"] if r["label"] in labels]
    study["config"]["methods"] = [m["label"] for m in study["methods"]]
    if not with_reference:
        study["reference"] = ""
        for m in study["methods"]:
            m["vs_reference"] = None
    part["distances"] = {k: v for k, v in part["distances"].items() if k in labels}
    part["conditions"] = {**part["conditions"], "processes": 1}
    return part


def test_parts_run_side_by_side_merge_into_the_whole(data):
    labels = [m["label"] for m in data["study"]["methods"]]
    ref = data["study"]["reference"]
    half = len(labels) // 2
    a, b = labels[:half], labels[half:]
    assert ref in a
    merged = merge([_part(data, a, True), _part(data, b, False)])
    assert merged["conditions"]["processes"] == 2
    assert merged["conditions"]["parts"] == [
        "--runs " + ",".join(x for x in a if x != ref),
        "--runs " + ",".join(b) + " --alone",
    ]
    assert list(merged["distances"]) == labels
    whole = {m["label"]: m for m in data["study"]["methods"]}
    for m in merged["study"]["methods"]:
        assert m["final_loss"] == whole[m["label"]]["final_loss"]
        if m["vs_reference"] is not None:
            assert m["vs_reference"]["mean"] == pytest.approx(
                whole[m["label"]]["vs_reference"]["mean"], abs=1e-12
            )
            assert m["vs_reference"]["p_holm"] == pytest.approx(whole[m["label"]]["vs_reference"]["p_holm"])
