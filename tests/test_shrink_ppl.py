"""docs/shrink-ppl.md is what scripts/shrink_ppl.py renders from its stored results (docs/shrink-ppl.json):
a hand edit, or results regenerated without rendering, fails here; and those results cover every
method, selection and count, as written and healed on both texts."""

from __future__ import annotations

import json

from scripts.shrink_ppl import COUNTS, DATA, DOC, HEAL_EVALS, METHODS, SELECTIONS, compare, render


def test_the_document_is_what_its_stored_results_render():
    assert render(json.loads(DATA.read_text())) == DOC.read_text(), (
        "run: python -m scripts.shrink_ppl --render"
    )


def test_the_stored_results_cover_every_method_selection_and_count_as_written_and_healed():
    data = json.loads(DATA.read_text())
    written = {(r["label"], r["select"], r["count"]) for r in data["as_written"]}
    wanted = {(label, select, count) for label, _, _ in METHODS for select in SELECTIONS for count in COUNTS}
    assert wanted <= written
    healed = {}
    for st in data["healing"]["studies"]:
        assert set(st["results"]) == set(HEAL_EVALS)
        for result in st["results"].values():
            assert [m["label"] for m in result["methods"]] == [label for label, _, _ in METHODS]
            assert not result["config"]["train_new_only"]
        for select in st["selections"]:
            healed[select, st["count"]] = st["removed"]
    # every selection's shrink of every count was healed (selections that chose the same layers share one)
    for select in SELECTIONS:
        for count in COUNTS:
            removed = next(
                r["removed"] for r in data["as_written"] if (r["select"], r["count"]) == (select, count)
            )
            assert healed[select, count] == removed


def test_intervals_compare_as_the_verdict_says():
    low, high, wide = [1.0, 1.1, 0.9, 1.0], [3.0, 3.1, 2.9, 3.0], [0.0, 4.0, 0.5, 3.5]
    assert (compare(low, high), compare(high, low), compare(low, wide)) == ("lower", "higher", "overlapping")
