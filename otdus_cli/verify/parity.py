"""What counts as parity for a verify run, and the verdict line and exit code it gives.

When the expansion is declared function-preserving, float32/float64 runs must give bitwise identical
logits (hence identical perplexities); bfloat16/float16 runs must agree within ``rtol`` on every
perplexity figure (default ``LOW_PRECISION_RTOL``); a model widened without noise, in float32/float64,
within ``WIDENED_RTOL``. Exit code 0 when parity holds or is not expected, 1 when it is expected and
broken.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from otdus_cli.verify.lockstep import LayerCheck

LOW_PRECISION_RTOL = 1e-3
# float32 runs of a model widened without noise: the same function up to the order of its routing sums
WIDENED_RTOL = 1e-5
EXACT_DTYPES = (torch.float32, torch.float64)


@dataclass(frozen=True)
class ParityRule:
    """How base and expanded figures must agree: bitwise (``rtol`` None), or within ``rtol``."""

    rtol: float | None
    tolerance: str  # the rule in words, as the report gives it

    def holds(self, base: dict[str, float], expanded: dict[str, float], logits_equal: bool) -> bool:
        """Whether the figures (``PerplexityMetrics.values()``) and the logits' equality meet the rule."""
        if self.rtol is None:
            return logits_equal and all(base[k] == expanded[k] for k in base)
        return all(
            abs(expanded[k] - base[k]) <= self.rtol * abs(base[k]) for k in base if k != "loglikelihood"
        )


def parity_rule(dtype: torch.dtype, widened: bool, rtol: float | None = None) -> ParityRule:
    """The rule for a run in ``dtype`` (``widened``: the expanded model has widened experts)."""
    if widened and dtype in EXACT_DTYPES:
        tol = WIDENED_RTOL if rtol is None else rtol
        return ParityRule(
            tol,
            f"relative {tol:g} on every perplexity figure (widened experts: duplicates split each routing "
            "weight in two, equal in exact arithmetic, summed in another order)",
        )
    if dtype in EXACT_DTYPES:
        return ParityRule(None, "bitwise (float32/float64): logits and perplexities must be identical")
    tol = LOW_PRECISION_RTOL if rtol is None else rtol
    return ParityRule(
        tol, f"relative {tol:g} on every perplexity figure ({str(dtype).replace('torch.', '')})"
    )


def verdict(
    *,
    expect_parity: bool,
    parity: bool,
    unchanged: bool,
    headline: str,
    base_value: float,
    expanded_value: float,
    tolerance: str,
    first_divergence: LayerCheck | None,
    static_reason: str | None,
    reproduces: str | None,
) -> tuple[str, int]:
    """The verdict line and exit code. ``unchanged``: nothing moved at all (said when no parity is
    expected); ``headline``: the protocol's main figure, base and expanded; ``static_reason``: why the
    static check did not prove preservation; ``reproduces``: whose wikitext figures these are."""
    if expect_parity:
        if parity:
            same = "==" if base_value == expanded_value else "~="
            line = (
                f"PARITY: function preserved ({headline} {base_value:.6g} {same} {expanded_value:.6g}; "
                f"{tolerance})"
            )
            exit_code = 0
        else:
            where = ""
            if first_divergence:
                where = (
                    f"; first divergence at {first_divergence.name} "
                    f"(max |diff| {first_divergence.max_abs_diff:.3g})"
                )
            where += f"; static check: {static_reason}" if static_reason else ""
            line = (
                f"BROKEN: expected function preservation, {headline} {base_value:.6g} -> "
                f"{expanded_value:.6g}{where}"
            )
            exit_code = 1
    else:
        change = "unchanged" if unchanged else f"{base_value:.8g} -> {expanded_value:.8g}"
        line = f"no parity expected (not function-preserving): {headline} {change}"
        exit_code = 0
    if reproduces:
        line += f" [wikitext figures of {reproduces}]"
    return line, exit_code
