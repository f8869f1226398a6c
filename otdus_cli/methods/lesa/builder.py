"""LESA (Yang et al., "LESA: Learnable LLM Layer Scaling-Up"): new layers predicted by a small MLP.

For each projection type P (q, k, v, o, gate, up, down; no gate where the MLP has none), the L base
layers' matrices W_l (out x in) are concatenated along the input dimension, M = [W_0 ... W_{L-1}]
(out x L*in), and decomposed once, M = U S V^T, so W_l = U S V_l^T with V_l^T the l-th (r x in)
block of V^T. A row of V_l^T is "the coefficients of singular direction j in layer l". An MLP (2 in
-> hidden -> hidden -> in, ReLU) is trained on every interior layer l and every direction j to map the pair
(V_{l-1}^T[j], V_{l+1}^T[j]) to V_l^T[j], with the loss

    (1 - lambda) mean((pred - target)^2) + lambda (||pred||_F - ||target||_F)^2     (per batch),

AdamW (lr 1e-3, torch's defaults otherwise), 10 epochs, batch 64, lambda 0.0005, hidden 256,
shuffled every epoch. The new layer between base layers i and i+1 is U S MLP(V_i^T, V_{i+1}^T)
(the predictor is trained on neighbours two apart and applied to adjacent layers, as published).
These facts and defaults are the LESA authors' notebook (also in the OT-DUS authors' repository as
Model/train_LESA.py, Model/load_LESA.py); this code is written independently of both.

Two variants (``--lesa-variant``):

* ``published``: what that notebook produces. Every tensor LESA does not predict (norms, Qwen2's
  q/k/v biases, Qwen3's q_norm/k_norm, Gemma's extra norms) is base layer 0's, because the
  notebook builds each new layer as a deep copy of layer 0 and replaces only the seven projection
  weights; nothing is zeroed (zero-init off by default; ``--zero-init`` still applies on request).
* ``pair`` (otdus's default): composes with zero-init (on by default, which makes the expansion
  function-preserving: o_proj and down_proj come out zero, so they are not predicted at all), and
  the tensors LESA does not predict are 1/2 (f_i + f_{i+1}) of the pair the new layer sits in.

Choices of ours, where the notebook has none or cannot be followed as written:

* The SVD is computed through the Gram matrix, M M^T = sum_l W_l W_l^T (out x out, each product and
  the sum in float64, one layer at a time), its eigendecomposition M M^T = U S^2 U^T, and V_l^T =
  S^-1 U^T W_l (one layer at a time again). This is the SVD of M (same U, S, V up to signs) without
  ever holding M or its LAPACK workspace; the V blocks, which the training reads, are the only thing
  as large as M. Directions with S below 1e-10 S_max (none in a trained model) are dropped. Each
  singular pair's sign is fixed (the largest-magnitude entry of U's column is positive), so results
  do not depend on the LAPACK build. The sign is not neutral: flipping direction j flips row j of
  every V_l^T, and the predictor (an MLP with biases and ReLUs, trained on all rows at once) is not
  equivariant to that, so another convention (LAPACK's own signs, say) trains another predictor and
  gives other new weights; this convention is ours, the notebook has none (it keeps numpy's).
  ``rank`` keeps the top-k directions only (our option, not the published default: less memory and
  training time, new weights of rank <= k).
* Seeded: each projection type has its own generator (seed, type), which draws the MLP's initial
  weights (uniform in +-1/sqrt(fan_in), weights and biases, as torch.nn.Linear's default init, in
  the order fc1.weight, fc1.bias, fc2..., fc3.bias) and then one permutation of the training rows
  per epoch (torch.randperm). The last batch of an epoch may be smaller, as with a DataLoader.
* The leave-one-out check (``loo`` held-out layers per type): for a held-out interior layer h the
  predictor is retrained without the samples whose *target* is h (same settings, own generator); h
  stays an *input* of its neighbours' samples (targets h-1 and h+1 read V_h), so the check is not a
  full hold-out: dropping those too would leave no training target on a 5-layer model. It predicts W_h
  from W_{h-1} and W_{h+1}; reported as ||W_hat - W_h||_F / ||W_h||_F, next to the same error of
  the plain average 1/2 (W_{h-1} + W_{h+1}) and of the full predictor (which saw h in training).
  Held-out layers are spread evenly over the interior layers the insertion pairs span. The SVD
  basis is the one of all layers (re-decomposing per held-out layer would cost an SVD each).

Function preservation: the notebook (and the paper) zero nothing, so ``published`` output is not
function-preserving unless ``--zero-init`` is asked for; ``pair`` with its default zero-init is.

Memory: one projection type at a time, so unlike the other methods the peak grows with depth.
Peak = the Gram matrix (out^2 float64) and its eigendecomposition (eigenvectors and LAPACK's
workspace, a few more out^2 float64), then U (out x r float32) plus the V blocks (L x r x in
float32, the size of all L layers' matrices of that type in float32) plus the MLP and its AdamW
state. Predicted weights are written to a scratch folder inside the staging folder (in the output
dtype) and read back when their layer is written.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, pairwise
from pathlib import Path
from typing import Any

import torch

from otdus_cli.device import device_kind
from otdus_cli.errors import OtdusError
from otdus_cli.methods.base import BuildContext, ParentLayer
from otdus_cli.methods.layer_roles import ParentRoles, RoleLayout
from otdus_cli.methods.lesa.options import LesaOptions
from otdus_cli.plan.layer_map import OutputLayer

__all__ = ["LesaBuilder", "LesaSettings", "PROJECTIONS", "generator_seed", "held_out_layers"]

# The projection types LESA predicts, in the order they are computed.
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
# S_j below this fraction of S_max: the direction carries no weight and is dropped (S^-1 would blow up).
_RANK_FLOOR = 1e-10
_REPORTED = ("hidden", "epochs", "batch_size", "lr", "weight_decay", "norm_weight", "rank", "loo")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LesaSettings:
    """Validated options of one LESA expansion (defaults: the published ones)."""

    variant: str = "pair"
    hidden: int = 256
    epochs: int = 10
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.01
    norm_weight: float = 0.0005
    rank: int | None = None
    loo: int = 1
    zero_init: bool = True
    seed: int = 0
    dtype: str = "auto"  # output dtype: predicted weights are kept in it until written
    device: torch.device = torch.device("cpu")

    @classmethod
    def from_context(cls, ctx: BuildContext) -> LesaSettings:
        """The settings of one build: the validated ``ctx.options`` (LesaOptions; None: its defaults)."""
        lesa = ctx.options if ctx.options is not None else LesaOptions()
        return cls(
            **lesa.model_dump(), zero_init=ctx.zero_init, seed=ctx.seed, dtype=ctx.dtype, device=ctx.device
        )


# --------------------------------------------------------------------------------------------
# The decomposition of one projection type across all layers.


@dataclass
class Basis:
    """W_l = U S V_l^T for every layer l of one projection type (U S kept as one matrix)."""

    us: torch.Tensor  # out x r, float32: U scaled by S column-wise
    s: torch.Tensor  # r, float32
    v: torch.Tensor  # L x r x in, float32: V_l^T per layer
    sq_norms: torch.Tensor  # L, float64: ||W_l||_F^2
    dropped: int  # directions of M's rank dropped (below the floor or beyond ``rank``)
    stored_dtype: torch.dtype  # the source's dtype of these matrices

    def rebuild(self, coefficients: torch.Tensor) -> torch.Tensor:
        """U S C for predicted coefficients C (r x in): the new layer's weight, float32."""
        return self.us @ coefficients

    def relative_error(self, coefficients: torch.Tensor, layer: int) -> float:
        """||U S C - W_l||_F / ||W_l||_F, computed in coefficient space (U's columns are orthonormal):
        the part of W_l outside the kept directions counts in full."""
        inside = (self.s[:, None] * (coefficients - self.v[layer])).double().pow(2).sum()
        kept = (self.s[:, None] * self.v[layer]).double().pow(2).sum()
        outside = (self.sq_norms[layer] - kept).clamp(min=0)
        if float(self.sq_norms[layer]) == 0:
            return float("nan")
        return float(((inside + outside) / self.sq_norms[layer]).sqrt())


def _read(layer: ParentLayer, layout: RoleLayout, role: str, device: torch.device) -> torch.Tensor:
    # a fresh ParentRoles per read: the other parts of a fused tensor are not kept waiting
    return ParentRoles(layer, layout, device).take(role)["weight"]


def gram_matrix(weights: Iterable[torch.Tensor]) -> torch.Tensor:
    """sum_l W_l W_l^T, each product and the sum in float64 (float32 products would lose the
    smallest directions: an eigenvalue below ~1e-7 of the largest is rounding there)."""
    gram: torch.Tensor | None = None
    for w in weights:
        w64 = w.double()
        gram = w64 @ w64.T if gram is None else gram.addmm_(w64, w64.T)
        del w64
    if gram is None:
        raise ValueError("no weights to decompose")
    return gram


def decompose(layers: Sequence[ParentLayer], layout: RoleLayout, role: str, s: LesaSettings) -> Basis:
    """The SVD of [W_0 ... W_{L-1}] through its Gram matrix, streamed one layer at a time."""
    dev = s.device
    first = _read(layers[0], layout, role, dev)
    stored_dtype = first.dtype
    first = first.to(torch.float32)
    out, width = first.shape
    gram = gram_matrix(chain([first], (_read(layer, layout, role, dev) for layer in layers[1:])))
    del first
    evals, evecs = torch.linalg.eigh(gram)  # ascending
    del gram
    evals, evecs = evals.flip(0), evecs.flip(1)
    full = min(out, len(layers) * width)
    smax = math.sqrt(max(float(evals[0]), 0.0))
    keep = int((evals[:full].clamp(min=0).sqrt() > _RANK_FLOOR * smax).sum()) if smax > 0 else 0
    if keep == 0:
        raise OtdusError(f"{role}: every layer's matrix is zero; LESA has nothing to decompose")
    rank = min(keep, s.rank) if s.rank else keep
    u = evecs[:, :rank]
    del evecs
    # fixed signs: the largest-magnitude entry of each column of U is positive
    peak = u.abs().argmax(dim=0)
    u = u * u[peak, torch.arange(rank, device=dev)].sign()
    sv = evals[:rank].sqrt()
    u32, s32 = u.to(torch.float32), sv.to(torch.float32)
    del u
    v = torch.empty(len(layers), rank, width, dtype=torch.float32, device=dev)
    sq_norms = torch.empty(len(layers), dtype=torch.float64)
    for i, layer in enumerate(layers):
        w = _read(layer, layout, role, dev).to(torch.float32)
        torch.matmul(u32.T, w, out=v[i])
        v[i].div_(s32[:, None])
        sq_norms[i] = w.double().pow(2).sum().cpu()
        del w
    return Basis(u32 * s32, s32, v, sq_norms.to(dev), full - rank, stored_dtype)


# --------------------------------------------------------------------------------------------
# The predictor: an MLP from (V_{l-1}^T[j], V_{l+1}^T[j]) to V_l^T[j].

Params = list[torch.Tensor]


def init_mlp(d_in: int, hidden: int, d_out: int, gen: torch.Generator) -> Params:
    """fc1, fc2, fc3 (weights and biases) uniform in +-1/sqrt(fan_in), drawn in that order."""
    params = []
    for fan_in, fan_out in ((d_in, hidden), (hidden, hidden), (hidden, d_out)):
        bound = 1.0 / math.sqrt(fan_in)
        params.append((torch.rand(fan_out, fan_in, generator=gen) * 2 - 1) * bound)
        params.append((torch.rand(fan_out, generator=gen) * 2 - 1) * bound)
    return params


def mlp(params: Params, x: torch.Tensor) -> torch.Tensor:
    w1, b1, w2, b2, w3, b3 = params
    h = torch.relu(torch.nn.functional.linear(x, w1, b1))
    h = torch.relu(torch.nn.functional.linear(h, w2, b2))
    return torch.nn.functional.linear(h, w3, b3)


def _inputs(v: torch.Tensor, before: torch.Tensor, after: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return torch.cat([v[before, rows], v[after, rows]], dim=1)


def train_predictor(v: torch.Tensor, targets: list[int], s: LesaSettings, seed: int) -> tuple[Params, float]:
    """Train on the samples (l, j) for l in ``targets`` (sample index (l's position) * r + j, as the
    published notebook stacks them); returns the parameters and the last epoch's mean loss."""
    dev = v.device
    rank, width = v.shape[1], v.shape[2]
    gen = torch.Generator().manual_seed(seed)
    params = [p.to(dev).requires_grad_() for p in init_mlp(2 * width, s.hidden, width, gen)]
    optimizer = torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay)
    target_layer = torch.tensor(targets, device=dev)
    n = len(targets) * rank
    lam = s.norm_weight
    epoch_loss = float("nan")
    for _ in range(s.epochs):
        order = torch.randperm(n, generator=gen).to(dev)
        total, batches = torch.zeros((), device=dev), 0  # summed on the device: no sync per step
        for start in range(0, n, s.batch_size):
            idx = order[start : start + s.batch_size]
            layer, row = target_layer[idx // rank], idx % rank
            x, y = _inputs(v, layer - 1, layer + 1, row), v[layer, row]
            pred = mlp(params, x)
            loss = (1 - lam) * (pred - y).pow(2).mean() + lam * (pred.norm() - y.norm()).pow(2)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.detach()
            batches += 1
        epoch_loss = float(total) / batches
    return [p.detach() for p in params], epoch_loss


def predict(params: Params, v: torch.Tensor, before: int, after: int) -> torch.Tensor:
    """Coefficients of the layer between ``before`` and ``after`` (r x in), float32."""
    with torch.no_grad():
        return mlp(params, torch.cat([v[before], v[after]], dim=1))


def held_out_layers(depth: int, pairs: Sequence[tuple[int, int]], count: int) -> list[int]:
    """``count`` interior layers (1 .. L-2) spread evenly over those the insertion pairs span
    (all interior layers when the span has fewer). Holding one out needs another to train on."""
    interior = list(range(1, depth - 1))
    if count == 0 or len(interior) < 2:
        return []
    low, high = min(a for a, _ in pairs), max(b for _, b in pairs)
    span = [h for h in interior if low <= h <= high]
    candidates = span if len(span) >= count else interior
    if len(candidates) <= count:
        return candidates
    return [candidates[int((j + 0.5) * len(candidates) / count)] for j in range(count)]


def generator_seed(base: int, role: str, held_out: int = -1) -> int:
    """A generator seed per (seed, projection type, held-out layer): a type's result does not depend
    on which other types are computed, nor the main predictor on the leave-one-out check."""
    return ((base * 1_000_003 + PROJECTIONS.index(role)) * 10_007 + held_out + 1) % (2**63)


def leave_one_out(basis: Basis, params: Params, role: str, held: list[int], s: LesaSettings) -> dict:
    interior = list(range(1, basis.v.shape[0] - 1))
    per_layer: dict[str, dict[str, float]] = {}
    for h in held:
        loo_params, _ = train_predictor(
            basis.v, [t for t in interior if t != h], s, generator_seed(s.seed, role, h)
        )
        average = (basis.v[h - 1] + basis.v[h + 1]) * 0.5
        per_layer[str(h)] = {
            "error": basis.relative_error(predict(loo_params, basis.v, h - 1, h + 1), h),
            "average_error": basis.relative_error(average, h),
            "fit_error": basis.relative_error(predict(params, basis.v, h - 1, h + 1), h),
        }
    summary: dict[str, Any] = {"held_out": held}
    for key in ("error", "average_error", "fit_error"):
        summary[key] = sum(e[key] for e in per_layer.values()) / len(per_layer)
    summary["layers"] = per_layer
    return summary


# --------------------------------------------------------------------------------------------
# The builder.


class LesaBuilder:
    """Predicts every new layer's projections in one pre-pass over the source (``prepare``), one
    projection type at a time; ``build`` then yields each new layer from the predictions kept in
    the scratch folder, plus the tensors LESA does not predict (pair average, or layer 0's)."""

    parents_needed = 2

    def __init__(self) -> None:
        self._settings: LesaSettings | None = None
        self._layout: RoleLayout | None = None
        self._layer0: ParentLayer | None = None
        self._predicted: dict[tuple[int, int], dict[str, Path]] = {}

    def prepare(
        self,
        layers: Sequence[ParentLayer],
        new_layers: Sequence[OutputLayer],
        ctx: BuildContext,
        scratch: Path,
    ) -> dict[str, Any]:
        """Decompose, train and predict for every projection type; returns the manifest's report."""
        family = ctx.family  # one LESA cannot build (MoE, ...) was refused at plan time (Method.refuses)
        s = LesaSettings.from_context(ctx)
        if len(layers) < 3:
            raise OtdusError(
                "--method lesa trains on (l-1, l+1) -> l triples and needs at least 3 base layers, "
                f"not {len(layers)}"
            )
        layout = RoleLayout(family, ctx.config, layers[0].suffixes(), method="lesa")
        self._settings, self._layout, self._layer0 = s, layout, layers[0]
        pairs = sorted({(lay.parents[0], lay.parents[1]) for lay in new_layers})
        held = held_out_layers(len(layers), pairs, s.loo)
        interior = list(range(1, len(layers) - 1))
        scratch.mkdir(parents=True, exist_ok=True)
        projections: dict[str, Any] = {}
        skipped: dict[str, str] = {}
        for role in PROJECTIONS:
            if role not in layout.roles:  # an ungated MLP's gate
                continue
            if s.zero_init and family.is_zero_target(self._weight_suffix(role)):
                skipped[role] = "zero-initialised (not predicted)"
                continue
            clock = [time.perf_counter()]  # phase boundaries: svd, train, predict, loo
            basis = decompose(layers, layout, role, s)
            clock.append(time.perf_counter())
            params, loss = train_predictor(basis.v, interior, s, generator_seed(s.seed, role))
            clock.append(time.perf_counter())
            for pair in pairs:  # U S C, out x r x in flops per new layer
                weight = basis.rebuild(predict(params, basis.v, *pair))
                path = scratch / f"{pair[0]}-{pair[1]}-{role}.pt"
                torch.save(weight.to("cpu", self._spill_dtype(basis.stored_dtype)), path)
                self._predicted.setdefault(pair, {})[role] = path
                del weight
            clock.append(time.perf_counter())
            info: dict[str, Any] = {
                "shape": [int(basis.us.shape[0]), int(basis.v.shape[2])],
                "rank": int(basis.s.numel()),
                "dropped_directions": basis.dropped,
                "train_loss": loss,
            }
            if held:
                info["loo"] = leave_one_out(basis, params, role, held, s)
            clock.append(time.perf_counter())
            phases = ("svd", "train", "predict", "loo")
            info["seconds"] = {k: round(b - a, 3) for k, (a, b) in zip(phases, pairwise(clock), strict=True)}
            projections[role] = info
            del basis, params
        report = {
            "variant": s.variant,
            "settings": {k: getattr(s, k) for k in _REPORTED}
            | {"seed": s.seed, "device": device_kind(s.device)},
            "not_predicted": (
                "base layer 0's (the published notebook deep-copies layer 0)"
                if s.variant == "published"
                else "1/2 (f_i + f_{i+1}) of the pair"
            ),
            "projections": projections,
            "skipped": skipped,
        }
        if not held:
            report["loo_skipped"] = (
                "--lesa-loo 0" if s.loo == 0 else "leave-one-out needs at least 4 base layers"
            )
        return report

    def _weight_suffix(self, role: str) -> str:
        layout = self._layout
        assert layout is not None
        stored = layout.fused_in.get(role, role)
        return layout.where[stored]["weight"]

    def _spill_dtype(self, stored: torch.dtype) -> torch.dtype:
        """The output dtype (the writer would cast to it anyway; keeping it halves the scratch)."""
        assert self._settings is not None
        return _DTYPES.get(self._settings.dtype, stored if stored.is_floating_point else torch.float32)

    def build(self, parents: Sequence[ParentLayer], ctx: BuildContext) -> Iterator[tuple[str, torch.Tensor]]:
        s, layout, layer0 = self._settings, self._layout, self._layer0
        if s is None or layout is None or layer0 is None:
            raise RuntimeError("LesaBuilder.build called before prepare")
        a, b = parents
        predicted = self._predicted.get((a.index, b.index), {})
        role_of_weight = {where["weight"]: role for role, where in layout.where.items()}
        for suffix in a.suffixes():
            role = role_of_weight.get(suffix)
            parts = layout.family.fused.get(role, (role,)) if role else ()
            if parts and all(p in predicted for p in parts):
                yield suffix, torch.cat([torch.load(predicted[p], weights_only=True) for p in parts], dim=0)
            elif s.variant == "published":
                yield suffix, layer0.get(suffix)
            else:
                yield suffix, (a.get(suffix).float() + b.get(suffix).float()) * 0.5
