"""Statistics of a transport plan T (n x m, nonnegative, total mass 1).

* ``entropy``: H(T) = -sum_ij T_ij log T_ij (natural log, 0 log 0 = 0). With uniform marginals
  H lies between log(max(n, m)) (a permutation / assignment, no blur) and log(n m) (the
  independent coupling T_ij = 1/(n m), every row of A averaged into every row of B). The OT-DUS
  paper's Table 8 reports this quantity averaged over layers, per module.
* ``entropy_normalized``: (H - log max(n, m)) / (log(n m) - log max(n, m)), in [0, 1]: 0 for a
  permutation, 1 for the independent coupling; comparable across module sizes.
* ``permutation_closeness``: mean over rows of max_j T_ij / rowsum_i, i.e. how much of each row's
  mass sits on its single best match: 1.0 for a permutation, 1/m for the independent coupling.
* ``row_error`` / ``col_error``: max relative deviation of a row (column) mass from 1/n (1/m),
  the same measure the Sinkhorn solver stops on; ``marginal_error`` is the larger of the two;
  ``marginal_error_l2``: ||colsum - 1/m||_2, the absolute L2 measure POT's ``ot.sinkhorn`` uses.

Reductions run in float64, in row blocks, so a 14336 x 14336 plan needs no second n x m buffer.
"""

from __future__ import annotations

import math

import torch

__all__ = ["plan_stats", "plan_entropy", "permutation_closeness", "marginal_errors"]

_BLOCK_ELEMENTS = 1 << 22  # float64 blocks of 32 MB: small next to the plan itself


def _row_blocks(plan: torch.Tensor):
    """Row slices of ``plan`` of about _BLOCK_ELEMENTS entries, in float64."""
    step = max(1, _BLOCK_ELEMENTS // max(1, plan.shape[1]))
    for s in range(0, plan.shape[0], step):
        yield s, plan[s : s + step].double()


def plan_entropy(plan: torch.Tensor) -> float:
    """H(T) = -sum T log T (natural log), with 0 log 0 = 0."""
    total = 0.0
    for _, t in _row_blocks(plan):
        total -= float(torch.special.xlogy(t, t).sum())
    return total


def permutation_closeness(plan: torch.Tensor) -> float:
    """Mean over rows of (largest entry / row mass): 1.0 for a permutation."""
    acc = 0.0
    for _, t in _row_blocks(plan):
        rows = t.sum(dim=1)
        acc += float((t.amax(dim=1) / rows.clamp_min(1e-300)).sum())
    return acc / plan.shape[0]


def marginal_errors(plan: torch.Tensor) -> dict[str, float]:
    """Relative L-inf errors of both marginals, and POT's absolute L2 column error."""
    n, m = plan.shape
    rows = torch.empty(n, dtype=torch.float64, device=plan.device)
    cols = torch.zeros(m, dtype=torch.float64, device=plan.device)
    for s, t in _row_blocks(plan):
        rows[s : s + t.shape[0]] = t.sum(dim=1)
        cols += t.sum(dim=0)
    row_err = float((rows * n - 1.0).abs().max())
    col_err = float((cols * m - 1.0).abs().max())
    return {
        "row_error": row_err,
        "col_error": col_err,
        "marginal_error": max(row_err, col_err),
        "marginal_error_l2": float(torch.linalg.vector_norm(cols - 1.0 / m)),
    }


def plan_stats(plan: torch.Tensor) -> dict[str, float]:
    """Entropy (raw and normalised), permutation closeness and marginal errors of a dense plan."""
    n, m = plan.shape
    h = plan_entropy(plan)
    low, high = math.log(max(n, m)), math.log(n * m)
    return {
        "entropy": h,
        "entropy_normalized": (h - low) / (high - low) if high > low else 0.0,
        "permutation_closeness": permutation_closeness(plan),
        **marginal_errors(plan),
    }
