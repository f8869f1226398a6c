"""OT-DUS on mixture-of-experts layers: experts matched first, then neurons inside each matched pair.

A new MoE layer comes from the pair (A, B) as a dense one does (builder.py), with the MLP replaced by
the MoE block:

* attention and norms exactly as for dense layers, in all three variants (builder.py's own code);
* experts: an exact assignment of A's experts to B's, on the router rows. A router row is the only
  per-expert parameter with no internal symmetry (it lives on the residual axis, which A and B
  share; in `paper`/`official` it is first moved through T_O like every MLP input), and it is what
  decides which tokens an expert serves. Expert weights cannot be compared directly (each expert's
  neurons are in arbitrary order), and comparing them after a neuron alignment would cost E^2 OT
  solves. Experts are discrete units, so the plan is a permutation (blending unrelated experts
  would average unrelated neurons);
* inside each matched pair (A's expert e, B's expert f), the expert is aligned exactly as a dense
  SwiGLU MLP of that variant: `paper`/`official` an own plan for gate and up on W_A (s T_O), down
  zero (solved only when zero-init is off); `structured` one joint plan per neuron (gate row, up
  row, down column) and no hidden-axis plan. The result is the new layer's expert f;
* router rows (and any per-expert router bias) follow the expert assignment and are averaged like
  any other weight; a shared expert (Qwen2-MoE) is a dense MLP and gets the dense treatment, its
  scalar gate row is averaged (through T_O in `paper`/`official`).

Zero-init zeroes o_proj, every expert's down projection and the shared expert's (the family's
zero-init targets), so the new layer is an exact identity.

Memory: experts are read, aligned and yielded one matched pair at a time: the peak is one expert
pair's tensors and one intermediate x intermediate plan, never a whole MoE layer in float32.
Statistics: ``ctx.stats["experts"]`` has one entry per matched pair (the manifest's record);
``ctx.stats["modules"]`` has the attention modules, the expert assignment ("experts") and one
summary per expert projection ("experts.gate", ...), so the terminal shows a line per module, not
one per expert.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any

import torch

from otdus_cli.arch.experts import ExpertLayout, expert_layout
from otdus_cli.arch.heads import Heads
from otdus_cli.errors import OtdusError
from otdus_cli.methods.base import BuildContext, ParentLayer
from otdus_cli.methods.layer_roles import (
    NORM_ROLES,
    ParentPair,
    ParentRoles,
    RoleLayout,
    RoleOutputs,
    aligned_role,
    average,
    average_role,
    f32,
    zeros_like_role,
)
from otdus_cli.methods.ot.builder import OTSettings, paper_attention, paper_matcher, structured_attention
from otdus_cli.transport.assignment import assignment
from otdus_cli.transport.cost import paper_cost
from otdus_cli.transport.plan import TransportPlan
from otdus_cli.transport.solve import match_parts

_ATTENTION_REQUIRED = ("q", "k", "v", "o", "mlp_norm")

Out = Iterator[tuple[str, torch.Tensor]]


def build_moe_layer(
    a: ParentLayer, b: ParentLayer, ctx: BuildContext, s: OTSettings, stats: dict[str, Any]
) -> Out:
    family = ctx.family
    layout = expert_layout(family.name)
    if layout is None:
        raise OtdusError(f"--method ot does not know the MoE layout of {family.name} yet")
    suffixes = a.suffixes()
    experts = layout.expert_count(ctx.config)
    if any(layout.is_expert_indexed(x) and not x.startswith(layout.block + layout.router) for x in suffixes):
        raise OtdusError(
            "--method ot reads experts stored one matrix per expert; this checkpoint stores them fused"
        )
    attention = RoleLayout(family, ctx.config, suffixes, required=_ATTENTION_REQUIRED)  # family.roles
    pair = ParentPair(ParentRoles(a, attention, s.device), ParentRoles(b, attention, s.device))
    heads = Heads.from_config(ctx.config)
    outputs = RoleOutputs(attention)
    done: set[str] = set()

    def emit(roles: Generator) -> Generator[tuple[str, torch.Tensor], None, Any]:
        """Write out a role generator's tensors; hand back its return value (T_O for paper)."""
        while True:
            try:
                role, tensors = next(roles)
            except StopIteration as stop:
                return stop.value
            for suffix, tensor in outputs.put(role, tensors):
                done.add(suffix)
                yield suffix, tensor

    if s.variant == "structured":
        yield from emit((role, average_role(*pair.take(role))) for role in NORM_ROLES if pair.has(role))
        plan_o = None
    else:
        offset = float(family.norm_offset)
        plan_o = yield from emit(paper_attention(pair, heads, s, offset, stats))
    block = _MoEBlock(a, b, layout, experts, s, plan_o, stats)
    for suffix, tensor in block.build():
        done.add(suffix)
        yield suffix, tensor
    ctx.stats["experts"] = block.pairs
    if s.variant == "structured":
        yield from emit(structured_attention(pair, heads, s, stats))
    for suffix in suffixes:  # no role: the plain average
        if suffix not in done:
            yield suffix, average(f32(a.get(suffix).to(s.device)), f32(b.get(suffix).to(s.device)))


class _MoEBlock:
    """The MoE block of the new layer, yielded one matched expert pair at a time."""

    def __init__(
        self,
        a: ParentLayer,
        b: ParentLayer,
        layout: ExpertLayout,
        experts: int,
        s: OTSettings,
        plan_o: TransportPlan | None,
        stats: dict[str, Any],
    ):
        self.a, self.b, self.layout, self.experts, self.s = a, b, layout, experts, s
        self.plan_o = plan_o  # hidden-axis plan of paper/official (None: structured, identity)
        self.stats = stats
        self.pairs: list[dict[str, Any]] = []
        self.scale = 1.0 if s.variant == "official" else None
        self.suffixes = set(a.suffixes())

    def _get(self, layer: ParentLayer, suffix: str) -> torch.Tensor:
        return layer.get(suffix).to(self.s.device)

    def _input_aligned(self, w: torch.Tensor) -> torch.Tensor:
        """W_A (s T_O): A's weight on the residual axis, moved to B's basis (paper/official)."""
        w = f32(w)
        return w if self.plan_o is None else self.plan_o.cols_to_b(w, self.scale)

    def build(self) -> Out:
        lay = self.layout
        router = f"{lay.block}{lay.router}"
        if f"{router}.weight" not in self.suffixes:
            raise OtdusError(
                f"layer {self.a.index} has no router {router}.weight, which every MoE layer of this "
                "family holds"
            )
        ra = self._input_aligned(self._get(self.a, f"{router}.weight"))
        rb = self._get(self.b, f"{router}.weight")
        if ra.shape[0] != self.experts:
            raise OtdusError(f"the router has {ra.shape[0]} rows; the config says {self.experts} experts")
        cost = paper_cost(ra, rb)
        plan = assignment(cost)
        perm = [int(p) for p in plan.perm.cpu()]  # A's expert e -> B's expert perm[e]
        self.stats["experts"] = {
            **plan.stats(),
            "cost": "router rows (paper cost, after T_O where the variant has it)",
            "perm": perm,
            "identity": perm == list(range(self.experts)),
            "cost_matched": float(cost[torch.arange(self.experts), plan.perm].sum()),
            "cost_identity": float(cost.diagonal().sum()),
        }
        del cost
        # router rows follow the expert plan: B's row f averaged with A's row perm^-1(f)
        yield f"{router}.weight", average(plan.rows_to_b(ra), rb)
        del ra, rb
        for kind in ("bias", "e_score_correction_bias"):
            name = f"{router}.{kind}"
            if name in self.suffixes:
                yield name, average(plan.rows_to_b(f32(self._get(self.a, name))), self._get(self.b, name))
        source_of = [0] * self.experts
        for e, f in enumerate(perm):
            source_of[f] = e
        for f in range(self.experts):
            yield from self._expert_pair(source_of[f], f)
        self._summarise()
        yield from self._shared_expert()

    def _names(self, prefix: str) -> dict[str, str]:
        lay = self.layout
        return {role: f"{prefix}{getattr(lay, role)}.weight" for role in ("gate", "up", "down")}

    def _expert_pair(self, e: int, f: int) -> Out:
        prefix = f"{self.layout.block}experts."
        na, nb = self._names(f"{prefix}{e}."), self._names(f"{prefix}{f}.")
        record: dict[str, Any] = {"a": e, "b": f}
        yield from self._dense_mlp(na, nb, record)
        self.pairs.append(record)

    def _dense_mlp(self, na: dict[str, str], nb: dict[str, str], record: dict[str, Any]) -> Out:
        """One SwiGLU MLP of A aligned to B's (an expert pair, or the shared experts); names of B's."""
        s = self.s
        if s.variant == "structured":
            ga, gb = self._get(self.a, na["gate"]), self._get(self.b, nb["gate"])
            ua, ub = self._get(self.a, na["up"]), self._get(self.b, nb["up"])
            da, db = self._get(self.a, na["down"]), self._get(self.b, nb["down"])
            plan = match_parts(
                [(ga, gb), (ua, ub), (da.T, db.T)], solver=s.solver, reg=s.reg, tol=s.tol, max_iter=s.max_iter
            )
            record["gate_up"] = plan.stats()
            yield nb["gate"], aligned_role(plan, {"weight": ga}, {"weight": gb}, None)["weight"]
            del ga, gb
            yield nb["up"], aligned_role(plan, {"weight": ua}, {"weight": ub}, None)["weight"]
            del ua, ub
            if s.zero_init:
                yield nb["down"], zeros_like_role({"weight": da})["weight"]
            else:
                yield nb["down"], average(plan.cols_to_b(f32(da)), db)
            return
        match, scale = paper_matcher(s, record)
        for role in ("gate", "up"):
            xa = self._input_aligned(self._get(self.a, na[role]))
            xb = self._get(self.b, nb[role])
            plan = match(xa, xb, role)
            yield nb[role], aligned_role(plan, {"weight": xa}, {"weight": xb}, scale)["weight"]
            del xa, xb, plan
        da = self._get(self.a, na["down"])
        if s.zero_init:  # zero either way: no plan is needed for it (nothing reads T_D here)
            yield nb["down"], zeros_like_role({"weight": da})["weight"]
        else:
            db = self._get(self.b, nb["down"])
            yield (
                nb["down"],
                aligned_role(match(da, db, "down"), {"weight": da}, {"weight": db}, scale)["weight"],
            )

    def _summarise(self) -> None:
        """One entry per expert projection in the per-module stats: means, the worst status."""
        keys = sorted({k for p in self.pairs for k, v in p.items() if isinstance(v, dict)})
        for key in keys:
            items = [p[key] for p in self.pairs if key in p]
            summary: dict[str, Any] = {"plans": len(items)}
            for field in ("entropy_normalized", "permutation_closeness", "marginal_error", "seconds"):
                values = [float(it[field]) for it in items if isinstance(it.get(field), (int, float))]
                if values:
                    summary[field] = sum(values) / len(values)
            summary["iterations"] = max(int(it.get("iterations") or 0) for it in items)
            summary["marginal_error"] = max(float(it.get("marginal_error") or 0.0) for it in items)
            bad = [it.get("status") for it in items if it.get("status", "ok") != "ok"]
            summary["status"] = bad[0] if bad else "ok"
            self.stats[f"experts.{key}"] = summary

    def _shared_expert(self) -> Out:
        if not self.layout.shared:
            return
        mlp_prefix, gate_prefix = self.layout.shared
        names = {role: f"{mlp_prefix}{role}_proj.weight" for role in ("gate", "up", "down")}
        if names["gate"] in self.suffixes:
            record: dict[str, Any] = {}
            yield from self._dense_mlp(names, names, record)
            for key, value in record.items():
                self.stats[f"shared_expert.{key}"] = value
        gate = f"{gate_prefix}weight"
        if gate in self.suffixes:  # the shared expert's scalar gate: a row on the residual axis
            yield gate, average(self._input_aligned(self._get(self.a, gate)), self._get(self.b, gate))
