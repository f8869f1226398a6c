"""Exact (unregularised) optimal transport with uniform marginals, as an assignment.

With n = m and uniform marginals 1/n, the exact OT problem min <C, T> over the plans with those
marginals is a linear program over n * (doubly stochastic matrices); by the Birkhoff-von Neumann
theorem the vertices of that polytope are the permutation matrices, so an optimal plan is
P / n for a permutation P. Finding it is the linear assignment problem, which SciPy's
``linear_sum_assignment`` (a shortest-augmenting-path Jonker-Volgenant solver) solves far faster
than a general network simplex such as POT's ``ot.emd``: 0.2 s for n = 4096 against minutes,
and with no n x n plan to store. ``ot.emd`` gives the same optimal cost (checked in the tests).
"""

from __future__ import annotations

import time

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from otdus_cli.transport.plan import TransportPlan

__all__ = ["assignment"]


def assignment(cost: torch.Tensor) -> TransportPlan:
    """The exact OT plan for a square ``cost`` with uniform marginals, as a permutation plan.

    Solved on the CPU in float64 (the solver is sequential); the permutation is returned on the
    cost's device. Deterministic: ties are broken the same way on every run.
    """
    if cost.dim() != 2 or cost.shape[0] != cost.shape[1]:
        raise ValueError(f"exact assignment needs a square cost, got {tuple(cost.shape)}")
    start = time.perf_counter()
    c = cost.detach().to("cpu", torch.float64).numpy()
    rows, cols = linear_sum_assignment(c)
    perm = np.empty(len(rows), dtype=np.int64)
    perm[rows] = cols
    total = float(c[rows, cols].sum()) / len(rows)
    return TransportPlan(
        cost.shape[0],
        cost.shape[1],
        perm=torch.from_numpy(perm).to(cost.device),
        info={
            "solver": "emd",
            "transport_cost": total,
            "iterations": 0,
            "converged": True,
            "status": "ok",
            "seconds": time.perf_counter() - start,
        },
    )
