"""docs/shrink-smollm2.md is what scripts/shrink_smollm2.py renders from its stored results
(docs/shrink-smollm2.json), and every figure in it is recomputed here from the stored per-window losses:
a hand-typed figure, or results regenerated without rendering, fails. Reads the stored JSON only."""

from __future__ import annotations

import json
import math
import re
import statistics

import pytest
from scipy.stats import ttest_rel

from scripts.shrink_smollm2 import (
    COMPARISONS,
    COUNTS,
    DATA,
    DOC,
    LACO_MERGES,
    METHODS,
    SELECTIONS,
    TOY,
    WINDOW,
    WINDOWS,
    render,
)


@pytest.fixture(scope="module")
def data() -> dict:
    return json.loads(DATA.read_text())


@pytest.fixture(scope="module")
def page() -> str:
    return DOC.read_text()


def _rows(data: dict) -> dict:
    return {(r["label"], r["select"], r["count"]): r for r in data["rows"]}


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split(" | ")]


def test_the_page_is_what_its_stored_results_render(data, page):
    assert render(data, json.loads(TOY.read_text())) == page, "run: python -m scripts.shrink_smollm2 --render"


def test_the_stored_results_cover_every_method_selection_and_count_on_the_declared_windows(data):
    rows = _rows(data)
    assert data["counts"] == list(COUNTS)
    for count in COUNTS:
        for select in SELECTIONS:
            removed = rows["drop", select, count]["removed"]
            assert len(removed) == count
            for label, _, _ in METHODS:  # every method removed the layers the selection chose
                assert rows[label, select, count]["removed"] == removed
    assert [loop["merge"] for loop in data["laco_loops"]] == list(LACO_MERGES)
    for loop in data["laco_loops"]:  # a row for each prefix of the kept merges that removes a count here
        kept = [t for t in loop["tried"] if t["accepted"]]
        prefixes = [sorted({i for t in kept[:k] for i in t["layers"][1:]}) for k in range(1, len(kept) + 1)]
        mine = f"C = {loop['merge']})"
        laco = [r["removed"] for r in data["rows"] if r["select"] == "laco" and mine in r["label"]]
        assert laco == [p for p in prefixes if len(p) in data["counts"]]
    assert data["comparisons"] == [list(c) for c in COMPARISONS]  # the family declared in the generator
    for name, ev in data["evals"].items():
        assert (ev["windows"], ev["seq_len"]) == (WINDOWS, WINDOW), name
        for r in data["rows"]:
            assert len(r["losses"][name]) == WINDOWS


def _ppl(losses: list[float]) -> tuple[float, float, float]:
    """exp(mean) and the normal 95% interval over the windows, computed here, not by the script."""
    mean = statistics.fmean(losses)
    half = 1.96 * statistics.stdev(losses) / math.sqrt(len(losses))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def _shown(x: float) -> str:
    return f"{x:.2f}" if x < 1e6 else f"{x:.3g}"


def test_every_perplexity_in_the_page_is_recomputed_from_the_stored_losses(data, page):
    rows = _rows(data)
    names = list(data["evals"])
    select = None
    checked = 0
    for line in page.splitlines():
        if line.startswith("## "):  # past the tables of one selection each
            select = None
        if line.startswith("### Selected by"):
            select = re.search(r"--select (\w+)", line).group(1)
            continue
        cells = _cells(line) if line.startswith("| ") else []
        if select and len(cells) == 3 + len(names) and cells[0].isdigit():
            count, label = int(cells[0]), cells[2]
            r = rows[label, "" if label == "none (source)" else select, count]
        elif len(cells) == 3 + len(names) and cells[0].startswith("laco, LaCo's selection"):
            r = rows[cells[0], "laco", int(cells[1])]
            cells = [cells[1], cells[2], cells[0], *cells[3:]]  # as the tables above: count, layers, label
        else:
            continue
        assert cells[1] == ", ".join(map(str, r["removed"]))
        for name, shown in zip(names, cells[3:], strict=True):
            ppl, low, high = _ppl(r["losses"][name])
            assert shown == f"{_shown(ppl)} [{_shown(low)}, {_shown(high)}]", (line, name)
            checked += 1
    laco = sum(r["select"] == "laco" for r in data["rows"])
    wanted = (
        len(SELECTIONS) * (1 + len(data["counts"]) * len(METHODS)) + laco
    )  # the source row heads each table
    assert checked == wanted * len(names)


def test_every_comparison_in_the_page_is_a_paired_test_of_the_stored_losses(data, page):
    """Each comparison cell: the mean per-window difference, and scipy's paired t test, whose p Holm's
    adjustment may only raise, by at most the size of the family."""
    rows = _rows(data)
    names = list(data["evals"])
    lines = [_cells(line) for line in page.splitlines() if " − " in line and line.startswith("| ")]
    lines = [c for c in lines if c[0].isdigit()]
    family = len(lines) * len(names)
    laco = {r["label"] for r in data["rows"] if r["select"] == "laco"}
    pairs = {tuple(c) for c in COMPARISONS} | {(label, "drop") for label in laco}
    seen = set()
    for cells in lines:
        count, removed = int(cells[0]), cells[1]
        a, b = cells[2].split(" − ")
        assert (a, b) in pairs
        if a in laco:  # LaCo's selection, against drop of as many layers by Block Influence
            first, second = rows[a, "laco", count], rows[b, "bi", count]
        else:
            select = next(
                s for s in SELECTIONS if ", ".join(map(str, rows["drop", s, count]["removed"])) == removed
            )
            first, second = rows[a, select, count], rows[b, select, count]
        assert ", ".join(map(str, first["removed"])) == removed
        for name, cell in zip(names, cells[3:], strict=True):
            mine, theirs = first["losses"][name], second["losses"][name]
            diff = statistics.fmean(x - y for x, y in zip(mine, theirs, strict=True))
            assert cell.startswith(f"{diff:+.4f} ["), (cells, name)
            shown = float(re.search(r", p ([0-9.e+-]+):", cell).group(1))
            p = ttest_rel(mine, theirs).pvalue
            assert p * 0.995 <= shown <= min(1.0, family * p) * 1.005, (cells, name, p)
            said = (
                "lower" if shown < 0.05 and diff < 0 else "higher" if shown < 0.05 else "no clear difference"
            )
            assert cell.endswith(f": {said}"), cell
        seen.add((count, removed, a, b))
    distinct = {
        (c, ", ".join(map(str, rows["drop", s, c]["removed"]))) for c in data["counts"] for s in SELECTIONS
    }
    assert len(seen) == len(distinct) * len(COMPARISONS) + sum(r["select"] == "laco" for r in data["rows"])


def test_every_verdict_tally_is_counted_from_the_comparison_table(page):
    """The counts a verdict sentence gives are the words of its comparison's cells in the table."""
    names_line = next(
        line for line in page.splitlines() if line.startswith("| removed | layers | comparison")
    )
    n_texts = len(_cells(names_line)) - 3
    words: dict[tuple[str, str], list[str]] = {}
    for line in page.splitlines():
        cells = _cells(line) if line.startswith("| ") and " − " in line else []
        if cells and cells[0].isdigit():
            a, b = cells[2].split(" − ")
            words.setdefault((a, b), []).extend(c.rsplit(": ", 1)[1] for c in cells[3 : 3 + n_texts])
    checked = 0
    for line in page.splitlines():
        m = re.match(
            r"- (.+?) against (.+?): .*?\(\1's loss lower in (\d+) of (\d+) comparisons, higher in "
            r"(\d+), no clear difference in (\d+)\)",
            line,
        )
        if m:
            w = words[m.group(1), m.group(2)]
            assert [int(x) for x in m.group(3, 4, 5, 6)] == [
                w.count("lower"),
                len(w),
                w.count("higher"),
                w.count("no clear difference"),
            ], line
            checked += 1
    assert checked == len(words)  # every comparison of the table has its verdict
