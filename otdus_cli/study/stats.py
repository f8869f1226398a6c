"""Small statistics for paired comparisons over seeds: mean, spread and a t confidence interval."""

from __future__ import annotations

import math
from collections.abc import Sequence

# Two-sided 95% Student t quantiles t_{0.975, df}, used when scipy is not installed.
_T975 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    12: 2.179,
    15: 2.131,
    20: 2.086,
    25: 2.060,
    30: 2.042,
    40: 2.021,
    60: 2.000,
    120: 1.980,
}


def t_quantile(df: int, confidence: float = 0.95) -> float:
    """Two-sided Student t quantile: scipy when installed, else a table (95% only, df rounded down)."""
    if df < 1:
        return math.nan
    try:
        from scipy.stats import t  # noqa: PLC0415

        return float(t.ppf(0.5 + confidence / 2, df))
    except ImportError:
        pass
    if abs(confidence - 0.95) > 1e-9:
        raise ValueError("without scipy only 95% intervals are available")
    if df > 120:
        return 1.960
    return _T975[max(k for k in _T975 if k <= df)]


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def paired_ci(diffs: Sequence[float], confidence: float = 0.95) -> dict[str, float | int | None]:
    """Mean of paired differences with its t interval (NaN-free: None when n < 2)."""
    n = len(diffs)
    mean, sd = mean_std(diffs)
    if n < 2:
        return {"n": n, "mean": mean, "std": sd, "low": None, "high": None, "confidence": confidence}
    half = t_quantile(n - 1, confidence) * sd / math.sqrt(n)
    return {
        "n": n,
        "mean": mean,
        "std": sd,
        "low": mean - half,
        "high": mean + half,
        "confidence": confidence,
    }
