"""`otdus diagnose`: does optimal transport pair neurons that really do the same work?

For adjacent base layers (A = f_i, B = f_{i+1}) of a checkpoint, on real text:

* MLP intermediate neurons (``act_fn(gate) * up``, the input of ``down_proj``): correlation of
  A's neuron with the B neuron it is paired with, averaged over the pairs, for
  - the OT-DUS paper plans (T_G, T_U, computed on gate / up rows with the input side aligned by
    T_O, as the paper variant does) and the structured variant's joint plan (gate row, up row and
    down column together), each read two ways: plan-weighted, sum_ij T_ij C_ij (for a plan near the
    independent coupling this is ~the mean of C by construction, whatever the plan favours), and
    one-to-one, the permutation that keeps most of the plan's mass (comparable with the baselines);
  - same-index pairing, and random pairings as the exact mean and standard deviation over all
    permutations (the null distribution a pairing's score is read against);
  - the activation variant's plan (``--ot-variant activation``: cost 1 - correlation, Sinkhorn at
    ``reg``), chosen on half of the windows and scored on the other half, both readings
    (``activation`` / ``activation_1to1``), the same protocol as ``best_held_out``;
  - the best pairing the activations allow (an exact assignment on the correlations): chosen on
    half of the windows and scored on the other half (``best_held_out``), because chosen and scored
    on the same tokens (``best_in_sample``) it is biased upwards; ``best_misaligned`` is that
    in-sample best with B's tokens deliberately taken from other text (the bias alone: a noise floor).
* attention heads: each head's contribution to the residual stream (its slice of the ``o_proj``
  input times its ``o_proj`` columns, centred per hidden dimension), correlated between A's head
  and B's head over every token and hidden dimension, under a weight-based head matching (exact
  assignment on q/k/v rows and o columns), same-index and random pairings (the random mean is the
  mean over all head pairs), the activation variant's head matching (whole GQA groups, held out
  as above: ``activation``), and the activation-based best matching (held out, in-sample,
  misaligned as above). Every pair of heads correlates somewhat on the same tokens (their writes
  share residual directions), so a head score means something only as a margin over the all-pairs
  mean, in units of its spread.
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
from otdus_cli.io.output_dir import OutputReport
from otdus_cli.output_files import check_new_file, new_file
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
    # pairing -> mean correlation of paired MLP neurons: ot_gate, ot_up, ot_joint (plan-weighted),
    # ot_gate_1to1, ot_up_1to1, ot_joint_1to1 (one-to-one reading), activation, activation_1to1
    # (the activation variant's plan, held out), same_index, random_mean, random_sd (over all
    # permutations), best_held_out, best_in_sample, best_misaligned
    mlp: dict[str, float]
    # pairing -> mean correlation of paired heads' residual contributions: matched, activation (the
    # activation variant's group matching, held out), same_index, random_mean (= the mean over all
    # head pairs), random_sd, best_held_out, best_in_sample, best_misaligned
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
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


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


def one_to_one(plan: TransportPlan) -> list[int]:
    """The permutation that keeps most of a soft plan's mass (its one-to-one reading)."""
    if plan.perm is not None:
        return plan.perm.cpu().tolist()
    return assignment(-plan.dense().double().cpu()).perm.cpu().tolist()


def best_pairing(c: torch.Tensor) -> list[int]:
    """The pairing with the highest mean correlation (an exact assignment on ``c``)."""
    return assignment((1.0 - c).float()).perm.cpu().tolist()


def random_pairing(c: torch.Tensor) -> tuple[float, float]:
    """Mean and standard deviation of the paired mean correlation over all n! permutations, exactly:
    for S = sum_i C[i, pi(i)], E S = sum_ij C_ij / n and Var S = sum_ij D_ij^2 / (n - 1) with
    D the doubly centred C (Hoeffding's permutation moments)."""
    n = c.shape[0]
    d = c - c.mean(dim=1, keepdim=True) - c.mean(dim=0, keepdim=True) + c.mean()
    sd = math.sqrt(float((d**2).sum()) / (n - 1)) / n if n > 1 else 0.0
    return float(c.mean()), sd


def _halves(samples: int, group: int) -> torch.Tensor:
    """Which of two halves each sample falls in: alternate windows (``group`` samples each), or the
    first and second half of the samples when there is a single window."""
    idx = torch.arange(samples)
    if samples // group >= 2:
        return (idx // group) % 2 == 1
    return idx >= samples // 2


def pairing_scores(xa: torch.Tensor, xb: torch.Tensor, group: int) -> tuple[torch.Tensor, dict[str, float]]:
    """The correlation matrix of A's units (columns of ``xa``) with B's, and the baseline pairings'
    scores: same_index, random_mean / random_sd, best_held_out, best_in_sample, best_misaligned.

    Rows are samples, ``group`` consecutive rows one window (the unit of the held-out split).
    best_held_out: the best pairing chosen on one half of the windows, scored on the other (both
    ways, averaged). best_misaligned: the in-sample best with B's rows taken from other text
    (shifted by half the samples and half a window), where no real pairing exists.
    """
    n_samples = xa.shape[0]
    c = correlation_matrix(xa, xb)
    half = _halves(n_samples, group)
    c0 = correlation_matrix(xa[~half], xb[~half])
    c1 = correlation_matrix(xa[half], xb[half])
    held = (_paired(c1, best_pairing(c0)) + _paired(c0, best_pairing(c1))) / 2
    shift = (n_samples // 2 + group // 2) % n_samples or 1
    cm = correlation_matrix(xa, xb.roll(shift, dims=0))
    mean, sd = random_pairing(c)
    scores = {
        "same_index": _paired(c, range(c.shape[0])),
        "random_mean": mean,
        "random_sd": sd,
        "best_held_out": held,
        "best_in_sample": _paired(c, best_pairing(c)),
        "best_misaligned": _paired(cm, best_pairing(cm)),
    }
    return c, scores


def held_out(
    xa: torch.Tensor, xb: torch.Tensor, group: int, choose: Callable[[torch.Tensor], Any], score: Callable
) -> float:
    """A pairing chosen by ``choose`` on the correlations of one half of the windows and scored by
    ``score(c, chosen)`` on the other half, both ways, averaged (the protocol of best_held_out)."""
    half = _halves(xa.shape[0], group)
    c0 = correlation_matrix(xa[~half], xb[~half])
    c1 = correlation_matrix(xa[half], xb[half])
    return (score(c1, choose(c0)) + score(c0, choose(c1))) / 2


def activation_scores(
    down_a: torch.Tensor,
    down_b: torch.Tensor,
    ha: torch.Tensor,
    hb: torch.Tensor,
    seq_len: int,
    hidden: int,
    heads: tuple[int, int],
    reg: float,
) -> tuple[dict[str, float], float]:
    """Held-out scores of the activation variant's choices: MLP (plan-weighted, one-to-one) and the
    heads' group matching (``ha``/``hb``: heads x (tokens * hidden) contributions)."""
    from otdus_cli.arch.heads import Heads
    from otdus_cli.methods.ot.builder import OTSettings, activation_plan, match_head_groups

    s = OTSettings(variant="activation", reg=reg)
    plans: dict[int, TransportPlan] = {}

    def plan(c: torch.Tensor) -> TransportPlan:
        if id(c) not in plans:
            plans[id(c)] = activation_plan(c.float(), s)
        return plans[id(c)]

    weighted = held_out(down_a, down_b, seq_len, plan, _plan_weighted)
    one = held_out(down_a, down_b, seq_len, lambda c: one_to_one(plan(c)), _paired)
    n_q, n_kv = heads
    geometry = Heads(n_q, n_kv, 1)
    matched = held_out(ha.T, hb.T, seq_len * hidden, lambda c: match_head_groups(c, geometry)[1], _paired)
    return {"activation": weighted, "activation_1to1": one}, matched


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
    """(n_q, tokens * hidden): each head's additive contribution to the residual stream, centred
    per hidden dimension over the tokens: a head's constant write (a fixed direction on every token)
    would otherwise correlate with any other head's, even on different text."""
    hd = o_in.shape[1] // n_q
    w = w_o.double()
    out = []
    for h in range(n_q):
        contribution = o_in[:, h * hd : (h + 1) * hd] @ w[:, h * hd : (h + 1) * hd].T  # (tokens, hidden)
        out.append((contribution - contribution.mean(dim=0, keepdim=True)).reshape(-1))
    return torch.stack(out)


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
    text: str | os.PathLike[str] = "bundled:tinystories-train-2mib",
    *,
    pairs: Sequence[tuple[int, int]] | None = None,
    max_tokens: int = 4096,
    seq_len: int = 256,
    reg: float = 0.06,
    device: str = "auto",
    png: str | os.PathLike[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> DiagnoseResult:
    """Diagnose adjacent layer pairs of ``checkpoint`` (a folder, hub id or ``bundled:stories260k``).

    ``text``: a text spec (study.data); ``pairs``: (i, i + 1) pairs, default every adjacent pair;
    ``max_tokens``: tokens of text run through the model (in windows of ``seq_len``); ``png``: write
    the weight-norm profile there (needs matplotlib), a new file (output_files.new_file): a name
    already taken is refused before any work.
    """
    from otdus_cli.device import resolve_device
    from otdus_cli.source import resolve_source
    from otdus_cli.study.data import load_documents, tokenize_windows
    from otdus_cli.study.train import load_model
    from otdus_cli.verify.metrics import load_tokenizer

    say = progress or (lambda msg: None)
    if png is not None:
        check_new_file(png, "--png")
    folder = str(resolve_source(checkpoint).folder)
    model = load_model(folder, resolve_device(device)).eval()
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
    warnings = []
    if windows.numel() < max_tokens:
        warnings.append(
            f"{docs.name} gives {windows.numel():,} tokens in whole windows of {seq_len}, fewer than the "
            f"{max_tokens:,} asked: fewer tokens make every correlation noisier"
        )
    say(f"running {windows.numel()} tokens through {depth} layers")
    acts = _capture(model, windows, {i for p in pairs for i in p})
    results = []
    for k, (a, b) in enumerate(pairs, 1):
        say(f"pair ({a}, {b}), {k} of {len(pairs)}")
        wa, wb = _weights(layers[a]), _weights(layers[b])
        plans = paper_plans(wa, wb, reg)
        joint = joint_mlp_plan(wa, wb, reg)
        c, baselines = pairing_scores(acts[a]["down_in"], acts[b]["down_in"], seq_len)
        mlp = {}
        for name, plan in (("ot_gate", plans["gate"]), ("ot_up", plans["up"]), ("ot_joint", joint)):
            mlp[name] = _plan_weighted(c, plan)
            mlp[f"{name}_1to1"] = _paired(c, one_to_one(plan))
        ha = _head_contributions(acts[a]["o_in"], wa["o"], n_q)
        hb = _head_contributions(acts[b]["o_in"], wb["o"], n_q)
        hidden = wa["o"].shape[0]
        act_mlp, act_heads = activation_scores(
            acts[a]["down_in"], acts[b]["down_in"], ha, hb, seq_len, hidden, (n_q, n_kv), reg
        )
        mlp.update(act_mlp)
        mlp.update(baselines)
        # samples are (token, hidden dimension) entries; a window is seq_len tokens of them
        ch, head_baselines = pairing_scores(ha.T, hb.T, seq_len * hidden)
        match = head_matching(wa, wb, n_q, n_kv)
        heads = {"matched": _paired(ch, match), "activation": act_heads, **head_baselines}
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
        warnings=warnings,
    )
    if png is not None:
        report = OutputReport()
        with new_file(png, "--png", report) as staged:
            if plot_weight_norms(result, staged) is not None:
                result.figures.append(str(png))
        result.warnings.extend(report.notes)
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
    from rich.console import Group
    from rich.table import Table

    mlp = Table(
        title=f"MLP neuron correlation of paired neurons ({result.tokens} tokens of {result.text})",
        caption="plan: weighted sum T∘C / one-to-one reading of the plan (activation: the "
        "--ot-variant activation plan, chosen on half the windows, scored on the other); random: mean ± "
        "sd over all permutations (a pairing is signal only as a margin over it, in sd); best: chosen "
        "on half the windows and scored on the other, in-sample (biased up), and in-sample on "
        "misaligned tokens (the bias alone)",
    )
    mlp.add_column("pair")
    for k in ("ot_gate", "ot_up", "ot_joint", "activation"):
        mlp.add_column(f"{k} w / 1:1", justify="right")
    for k in ("same index", "random", "best held-out", "in-sample", "misaligned"):
        mlp.add_column(k, justify="right")
    heads = Table(
        title="attention heads: correlation of paired heads' residual contributions",
        caption="random = the mean over all head pairs: every pair correlates a little (shared residual "
        "directions), so only a margin over it, in sd, shows a match",
    )
    heads.add_column("pair")
    for k in ("matched", "activation", "same index", "random", "best held-out", "in-sample", "misaligned"):
        heads.add_column(k, justify="right")
    heads.add_column("head match (A -> B)")
    ent = Table(title=f"transport plan entropy (paper variant, reg {result.reg}); normalised in brackets")
    ent.add_column("pair")
    for m in MODULES:
        ent.add_column(m, justify="right")
    for p in result.pairs:
        name = f"{p.a}-{p.b}"
        m, h = p.mlp, p.heads
        mlp.add_row(
            name,
            *[f"{m[k]:.3f} / {m[k + '_1to1']:.3f}" for k in ("ot_gate", "ot_up", "ot_joint", "activation")],
            f"{m['same_index']:.3f}",
            f"{m['random_mean']:.3f} ± {m['random_sd']:.3f}",
            *[f"{m[k]:.3f}" for k in ("best_held_out", "best_in_sample", "best_misaligned")],
        )
        heads.add_row(
            name,
            f"{h['matched']:.3f}",
            f"{h['activation']:.3f}",
            f"{h['same_index']:.3f}",
            f"{h['random_mean']:.3f} ± {h['random_sd']:.3f}",
            *[f"{h[k]:.3f}" for k in ("best_held_out", "best_in_sample", "best_misaligned")],
            ",".join(map(str, p.head_match)),
        )
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
    from otdus_cli.study.report import _pyplot

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
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
