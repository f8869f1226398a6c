"""Entropic optimal transport with uniform marginals: a fast, stable Sinkhorn solver.

Problem: given a cost C (n x m), find the plan T >= 0 with row sums 1/n and column sums 1/m that
minimises <C, T> - reg * H(T). Its solution is T = diag(u) K diag(v) / n with K = exp(-C / reg).

Algorithm: Sinkhorn-Knopp scaling with *absorption* (Schmitzer 2019, "Stabilized sparse scaling
algorithms for entropy regularized transport problems"). The plan is kept as

    P = diag(u) exp((f_i + g_j - C_ij) / reg) diag(v),        T = P / n,

where f, g are dual potentials and u, v scalings close to 1. Each iteration costs two
matrix-vector products with the stored kernel (fast BLAS gemv on float32, on any device).
When a scaling leaves [1/absorb, absorb], it is absorbed into the potentials (f += reg log u,
g += reg log v) and the kernel is recomputed from C: one exp over the n x m matrix, which happens
a handful of times per solve. Entries whose exponent is below -80 are set to exactly zero (their
weight relative to the largest entry of the row is below 1e-34), which avoids subnormal floats,
which are very slow on CPUs.

The potentials start at a c-transform pair: f_i = min_j C_ij, g_j = min_i (C_ij - f_i). Then every
exponent is <= 0 and every row and column of the kernel contains an entry exactly 1, so the first
scaling step can neither overflow nor divide by zero, whatever reg is (tested at reg = 0.01 on a
[0, 1] cost, where the plain kernel exp(-C / reg) reaches 1e-44).

Stopping rule: the *relative marginal error*

    err = max( max_i |n * rowsum_i(T) - 1|,  max_j |m * colsum_j(T) - 1| ),

i.e. the largest relative deviation of any row or column mass from its target 1/n (1/m). After
each column update the column sums are exact, so err is the row error, which the next iteration's
matrix-vector product yields for free. The solver stops as soon as err <= tol (converged) or
after max_iter iterations (not converged; reported, not raised). The float32 floor of err, from
rounding inside the products, is about 1e-7 * sqrt(n) in the worst case and usually lower;
tol = 1e-6 is reachable for n up to ~14k on CPU (see docs/ot.md), 1e-5 always is.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

__all__ = ["SinkhornResult", "sinkhorn"]

# Exponents below this become exact zeros in the kernel (exp(-80) = 1.8e-35, still a normal float32).
_EXP_FLOOR = -80.0


@dataclass
class SinkhornResult:
    """A solved entropic plan and how the solve went."""

    plan: torch.Tensor  # n x m, float32, rows sum to 1/n and columns to 1/m (within marginal_error)
    iterations: int  # full (row + column) scaling iterations performed
    marginal_error: float  # relative marginal error at the end (see module docstring)
    converged: bool  # marginal_error <= tol was reached within max_iter
    absorptions: int  # how many times the scalings were absorbed into the potentials
    seconds: float  # wall time of the solve (kernel build included)
    status: str = "ok"  # "ok", "max_iter" or "numerical_error"


def _kernel(cost: torch.Tensor, f: torch.Tensor, g: torch.Tensor, reg: float, out: torch.Tensor | None):
    """exp((f_i + g_j - C_ij) / reg), written into ``out`` when given (one n x m buffer)."""
    out = torch.sub(cost, f[:, None], out=out) if out is not None else cost - f[:, None]
    out.sub_(g[None, :])
    out.mul_(-1.0 / reg)
    torch.nn.functional.threshold(out, _EXP_FLOOR, -math.inf, inplace=True)
    return out.exp_()


def sinkhorn(
    cost: torch.Tensor,
    reg: float = 0.06,
    tol: float = 1e-6,
    max_iter: int = 2000,
    absorb: float = 1e3,
) -> SinkhornResult:
    """Entropic OT plan between uniform marginals for ``cost`` (n x m), on the cost's device.

    Args:
        cost: ground cost, 2-D floating tensor; it is read (never modified) and kept during the
            solve for the kernel rebuilds. Computed in float32 whatever its dtype.
        reg: entropic regularisation (same units as the cost; 0.06 on the paper's [0, 1] cost).
        tol: stop when the relative marginal error (module docstring) is <= tol.
        max_iter: iteration cap; reaching it is reported as converged=False, status="max_iter".
        absorb: scalings outside [1/absorb, absorb] are absorbed into the dual potentials.

    Returns a SinkhornResult. Memory: the cost plus one n x m float32 buffer (the kernel, turned
    into the plan in place at the end). Deterministic for a given device and input.
    """
    if cost.dim() != 2:
        raise ValueError(f"cost must be 2-D, got shape {tuple(cost.shape)}")
    if reg <= 0 or tol <= 0 or max_iter < 1:
        raise ValueError("need reg > 0, tol > 0 and max_iter >= 1")
    start = time.perf_counter()
    c = cost.float()
    n, m = c.shape
    # Work with the scaled plan P = n T whose rows sum to 1 and columns to n / m.
    col_target = n / m
    f = c.min(dim=1).values
    g = _colmin_shifted(c, f)
    kernel = _kernel(c, f, g, reg, None)
    u = torch.ones(n, dtype=torch.float32, device=c.device)
    v = torch.ones(m, dtype=torch.float32, device=c.device)
    absorptions = 0
    err = math.inf
    status = "max_iter"
    iterations = 0
    while True:
        kv = torch.mv(kernel, v)
        if iterations > 0:
            row = u * kv
            err = float((row - 1.0).abs().max())
            if not math.isfinite(err):
                status = "numerical_error"
                break
            if err <= tol:
                status = "ok"
                break
        if iterations >= max_iter:
            break
        u = 1.0 / kv
        v = col_target / torch.mv(kernel.T, u)
        iterations += 1
        lo = float(torch.minimum(u.min(), v.min()))
        hi = float(torch.maximum(u.max(), v.max()))
        if not (math.isfinite(lo) and math.isfinite(hi) and lo > 0):
            status = "numerical_error"
            break
        if hi > absorb or lo < 1.0 / absorb:
            # diag(u) exp((f + g - C) / reg) diag(v) = exp((f + reg log u + g + reg log v - C) / reg)
            f = f + reg * torch.log(u)
            g = g + reg * torch.log(v)
            kernel = _kernel(c, f, g, reg, kernel)
            u = torch.ones_like(u)
            v = torch.ones_like(v)
            absorptions += 1
    plan = kernel.mul_(u[:, None]).mul_(v[None, :]).div_(n)
    return SinkhornResult(
        plan=plan,
        iterations=iterations,
        marginal_error=err,
        converged=status == "ok",
        absorptions=absorptions,
        seconds=time.perf_counter() - start,
        status=status,
    )


def _colmin_shifted(c: torch.Tensor, f: torch.Tensor, block: int = 2048) -> torch.Tensor:
    """min_i (C_ij - f_i) without an extra n x m buffer (rows processed in blocks)."""
    out = torch.full((c.shape[1],), math.inf, dtype=c.dtype, device=c.device)
    for s in range(0, c.shape[0], block):
        part = (c[s : s + block] - f[s : s + block, None]).min(dim=0).values
        out = torch.minimum(out, part)
    return out
