"""Front door: match the rows of two weight matrices with one call.

    plan = match_rows(W_A, W_B, cost="paper", solver="sinkhorn", reg=0.06)
    aligned_A = plan.rows_to_b(W_A)          # (n T)^T W_A

``cost``: "paper" (unit rows, Euclidean, divided by its max: Imfeld et al.'s weight-based ground
metric, which the `paper` variant uses) or "raw" (Euclidean on raw rows: the released script's).
``solver``:
  * "sinkhorn": our stabilised Sinkhorn (sinkhorn.py), stops at relative marginal error <= tol;
  * "emd": the exact plan, an assignment (assignment.py);
  * "official": POT's standard Sinkhorn exactly as the released code calls it (official.py);
    tol / max_iter do not apply to it (its settings are pinned: 10000 iterations, stopThr 1e-9).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from otdus_cli.transport.assignment import assignment
from otdus_cli.transport.cost import paper_cost, paper_cost_of_parts, raw_cost
from otdus_cli.transport.official import official_sinkhorn
from otdus_cli.transport.plan import TransportPlan
from otdus_cli.transport.sinkhorn import sinkhorn

__all__ = ["COSTS", "SOLVERS", "match_parts", "match_rows", "solve_cost"]

COSTS = ("paper", "raw")
SOLVERS = ("sinkhorn", "emd", "official")

DEFAULT_REG = 0.06
DEFAULT_TOL = 1e-6
DEFAULT_MAX_ITER = 2000


def solve_cost(
    cost: torch.Tensor,
    solver: str = "sinkhorn",
    reg: float = DEFAULT_REG,
    tol: float = DEFAULT_TOL,
    max_iter: int = DEFAULT_MAX_ITER,
    overwrite: bool = False,
) -> TransportPlan:
    """Solve uniform-marginal OT on a precomputed cost matrix.

    ``overwrite``: the cost may be destroyed (Sinkhorn then builds the plan in its buffer).
    """
    if solver == "sinkhorn":
        res = sinkhorn(cost, reg=reg, tol=tol, max_iter=max_iter, overwrite=overwrite)
        return TransportPlan(
            cost.shape[0],
            cost.shape[1],
            matrix=res.plan,
            info={
                "solver": "sinkhorn",
                "reg": reg,
                "iterations": res.iterations,
                "solver_error": res.marginal_error,
                "converged": res.converged,
                "status": res.status,
                "absorptions": res.absorptions,
                "omega": res.omega,
                "seconds": res.seconds,
            },
        )
    if solver == "emd":
        return assignment(cost)
    if solver == "official":
        plan = official_sinkhorn(cost, reg=reg)
        plan.info["reg"] = reg
        return plan
    raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")


def match_rows(
    xa: torch.Tensor,
    xb: torch.Tensor,
    cost: str = "paper",
    solver: str = "sinkhorn",
    reg: float = DEFAULT_REG,
    tol: float = DEFAULT_TOL,
    max_iter: int = DEFAULT_MAX_ITER,
) -> TransportPlan:
    """Plan matching the rows of ``xa`` (A's neurons) to the rows of ``xb`` (B's), in float32.

    Memory: one n x m float32 matrix (the cost, turned into the plan in place by Sinkhorn) plus
    float32 copies of inputs given in another dtype.
    """
    if cost not in COSTS:
        raise ValueError(f"unknown cost {cost!r}; choose one of {', '.join(COSTS)}")
    c = paper_cost(xa, xb) if cost == "paper" else raw_cost(xa.float(), xb.float())
    plan = solve_cost(c, solver=solver, reg=reg, tol=tol, max_iter=max_iter, overwrite=True)
    plan.info["cost"] = cost
    return plan


def match_parts(
    parts: Sequence[tuple[torch.Tensor, torch.Tensor]],
    solver: str = "sinkhorn",
    reg: float = DEFAULT_REG,
    tol: float = DEFAULT_TOL,
    max_iter: int = DEFAULT_MAX_ITER,
) -> TransportPlan:
    """Plan matching rows made of several parts (``paper_cost_of_parts``), e.g. an MLP neuron's
    gate row, up row and down column."""
    c = paper_cost_of_parts(parts)
    plan = solve_cost(c, solver=solver, reg=reg, tol=tol, max_iter=max_iter, overwrite=True)
    plan.info["cost"] = "paper"
    return plan
