"""A solved transport plan and how it moves A's neurons onto B's.

T (n x m) couples the n rows (output neurons) of A with the m rows of B; T_ij is the mass of A's
neuron i sent to B's neuron j. With uniform marginals, n T has rows and columns summing to 1
(when n = m), so (n T)^T W_A expresses B's neuron j as a convex combination of A's neurons: the
"aligned" A. Unscaled, T^T W_A is that combination times 1/n, so A's share of an average
shrinks by ~n. Scaling by n is the fusion codes' convention (Imfeld et al.'s otfusion_lib.py,
"normalize t_out with beta (marginals)"; Singh & Jaggi's ``--correction``), which the `paper`
and `structured` variants follow. The OT-DUS paper's transport-matrix-flow table writes T_O and
1/2 (T_O + I) with no factor, and the authors' released script applies
T unscaled (`official`): hence ``scale`` (docs/ot.md, "Where each choice comes from").

A plan is stored either densely (Sinkhorn) or as a permutation (exact assignment with uniform
marginals, where T = P / n for a permutation matrix P): applying a permutation is an index, not
an n x n matrix product, and needs no n x n buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from otdus_cli.transport.stats import plan_stats

__all__ = ["TransportPlan"]


@dataclass
class TransportPlan:
    """T (n x m): dense ``matrix``, or ``perm`` (A row i -> B row perm[i]) for an assignment."""

    n: int
    m: int
    matrix: torch.Tensor | None = None
    perm: torch.Tensor | None = None
    info: dict[str, Any] = field(default_factory=dict)  # solver report (iterations, error, ...)

    def __post_init__(self) -> None:
        if (self.matrix is None) == (self.perm is None):
            raise ValueError("a TransportPlan holds exactly one of matrix or perm")
        if self.perm is not None and self.n != self.m:
            raise ValueError("a permutation plan needs n == m")

    @classmethod
    def identity(cls, n: int, device: torch.device | str = "cpu") -> TransportPlan:
        """The plan that keeps neuron i on neuron i (T = I / n)."""
        return cls(n, n, perm=torch.arange(n, device=device), info={"solver": "identity"})

    def _inverse(self) -> torch.Tensor:
        assert self.perm is not None
        return torch.argsort(self.perm)

    def rows_to_b(self, w: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """(s T)^T w: A-indexed rows (dim 0 of ``w``, size n) moved to B's indexing (size m).

        ``s`` defaults to n (the fusion convention: variants paper and structured); pass
        scale=1.0 for the released script's (variant official).
        ``w`` may be 1-D (a bias or norm vector) or 2-D (a weight matrix).
        """
        s = float(self.n) if scale is None else float(scale)
        if self.perm is not None:
            out = w[self._inverse()]
            return out if s == self.n else out * (s / self.n)
        t = self.matrix.to(w.dtype)
        out = t.T @ w
        return out.mul_(s)

    def cols_to_b(self, w: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """w (s T): A-indexed columns (last dim of ``w``, size n) moved to B's indexing.

        This is how a plan on a module's *input* side acts (T_in in the paper's notation). For a
        1-D ``w`` it equals ``rows_to_b(w)``.
        """
        s = float(self.n) if scale is None else float(scale)
        if self.perm is not None:
            out = w[..., self._inverse()]
            return out if s == self.n else out * (s / self.n)
        out = w @ self.matrix.to(w.dtype)
        return out.mul_(s)

    def dense(self) -> torch.Tensor:
        """T as an n x m matrix (total mass 1)."""
        if self.matrix is not None:
            return self.matrix
        t = torch.zeros(self.n, self.m, dtype=torch.float32, device=self.perm.device)
        t[torch.arange(self.n, device=self.perm.device), self.perm] = 1.0 / self.n
        return t

    def is_identity(self) -> bool:
        """True for a permutation plan that keeps every neuron in place."""
        return self.perm is not None and bool(
            torch.equal(self.perm, torch.arange(self.n, device=self.perm.device))
        )

    def stats(self) -> dict[str, Any]:
        """Solver report plus entropy, permutation closeness and marginal errors (JSON-ready)."""
        out: dict[str, Any] = {"n": self.n, **self.info}
        if self.perm is not None:
            # Closed forms for T = P / n: no dense n x n matrix is materialised.
            out.update(
                entropy=float(torch.log(torch.tensor(float(self.n)))),
                entropy_normalized=0.0,
                permutation_closeness=1.0,
                row_error=0.0,
                col_error=0.0,
                marginal_error=0.0,
                marginal_error_l2=0.0,
                identity=self.is_identity(),
            )
        else:
            out.update(plan_stats(self.matrix))
        return out
