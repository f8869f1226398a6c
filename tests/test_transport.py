"""The transport toolkit: costs, our Sinkhorn, the exact assignment, the released code's POT call,
plans and their statistics. Fast: small problems, CPU (CUDA checks run only where a GPU exists)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import ot
import pytest
import torch

from otdus_cli.device import resolve_device
from otdus_cli.transport.assignment import assignment
from otdus_cli.transport.cost import euclidean_distances, paper_cost, paper_cost_of_parts, raw_cost, unit_rows
from otdus_cli.transport.official import official_sinkhorn
from otdus_cli.transport.plan import TransportPlan
from otdus_cli.transport.sinkhorn import sinkhorn
from otdus_cli.transport.solve import match_rows
from otdus_cli.transport.stats import marginal_errors, plan_stats


def _rows(n: int, d: int, seed: int) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


def _reference_plan(cost: torch.Tensor, reg: float, iters: int = 20000) -> np.ndarray:
    """Plain Sinkhorn-Knopp in float64 (exp(-1/0.01) = 4e-44 is a normal float64): ground truth."""
    c = cost.double().numpy()
    n, m = c.shape
    k = np.exp(-c / reg)
    u, v = np.ones(n), np.ones(m)
    for _ in range(iters):
        u = (1.0 / n) / (k @ v)
        v = (1.0 / m) / (k.T @ u)
        if np.abs((u * (k @ v)) * n - 1.0).max() < 1e-12:
            break
    return u[:, None] * k * v[None, :]


# ---------------------------------------------------------------- costs


def test_euclidean_distances_match_cdist_and_stay_real_on_identical_rows():
    x, y = _rows(50, 32, 0), _rows(40, 32, 1)
    assert torch.allclose(euclidean_distances(x, y), torch.cdist(x, y), atol=1e-4)
    # |a|^2 + |a|^2 - 2 a.a is not exactly 0 in float32 (the two dot products round differently) and
    # can come out negative: it is clamped, so the distance is real (never NaN) and within the rounding
    # bound sqrt(4 d eps) |a| of a length-d float32 dot product; exact zeros are not promised
    diag = euclidean_distances(x, x).diagonal()
    assert not diag.isnan().any() and (diag >= 0).all()
    bound = math.sqrt(4 * 32 * torch.finfo(torch.float32).eps) * torch.linalg.vector_norm(x, dim=1)
    assert (diag <= bound).all() and diag.max() > 0  # > 0: the rounding is real


def test_paper_cost_is_unit_row_euclidean_divided_by_its_max():
    x, y = _rows(30, 16, 2) * 7.0, _rows(30, 16, 3) * 0.01
    c = paper_cost(x, y)
    ref = torch.cdist(unit_rows(x), unit_rows(y))
    assert torch.allclose(c, ref / ref.max(), atol=1e-5)
    assert float(c.max()) == pytest.approx(1.0) and float(c.min()) >= 0.0
    # invariant to row scaling: only directions matter
    assert torch.allclose(paper_cost(x * 3.0, y), c, atol=1e-5)


def test_cost_of_parts_is_the_paper_cost_of_concatenated_unit_parts():
    xa = [_rows(40, 12, 30), _rows(40, 20, 31) * 5.0, _rows(40, 7, 32)]
    xb = [_rows(36, 12, 33), _rows(36, 20, 34), _rows(36, 7, 35) * 0.1]
    xa[1][3] = 0.0  # an all-zero part stays zero, as unit_rows leaves it
    xb[2][5] = 0.0
    got = paper_cost_of_parts(list(zip(xa, xb, strict=True)))
    fa = torch.cat([unit_rows(x) for x in xa], dim=1)
    fb = torch.cat([unit_rows(x) for x in xb], dim=1)
    ref = torch.cdist(fa, fb)
    assert torch.allclose(got, ref / ref.max(), atol=1e-5)
    # one part: the paper cost itself; a degenerate input gives zeros, not NaN
    assert torch.equal(paper_cost_of_parts([(xa[0], xb[0])]), paper_cost(xa[0], xb[0]))
    assert not paper_cost(torch.zeros(4, 3), torch.zeros(5, 3)).any()


def test_raw_cost_is_cdist_on_raw_rows():
    x, y = _rows(20, 8, 4), _rows(25, 8, 5)
    assert torch.equal(raw_cost(x, y), torch.cdist(x, y, p=2))


# ---------------------------------------------------------------- sinkhorn


@pytest.mark.parametrize("n,m", [(64, 64), (48, 80)])
def test_sinkhorn_marginals_within_tol_and_matches_float64_reference(n, m):
    cost = paper_cost(_rows(n, 24, 6), _rows(m, 24, 7))
    res = sinkhorn(cost, reg=0.06, tol=1e-6)
    assert res.converged and res.status == "ok" and res.marginal_error <= 1e-6
    errs = marginal_errors(res.plan)
    assert errs["marginal_error"] <= 2e-6  # measured again in float64 on the returned plan
    assert float(res.plan.sum()) == pytest.approx(1.0, abs=1e-5)
    ref = _reference_plan(cost, 0.06)
    assert np.abs(res.plan.double().numpy() - ref).max() * n < 1e-4


def test_sinkhorn_is_stable_at_reg_001_where_the_plain_kernel_leaves_float32_range():
    cost = paper_cost(_rows(32, 16, 8), _rows(32, 16, 10))
    assert float(torch.exp(-cost / 0.01).min()) < 1e-38  # exp(-C/reg) leaves float32's normal range
    res = sinkhorn(cost, reg=0.01, tol=1e-6, max_iter=20000)
    assert res.converged, res
    assert torch.isfinite(res.plan).all()
    assert marginal_errors(res.plan)["marginal_error"] <= 2e-6
    ref = _reference_plan(cost, 0.01)
    assert np.abs(res.plan.double().numpy() - ref).max() * 32 < 1e-4


def test_sinkhorn_stays_finite_and_honest_where_plain_float32_sinkhorn_breaks():
    cost = paper_cost(_rows(32, 16, 8), _rows(32, 16, 10))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = ot.sinkhorn(torch.ones(32) / 32, torch.ones(32) / 32, cost, 0.005, numItermax=1000)
    assert any("numerical errors" in str(w.message) for w in caught)  # POT gives up (K underflows)
    assert marginal_errors(plain)["marginal_error"] > 0.5
    res = sinkhorn(cost, reg=0.005, tol=1e-6, max_iter=1500)
    assert torch.isfinite(res.plan).all() and res.status in ("ok", "max_iter")
    true_err = marginal_errors(res.plan)["marginal_error"]
    assert true_err == pytest.approx(res.marginal_error, abs=1e-5)  # the reported error is the real one
    assert true_err < 1e-2


def test_sinkhorn_reports_non_convergence_when_max_iter_is_tiny():
    cost = paper_cost(_rows(64, 16, 11), _rows(64, 16, 12))
    res = sinkhorn(cost, reg=0.01, tol=1e-7, max_iter=3)
    assert not res.converged and res.status == "max_iter" and res.iterations == 3
    assert res.marginal_error > 1e-7 and math.isfinite(res.marginal_error)
    assert torch.isfinite(res.plan).all()


def test_sinkhorn_on_identical_rows_is_close_to_identity():
    x = _rows(40, 32, 13)
    res = sinkhorn(paper_cost(x, x), reg=0.06)
    stats = plan_stats(res.plan)
    assert torch.equal(res.plan.argmax(dim=1), torch.arange(40))
    assert stats["permutation_closeness"] > 0.9


def test_sinkhorn_is_deterministic():
    cost = paper_cost(_rows(70, 20, 14), _rows(70, 20, 15))
    a, b = sinkhorn(cost), sinkhorn(cost)
    assert torch.equal(a.plan, b.plan) and a.iterations == b.iterations


@pytest.mark.parametrize("reg", [0.06, 0.01])
def test_sinkhorn_overwrite_builds_the_plan_in_the_costs_buffer(reg):
    # reg 0.01 forces absorptions, which rescale the kernel in place instead of rebuilding it
    cost = paper_cost(_rows(48, 16, 18), _rows(48, 16, 19))
    kept = sinkhorn(cost, reg=reg, tol=1e-6, max_iter=20000)
    given = cost.clone()
    res = sinkhorn(given, reg=reg, tol=1e-6, max_iter=20000, overwrite=True)
    assert res.plan.data_ptr() == given.data_ptr()  # no second n x m buffer
    assert res.converged and marginal_errors(res.plan)["marginal_error"] <= 2e-6
    if reg == 0.01:
        assert res.absorptions > 0 and kept.absorptions > 0
    assert (res.plan - kept.plan).abs().max() * 48 < 1e-5
    assert np.abs(res.plan.double().numpy() - _reference_plan(cost, reg)).max() * 48 < 1e-4


def test_sinkhorn_does_not_modify_the_cost():
    cost = paper_cost(_rows(30, 8, 16), _rows(30, 8, 17))
    before = cost.clone()
    sinkhorn(cost, reg=0.02)
    assert torch.equal(cost, before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_sinkhorn_on_cuda_matches_cpu():
    cost = paper_cost(_rows(256, 64, 18), _rows(256, 64, 19))
    cpu = sinkhorn(cost)
    gpu = sinkhorn(cost.cuda())
    assert gpu.plan.device.type == "cuda" and gpu.converged
    assert torch.allclose(gpu.plan.cpu() * 256, cpu.plan * 256, atol=1e-4)


# ---------------------------------------------------------------- exact assignment


def test_assignment_equals_pot_emd_optimum_and_is_a_permutation():
    cost = paper_cost(_rows(30, 8, 20), _rows(30, 8, 21))
    plan = assignment(cost)
    assert sorted(plan.perm.tolist()) == list(range(30))
    n = 30
    t = ot.emd(np.full(n, 1.0 / n), np.full(n, 1.0 / n), cost.double().numpy())
    emd_cost = float((t * cost.double().numpy()).sum())
    ours = float(cost.double()[torch.arange(n), plan.perm].sum()) / n
    assert ours == pytest.approx(emd_cost, abs=1e-9)
    assert plan.info["transport_cost"] == pytest.approx(emd_cost, abs=1e-9)


def test_assignment_recovers_a_planted_permutation_exactly():
    x = _rows(50, 16, 22)
    perm = torch.randperm(50, generator=torch.Generator().manual_seed(23))
    plan = match_rows(x, x[perm] + 1e-3 * _rows(50, 16, 24), solver="emd")
    # A row perm[j] sits at B row j, so A row i must go to B row argsort(perm)[i]
    assert torch.equal(plan.perm, torch.argsort(perm))
    assert torch.equal(plan.rows_to_b(x), x[perm])


# ---------------------------------------------------------------- plans


def test_permutation_and_dense_plans_apply_the_same_way():
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(25))
    p_perm = TransportPlan(12, 12, perm=perm)
    p_dense = TransportPlan(12, 12, matrix=p_perm.dense())
    w = _rows(12, 5, 26)
    assert torch.allclose(p_perm.rows_to_b(w), p_dense.rows_to_b(w), atol=1e-6)
    assert torch.allclose(p_perm.cols_to_b(w.T), p_dense.cols_to_b(w.T), atol=1e-6)
    v = _rows(1, 12, 27)[0]
    assert torch.allclose(p_perm.cols_to_b(v), p_perm.rows_to_b(v))
    # unscaled application (the released code's convention) shrinks by n
    assert torch.allclose(p_dense.rows_to_b(w, scale=1.0), p_perm.rows_to_b(w) / 12, atol=1e-7)
    assert torch.allclose(p_perm.rows_to_b(w, scale=1.0), p_perm.rows_to_b(w) / 12, atol=1e-7)
    assert TransportPlan.identity(5).is_identity()


# ---------------------------------------------------------------- statistics


def test_stats_limits_permutation_and_independent_coupling():
    n = 16
    perm_plan = TransportPlan(n, n, perm=torch.randperm(n, generator=torch.Generator().manual_seed(28)))
    s = plan_stats(perm_plan.dense())
    assert s["entropy"] == pytest.approx(math.log(n), abs=1e-6)
    assert s["entropy_normalized"] == pytest.approx(0.0, abs=1e-6)
    assert s["permutation_closeness"] == pytest.approx(1.0)
    assert perm_plan.stats()["entropy"] == pytest.approx(s["entropy"], abs=1e-6)
    uniform = torch.full((n, n), 1.0 / n**2)
    s = plan_stats(uniform)
    assert s["entropy"] == pytest.approx(2 * math.log(n), abs=1e-5)
    assert s["entropy_normalized"] == pytest.approx(1.0, abs=1e-5)
    assert s["permutation_closeness"] == pytest.approx(1.0 / n)
    assert s["marginal_error"] < 1e-5


# ---------------------------------------------------------------- the released code's solver


def test_official_solver_is_exactly_pots_sinkhorn_call():
    x, y = _rows(12, 6, 29) * 0.3, _rows(12, 6, 30) * 0.3
    plan = match_rows(x, y, cost="raw", solver="official")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = ot.sinkhorn(
            torch.ones(12) / 12, torch.ones(12) / 12, torch.cdist(x, y, p=2), 0.06, numItermax=10000
        )
    assert torch.equal(plan.matrix, ref)
    assert plan.info["iterations"] == 10000 and plan.info["status"] == "max_iter"
    assert any("did not converge" in w for w in plan.info["warnings"])


def test_official_solver_reports_pots_underflow_honestly():
    # Raw distances of ~60 with reg 0.06: exp(-M / reg) is 0 in float32, so K^T u = 0 at once.
    x, y = _rows(10, 4, 31) * 30.0, _rows(10, 4, 32) * 30.0 + 100.0
    plan = official_sinkhorn(raw_cost(x, y))
    assert plan.info["status"] == "numerical_error"
    assert any("numerical errors" in w for w in plan.info["warnings"])
    stats = plan.stats()
    # POT returns its previous iterate: here K / n^2 = all zeros, so the marginals are far off
    assert stats["marginal_error"] >= 0.99


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
