"""OT-DUS: a new layer from the adjacent pair (A = f_i, B = f_{i+1}), neurons aligned by OT.

For a module with weight W (rows = output neurons) a transport plan T couples A's neurons with
B's; A is aligned to B and the two are averaged:

    W_new = 1/2 ( (s T)^T (W_A T_in) + W_B ),   s = n (paper, structured) or 1 (official)

where T_in is the plan already applied to the module's input side ("transport matrix flow").
Four variants (docs/ot.md has the full tables and the reasons):

* ``paper`` (default): the paper's transport-matrix flow (an own plan for each of q, k, v, o,
  gate, up, down; post-attention norm T_in = 1/2 (T_O + I), gate/up T_in = T_O; o/down zero)
  with Imfeld et al.'s fusion conventions where the paper's text is silent (the cost) or
  writes otherwise (no factor n): plans applied scaled by n (so an aligned row is a convex
  combination of A's rows, not 1/n of one), unit-row Euclidean cost divided by its max (the
  cost on which Imfeld et al. found reg 0.06 best for weight-based fusion).
* ``official``: what the authors' released script (Model/OT-DUS.py) computes (docs/ot.md,
  "Where each choice comes from"): raw Euclidean cost, POT's standard Sinkhorn (reg 0.06, 10000
  iterations, stopThr 1e-9) in float32, plans applied WITHOUT the factor n, as the paper's table writes them.
* ``structured`` (ours): alignment only along the layer's real symmetries. One plan
  per MLP neuron (gate row, up row, down column together); attention aligned by whole heads (a
  KV head with its group of query heads), no permutation inside q/k heads (RoPE pairs intact),
  V dims matched inside a head with the O columns following; the hidden (residual) axis is not
  permuted at all.
* ``activation`` (ours): the structured flow with plans from activations on calibration
  text (methods/ot/calibration.py) instead of weights: MLP neurons by the correlation of their
  activations (the input of down_proj), heads (with their GQA group) by the correlation of their
  contributions to the residual stream, V dims by the correlation of the heads' outputs. Needs the
  pre-pass ``prepare`` (one streamed pass of the source over the calibration text).

docs/ot.md, "Where each choice comes from", gives the source of every choice (paper, Imfeld et
al., released script, ours); methods/ot/choices.py records them in the manifest.

Options: ``ctx.options``, the validated OTOptions (options.py; None: its defaults), with
``ctx.zero_init`` (whether o/down come out zero, as in the paper) and ``ctx.device``.
``official`` pins its solver (POT, 10000 iterations, stopThr 1e-9) and ignores tol/max_iter;
it honours reg. Per-module plan statistics go to ``ctx.stats["modules"]``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

import torch

from otdus_cli.arch.heads import Heads
from otdus_cli.errors import OtdusError
from otdus_cli.methods.base import BuildContext, ParentLayer
from otdus_cli.methods.layer_roles import (
    NORM_ROLES,
    ParentPair,
    ParentRoles,
    RoleLayout,
    RoleOutputs,
    Tensors,
    add_into,
    aligned_role,
    average,
    average_role,
    f32,
    zeros_like_role,
)
from otdus_cli.methods.ot.options import OTOptions, OTVariant
from otdus_cli.transport.assignment import assignment
from otdus_cli.transport.cost import correlation_cost, euclidean_distances, unit_rows
from otdus_cli.transport.plan import TransportPlan
from otdus_cli.transport.solve import (
    DEFAULT_MAX_ITER,
    DEFAULT_REG,
    DEFAULT_TOL,
    match_parts,
    match_rows,
    solve_cost,
)

if TYPE_CHECKING:
    from otdus_cli.methods.ot.calibration import PairActivations
    from otdus_cli.plan.layer_map import OutputLayer

__all__ = ["OTBuilder", "OTSettings", "VARIANTS"]

VARIANTS = get_args(OTVariant)


@dataclass(frozen=True)
class OTSettings:
    """Validated options of one OT build."""

    variant: str = "paper"
    solver: str = "sinkhorn"
    reg: float = DEFAULT_REG
    tol: float = DEFAULT_TOL
    max_iter: int = DEFAULT_MAX_ITER
    device: torch.device = torch.device("cpu")
    zero_init: bool = True
    calib: str | None = None  # activation: the calibration text spec (None: the bundled default)
    calib_tokens: int | None = None  # activation: at most this many tokens (None: the default)

    @classmethod
    def from_context(cls, ctx: BuildContext) -> OTSettings:
        """The settings of one build: the validated ``ctx.options`` (OTOptions; None: its defaults)."""
        ot = ctx.options if ctx.options is not None else OTOptions()
        return cls(
            ot.variant,
            ot.solver,
            ot.reg,
            ot.tol,
            ot.max_iter,
            ctx.device,
            ctx.zero_init,
            ot.calib,
            ot.calib_tokens,
        )


# (f_i, f_{i+1}, context, settings, statistics) -> the new layer's tensors
MoeLayer = Callable[
    [ParentLayer, ParentLayer, BuildContext, OTSettings, dict[str, Any]], Iterator[tuple[str, torch.Tensor]]
]


class OTBuilder:
    """Builds one new layer from (f_i, f_{i+1}) by OT alignment and averaging (see module doc).

    Streaming: parent tensors are read when a formula first needs them and each finished module
    is yielded (and can be written and freed) before the next is built, so the builder's memory
    is that of the largest module step: for an MLP projection, the n x n plan plus three
    n x d matrices (aligned input, result, B's weight in its storage dtype).
    """

    parents_needed = 2

    def __init__(self, moe_layer: MoeLayer | None = None) -> None:
        self._calibrated: dict[tuple[int, int], Path] = {}  # activation: pair -> its statistics
        # the builder of a mixture-of-experts layer (moe.py: build_moe_layer), passed in by the method's
        # declaration (methods/ot: OT.make_builder): moe.py builds on this module's attention formulas
        self.moe_layer = moe_layer

    def prepare(
        self,
        layers: Sequence[ParentLayer],
        new_layers: Sequence[OutputLayer],
        ctx: BuildContext,
        scratch: Path,
    ) -> dict[str, Any] | None:
        """The activation variant's pre-pass (methods/ot/calibration.py); nothing for the others."""
        settings = OTSettings.from_context(ctx)
        if settings.variant != "activation":
            return None
        from otdus_cli.methods.ot.calibration import calibrate

        pairs = sorted({(lay.parents[0], lay.parents[1]) for lay in new_layers})
        report, self._calibrated = calibrate(pairs, ctx, settings, scratch)
        return report

    def build(self, parents: Sequence[ParentLayer], ctx: BuildContext) -> Iterator[tuple[str, torch.Tensor]]:
        family = ctx.family
        settings = OTSettings.from_context(ctx)
        a, b = parents
        suffixes_a = a.suffixes()
        missing = sorted(set(suffixes_a) - set(b.suffixes()))
        if missing:
            raise OtdusError(
                f"layers {a.index} and {b.index} differ: {missing[0]} exists only in layer {a.index}"
            )
        stats: dict[str, Any] = {}
        ctx.stats["variant"] = settings.variant
        ctx.stats["solver"] = "pot-sinkhorn" if settings.variant == "official" else settings.solver
        ctx.stats["parents"] = [a.index, b.index]
        ctx.stats["modules"] = stats
        if family.moe:  # experts matched first, then neurons inside each matched pair (moe.py)
            if self.moe_layer is None:
                raise RuntimeError("OTBuilder: MoE layers need moe_layer (methods/ot: OT.make_builder())")
            yield from self.moe_layer(a, b, ctx, settings, stats)
            return
        layout = RoleLayout(family, ctx.config, suffixes_a)
        pair = ParentPair(ParentRoles(a, layout, settings.device), ParentRoles(b, layout, settings.device))
        heads = Heads.from_config(ctx.config)
        if settings.variant == "activation":
            path = self._calibrated.get((a.index, b.index))
            if path is None:
                raise RuntimeError(f"OTBuilder.build: no activation statistics for ({a.index}, {b.index})")
            from otdus_cli.methods.ot.calibration import PairActivations

            roles = _activation(pair, heads, settings, stats, PairActivations.load(path))
        elif settings.variant == "structured":
            roles = _structured(pair, heads, settings, stats)  # plain averages: offset-free
        else:
            roles = _paper(pair, heads, settings, float(family.norm_offset), stats)
        outputs = RoleOutputs(layout)
        done: set[str] = set()
        for role, tensors in roles:
            ready = outputs.put(role, tensors)
            del tensors
            while ready:
                suffix, tensor = ready.pop(0)
                done.add(suffix)
                yield suffix, tensor
                del tensor  # written by now; keep the frame from holding it
        for suffix in suffixes_a:
            if suffix not in done:  # no role: the plain average (e.g. tensors a template does not describe)
                dev = settings.device
                ta, tb = a.get(suffix).to(dev, torch.float32), b.get(suffix).to(dev, torch.float32)
                yield suffix, average(ta, tb)


def _check_heads(q_rows: int, k_rows: int, heads: Heads) -> None:
    if q_rows != heads.n_q * heads.head_dim or k_rows != heads.n_kv * heads.head_dim:
        raise OtdusError(
            f"q/k have {q_rows}/{k_rows} rows; the config implies {heads.n_q}x{heads.head_dim} and "
            f"{heads.n_kv}x{heads.head_dim}"
        )


def _norm_through(
    plan: TransportPlan, g_a: torch.Tensor, g_b: torch.Tensor, offset: float, scale: float | None, mix: bool
) -> torch.Tensor:
    """A norm gain aligned through a plan on its axis, then averaged with B's.

    The gain that multiplies activations is s = w + offset (offset 1 for Gemma's (1 + w) norms),
    so the alignment acts on s: 1/2 (s_A T_in + s_B) - offset (our choice: Gemma is outside the
    paper). ``mix``: T_in = 1/2 (s T + I), the paper's rule for the post-attention norm (residual
    = identity path + attention path; Imfeld et al.'s "mean" residual policy does the same).
    Written as 1/2 (w_A T_in + w_B) + offset/2 (1 T_in - 1), which is bit-exact when T_in's
    columns sum to exactly 1 (a permutation); with the released code's unscaled T they sum to
    ~1/n and the offset term matters.
    """
    g_a, g_b = f32(g_a), f32(g_b)

    def through(x: torch.Tensor) -> torch.Tensor:
        moved = plan.cols_to_b(x, scale)
        return average(moved, x) if mix else moved

    out = average(through(g_a), g_b)
    if offset:
        out = out + 0.5 * offset * (through(torch.ones_like(g_a)) - 1.0)
    return out


def _norm_role_through(
    plan: TransportPlan,
    ta: dict[str, torch.Tensor],
    tb: dict[str, torch.Tensor],
    offset: float,
    scale: float | None,
    mix: bool,
) -> dict[str, torch.Tensor]:
    """A norm's gain (``_norm_through``) and, where it has one (LayerNorm's), its bias through the same
    plan: the bias is added on the axis the gain scales, so it moves with it (no offset: a bias is not
    a gain). Our extension: the paper's and Imfeld et al.'s norms have no bias."""
    out = {"weight": _norm_through(plan, ta["weight"], tb["weight"], offset, scale, mix)}
    if "bias" in ta:
        out["bias"] = _norm_through(plan, ta["bias"], tb["bias"], 0.0, scale, mix)
    return out


# --------------------------------------------------------------------------------------------
# Variants "paper" and "official".

Roles = Iterator[tuple[str, dict[str, torch.Tensor]]]


def _paper(pair: ParentPair, heads: Heads, s: OTSettings, offset: float, stats: dict) -> Roles:
    """The paper's transport-matrix-flow table, yielding each module as soon as it is built.

    paper:    cost "paper" (Imfeld et al.'s), chosen solver, plans applied as n T (Imfeld et
              al.'s convention: an aligned row is a convex combination of A's rows).
    official: cost "raw", POT standard Sinkhorn, plans applied as T (scale 1), as the released
              script does and the paper's table writes them: A's contribution shrinks by ~n,
              so q/k/v/gate/up come out ~ 1/2 W_B.
    With zero-init on, o and down come out zero: their plans are still solved (T_O feeds the
    post-attention norm and gate/up; T_D Gemma's post-feedforward norm; both go to the stats),
    but the aligned weights are not computed.
    """
    plan_o = yield from paper_attention(pair, heads, s, offset, stats)
    yield from _paper_mlp(pair, plan_o, s, offset, stats)


def paper_matcher(s: OTSettings, stats: dict) -> tuple[Callable[..., TransportPlan], float | None]:
    """match(x_A, x_B, module) for the paper/official variants (stats recorded under ``module``), and
    the plan scale they apply (None: the plan's own n; official: 1)."""
    official = s.variant == "official"
    cost = "raw" if official else "paper"
    solver = "official" if official else s.solver

    def match(xa: torch.Tensor, xb: torch.Tensor, module: str) -> TransportPlan:
        plan = match_rows(xa, xb, cost=cost, solver=solver, reg=s.reg, tol=s.tol, max_iter=s.max_iter)
        stats[module] = plan.stats()
        return plan

    return match, (1.0 if official else None)


def paper_attention(
    pair: ParentPair, heads: Heads, s: OTSettings, offset: float, stats: dict
) -> Generator[tuple[str, dict[str, torch.Tensor]], None, TransportPlan]:
    """The attention half of the paper's flow, up to the pre-MLP norm; returns T_O (the MLP's T_in)."""
    official = s.variant == "official"
    match, scale = paper_matcher(s, stats)

    def plain(role: str) -> Roles:
        if pair.has(role):
            ta, tb = pair.take(role)
            yield role, average_role(ta, tb)

    yield from plain("attn_norm")
    rows: dict[str, int] = {}
    for role in ("q", "k", "v"):
        ta, tb = pair.take(role)
        rows[role] = ta["weight"].shape[0]
        if role == "k":
            _check_heads(rows["q"], rows["k"], heads)
        plan = match(ta["weight"], tb["weight"], role)
        out = aligned_role(plan, ta, tb, scale)
        del ta, tb, plan
        yield role, out
        del out  # the consumer has written it: do not hold it through the next module
    yield from plain("q_norm")  # per head_dim, shared by all heads: no rows to align
    yield from plain("k_norm")
    ta, tb = pair.take("o")
    plan_o = match(ta["weight"], tb["weight"], "o")
    # o's own alignment (only kept when zero_init is off): T_in = I per the paper's table.
    out = zeros_like_role(ta) if s.zero_init else aligned_role(plan_o, ta, tb, scale)
    del ta, tb
    yield "o", out
    del out
    # Gemma's post-attention / post-feedforward norms scale o's / down's output rows, so in
    # "paper" they follow T_O / T_D (the plans of the rows they multiply: our extension of the
    # flow, neither the paper nor the released script has these tensors). They only ever act on
    # the zeroed outputs, so they cannot change the function; "official" averages them plainly
    # rather than invent a convention.
    yield from _output_norm(pair, "attn_out_norm", plan_o, offset, scale, official)
    # Post-attention (pre-MLP) norm: T_in = 1/2 (s T_O + I) (the paper's table: the residual
    # stream is the identity path plus the attention path; s = n is Imfeld et al.'s scaling).
    if pair.has("mlp_norm"):  # a norm without weight (OLMo's) has nothing to align
        ta, tb = pair.take("mlp_norm")
        yield "mlp_norm", _norm_role_through(plan_o, ta, tb, offset, scale, mix=True)
    return plan_o


def _paper_mlp(pair: ParentPair, plan_o: TransportPlan, s: OTSettings, offset: float, stats: dict) -> Roles:
    official = s.variant == "official"
    match, scale = paper_matcher(s, stats)
    for role in [r for r in ("gate", "up") if pair.has(r)]:  # an ungated MLP has up alone
        ta, tb = pair.take(role)
        inputs = {**ta, "weight": plan_o.cols_to_b(f32(ta["weight"]), scale)}  # W_A T_in, T_in = s T_O
        del ta
        plan = match(inputs["weight"], tb["weight"], role)
        out = aligned_role(plan, inputs, tb, scale)
        del inputs, tb, plan
        yield role, out
        del out
    del plan_o
    ta, tb = pair.take("down")
    plan_d = match(ta["weight"], tb["weight"], "down")
    out = zeros_like_role(ta) if s.zero_init else aligned_role(plan_d, ta, tb, scale)
    del ta, tb
    yield "down", out
    yield from _output_norm(pair, "mlp_out_norm", plan_d, offset, scale, official)


def _output_norm(
    pair: ParentPair, role: str, plan: TransportPlan, offset: float, scale: float | None, official: bool
) -> Roles:
    if not pair.has(role):
        return
    ta, tb = pair.take(role)
    if official:
        yield role, average_role(ta, tb)
    else:
        yield role, _norm_role_through(plan, ta, tb, offset, scale, mix=False)


# --------------------------------------------------------------------------------------------
# Variant "structured".


def _structured(pair: ParentPair, heads: Heads, s: OTSettings, stats: dict) -> Roles:
    """Alignment along the layer's real symmetries only (docs/ot.md).

    * Residual (hidden) axis: identity. A and B read and write the same residual stream, whose
      basis is fixed by the embeddings and every other layer; no permutation of it relates the
      two layers. (The paper's T_O, solved on o_proj rows, mixes hidden dims: with heads
      permuted in B it is far from I and scrambles gate/up inputs and the MLP norm; see the
      planted-symmetry tests.) So every norm is a plain average and o/down rows are not moved.
    * MLP: neuron k is (gate row k, up row k, down column k); SwiGLU multiplies gate_k by up_k,
      so one plan for all three (cost on the concatenated unit-normalised vectors).
    * Attention: heads are the units. A KV head moves with its group of query heads; query heads
      may be re-paired inside a group; inside a head, q/k dims are never permuted (RoPE rotates
      dims d and d + head_dim/2 together at a fixed frequency), while V dims, which only meet
      O's columns, get their own plan, and O's columns follow both head and V-dim plans.
    """
    for role in NORM_ROLES:
        if pair.has(role):
            ta, tb = pair.take(role)
            yield role, average_role(ta, tb)

    # --- MLP: one plan per neuron (gate row, up row, down column), on the parts' cost (an ungated
    # MLP's neuron: up row, down column).
    mlp = _mlp_roles(pair)
    plan = match_parts(
        [(ta["weight"], tb["weight"]) for ta, tb in (mlp[r] for r in ("gate", "up") if r in mlp)]
        + [(mlp["down"][0]["weight"].T, mlp["down"][1]["weight"].T)],
        solver=s.solver,
        reg=s.reg,
        tol=s.tol,
        max_iter=s.max_iter,
    )
    stats["gate_up"] = plan.stats()
    yield from _mlp_through(mlp, plan, s)
    del plan
    yield from structured_attention(pair, heads, s, stats)


def _mlp_roles(pair: ParentPair) -> dict[str, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    """The MLP's (A's, B's) tensors by role: gate (where it has one), up and down."""
    return {role: pair.take(role) for role in ("gate", "up", "down") if role != "gate" or pair.has(role)}


def _mlp_through(
    mlp: dict[str, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]],
    plan: TransportPlan,
    s: OTSettings,
) -> Roles:
    """gate/up rows and down columns of an MLP (up and down alone where it has no gate) aligned by one
    neuron plan, then averaged."""
    for role in [r for r in ("gate", "up") if r in mlp]:
        ta, tb = mlp.pop(role)
        out = aligned_role(plan, ta, tb, None)
        del ta, tb
        yield role, out
        del out
    ta, tb = mlp.pop("down")
    if s.zero_init:
        down = zeros_like_role(ta)
    else:
        down = {"weight": add_into(plan.cols_to_b(f32(ta["weight"])), tb["weight"]).mul_(0.5)}
        if "bias" in ta:  # down's bias lives on the hidden axis: not permuted
            down["bias"] = average(f32(ta["bias"]), tb["bias"])
    del ta, tb
    yield "down", down


def structured_attention(
    pair: ParentPair, heads: Heads, s: OTSettings, stats: dict, matcher: ActivationAttention | None = None
) -> Roles:
    """Attention of the structured variant: head-level assignment, then V dims inside matched heads
    (matched on weights, or by ``matcher`` on activations)."""
    att = {role: pair.take(role) for role in ("q", "k", "v", "o")}
    ta = {role: {kind: f32(t) for kind, t in att[role][0].items()} for role in att}
    tb = {role: {kind: f32(t) for kind, t in att[role][1].items()} for role in att}
    del att
    _check_heads(ta["q"]["weight"].shape[0], ta["k"]["weight"].shape[0], heads)
    yield from _structured_attention(ta, tb, heads, s, stats, matcher)


def _structured_attention(
    ta: Tensors, tb: Tensors, heads: Heads, s: OTSettings, stats: dict, matcher: ActivationAttention | None
) -> Roles:
    if matcher is None:
        kv_perm, q_perm, head_stats = _match_heads(ta, tb, heads)
    else:
        kv_perm, q_perm, head_stats = matcher.match_heads()
    stats["heads"] = head_stats
    hd, g = heads.head_dim, heads.group
    device = ta["q"]["weight"].device
    q_rows = _head_rows(q_perm, hd, device)  # B's head j takes the rows of A's head perm^-1(j)
    kv_rows = _head_rows(kv_perm, hd, device)
    yield "q", {kind: average(t[q_rows], tb["q"][kind]) for kind, t in ta["q"].items()}
    yield "k", {kind: average(t[kv_rows], tb["k"][kind]) for kind, t in ta["k"].items()}
    # V dims: one plan per matched KV head pair; O's columns of that group's query heads follow.
    v_a = {kind: t[kv_rows] for kind, t in ta["v"].items()}  # A's KV heads in B's head order
    # A's query-head column blocks in B's head order (not needed when o comes out zero)
    o_a = None if s.zero_init else ta["o"]["weight"][:, q_rows]
    v_new = {kind: torch.empty_like(t) for kind, t in v_a.items()}
    o_new = None if o_a is None else torch.empty_like(o_a)
    v_stats = []
    for j in range(heads.n_kv):
        rows = slice(j * hd, (j + 1) * hd)
        if matcher is not None:
            plan = matcher.v_plan(j, kv_perm, q_perm)
        else:
            plan = match_rows(
                v_a["weight"][rows],
                tb["v"]["weight"][rows],
                cost="paper",
                solver=s.solver,
                reg=s.reg,
                tol=s.tol,
                max_iter=s.max_iter,
            )
        v_stats.append(plan.stats())
        for kind, t in v_a.items():
            v_new[kind][rows] = average(plan.rows_to_b(t[rows]), tb["v"][kind][rows])
        for h in range(j * g, (j + 1) * g) if o_new is not None else ():
            cols = slice(h * hd, (h + 1) * hd)
            o_new[:, cols] = average(plan.cols_to_b(o_a[:, cols]), tb["o"]["weight"][:, cols])
    stats["v"] = _mean_stats(v_stats)
    yield "v", v_new
    if o_new is None:
        yield "o", zeros_like_role(ta["o"])
        return
    o_out = {"weight": o_new}
    if "bias" in ta["o"]:  # hidden axis: not permuted
        o_out["bias"] = average(ta["o"]["bias"], tb["o"]["bias"])
    yield "o", o_out


# --------------------------------------------------------------------------------------------
# Variant "activation": the structured flow, plans from activations on calibration text.


def _activation(pair: ParentPair, heads: Heads, s: OTSettings, stats: dict, acts: PairActivations) -> Roles:
    """The structured variant's flow (hidden axis never permuted; one plan per MLP neuron; heads
    with their GQA group; V dims inside matched heads) with every plan solved on activation
    correlations (methods/ot/calibration.py) instead of weight distances. Cost: 1 - correlation,
    divided by its maximum (transport/cost.py, ``correlation_cost``)."""
    for role in NORM_ROLES:
        if pair.has(role):
            ta, tb = pair.take(role)
            yield role, average_role(ta, tb)
    mlp = _mlp_roles(pair)
    n = mlp["up"][0]["weight"].shape[0]
    if acts.mlp.shape != (n, n):
        raise OtdusError(f"activation statistics of {tuple(acts.mlp.shape)} MLP neurons, the layers have {n}")
    plan = activation_plan(acts.mlp.to(s.device), s)
    stats["gate_up"] = plan.stats()
    yield from _mlp_through(mlp, plan, s)
    del plan, mlp
    w_o = (pair.a.take("o")["weight"], pair.b.take("o")["weight"])  # fresh reads: attention takes its own
    yield from structured_attention(pair, heads, s, stats, ActivationAttention(acts, w_o, heads, s))


def activation_plan(corr: torch.Tensor, s: OTSettings) -> TransportPlan:
    """The plan of A's units onto B's from their activation correlations (``correlation_cost``)."""
    plan = solve_cost(
        correlation_cost(corr), solver=s.solver, reg=s.reg, tol=s.tol, max_iter=s.max_iter, overwrite=True
    )
    plan.info["cost"] = "activation"
    return plan


def match_head_groups(corr: torch.Tensor, heads: Heads) -> tuple[list[int], list[int], dict[str, Any]]:
    """Exact assignment of A's KV groups to B's, then of query heads inside each matched group, on
    the heads' correlation ``corr`` (n_q x n_q): group cost = the best pairing of its query heads'
    1 - correlation (heads are discrete units: the assignment is exact, as in ``_match_heads``)."""
    g, n_kv = heads.group, heads.n_kv
    cost = (1.0 - corr.double().cpu()).clamp_(min=0.0)
    group_cost = torch.empty(n_kv, n_kv, dtype=torch.float64)
    inner: dict[tuple[int, int], list[int]] = {}
    for i in range(n_kv):
        for j in range(n_kv):
            block = cost[i * g : (i + 1) * g, j * g : (j + 1) * g]
            q_plan = assignment(block)
            perm = q_plan.perm.cpu()
            inner[i, j] = [j * g + int(p) for p in perm]
            group_cost[i, j] = float(block[torch.arange(g), perm].sum())
    kv_perm = [int(p) for p in assignment(group_cost).perm]
    q_perm = [0] * heads.n_q
    for i, j in enumerate(kv_perm):
        for k, target in enumerate(inner[i, j]):
            q_perm[i * g + k] = target
    q_index = torch.tensor(q_perm)
    info = {
        "solver": "assignment",
        "cost": "activation",
        "kv_perm": kv_perm,
        "q_perm": q_perm,
        "identity": kv_perm == list(range(n_kv)) and q_perm == list(range(heads.n_q)),
        "cost_matched": float(group_cost[torch.arange(n_kv), torch.tensor(kv_perm)].sum()),
        "cost_identity": float(group_cost.diagonal().sum()),
        "correlation_matched": float(corr.double().cpu()[torch.arange(heads.n_q), q_index].mean()),
    }
    return kv_perm, q_perm, info


class ActivationAttention:
    """The activation variant's attention plans: heads by the correlation of their residual
    contributions, V dims by the correlation of the matched heads' outputs (o_proj inputs)."""

    def __init__(
        self, acts: PairActivations, w_o: tuple[torch.Tensor, torch.Tensor], heads: Heads, s: OTSettings
    ):
        from otdus_cli.methods.ot.calibration import head_correlation

        self.heads, self.s = heads, s
        self.head_corr = head_correlation(acts.o_cross, acts.o_auto_a, acts.o_auto_b, *w_o)
        self.o_corr = acts.o_correlation()

    def match_heads(self) -> tuple[list[int], list[int], dict[str, Any]]:
        return match_head_groups(self.head_corr, self.heads)

    def v_plan(self, j: int, kv_perm: list[int], q_perm: list[int]) -> TransportPlan:
        """Plan of V dims for B's KV head j and the A head matched to it: the correlation of A's
        head-output dims with B's, averaged over the group's matched query heads."""
        hd, g = self.heads.head_dim, self.heads.group
        i = kv_perm.index(j)
        blocks = [
            self.o_corr[h * hd : (h + 1) * hd, q_perm[h] * hd : (q_perm[h] + 1) * hd]
            for h in range(i * g, (i + 1) * g)
        ]
        return activation_plan(torch.stack(blocks).mean(dim=0).to(self.s.device), self.s)


def _head_rows(perm: list[int], hd: int, device: torch.device) -> torch.Tensor:
    """Row index that puts A's head perm^-1(j) at B's head j (perm: A head i -> B head perm[i])."""
    inv = [0] * len(perm)
    for i, j in enumerate(perm):
        inv[j] = i
    return torch.tensor([inv[j] * hd + d for j in range(len(perm)) for d in range(hd)], device=device)


def _head_distances(xa: torch.Tensor, xb: torch.Tensor, hd: int) -> torch.Tensor:
    """D[a, b] = sum_d |x_A[a, d] - x_B[b, d]| over the unit-normalised rows of heads a and b.

    Rows are compared dim by dim (d with d): no permutation inside a head.
    """
    ua = unit_rows(xa).reshape(-1, hd, xa.shape[1])
    ub = unit_rows(xb).reshape(-1, hd, xb.shape[1])
    dots = torch.einsum("adh,bdh->abd", ua, ub)
    return (2.0 - 2.0 * dots).clamp_(min=0.0).sqrt_().sum(dim=2)


def _match_heads(ta: Tensors, tb: Tensors, heads: Heads) -> tuple[list[int], list[int], dict[str, Any]]:
    """Exact assignment of A's KV groups (KV head + its query heads) to B's, then of query heads
    within each matched group.

    Group cost = k distance (dim by dim) + best pairing of the group's query heads (dim by dim)
    + v distance under the best matching of V dims (V dims are a free symmetry, so a permuted
    V head still matches its original). Heads are discrete units, so the assignment is exact
    (the problem is tiny: n_kv x n_kv groups, group x group query heads, head_dim x head_dim).
    """
    hd, g, n_kv = heads.head_dim, heads.group, heads.n_kv
    dq = _head_distances(ta["q"]["weight"], tb["q"]["weight"], hd).cpu()  # n_q x n_q
    dk = _head_distances(ta["k"]["weight"], tb["k"]["weight"], hd).cpu()  # n_kv x n_kv
    va = unit_rows(ta["v"]["weight"]).reshape(n_kv, hd, -1)
    vb = unit_rows(tb["v"]["weight"]).reshape(n_kv, hd, -1)
    group_cost = torch.empty(n_kv, n_kv, dtype=torch.float64)
    inner: dict[tuple[int, int], list[int]] = {}
    for i in range(n_kv):
        for j in range(n_kv):
            dv = euclidean_distances(va[i], vb[j])
            v_plan = assignment(dv)
            v_cost = float(dv[torch.arange(hd, device=dv.device), v_plan.perm].sum())
            block = dq[i * g : (i + 1) * g, j * g : (j + 1) * g]
            q_plan = assignment(block)
            q_cost = float(block[torch.arange(g), q_plan.perm.cpu()].sum())
            inner[i, j] = [j * g + int(p) for p in q_plan.perm.cpu()]
            group_cost[i, j] = float(dk[i, j]) + q_cost + v_cost
    group_plan = assignment(group_cost)
    kv_perm = [int(p) for p in group_plan.perm]
    q_perm = [0] * heads.n_q
    for i, j in enumerate(kv_perm):
        for k, target in enumerate(inner[i, j]):
            q_perm[i * g + k] = target
    identity_cost = float(group_cost.diagonal().sum())
    matched_cost = float(group_cost[torch.arange(n_kv), torch.tensor(kv_perm)].sum())
    info = {
        "solver": "assignment",
        "kv_perm": kv_perm,
        "q_perm": q_perm,
        "identity": kv_perm == list(range(n_kv)) and q_perm == list(range(heads.n_q)),
        "cost_matched": matched_cost,
        "cost_identity": identity_cost,
    }
    return kv_perm, q_perm, info


def _mean_stats(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean of the numeric entries of several plan reports (bools: all; others: first)."""
    out: dict[str, Any] = {"plans": len(items)}
    for key, value in items[0].items():
        if isinstance(value, bool):
            out[key] = all(bool(it[key]) for it in items)
        elif isinstance(value, (int, float)):
            out[key] = sum(float(it[key]) for it in items) / len(items)
        else:
            out[key] = value
    return out
