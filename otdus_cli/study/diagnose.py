"""`otdus diagnose`: does optimal transport pair neurons that really do the same work?

For adjacent base layers (A = f_i, B = f_{i+1}) of a checkpoint, on real text:

* MLP intermediate neurons (``act_fn(gate) * up``, the input of ``down_proj``): correlation of
  A's neuron with B's neuron it is paired with, for the OT-DUS paper plans (T_G, T_U, computed on
  gate / up rows with the input side aligned by T_O, as the paper variant does), the structured
  variant's joint plan (gate row, up row and down column together), same-index pairing, a
  random pairing, and the best pairing the activations allow (an exact assignment on the
  correlations, an upper bound). A soft plan's score is its plan-weighted mean correlation
  sum_ij T_ij C_ij (equal to the paired mean for a permutation); ``ot_gate_argmax`` pairs each A
  neuron with B's neuron that gets most of its mass.
* attention heads: each head's contribution to the residual stream (its slice of the ``o_proj``
  input times its ``o_proj`` columns), correlated between A's head and B's head, under a
  weight-based head matching (exact assignment on q/k/v rows and o columns), same-index and
  random pairings, and the activation-based best matching.
* transport-plan entropy of every module (the paper's Table 8 statistic), paper variant.
* the per-layer weight-norm profile: a fine-tuned-to-convergence checkpoint shows a smooth,
  typically rising profile (the MoE-growth paper's tell); printed as bars, optionally a PNG.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from otdus_cli.errors import OtdusError
from otdus_cli.transport.assignment import assignment
from otdus_cli.transport.cost import euclidean_distances, unit_rows
from otdus_cli.transport.plan import TransportPlan
from otdus_cli.transport.solve import match_rows

__all__ = [
    "DiagnoseResult",
    "PairDiagnosis",
    "diagnose",
    "diagnose_tables",
    "norm_bars",
    "plot_weight_norms",
    "sparkline",
]

MODULES = ("q", "k", "v", "o", "gate", "up", "down")
_ATTN = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}
_MLP = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


@dataclass
class PairDiagnosis:
    a: int
    b: int
    # pairing name -> mean correlation of paired MLP neurons (ot_gate, ot_up, ot_joint, same_index, ...)
    mlp: dict[str, float]
    # pairing name -> mean correlation of paired heads' residual contributions
    heads: dict[str, float]
    head_match: list[int]  # A's head i -> B's head head_match[i] (weight-based)
    entropy: dict[str, dict[str, float]]  # module -> entropy, entropy_normalized, permutation_closeness


@dataclass
class DiagnoseResult:
    checkpoint: str
    text: str
    tokens: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    reg: float
    pairs: list[PairDiagnosis]
    weight_norms: list[dict[str, float]]  # per layer: module -> Frobenius norm, plus "total"
    figures: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def mean_entropy(self) -> dict[str, float]:
        """Per module, the plan entropy averaged over the diagnosed pairs (Table 8's layout)."""
        return {m: sum(p.entropy[m]["entropy"] for p in self.pairs) / len(self.pairs) for m in MODULES}


# -- activations ----------------------------------------------------------------------------------
def _layers(model) -> Sequence:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise OtdusError("diagnose needs a decoder with model.layers (Llama-style checkpoints)")
    first = layers[0]
    for name in _ATTN.values():
        if not hasattr(first.self_attn, name):
            raise OtdusError(f"diagnose needs separate q/k/v/o projections (no self_attn.{name})")
    for name in _MLP.values():
        if not hasattr(first.mlp, name):
            raise OtdusError(f"diagnose needs a gated MLP with separate gate/up/down (no mlp.{name})")
    return layers


@torch.no_grad()
def _capture(
    model, windows: torch.Tensor, wanted: set[int], batch: int = 8
) -> dict[int, dict[str, torch.Tensor]]:
    """Inputs of o_proj and down_proj of the wanted layers, as (tokens, features) float64."""
    layers = _layers(model)
    store: dict[int, dict[str, list[torch.Tensor]]] = {i: {"o_in": [], "down_in": []} for i in wanted}
    handles = []
    for i in wanted:

        def hook(key: str, i: int = i) -> Callable:
            def fn(module, args):
                store[i][key].append(args[0].detach().reshape(-1, args[0].shape[-1]).double().cpu())

            return fn

        handles.append(layers[i].self_attn.o_proj.register_forward_pre_hook(hook("o_in")))
        handles.append(layers[i].mlp.down_proj.register_forward_pre_hook(hook("down_in")))
    try:
        device = next(model.parameters()).device
        for s in range(0, windows.shape[0], batch):
            model(input_ids=windows[s : s + batch].to(device))
    finally:
        for h in handles:
            h.remove()
    return {i: {k: torch.cat(v) for k, v in d.items()} for i, d in store.items()}


def _standardise(x: torch.Tensor) -> torch.Tensor:
    """Columns centred and scaled to unit norm (a constant column stays zero)."""
    x = x - x.mean(dim=0, keepdim=True)
    return x / torch.linalg.vector_norm(x, dim=0, keepdim=True).clamp_min(1e-12)


def correlation_matrix(xa: torch.Tensor, xb: torch.Tensor) -> torch.Tensor:
    """C[i, j] = Pearson correlation of column i of ``xa`` with column j of ``xb`` (rows = samples)."""
    return _standardise(xa).T @ _standardise(xb)


def _paired(c: torch.Tensor, perm: Sequence[int] | torch.Tensor) -> float:
    idx = torch.as_tensor(perm)
    return float(c[torch.arange(c.shape[0]), idx].mean())


def _plan_weighted(c: torch.Tensor, plan: TransportPlan) -> float:
    """sum_ij T_ij C_ij: mean correlation of the pairs a plan makes (total mass 1)."""
    if plan.perm is not None:
        return _paired(c, plan.perm.cpu())
    return float((plan.dense().double().cpu() * c).sum())


def _plan_argmax(c: torch.Tensor, plan: TransportPlan) -> float:
    """Mean correlation of each A neuron with its single most-weighted B neuron in the plan."""
    if plan.perm is not None:
        return _paired(c, plan.perm.cpu())
    return _paired(c, plan.dense().argmax(dim=1).cpu())


def _best(c: torch.Tensor) -> tuple[float, list[int]]:
    plan = assignment((1.0 - c).float())
    perm = plan.perm.cpu().tolist()
    return _paired(c, perm), perm


# -- weights --------------------------------------------------------------------------------------
def _weights(layer) -> dict[str, torch.Tensor]:
    w = {k: getattr(layer.self_attn, v).weight.detach().float().cpu() for k, v in _ATTN.items()}
    w.update({k: getattr(layer.mlp, v).weight.detach().float().cpu() for k, v in _MLP.items()})
    return w


def paper_plans(
    wa: dict[str, torch.Tensor], wb: dict[str, torch.Tensor], reg: float = 0.06
) -> dict[str, TransportPlan]:
    """The OT-DUS paper variant's plan for every module of the pair (reference section 2)."""
    plans = {m: match_rows(wa[m], wb[m], cost="paper", reg=reg) for m in ("q", "k", "v", "o", "down")}
    # gate / up: input side (hidden axis) aligned by n T_O first (transport matrix flow)
    for m in ("gate", "up"):
        plans[m] = match_rows(plans["o"].cols_to_b(wa[m]), wb[m], cost="paper", reg=reg)
    return plans


def joint_mlp_plan(
    wa: dict[str, torch.Tensor], wb: dict[str, torch.Tensor], reg: float = 0.06
) -> TransportPlan:
    """One plan per MLP neuron on [gate row | up row | down column] (the structured variant's view)."""

    def feats(w: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([unit_rows(w["gate"]), unit_rows(w["up"]), unit_rows(w["down"].T)], dim=1)

    return match_rows(feats(wa), feats(wb), cost="paper", reg=reg)


def head_matching(wa: dict[str, torch.Tensor], wb: dict[str, torch.Tensor], n_q: int, n_kv: int) -> list[int]:
    """Exact assignment of A's query heads to B's on [q rows | k rows | v rows | o columns] of a head."""
    hd = wa["q"].shape[0] // n_q
    group = n_q // n_kv

    def feats(w: dict[str, torch.Tensor]) -> torch.Tensor:
        rows = []
        for h in range(n_q):
            kv = h // group
            parts = [
                w["q"][h * hd : (h + 1) * hd],
                w["k"][kv * hd : (kv + 1) * hd],
                w["v"][kv * hd : (kv + 1) * hd],
                w["o"][:, h * hd : (h + 1) * hd].T,
            ]
            rows.append(torch.cat([unit_rows(p).reshape(-1) for p in parts]))
        return torch.stack(rows)

    plan = assignment(euclidean_distances(feats(wa), feats(wb)))
    return plan.perm.cpu().tolist()


def _head_contributions(o_in: torch.Tensor, w_o: torch.Tensor, n_q: int) -> torch.Tensor:
    """(n_q, tokens * hidden): each head's additive contribution to the residual stream."""
    hd = o_in.shape[1] // n_q
    w = w_o.double()
    out = [(o_in[:, h * hd : (h + 1) * hd] @ w[:, h * hd : (h + 1) * hd].T).reshape(-1) for h in range(n_q)]
    return torch.stack(out)


def _head_correlation(ca: torch.Tensor, cb: torch.Tensor) -> torch.Tensor:
    return correlation_matrix(ca.T, cb.T)


def weight_norm_profile(layers: Sequence) -> list[dict[str, float]]:
    """Per layer: Frobenius norm of each projection, and of all the layer's parameters ("total")."""
    out = []
    for layer in layers:
        w = _weights(layer)
        row = {m: float(torch.linalg.vector_norm(w[m])) for m in MODULES}
        row["total"] = math.sqrt(sum(float(p.detach().double().pow(2).sum()) for p in layer.parameters()))
        out.append(row)
    return out


# -- front door -----------------------------------------------------------------------------------
def diagnose(
    checkpoint: str,
    text: str | os.PathLike[str] = "bundled:tinystories-sample",
    *,
    pairs: Sequence[tuple[int, int]] | None = None,
    max_tokens: int = 4096,
    seq_len: int = 256,
    reg: float = 0.06,
    seed: int = 0,
    device: str = "cpu",
    png: str | os.PathLike[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> DiagnoseResult:
    """Diagnose adjacent layer pairs of ``checkpoint`` (a folder, hub id or ``bundled:stories260k``).

    ``text``: a text spec (study.data); ``pairs``: (i, i + 1) pairs, default every adjacent pair;
    ``max_tokens``: tokens of text run through the model (in windows of ``seq_len``); ``png``: write
    the weight-norm profile there (needs matplotlib).
    """
    from otdus_cli.source import resolve_source  # noqa: PLC0415
    from otdus_cli.study.data import load_documents, tokenize_windows  # noqa: PLC0415
    from otdus_cli.study.train import load_model  # noqa: PLC0415
    from otdus_cli.verify.metrics import load_tokenizer  # noqa: PLC0415

    say = progress or (lambda msg: None)
    folder = str(resolve_source(checkpoint).folder)
    model = load_model(folder, torch.device(device)).eval()
    layers = _layers(model)
    depth = len(layers)
    if pairs is None:
        pairs = [(i, i + 1) for i in range(depth - 1)]
    pairs = [(int(a), int(b)) for a, b in pairs]
    for a, b in pairs:
        if not (0 <= a < depth and 0 <= b < depth) or a == b:
            raise OtdusError(f"pair ({a}, {b}) is not two distinct layers of a {depth}-layer model")
    cfg = model.config
    n_q = int(cfg.num_attention_heads)
    n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_q)
    seq_len = min(seq_len, int(getattr(cfg, "max_position_embeddings", seq_len) or seq_len))
    docs = load_documents(text)
    tokenizer = load_tokenizer(folder)
    windows = tokenize_windows(tokenizer, docs, seq_len, max(1, math.ceil(max_tokens / seq_len)))
    say(f"running {windows.numel()} tokens through {depth} layers")
    acts = _capture(model, windows, {i for p in pairs for i in p})
    gen = torch.Generator().manual_seed(seed)
    results = []
    for a, b in pairs:
        say(f"pair ({a}, {b})")
        wa, wb = _weights(layers[a]), _weights(layers[b])
        plans = paper_plans(wa, wb, reg)
        joint = joint_mlp_plan(wa, wb, reg)
        c = correlation_matrix(acts[a]["down_in"], acts[b]["down_in"])
        n = c.shape[0]
        best, _ = _best(c)
        mlp = {
            "ot_gate": _plan_weighted(c, plans["gate"]),
            "ot_gate_argmax": _plan_argmax(c, plans["gate"]),
            "ot_up": _plan_weighted(c, plans["up"]),
            "ot_joint": _plan_weighted(c, joint),
            "same_index": _paired(c, range(n)),
            "random": _paired(c, torch.randperm(n, generator=gen)),
            "best": best,
        }
        ha = _head_contributions(acts[a]["o_in"], wa["o"], n_q)
        hb = _head_contributions(acts[b]["o_in"], wb["o"], n_q)
        ch = _head_correlation(ha, hb)
        match = head_matching(wa, wb, n_q, n_kv)
        heads = {
            "matched": _paired(ch, match),
            "same_index": _paired(ch, range(n_q)),
            "random": _paired(ch, torch.randperm(n_q, generator=gen)),
            "best": _best(ch)[0],
        }
        entropy = {}
        for m, plan in plans.items():
            st = plan.stats()
            entropy[m] = {k: float(st[k]) for k in ("entropy", "entropy_normalized", "permutation_closeness")}
        results.append(PairDiagnosis(a, b, mlp, heads, match, {m: entropy[m] for m in MODULES}))
    result = DiagnoseResult(
        checkpoint=checkpoint,
        text=docs.name,
        tokens=int(windows.numel()),
        num_layers=depth,
        intermediate_size=int(wa["gate"].shape[0]) if pairs else 0,
        num_heads=n_q,
        reg=reg,
        pairs=results,
        weight_norms=weight_norm_profile(layers),
    )
    if png is not None:
        out = plot_weight_norms(result, png)
        if out is not None:
            result.figures.append(str(out))
    return result


# -- rendering ------------------------------------------------------------------------------------
_BLOCKS = " ▏▎▍▌▋▊▉█"


def _bar(value: float, top: float, width: int) -> str:
    cells = 0.0 if top <= 0 else max(0.0, value) / top * width
    full = int(cells)
    frac = int(round((cells - full) * 8))
    if frac == 8:
        full, frac = full + 1, 0
    return "█" * full + (_BLOCKS[frac] if frac else "")


def norm_bars(result: DiagnoseResult, key: str = "total", width: int = 40) -> str:
    """The weight-norm profile as unicode bars, one line per layer (for any terminal)."""
    values = [row[key] for row in result.weight_norms]
    top = max(values) if values else 0.0
    return "\n".join(f"layer {i:>3} {_bar(v, top, width):<{width}} {v:9.3f}" for i, v in enumerate(values))


def sparkline(values: Sequence[float]) -> str:
    ticks = "▁▂▃▄▅▆▇█"
    lo, hi = min(values), max(values)
    span = hi - lo or 1.0
    return "".join(ticks[int((v - lo) / span * (len(ticks) - 1))] for v in values)


def diagnose_tables(result: DiagnoseResult):
    """Rich renderables: MLP and head correlations per pair, plan entropies, the norm profile."""
    from rich.console import Group  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    mlp = Table(title=f"MLP neuron correlation of paired neurons ({result.tokens} tokens of {result.text})")
    mlp.add_column("pair")
    keys = ["ot_gate", "ot_gate_argmax", "ot_up", "ot_joint", "same_index", "random", "best"]
    for k in keys:
        mlp.add_column(k, justify="right")
    heads = Table(title="attention heads: correlation of paired heads' residual contributions")
    heads.add_column("pair")
    hkeys = ["matched", "same_index", "random", "best"]
    for k in hkeys:
        heads.add_column(k, justify="right")
    heads.add_column("head match (A -> B)")
    ent = Table(title=f"transport plan entropy (paper variant, reg {result.reg}); normalised in brackets")
    ent.add_column("pair")
    for m in MODULES:
        ent.add_column(m, justify="right")
    for p in result.pairs:
        name = f"{p.a}-{p.b}"
        mlp.add_row(name, *[f"{p.mlp[k]:.3f}" for k in keys])
        heads.add_row(name, *[f"{p.heads[k]:.3f}" for k in hkeys], ",".join(map(str, p.head_match)))
        ent.add_row(
            name,
            *[f"{p.entropy[m]['entropy']:.2f} ({p.entropy[m]['entropy_normalized']:.2f})" for m in MODULES],
        )
    norms = Table(title="per-layer weight norm (Frobenius, all parameters of the layer)")
    norms.add_column("layer", justify="right")
    norms.add_column("norm", justify="left")
    norms.add_column("value", justify="right")
    top = max(r["total"] for r in result.weight_norms)
    for i, r in enumerate(result.weight_norms):
        norms.add_row(str(i), f"[cyan]{_bar(r['total'], top, 40)}[/cyan]", f"{r['total']:.3f}")
    parts = [mlp, heads, ent, norms] if result.pairs else [norms]
    return Group(*parts)


def plot_weight_norms(result: DiagnoseResult, path: str | os.PathLike[str]) -> Path | None:
    """Per-layer norm of every projection and of the whole layer (PNG); None without matplotlib."""
    from otdus_cli.study.report import _pyplot  # noqa: PLC0415

    plt = _pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    x = list(range(len(result.weight_norms)))
    axes[0].plot(x, [r["total"] for r in result.weight_norms], marker="o", color="black")
    axes[0].set_title("whole layer")
    for m in MODULES:
        axes[1].plot(x, [r[m] for r in result.weight_norms], marker=".", label=m)
    axes[1].set_title("per projection")
    axes[1].legend(fontsize=8, ncol=2)
    for ax in axes:
        ax.set_xticks(x)
        ax.set_xlabel("layer")
        ax.set_ylabel("Frobenius norm")
        ax.grid(alpha=0.3)
    fig.suptitle(f"weight-norm profile: {result.checkpoint}", fontsize=9)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
