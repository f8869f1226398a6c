"""docs/shrink-ppl.md is what scripts/shrink_ppl.py renders from its stored results (docs/shrink-ppl.json):
a hand edit, or results regenerated without rendering, fails here; and those results cover every
method, selection and count, as written and healed on both texts."""

from __future__ import annotations

import json
import re

from scipy.stats import ttest_rel

from scripts.shrink_ppl import (
    COUNTS,
    DATA,
    DOC,
    HEAL_EVALS,
    METHODS,
    OT_LABELS,
    RIVALS,
    SELECTIONS,
    interval,
    paired,
    render,
)


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


def test_a_paired_test_separates_what_overlapping_intervals_do_not():
    """Windows differ far more from each other than the two models do: the perplexity intervals overlap,
    the per-window differences (all near +0.1) do not leave zero in doubt; p is scipy's paired t test."""
    base = [1.0 + 0.5 * (w % 7) for w in range(40)]
    worse = [x + 0.1 + 0.01 * (w % 3) for w, x in enumerate(base)]
    _, low, high = interval(base)
    assert interval(worse)[1] < high  # the intervals overlap
    c = paired(worse, base)
    assert c["low"] > 0 and abs(c["p"] - ttest_rel(worse, base).pvalue) < 1e-12


def test_every_as_written_comparison_in_the_document_is_a_paired_test_of_the_stored_losses():
    """A figure typed into the document, or a comparison made another way, fails: every OT-against-rival
    cell of the as-written comparisons is recomputed here from the stored window losses (the mean
    difference, and scipy's paired t test, whose p Holm's adjustment may only raise, by at most the
    number of comparisons)."""
    data = json.loads(DATA.read_text())
    names = list(data["evals"])
    rows = {(r["label"], r["select"], r["count"]): r for r in data["as_written"] if r["count"]}
    comparisons = [line for line in DOC.read_text().splitlines() if " − " in line]
    lines = {" | ".join(line.split(" | ")[:2]): line for line in comparisons}
    shrinks = {(r["count"], tuple(r["removed"])): select for (_, select, _), r in rows.items()}
    checked = 0
    for (count, removed), select in shrinks.items():
        for ot in OT_LABELS:
            for rival in RIVALS:
                line = lines[f"| {', '.join(map(str, removed))} | {ot} − {rival}"]
                cells = line.strip(" |").split(" | ")[2:]
                for name, cell in zip(names, cells, strict=True):
                    mine, theirs = (
                        rows[ot, select, count]["losses"][name],
                        rows[rival, select, count]["losses"][name],
                    )
                    diff = sum(mine) / len(mine) - sum(theirs) / len(theirs)
                    assert cell.startswith(f"{diff:+.4f} ["), (ot, rival, name, cell)
                    shown = float(re.search(r", p ([0-9.e+-]+):", cell).group(1))
                    p = ttest_rel(mine, theirs).pvalue
                    family = len(shrinks) * len(OT_LABELS) * len(RIVALS) * len(names)
                    assert p * 0.995 <= shown <= min(1.0, family * p) * 1.005, (cell, p)  # shown to 3 digits
                    checked += 1
    assert checked == len(shrinks) * len(OT_LABELS) * len(RIVALS) * len(names)
