"""study statistics against scipy on fixed inputs: Holm, the seeds x windows interval, the sign-flip
test, and the verdicts a study table draws from them (no training: milliseconds)."""

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from otdus_cli.errors import OtdusError
from otdus_cli.study import StudyResult
from otdus_cli.study.report import study_markdown
from otdus_cli.study.stats import by_document_mean_ci, crossed_mean_ci, holm, sign_flip_p, t_quantile, tost
from tests.support.study_results import study_from_window_losses

# Per-seed final-loss differences to `ot` on the new domain, 3 seeds, from the first Table 6 run
# (docs/evidence/table6*/new-domain/study.json at commit d08f74a): 7 comparisons with one reference.
NEW_DOMAIN_DIFFS = {
    "ot+nozero": [-0.03495768549561218, -0.043290506197711576, -0.037190274616551555],
    "average+zero": [-0.04068617933378471, -0.03686323190924368, -0.04116316667691944],
    "average": [-0.0028826696040438193, -0.010644467171095684, -0.0011394831139273087],
    "ot:structured": [0.004393329770546295, 0.009571786314796604, 0.0062290301786003255],
    "ot:official": [0.07905438440678303, 0.07281894633776265, 0.07157541510314136],
    "copy": [-0.032096562423105546, -0.042241854930487044, -0.021584898780963258],
    "random": [0.08955491433932083, 0.09444221236261496, 0.10328053552021776],
}


def _holm_by_closed_testing(p: list[float]) -> list[float]:
    """Holm as the closed testing procedure with Bonferroni local tests: the adjusted p of H_k is the
    largest Bonferroni p over every intersection hypothesis that contains H_k (an independent route)."""
    m = len(p)
    out = []
    for k in range(m):
        worst = 0.0
        for size in range(1, m + 1):
            for subset in itertools.combinations(range(m), size):
                if k in subset:
                    worst = max(worst, min(1.0, size * min(p[j] for j in subset)))
        out.append(worst)
    return out


def test_seed_only_p_values_match_scipy_and_holm_removes_three_verdicts():
    """The referee's recomputation (issue 23): under Holm, ot:structured 'worse' (0.047 -> 0.10) and
    copy 'better' (0.033 -> 0.10) lose significance; average+zero beating ot (Holm 0.007) stays."""
    p = {}
    for label, diffs in NEW_DOMAIN_DIFFS.items():
        r = crossed_mean_ci([[x] for x in diffs])  # one value per seed: the paired t test over seeds
        ref = stats.ttest_1samp(diffs, 0.0)
        ci = ref.confidence_interval(0.95)
        assert r["error"] == "seeds" and r["df"] == 2
        assert r["p"] == pytest.approx(ref.pvalue, rel=1e-12)
        assert (r["low"], r["high"]) == pytest.approx((ci.low, ci.high), rel=1e-12)
        p[label] = r["p"]
    adjusted = dict(zip(p, holm(list(p.values())), strict=True))
    assert round(p["ot:structured"], 3) == 0.047 and round(adjusted["ot:structured"], 2) == 0.10
    assert round(p["copy"], 3) == 0.033 and round(adjusted["copy"], 2) == 0.10
    assert round(adjusted["average+zero"], 3) == 0.007


def test_holm_equals_closed_testing_and_skips_non_tests():
    rng = np.random.default_rng(3)
    for m in (1, 2, 5, 7):
        p = list(rng.uniform(0, 0.2, size=m))
        assert holm(p) == pytest.approx(_holm_by_closed_testing(p), abs=1e-15)
    assert holm([0.01, None, 0.04]) == [0.02, None, 0.04]
    assert holm([]) == []


def test_one_seed_is_the_paired_t_test_over_windows():
    rng = np.random.default_rng(0)
    x = rng.normal(0.001, 0.01, size=24)
    r = crossed_mean_ci([x])
    ref = stats.ttest_1samp(x, 0.0)
    ci = ref.confidence_interval(0.95)
    assert r["error"] == "windows" and r["df"] == 23
    assert r["p"] == pytest.approx(ref.pvalue, rel=1e-12)
    assert (r["low"], r["high"]) == pytest.approx((ci.low, ci.high), rel=1e-12)


def test_window_effects_alone_give_the_t_test_over_window_means():
    """Every seed sees the same per-window differences (plus a constant per seed that is exactly
    zero here): the error is all in the windows, and more seeds must not shrink it."""
    rng = np.random.default_rng(1)
    b = rng.normal(0, 0.01, size=32)
    table = np.tile(b, (5, 1)) + rng.normal(0, 1e-9, size=(5, 32))  # residual noise ~0
    r = crossed_mean_ci(table)
    ref = stats.ttest_1samp(table.mean(axis=0), 0.0)
    assert r["error"] == "seeds and windows"
    assert r["se"] == pytest.approx(stats.sem(table.mean(axis=0)), rel=1e-6)
    assert r["df"] == pytest.approx(31, rel=1e-3)
    assert r["p"] == pytest.approx(ref.pvalue, rel=1e-4)
    # the seed-only interval (what study reported before) is about 10^7 times too narrow here
    seeds_only = crossed_mean_ci([[v] for v in table.mean(axis=1)])
    assert seeds_only["high"] - seeds_only["low"] < 1e-5 * (r["high"] - r["low"])


def test_two_way_mean_squares_and_satterthwaite_df():
    """Fixed 3 x 4 table: the mean squares of the two-way layout and the interval, by hand."""
    d = np.array([[0.3, -0.1, 0.5, 0.2], [0.1, 0.0, 0.6, 0.1], [0.5, -0.3, 0.9, 0.4]])
    s, w = d.shape
    g = d.mean()
    ms_s = w * ((d.mean(1) - g) ** 2).sum() / (s - 1)
    ms_w = s * ((d.mean(0) - g) ** 2).sum() / (w - 1)
    e = d - d.mean(1, keepdims=True) - d.mean(0, keepdims=True) + g
    ms_e = (e**2).sum() / ((s - 1) * (w - 1))
    assert ms_s > ms_e and ms_w > ms_e  # no truncation in this table
    var = (ms_s + ms_w - ms_e) / (s * w)
    df = (ms_s + ms_w - ms_e) ** 2 / (ms_s**2 / (s - 1) + ms_w**2 / (w - 1) + ms_e**2 / ((s - 1) * (w - 1)))
    r = crossed_mean_ci(d)
    assert (r["ms_seeds"], r["ms_windows"], r["ms_resid"]) == pytest.approx((ms_s, ms_w, ms_e), rel=1e-12)
    assert r["se"] == pytest.approx(math.sqrt(var), rel=1e-12) and r["df"] == pytest.approx(df, rel=1e-12)
    half = stats.t.ppf(0.975, df) * math.sqrt(var)
    assert (r["low"], r["high"]) == pytest.approx((g - half, g + half), rel=1e-12)
    assert r["p"] == pytest.approx(2 * stats.t.sf(g / math.sqrt(var), df), rel=1e-12)
    assert t_quantile(2) == pytest.approx(stats.t.ppf(0.975, 2))


def test_a_seed_mean_square_below_the_residual_keeps_the_seed_term():
    """Two seeds that happen to agree (seed mean square below the residual's): the seed term stays in
    the interval, raised to the residual, with its one degree of freedom, so the test does not rest
    on the windows' 63. Dropping it (as before) gave the windows-alone p of 3e-5 on this table;
    kept, p is 0.022 (the seeds-only test, blind to the windows, gives 0.014)."""
    rng = np.random.default_rng(0)
    d = 0.01 + rng.normal(0, 0.02, (1, 64)) + rng.normal(0, 0.02, (2, 64))
    d -= d.mean(axis=1, keepdims=True) - d.mean()  # the two seeds' means agree exactly
    d[1] += 0.0005  # but not quite: a seed mean square far below the residual's
    s, w = d.shape
    r = crossed_mean_ci(d)
    ms_s, ms_w, ms_e = r["ms_seeds"], r["ms_windows"], r["ms_resid"]
    assert ms_s < ms_e < ms_w
    var = ms_w / (s * w)  # (max(MS_s, MS_e) + MS_w - MS_e) / (S W)
    df = ms_w**2 / (ms_e**2 / (s - 1) + ms_w**2 / (w - 1) + ms_e**2 / ((s - 1) * (w - 1)))
    assert r["se"] == pytest.approx(math.sqrt(var), rel=1e-12) and r["df"] == pytest.approx(df, rel=1e-12)
    assert r["df"] < 3 and round(r["p"], 3) == 0.022
    windows_alone = stats.ttest_1samp(d.mean(axis=0), 0.0).pvalue  # what dropping the seed term gave
    assert windows_alone < 1e-4


def test_crossed_interval_covers_when_windows_dominate():
    """Simulated studies with the in-domain shape (5 seeds, 128 shared windows, window effects far
    larger than seed effects): the seeds x windows interval covers the true mean ~95% of the time;
    an interval over seed means alone (the old report) covers far less."""
    rng = np.random.default_rng(7)
    sims, covered, covered_seeds_only = 300, 0, 0
    for _ in range(sims):
        d = rng.normal(0, 0.05, (5, 1)) + rng.normal(0, 1.0, (1, 128)) + rng.normal(0, 0.5, (5, 128))
        r = crossed_mean_ci(d)
        covered += r["low"] <= 0 <= r["high"]
        old = crossed_mean_ci([[v] for v in d.mean(axis=1)])
        covered_seeds_only += old["low"] <= 0 <= old["high"]
    assert 0.90 <= covered / sims <= 0.99
    assert covered_seeds_only / sims < 0.75


def test_sign_flip_p_matches_scipy_and_its_floor():
    x = np.array([0.3, -0.1, 0.25, 0.4, 0.2])
    ref = stats.permutation_test((x,), np.mean, permutation_type="samples", n_resamples=np.inf)
    assert sign_flip_p(list(x)) == pytest.approx(ref.pvalue)
    assert sign_flip_p([-1.0, -2.0, -3.0]) == 0.25  # three seeds all agreeing: the smallest p possible
    assert sign_flip_p([1.0, 2.0, 3.0, 4.0, 5.0]) == 0.0625


def test_verdict_accounts_for_windows_and_multiple_comparisons():
    """Three seeds agree to 1e-5 that `a` is 0.0006 below the reference, but the windows disagree
    (SD 0.002 over 24 windows): not a finding once the evaluation sample counts. Before, the
    report paired by seed only and called it "better"."""
    rng = np.random.default_rng(11)
    ref_losses = rng.normal(1.3, 0.2, size=24)
    window_effect = rng.normal(0, 0.002, size=24)
    window_effect += -0.0006 - window_effect.mean()
    a = [list(ref_losses + window_effect + rng.normal(0, 1e-5, 24)) for _ in range(3)]
    big = [list(ref_losses + 0.1 + rng.normal(0, 1e-3, 24)) for _ in range(3)]
    result = study_from_window_losses({"ref": [list(ref_losses)] * 3, "a": a, "big": big})
    vs = result.summary("a").vs_reference
    assert vs["error"] == "seeds and windows" and vs["n_windows"] == 24
    assert vs["low"] < 0 < vs["high"] and vs["p"] > 0.05
    seeds_only = crossed_mean_ci([[x] for x in vs["diffs"]])
    assert seeds_only["high"] < 0  # what the old report said: "better"
    big_vs = result.summary("big").vs_reference
    assert big_vs["p_holm"] == pytest.approx(min(1.0, 2 * big_vs["p"])) and vs["comparisons"] == 2
    table = study_markdown(result)
    row_a = next(line for line in table.splitlines() if line.startswith("| a |"))
    assert row_a.rstrip().endswith("| n.s. |") and "3/3" in row_a
    assert "| worse |" in next(line for line in table.splitlines() if line.startswith("| big |"))
    assert "not a ranking" in table and "cannot go below p = 0.25" in table


def test_recompute_from_stored_runs_without_window_losses():
    """A result saved before per-window losses were stored falls back to the seed-only interval,
    still Holm-adjusted, and another reference can be chosen afterwards."""
    result = study_from_window_losses(
        {"ref": [[1.0], [1.1], [1.2]], "a": [[0.9], [1.05], [1.1]], "b": [[1.5], [1.6], [1.6]]}
    )
    again = StudyResult.from_dict(result.to_dict()).recompute("b")
    vs = again.summary("a").vs_reference
    assert again.reference == "b" and vs["error"] == "seeds" and vs["reference"] == "b"
    assert vs["p"] == pytest.approx(stats.ttest_1samp([0.9 - 1.5, 1.05 - 1.6, 1.1 - 1.6], 0.0).pvalue)
    assert again.summary("b").vs_reference is None and again.summary("ref").vs_reference["comparisons"] == 2


def test_arms_added_from_a_later_run_are_compared_as_if_run_together():
    """Arms added from a later run of the same study (its reference runs identical) give the same
    comparisons, Holm over every arm, as one study with all of them; a later run whose reference
    does not reproduce the stored one is refused."""
    rng = np.random.default_rng(12)
    ref = [list(rng.normal(1.0, 0.1, 16)) for _ in range(3)]
    a = [[x + 0.01 + rng.normal(0, 0.005) for x in seed] for seed in ref]
    b = [[x - 0.02 + rng.normal(0, 0.005) for x in seed] for seed in ref]
    together = study_from_window_losses({"ref": ref, "a": a, "b": b})
    first = study_from_window_losses({"ref": ref, "a": a})
    merged = first.with_arms(study_from_window_losses({"ref": ref, "b": b}), order=["ref", "b", "a"])
    assert [m.label for m in merged.methods] == ["ref", "b", "a"]
    for label in ("a", "b"):
        assert merged.summary(label).vs_reference == together.summary(label).vs_reference
    assert (
        merged.summary("a").vs_reference["comparisons"] == 2 and "added from a later run" in merged.notes[-1]
    )
    drifted = [[x + 1e-4 for x in seed] for seed in ref]
    with pytest.raises(OtdusError, match="differ by up to"):
        first.with_arms(study_from_window_losses({"ref": drifted, "b": b}))
    # a study stored before window documents were recorded takes a later run's arms and documents;
    # two runs that record different documents are not the same study
    later = study_from_window_losses({"ref": ref, "b": b})
    later.data["eval_window_documents"] = list(range(16))
    assert first.with_arms(later).data["eval_window_documents"] == list(range(16))
    other = study_from_window_losses({"ref": ref, "a": a})
    other.data["eval_window_documents"] = [0] * 16
    with pytest.raises(OtdusError, match="not the same study"):
        other.with_arms(later)


def test_tost_is_two_one_sided_t_tests_and_the_90_percent_interval_inside_the_margin():
    """One seed: the crossed model is the paired t test over windows, so TOST is the larger of
    scipy's one-sided tests against -margin and +margin; it rejects exactly when the 90% interval
    lies inside (-margin, +margin). A clear difference, a tight zero and a noisy zero."""
    rng = np.random.default_rng(11)
    margin = 0.01
    for shift, noise, equivalent in ((0.03, 0.01, False), (0.001, 0.005, True), (0.0, 0.05, False)):
        x = shift + rng.normal(0, noise, 40)
        ci = crossed_mean_ci([list(x)])
        p = tost(ci["mean"], ci["se"], ci["df"], margin)
        want = max(
            stats.ttest_1samp(x, -margin, alternative="greater").pvalue,
            stats.ttest_1samp(x, margin, alternative="less").pvalue,
        )
        assert p == pytest.approx(want, rel=1e-10)
        ninety = stats.ttest_1samp(x, 0.0).confidence_interval(0.90)
        assert (p < 0.05) == (-margin < ninety.low and ninety.high < margin) == equivalent
    assert tost(0.0, None, None, margin) is None
    with pytest.raises(ValueError, match="margin"):
        tost(0.0, 1.0, 3.0, 0.0)


def test_by_document_interval_resamples_documents_not_windows():
    """Windows averaged within their document, then seeds crossed with documents: with one window per
    document it is the windows' interval; when a document's windows share its effect, counting them
    as independent draws gives a narrower interval than counting the documents."""
    rng = np.random.default_rng(13)
    table = rng.normal(0.01, 0.02, (3, 12)).tolist()
    alone = by_document_mean_ci(table, list(range(12)))
    assert {k: alone[k] for k in ("mean", "se", "df", "p")} == {
        k: crossed_mean_ci(table)[k] for k in ("mean", "se", "df", "p")
    }
    documents = [w // 4 for w in range(12)]  # 3 documents of 4 windows each
    effect = rng.normal(0, 0.05, 3)
    shared = [[x + effect[documents[w]] for w, x in enumerate(seed)] for seed in table]
    want = crossed_mean_ci(np.asarray(shared).reshape(3, 3, 4).mean(axis=2).tolist())
    got = by_document_mean_ci(shared, documents)
    assert got["n_documents"] == 3 and got["se"] == pytest.approx(want["se"], rel=1e-12)
    assert got["high"] - got["low"] > crossed_mean_ci(shared)["high"] - crossed_mean_ci(shared)["low"]
    with pytest.raises(ValueError, match="one document per window"):
        by_document_mean_ci(table, [0, 1])
    # a study that recorded its windows' documents reports the interval with each comparison
    result = study_from_window_losses({"ref": [[1.0] * 12] * 3, "a": [[1.0 + x for x in s] for s in shared]})
    result.data["eval_window_documents"] = documents
    assert result.recompute().summary("a").vs_reference["by_document"]["se"] == pytest.approx(got["se"])


def test_arms_run_alone_join_only_when_the_base_loss_agrees():
    """Arms run in a process of their own (no shared reference run) join a stored study only with
    shared_run=False, and only when the base's held-out loss agrees bit for bit; the notes say so."""
    first = study_from_window_losses({"ref": [[1.0, 1.2], [1.1, 1.3]], "a": [[1.0, 1.1], [1.2, 1.2]]})
    alone = study_from_window_losses({"b": [[0.9, 1.0], [1.0, 1.1]]}, reference="")
    with pytest.raises(OtdusError, match="share no run"):
        first.with_arms(alone)
    merged = first.with_arms(alone, shared_run=False)
    assert [m.label for m in merged.methods] == ["ref", "a", "b"]
    assert merged.summary("b").vs_reference["reference"] == "ref"
    assert "no shared run" in merged.notes[-1]
    alone.base_loss = 0.5
    with pytest.raises(OtdusError, match="base's held-out loss differs"):
        first.with_arms(alone, shared_run=False)
