"""docs/evidence.md's generated blocks: they are what scripts/evidence.py renders from the stored
results, and the verdicts, contrasts and error split they print agree with scipy on fixed inputs."""

import re
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from otdus_cli.study import PrimaryFamily
from otdus_cli.study.evidence import (
    ALIGNMENT_VS_AVERAGE,
    DOSE,
    across_studies_lines,
    blocks,
    contrasts_markdown,
    dose_response_markdown,
    error_markdown,
    error_parts,
    primary_markdown,
    render_document,
    strip_generated,
    verdict_lines,
)
from otdus_cli.study.stats import holm, tost
from tests.support.study_results import study_from_window_losses

ROOT = Path(__file__).parent.parent
DOC = ROOT / "docs" / "evidence.md"
RECIPES = {
    "table6": ROOT / "recipes" / "study-table6.yaml",
    "interpose-stack": ROOT / "recipes" / "study-interpose-stack.yaml",
    "plateau": ROOT / "recipes" / "study-plateau.yaml",
}
# A figure: a decimal, a number with thousands separators, a percentage, "41k".
FIGURE = re.compile(r"(?<![\w./-])[-+±]?(?:\d+(?:\.\d+)?%|\d+(?:,\d{3})+(?:\.\d+)?|\d*\.\d+|\d+k\b)")
# Settings the prose may name (they are inputs, fixed in the recipes and the code, not results).
SETTINGS = re.compile(
    r"reg 0\.0[1236]\b|betas 0\.9/0\.95|10% linear warmup|cosine to 10%|clip 1\.0|first 95%|last 5%"
    r"|p < 0\.05|below 0\.05|N\(0, 0\.02\^2\)"
)


def hand_typed_figures(text: str) -> list[str]:
    """Figures in ``text`` outside its generated blocks and values, settings excepted."""
    return [m.group() for m in FIGURE.finditer(SETTINGS.sub("", strip_generated(text)))]


def test_evidence_doc_is_what_its_stored_results_render():
    """Every figure in a generated block of docs/evidence.md comes from docs/evidence/**.json through
    the current statistics: a hand edit, or results regenerated without `render`, fails here."""
    text = DOC.read_text()
    names = re.findall(r"<!-- evidence:([\w:.-]+) -->", text)
    for wanted in (
        "study:in-domain",
        "study:new-domain",
        "contrasts:new-domain",
        "alignment:in-domain",
        "alignment:new-domain",
        "sharpness:in-domain",
        "sharpness:new-domain",
        "interpose-stack:study:in-domain",
        "interpose-stack:study:new-domain",
        "diagnose-mlp",
        "planted",
        "runs",
        "primary",
    ):
        assert wanted in names
    assert render_document(text, ROOT / "docs" / "evidence", RECIPES) == text, "run: make evidence"
    assert "<!-- v:" in text


def test_evidence_prose_carries_no_hand_typed_figure():
    """Every figure in docs/evidence.md's prose is a generated value: a number typed by hand (which
    goes stale when an arm is added, as six once did) fails here."""
    assert hand_typed_figures(DOC.read_text()) == []


def test_hand_typed_figures_are_found_and_generated_ones_are_not():
    doc = (
        "Holm p 0.034 here, a 12.5% gain, 41k tokens, 16,256 windows, reg 0.06 is a setting.\n"
        "<!-- v:in-domain|ot|average|abs3 -->0.106<!-- /v --> nats\n"
        "<!-- evidence:runs -->\n| 4.5 min |\n<!-- evidence:end -->\n"
    )
    assert hand_typed_figures(doc) == ["0.034", "12.5%", "41k", "16,256"]


def test_hand_edited_value_or_block_fails_the_render_check():
    """Changing one generated value (or one digit of a block) makes the document differ from what
    the stored results render."""
    text = DOC.read_text()
    value = re.search(r"(<!-- v:[^ ]+ -->)([^\n]*?)(<!-- /v -->)", text)
    edited = text[: value.start(2)] + "9.999" + text[value.end(2) :]
    assert render_document(edited, ROOT / "docs" / "evidence", RECIPES) != edited
    block = text.index("<!-- evidence:primary -->")
    digit = re.compile(r"\d").search(text, block)
    edited = text[: digit.start()] + str((int(digit.group()) + 1) % 10) + text[digit.end() :]
    assert render_document(edited, ROOT / "docs" / "evidence", RECIPES) != edited


def test_unknown_value_refused(tmp_path):
    with pytest.raises(KeyError, match="docs value"):
        render_document("<!-- v:nowhere|a|b|abs3 -->1<!-- /v -->\n", tmp_path)


def test_unknown_block_refused(tmp_path):
    with pytest.raises(KeyError, match="no such generated block"):
        render_document("<!-- evidence:nonsense -->\nx\n<!-- evidence:end -->\n", tmp_path)


def _windows(rng, base, shift, noise, seeds=3):
    return [list(base + shift + rng.normal(0, noise, base.shape)) for _ in range(seeds)]


@pytest.fixture(scope="module")
def two_by_two():
    """One seed, 40 windows: zero-init lowers the loss by 0.1 for both methods, OT adds nothing."""
    rng = np.random.default_rng(2)
    base = rng.normal(2.0, 0.3, 40)
    table = {
        "ot": _windows(rng, base, 0.0, 0.01, seeds=1),
        "ot+nozero": _windows(rng, base, 0.1, 0.01, seeds=1),
        "average+zero": _windows(rng, base, 0.0, 0.01, seeds=1),
        "average": _windows(rng, base, 0.1, 0.01, seeds=1),
    }
    return table, study_from_window_losses(table, reference="ot")


def test_contrasts_match_scipy_paired_t_and_holm(two_by_two):
    """With one seed each contrast is the paired t test over windows (scipy's ttest_rel); the Holm
    column adjusts over the four contrasts of the 2x2."""
    table, result = two_by_two
    pairs = [
        ("ot", "ot+nozero"),
        ("average+zero", "average"),
        ("ot", "average+zero"),
        ("ot+nozero", "average"),
    ]
    expected_p = [stats.ttest_rel(table[a][0], table[b][0]).pvalue for a, b in pairs]
    for (a, b), p in zip(pairs, expected_p, strict=True):
        assert result.contrast(a, b)["p"] == pytest.approx(p, rel=1e-10)
    rows = [line for line in contrasts_markdown(result).splitlines() if line.startswith("| ") and "`" in line]
    assert len(rows) == 4
    for row, q in zip(rows, holm(expected_p), strict=True):
        cells = [c.strip() for c in row.split("|")]
        assert cells[4] == ("< 0.001" if q < 0.001 else f"{q:.3f}")
    verdicts = [row.rsplit("|", 2)[1].strip() for row in rows]
    assert verdicts[0] == "lower" and verdicts[1] == "lower" and verdicts[2] == "n.s."


def test_verdict_lines_follow_the_holm_adjusted_tests():
    """`low` is clearly below the reference, `high` clearly above, `tiny` differs by less than the
    window noise: each lands in its own bullet, with the Holm p that the table shows."""
    rng = np.random.default_rng(4)
    base = rng.normal(1.5, 0.2, 32)
    result = study_from_window_losses(
        {
            "ref": _windows(rng, base, 0.0, 0.01),
            "low": _windows(rng, base, -0.05, 0.01),
            "high": _windows(rng, base, 0.05, 0.01),
            "tiny": _windows(rng, base, 0.0005, 0.01),
        }
    )
    lower, higher, unclear = verdict_lines(result)
    assert "`low`" in lower and "`low`" not in higher + unclear
    assert "`high`" in higher and "`tiny`" in unclear and "`tiny`" not in lower + higher
    tiny = result.summary("tiny").vs_reference
    assert f"Holm p {tiny['p_holm']:.3f}" in unclear and "3/3 seeds" in lower


def test_error_split_adds_up_and_seed_only_interval_is_scipys():
    """The SE's seed, window and residual parts are the two-way model's variance components
    (squares add up to SE^2 when none is truncated); the seeds-only half-width is scipy's t
    interval over the per-seed mean differences."""
    rng = np.random.default_rng(9)
    base = rng.normal(1.0, 0.2, 24)
    seeds = 4
    a = [list(base + 0.02 + rng.normal(0, 0.003) + rng.normal(0, 0.01, 24)) for _ in range(seeds)]
    result = study_from_window_losses({"ref": [list(base)] * seeds, "a": a})
    vs = result.summary("a").vs_reference
    assert vs["error"] == "seeds and windows"
    parts = error_parts(vs)
    assert parts["seed"] ** 2 + parts["window"] ** 2 + parts["residual"] ** 2 == pytest.approx(
        vs["se"] ** 2, rel=1e-12
    )
    ci = stats.ttest_1samp(vs["diffs"], 0.0).confidence_interval(0.95)
    assert parts["seeds_only_half_width"] == pytest.approx((ci.high - ci.low) / 2, rel=1e-10)
    assert parts["half_width"] == pytest.approx(stats.t.ppf(0.975, vs["df"]) * vs["se"], rel=1e-10)
    row = next(line for line in error_markdown(result).splitlines() if line.startswith("| a |"))
    assert row == "| a | " + " | ".join(f"{x:.5f}" for x in parts.values()) + " |"


def test_across_studies_holm_counts_every_comparison():
    rng = np.random.default_rng(5)
    base = rng.normal(1.0, 0.1, 16)
    one = study_from_window_losses(
        {"ref": _windows(rng, base, 0, 0.01), "a": _windows(rng, base, 0.004, 0.01)}
    )
    two = study_from_window_losses({"ref": _windows(rng, base, 0, 0.01), "b": _windows(rng, base, 0.2, 0.01)})
    p = [one.summary("a").vs_reference["p"], two.summary("b").vs_reference["p"]]
    q = holm(p)
    kept, lost = across_studies_lines({"one": one, "two": two})
    assert "all 2 comparisons of the 2 studies" in kept
    assert ("`a` (one" in kept) == (q[0] < 0.05) and "`b` (two" in kept
    # `a` alone in its study is adjusted over 1 test: significant there, lost over both when q >= 0.05
    assert ("`a` (one" in lost) == (p[0] < 0.05 <= q[0])


def test_alignment_table_holds_the_arms_a_study_has_and_grows_with_added_arms(tmp_path):
    """Each alignment arm minus `average+zero`, Holm over the rows present: an arm not run yet is
    left out, and once merged in with StudyResult.with_arms (as `ot:activation/emd` was) its row
    appears and the Holm column adjusts over one more contrast."""
    rng = np.random.default_rng(7)
    base = rng.normal(1.5, 0.2, 32)
    table = {
        "average+zero": _windows(rng, base, 0.0, 0.01),
        "ot": _windows(rng, base, 0.03, 0.01),
        "ot/emd": _windows(rng, base, 0.0002, 0.01),
    }
    first = study_from_window_losses(table, reference="ot")
    rows = [r for r in contrasts_markdown(first, ALIGNMENT_VS_AVERAGE).splitlines() if "`" in r]
    assert [r.split("`")[1] for r in rows] == ["ot", "ot/emd"]
    p = [first.contrast(a, "average+zero")["p"] for a in ("ot", "ot/emd")]
    assert [r.split("|")[4].strip() for r in rows] == [_fmt(q) for q in holm(p)]
    assert rows[0].endswith("| higher |") and rows[1].endswith("| n.s. |")

    later = study_from_window_losses(
        {"ot": table["ot"], "ot:activation/emd": _windows(rng, base, -0.02, 0.01)}, reference="ot"
    )
    merged = first.with_arms(later)
    rows = [r for r in contrasts_markdown(merged, ALIGNMENT_VS_AVERAGE).splitlines() if "`" in r]
    assert [r.split("`")[1] for r in rows] == ["ot", "ot/emd", "ot:activation/emd"]
    p.append(merged.contrast("ot:activation/emd", "average+zero")["p"])
    assert [r.split("|")[4].strip() for r in rows] == [_fmt(q) for q in holm(p)]
    assert rows[2].endswith("| lower |")


def _fmt(q: float) -> str:
    return "< 0.001" if q < 0.001 else f"{q:.3f}"


def test_each_study_set_gets_its_own_blocks(tmp_path):
    """docs/evidence/table6/STUDY/ gives `study:STUDY`; another set's folder SET/STUDY/ gives
    `SET:study:STUDY` (and its own setup and across-studies blocks), never mixed with Table 6's."""
    rng = np.random.default_rng(3)
    base = rng.normal(1.0, 0.1, 8)
    for folder, labels in (("table6", ("ref", "a")), ("interpose-stack", ("ref", "b"))):
        result = study_from_window_losses(
            {x: _windows(rng, base, 0.01 * i, 0.01) for i, x in enumerate(labels)}
        )
        result.config.update(lr=1e-3, batch=1, seq_len=8)
        result.data.update(
            train="t.txt",
            eval="e.txt",
            train_documents=1,
            eval_documents=1,
            eval_windows=8,
            eval_tokens_scored=56,
        )
        (tmp_path / folder).mkdir(parents=True)
        result.save(tmp_path / folder / "s", plot=False)
    made = blocks(tmp_path)
    assert {"study:s", "study-setup", "interpose-stack:study:s", "interpose-stack:study-setup"} <= set(made)
    assert "`a`" in made["study:s"]() and "`b`" not in made["study:s"]()
    assert "`b`" in made["interpose-stack:study:s"]() and "`a`" not in made["interpose-stack:study:s"]()


def test_primary_family_holm_within_it_and_tost_backs_equivalence():
    """The declared family only: Holm over its three contrasts per study, TOST at its margin; a
    study missing an arm of the family is refused (the family is fixed before the data)."""
    rng = np.random.default_rng(8)
    base = rng.normal(1.5, 0.2, 32)
    result = study_from_window_losses(
        {
            "ot": _windows(rng, base, 0.0, 0.01),
            "average": _windows(rng, base, 0.05, 0.01),
            "copy": _windows(rng, base, 0.004, 0.05),
            "average+zero": _windows(rng, base, 0.0, 0.001),
            "random": _windows(rng, base, 0.3, 0.01),
        },
        reference="ot",
    )
    family = PrimaryFamily(
        reference="ot", against=["average", "copy", "average+zero"], equivalence_margin=0.01, declared="test"
    )
    table = primary_markdown({"s": result}, family, "recipes/x.yaml")
    rows = [r for r in table.splitlines() if r.startswith("| s |")]
    assert len(rows) == 3 and "random" not in table
    stats = [result.contrast("ot", a) for a in family.against]
    for row, vs, q in zip(rows, stats, holm([s["p"] for s in stats]), strict=True):
        cells = [c.strip() for c in row.split("|")]
        assert cells[5] == _fmt(q)
        assert cells[6] == _fmt(tost(vs["mean"], vs["se"], vs["df"], 0.01))
    assert rows[0].endswith("| lower | not shown |") and rows[2].endswith("| n.s. | within ±0.01 |")
    with pytest.raises(KeyError, match="lacks the primary family"):
        lacking = study_from_window_losses({"ot": [list(base)], "copy": [list(base)]}, reference="ot")
        primary_markdown({"s": lacking}, family, "x")


def test_dose_response_is_called_monotone_only_when_every_step_is_lower():
    """Five sharpness levels: "monotone" needs every step to the next sharper level to lower the final
    loss at Holm p < 0.05; a run of steps that stops falling is reported as not shown monotone."""
    rng = np.random.default_rng(5)
    base = rng.normal(1.5, 0.2, 32)
    labels = [a for a, _ in DOSE]
    assert len(labels) >= 5
    falling = study_from_window_losses(
        {a: _windows(rng, base, -0.02 * i, 0.001) for i, a in enumerate(labels)}, reference="ot"
    )
    assert "**5 levels**: monotone: every sharper level ends lower" in dose_response_markdown(falling)
    levelled = study_from_window_losses(
        {a: _windows(rng, base, -0.02 * min(i, 2), 0.001) for i, a in enumerate(labels)}, reference="ot"
    )
    text = dose_response_markdown(levelled)
    assert "not shown monotone: 2 of 4 steps lower and 0 higher" in text
    assert text.count("| `ot") == 5 and "Sinkhorn reg 0.06 -> Sinkhorn reg 0.03" in text
