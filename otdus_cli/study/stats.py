"""Statistics for paired comparisons of training runs: seeds crossed with shared evaluation windows.

Every run of a study is scored on the same held-out windows, so a method's difference to the
reference on window w after training with seed s, d[s, w], has two sources of error: the seeds
(training randomness, which more seeds average out) and the windows (which text happened to be
held out, which more seeds do *not* average out). A two-way crossed random-effects model,
d[s, w] = mu + a_s + b_w + e_sw, gives the variance of the grand mean
Var = sigma_a^2 / S + sigma_b^2 / W + sigma_e^2 / (S W) = (E MS_seeds + E MS_windows - E MS_resid) / (S W)
(expected ANOVA mean squares), estimated from the observed mean squares with the variance
components truncated at zero, and a Student t interval with Satterthwaite's degrees of freedom.
With one seed it is the paired t interval over windows; without per-window data, the paired t
interval over seeds.

Several methods compared with one reference are several tests: :func:`holm` adjusts their
p-values (Holm's step-down method, family-wise error controlled under any dependence).
With few seeds no distribution-free seed-level test can be significant: a sign-flip test over
S seeds cannot go below 2 / 2^S (0.25 for 3 seeds, 0.0625 for 5); :func:`sign_flip_p` reports it.

A non-significant difference is not evidence of no difference. :func:`tost` (two one-sided tests)
is: it rejects "the difference is at least ``margin`` in size" when both one-sided t tests against
-margin and +margin reject, i.e. when the 1 - 2 alpha interval lies inside (-margin, +margin).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
from scipy.stats import t as student_t

__all__ = ["by_document_mean_ci", "crossed_mean_ci", "holm", "mean_std", "sign_flip_p", "t_quantile", "tost"]


def t_quantile(df: float, confidence: float = 0.95) -> float:
    """Two-sided Student t quantile t_{(1 + confidence) / 2, df}."""
    if df <= 0:
        return math.nan
    return float(student_t.ppf(0.5 + confidence / 2, df))


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def _t_test(mean: float, se: float, df: float, confidence: float) -> dict[str, float | None]:
    if not df > 0:  # a single value: no spread to test against
        return {"se": None, "df": None, "low": None, "high": None, "p": None}
    half = t_quantile(df, confidence) * se
    # no spread at all: any nonzero mean is certain, a zero one is no evidence
    no_spread = 0.0 if mean != 0 else 1.0
    p = float(2 * student_t.sf(abs(mean) / se, df)) if se > 0 else no_spread
    return {"se": se, "df": df, "low": mean - half, "high": mean + half, "p": p}


def crossed_mean_ci(diffs: Sequence[Sequence[float]], confidence: float = 0.95) -> dict[str, object]:
    """Mean of ``diffs[seed][window]`` with an interval that accounts for seeds and windows.

    Returns n_seeds, n_windows, mean, se, df (Satterthwaite), low/high (None when there is nothing
    to estimate a spread from), p (two-sided t test of a zero mean), the mean squares and the
    estimated standard deviations of the seed, window and residual components, and ``error``:
    which sources the interval includes ("seeds and windows", "windows", "seeds").
    """
    d = np.asarray(diffs, dtype=np.float64)
    if d.ndim != 2 or d.size == 0:
        raise ValueError(f"diffs must be a non-empty seeds x windows table, got shape {d.shape}")
    s, w = d.shape
    grand = float(d.mean())
    seed_means = d.mean(axis=1)
    window_means = d.mean(axis=0)
    ms_seeds = w * float(((seed_means - grand) ** 2).sum()) / (s - 1) if s > 1 else math.nan
    ms_windows = s * float(((window_means - grand) ** 2).sum()) / (w - 1) if w > 1 else math.nan
    if s > 1 and w > 1:
        resid = d - seed_means[:, None] - window_means[None, :] + grand
        ms_resid = float((resid**2).sum()) / ((s - 1) * (w - 1))
        # Var(grand mean) = (MS_s + MS_w - MS_e) / (S W), each variance component truncated at zero:
        # a seed or window mean square below the residual's is raised to it. The seed term stays in
        # the sum with its own S - 1 degrees of freedom even then: dropping it would rest the interval
        # on the windows' many degrees of freedom, as if the few seeds had shown that seeds do not
        # matter (with 2 seeds, a seeds-only p of 0.04 became 1e-7 that way)
        terms = [
            (max(ms_seeds, ms_resid), s - 1, 1.0),
            (max(ms_windows, ms_resid), w - 1, 1.0),
            (ms_resid, (s - 1) * (w - 1), -1.0),
        ]
        total = sum(c * m for m, _, c in terms)
        se = math.sqrt(max(total, 0.0) / (s * w))
        denom = sum(m**2 / df for m, df, _ in terms)
        df = total**2 / denom if denom > 0 else float((s - 1) * (w - 1))
        error = "seeds and windows"
        components = {
            "seed_sd": math.sqrt(max(ms_seeds - ms_resid, 0.0) / w),
            "window_sd": math.sqrt(max(ms_windows - ms_resid, 0.0) / s),
            "residual_sd": math.sqrt(ms_resid),
        }
    elif w > 1:  # one seed: paired t over windows
        ms_resid = math.nan
        se, df, error = math.sqrt(ms_windows / (s * w)), float(w - 1), "windows"
        components = {"window_sd": float(window_means.std(ddof=1))}
    elif s > 1:  # no per-window data: paired t over seeds
        ms_resid = math.nan
        se, df, error = math.sqrt(ms_seeds / (s * w)), float(s - 1), "seeds"
        components = {"seed_sd": float(seed_means.std(ddof=1))}
    else:
        ms_resid, se, df, error, components = math.nan, 0.0, 0.0, "none", {}
    return {
        "n_seeds": s,
        "n_windows": w,
        "mean": grand,
        **_t_test(grand, se, df, confidence),
        "confidence": confidence,
        "error": error,
        # None where a mean square is undefined (one seed or one window): JSON has no NaN
        "ms_seeds": None if math.isnan(ms_seeds) else ms_seeds,
        "ms_windows": None if math.isnan(ms_windows) else ms_windows,
        "ms_resid": None if math.isnan(ms_resid) else ms_resid,
        **components,
    }


def by_document_mean_ci(
    diffs: Sequence[Sequence[float]], documents: Sequence[int], confidence: float = 0.95
) -> dict[str, object]:
    """:func:`crossed_mean_ci` with documents, not windows, as the sampled unit: each seed's
    differences are first averaged over the windows of each document (``documents[w]``: window w's
    document), then seeds are crossed with documents. Windows of one document are not independent
    draws; this interval does not assume they are. Its mean weights documents equally, so it
    differs from the window mean when documents give different numbers of windows."""
    d = np.asarray(diffs, dtype=np.float64)
    if d.ndim != 2 or d.shape[1] != len(documents):
        raise ValueError(
            f"one document per window: {len(documents)} documents for a table of shape {d.shape}"
        )
    groups = sorted(set(documents))
    owner = np.asarray(documents)
    table = np.stack([d[:, owner == g].mean(axis=1) for g in groups], axis=1)
    return {**crossed_mean_ci(table.tolist(), confidence), "n_documents": len(groups)}


def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm-adjusted p-values (None entries are not tests: left None and not counted).

    Sorted ascending, the j-th smallest of m p-values becomes max over i <= j of min(1, (m - i + 1) p_(i)).
    """
    tests = sorted((p, k) for k, p in enumerate(pvalues) if p is not None)
    m = len(tests)
    out: list[float | None] = [None] * len(pvalues)
    running = 0.0
    for i, (p, k) in enumerate(tests):
        running = max(running, min(1.0, (m - i) * p))
        out[k] = running
    return out


def sign_flip_p(values: Sequence[float]) -> float | None:
    """Exact two-sided sign-flip (paired permutation) p-value of a zero mean, over all 2^n sign
    assignments; its smallest possible value is 2 / 2^n. None for no values or more than 16."""
    n = len(values)
    if n == 0 or n > 16:
        return None
    x = np.asarray(values, dtype=np.float64)
    observed = abs(float(x.sum()))
    signs = np.array(list(itertools.product((1.0, -1.0), repeat=n)))
    sums = np.abs(signs @ x)
    return float((sums >= observed - 1e-12 * max(1.0, observed)).mean())


def tost(mean: float, se: float | None, df: float | None, margin: float) -> float | None:
    """Two one-sided tests of equivalence: the p-value of "|true difference| >= margin", the larger
    of the t tests of H0: mu <= -margin and H0: mu >= +margin (Schuirmann). Below alpha, the
    difference is shown to be smaller than ``margin``. None when there is no spread to test with."""
    if margin <= 0:
        raise ValueError(f"equivalence margin must be positive, got {margin}")
    if se is None or df is None or not df > 0:
        return None
    if se == 0:
        return 0.0 if abs(mean) < margin else 1.0
    below = float(student_t.sf((mean + margin) / se, df))  # H0: mu <= -margin
    above = float(student_t.cdf((mean - margin) / se, df))  # H0: mu >= +margin
    return max(below, above)
