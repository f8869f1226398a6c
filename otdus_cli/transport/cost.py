"""Ground costs between the rows of two weight matrices.

Row i of a weight matrix is the input weight vector of output neuron i. A cost matrix C (n x m)
holds C[i, j] = distance between row i of A and row j of B; the transport plan is solved on it.

Two costs are offered:

* ``paper_cost`` (the cost of the `paper` variant; the name is historical): each row scaled to
  unit L2 norm, Euclidean (not squared) distance, the whole matrix divided by its maximum so
  that it lies in [0, 1]. This is Imfeld et al.'s weight-based ground metric (their released
  transformer-fusion code, ground_metric.py: ``wts.norm: True``, ``type: euclidean``,
  ``squared: False``, ``norm: max``), for which their configuration names 0.06 as the best
  Sinkhorn regularisation with weights; on a [0, 1] cost reg = 0.06 means "a cost gap of 0.06
  weighs e times less". As far as we could check (docs/ot.md, "Where each choice
  comes from"), the OT-DUS paper's text does not state this normalisation: taking it for
  `paper` is our choice.
* ``raw_cost``: Euclidean distance between the raw rows, as the authors' released script
  computes it (``torch.cdist(W1, W2, p=2)`` in Model/OT-DUS.py); reg = 0.06 is then an absolute
  scale that depends on the norms of the weights.

Distances are computed with matrix products (``|a|^2 + |b|^2 - 2 a.b``, clamped at 0, square
root), which needs only the n x m output and is fast on every device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "correlation_cost",
    "euclidean_distances",
    "paper_cost",
    "paper_cost_of_parts",
    "raw_cost",
    "unit_rows",
]

_EPS = 1e-12


def unit_rows(x: torch.Tensor, eps: float = _EPS) -> torch.Tensor:
    """Rows of ``x`` (2-D) scaled to unit L2 norm; an all-zero row stays zero."""
    norms = torch.linalg.vector_norm(x, dim=1, keepdim=True)
    return x / norms.clamp_min(eps)


def euclidean_distances(xa: torch.Tensor, xb: torch.Tensor) -> torch.Tensor:
    """Pairwise Euclidean distances between the rows of ``xa`` (n x d) and ``xb`` (m x d).

    Uses ``|a|^2 + |b|^2 - 2 a.b`` with in-place updates, so the only n x m buffer is the result.
    Rounding can make the squared distance slightly negative; it is clamped at 0 first.
    """
    if xa.dim() != 2 or xb.dim() != 2 or xa.shape[1] != xb.shape[1]:
        raise ValueError(
            f"expected two 2-D tensors with equal row length, got {tuple(xa.shape)}, {tuple(xb.shape)}"
        )
    sq_a = (xa * xa).sum(dim=1)
    sq_b = (xb * xb).sum(dim=1)
    dist = torch.mm(xa, xb.T)  # n x m
    dist.mul_(-2.0)
    dist.add_(sq_a[:, None])
    dist.add_(sq_b[None, :])
    dist.clamp_(min=0.0)
    return dist.sqrt_()


def paper_cost(xa: torch.Tensor, xb: torch.Tensor) -> torch.Tensor:
    """The `paper` variant's cost (Imfeld et al.'s): unit-norm rows, Euclidean distance, divided by
    its maximum (in [0, 1]).

    If every distance is zero (identical, degenerate inputs) the cost is all zeros.
    """
    return paper_cost_of_parts([(xa, xb)])


def paper_cost_of_parts(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``paper_cost`` between rows made of several parts, each part scaled to unit norm.

    Row i of A stands for [unit(A1_i) | unit(A2_i) | ...] (one part: ``paper_cost``). The
    concatenation is never built: with e_i the number of nonzero parts of row i (an all-zero
    part stays zero, as in ``unit_rows``),

        |fa_i - fb_j|^2 = ea_i + eb_j - 2 sum_p cos_p(i, j),

    so the only n x m buffer is the result, and no unit-row copy is made for the first part
    (its product is divided by the norms afterwards). Computed in float32.
    """
    if not parts:
        raise ValueError("no parts to compare")
    dot: torch.Tensor | None = None
    ea: torch.Tensor | float = 0.0
    eb: torch.Tensor | float = 0.0
    for xa, xb in parts:
        if xa.dim() != 2 or xb.dim() != 2 or xa.shape[1] != xb.shape[1]:
            raise ValueError(
                f"expected two 2-D tensors with equal row length, got {tuple(xa.shape)}, {tuple(xb.shape)}"
            )
        a, b = xa.float(), xb.float()
        na = torch.linalg.vector_norm(a, dim=1).clamp_min_(_EPS)
        nb = torch.linalg.vector_norm(b, dim=1).clamp_min_(_EPS)
        if dot is None:
            dot = torch.mm(a, b.T)
            dot.div_(na[:, None]).div_(nb[None, :])
        else:
            dot.addmm_(a / na[:, None], (b / nb[:, None]).T)
        ea = ea + (na > _EPS).float()
        eb = eb + (nb > _EPS).float()
        del a, b
    assert dot is not None and isinstance(ea, torch.Tensor) and isinstance(eb, torch.Tensor)
    cost = dot.mul_(-2.0).add_(ea[:, None]).add_(eb[None, :]).clamp_(min=0.0).sqrt_()
    peak = cost.max()
    if peak > 0:
        cost.div_(peak)
    return cost


def raw_cost(xa: torch.Tensor, xb: torch.Tensor) -> torch.Tensor:
    """The released code's cost: Euclidean distance between raw rows (``torch.cdist``, p = 2)."""
    return torch.cdist(xa, xb, p=2)


def correlation_cost(corr: torch.Tensor) -> torch.Tensor:
    """The `activation` variant's cost: 1 - Pearson correlation, divided by its maximum.

    1 - C[i, j] is half the squared Euclidean distance between the standardised activation
    vectors of A's unit i and B's unit j (|z_a - z_b|^2 = 2 - 2 C), i.e. the squared-Euclidean
    ground metric on activations; it is linear in C, so the exact plan (``--solver emd``) is the
    pairing with the highest total correlation. Divided by its maximum (cost in [0, 1]) so that
    ``reg`` is relative, as for the weight costs. A fresh float32 matrix.
    """
    cost = torch.ones_like(corr, dtype=torch.float32).sub_(corr.to(torch.float32)).clamp_(min=0.0)
    peak = cost.max()
    if peak > 0:
        cost.div_(peak)
    return cost
