"""Activation statistics of adjacent layer pairs on calibration text (the `activation` OT variant).

The source checkpoint runs through the streamed, layer-by-layer evaluator (verify/streaming.py):
one decoder layer is in memory at a time. Forward pre-hooks on a layer's ``o_proj`` and
``down_proj`` see their inputs (the heads' outputs; the MLP neurons ``act(gate) * up``) batch by
batch. For a pair (A, B):

* while layer A runs, its two inputs are kept for the calibration tokens (float32, CPU), then
  centred exactly (the mean over all tokens is known once A's pass ends);
* while layer B runs, each batch's inputs meet the same batch's rows of A and are folded into
  running statistics: the cross-products sum (A - mean_A)^T (B - s_B) and B's shifted sums (s_B is
  B's first-batch mean: it keeps the float sums well conditioned; since A is centred exactly the
  cross-products equal those of centred B). B's activations are never kept;
* when B's pass ends, A's activations are dropped and the pair's statistics are final.

Memory (docs/ot.md, "activation"): one layer's weights, the evaluator's hidden states
(tokens x hidden), A's kept inputs (tokens x (intermediate + heads x head_dim) float32), and per
open pair the I x I MLP cross-product and the Dq x Dq ``o_proj``-input cross-product (float32),
plus per-head auto-covariance blocks. With adjacent pairs only one pair is open at a time.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from otdus_cli.errors import OtdusError

# the defaults live with the options (importable without torch: the CLI and shrink's options read them)
from otdus_cli.methods.ot.options import DEFAULT_CALIB, DEFAULT_CALIB_TOKENS, MIN_CALIB_TOKENS

__all__ = [
    "CALIB_SEQ_LEN",
    "DEFAULT_CALIB",
    "DEFAULT_CALIB_TOKENS",
    "MIN_CALIB_TOKENS",
    "PairActivations",
    "PairMoments",
    "calibration_windows",
    "capture_pair_activations",
    "head_correlation",
]

CALIB_SEQ_LEN = 256  # window length (or the model's context, if shorter)


class PairMoments:
    """Running moments of (A's features, B's features) over the same samples.

    ``set_a`` takes all of A's samples (n_samples x p) and centres them; ``add_b`` then takes B's
    samples batch by batch (rows ``start:start + k``, in A's row order). ``finish`` gives the
    cross-covariance, the variances and, on request, B's auto-covariance blocks.
    """

    def __init__(self, blocks: int | None = None):
        self.blocks = blocks  # per-block auto-covariance of B (heads: blocks of head_dim features)
        self.a: torch.Tensor | None = None
        self.var_a: torch.Tensor | None = None
        self.auto_a: torch.Tensor | None = None
        self.cross: torch.Tensor | None = None
        self.shift: torch.Tensor | None = None
        self.sum_b: torch.Tensor | None = None
        self.sq_b: torch.Tensor | None = None
        self.auto_b: torch.Tensor | None = None
        self.seen = 0

    def nbytes(self) -> int:
        """Bytes of the tensors this accumulator holds now."""
        held = (self.a, self.var_a, self.auto_a, self.cross, self.shift, self.sum_b, self.sq_b, self.auto_b)
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def set_a(self, a: torch.Tensor) -> None:
        """A's samples (float32, centred in place: the caller hands them over)."""
        a = a.to(torch.float32)
        a -= (_column_sums(a)[0] / a.shape[0]).to(torch.float32)
        self.a = a
        self.var_a = _column_sums(a)[1]
        if self.blocks:
            n, p = a.shape
            ab = a.reshape(n, self.blocks, p // self.blocks).transpose(0, 1)  # (blocks, n, hd)
            self.auto_a = torch.bmm(ab.transpose(1, 2), ab)

    def add_b(self, b: torch.Tensor, start: int) -> None:
        assert self.a is not None, "set_a first"
        b = b.to(torch.float32)
        if self.shift is None:
            self.shift = b.mean(dim=0)
            p = b.shape[1]
            self.cross = torch.zeros(self.a.shape[1], p, dtype=torch.float32)
            self.sum_b = torch.zeros(p, dtype=torch.float64)
            self.sq_b = torch.zeros(p, dtype=torch.float64)
            if self.blocks:
                hd = p // self.blocks
                self.auto_b = torch.zeros(self.blocks, hd, hd, dtype=torch.float32)
        assert self.cross is not None and self.sum_b is not None and self.sq_b is not None
        b = b - self.shift
        rows = self.a[start : start + b.shape[0]]
        if rows.shape[0] != b.shape[0]:
            raise RuntimeError("B's samples do not line up with A's (a different batching?)")
        self.cross.addmm_(rows.T, b)
        b64 = b.to(torch.float64)
        self.sum_b += b64.sum(dim=0)
        self.sq_b += (b64**2).sum(dim=0)
        if self.auto_b is not None:
            bb = b.reshape(b.shape[0], self.blocks, -1).transpose(0, 1)
            self.auto_b += torch.bmm(bb.transpose(1, 2), bb)
        self.seen += b.shape[0]

    def finish(self) -> dict[str, torch.Tensor]:
        """cross (p_A x p_B, sums over samples of centred products), var_a, var_b (sums of squares of
        centred values), auto_a / auto_b (blocks, when asked); A's samples are dropped."""
        assert self.a is not None and self.cross is not None
        assert self.sum_b is not None and self.sq_b is not None
        n = self.a.shape[0]
        if self.seen != n:
            raise RuntimeError(f"B saw {self.seen} samples, A {n}")
        mean_shifted = self.sum_b / n  # mean(B) - shift
        var_b = (self.sq_b - n * mean_shifted**2).clamp_min(0.0)
        out = {"cross": self.cross, "var_a": self.var_a, "var_b": var_b}
        if self.blocks:
            assert self.auto_b is not None and self.auto_a is not None
            m = mean_shifted.to(torch.float32).reshape(self.blocks, -1)
            out["auto_a"] = self.auto_a
            out["auto_b"] = self.auto_b - n * m[:, :, None] * m[:, None, :]
        self.a = None
        return out


def _column_sums(x: torch.Tensor, rows: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-column sum and sum of squares in float64, a block of rows at a time (no full copy)."""
    total = torch.zeros(x.shape[1], dtype=torch.float64)
    squares = torch.zeros(x.shape[1], dtype=torch.float64)
    for s in range(0, x.shape[0], rows):
        block = x[s : s + rows].to(torch.float64)
        total += block.sum(dim=0)
        squares += (block * block).sum(dim=0)
    return total, squares


def correlation_from(cross: torch.Tensor, var_a: torch.Tensor, var_b: torch.Tensor) -> torch.Tensor:
    """Pearson correlations from centred sums (a constant feature correlates 0 with everything)."""
    sa = var_a.sqrt().clamp_min(1e-12).to(torch.float32)
    sb = var_b.sqrt().clamp_min(1e-12).to(torch.float32)
    return (cross / sa[:, None] / sb[None, :]).clamp_(-1.0, 1.0)


@dataclass
class PairActivations:
    """What the activation variant needs of one pair (A, B), all float32 on the CPU."""

    a: int
    b: int
    tokens: int
    mlp: torch.Tensor  # I x I: Pearson correlation of A's down_proj inputs with B's
    o_cross: torch.Tensor  # Dq x Dq: centred cross-products of the o_proj inputs
    o_var_a: torch.Tensor  # Dq: centred sums of squares
    o_var_b: torch.Tensor
    o_auto_a: torch.Tensor  # n_q x hd x hd: per-head auto-covariance sums (centred)
    o_auto_b: torch.Tensor

    def o_correlation(self) -> torch.Tensor:
        """Dq x Dq Pearson correlation of the o_proj inputs (head h's dims are h*hd .. h*hd+hd-1)."""
        return correlation_from(self.o_cross, self.o_var_a, self.o_var_b)

    def save(self, path: Path) -> None:
        torch.save(self.__dict__, path)

    @classmethod
    def load(cls, path: Path) -> PairActivations:
        return cls(**torch.load(path, weights_only=True))


def head_correlation(
    o_cross: torch.Tensor,
    o_auto_a: torch.Tensor,
    o_auto_b: torch.Tensor,
    w_o_a: torch.Tensor,
    w_o_b: torch.Tensor,
) -> torch.Tensor:
    """n_q x n_q correlation of the heads' residual contributions (A's head h, B's head h').

    Head h writes c_h(t) = W_h x_h(t) (W_h: its block of o_proj columns; x_h: its slice of the o_proj
    input, centred). Over every token and hidden dimension, sum_t <c_h(t), c'_h'(t)> =
    sum_ij (W_h^T W'_h')_ij M_hh'[i, j] with M_hh' the hd x hd block of the cross-products, so the
    statistics, not the activations, suffice (the same number `otdus diagnose` computes from kept
    activations).
    """
    n_q, hd, _ = o_auto_a.shape
    wa, wb = w_o_a.to(torch.float32), w_o_b.to(torch.float32)
    # the statistics are kept on the CPU; the weights are on the build's device (a GPU with --device cuda)
    o_cross, o_auto_a, o_auto_b = (t.to(wa.device) for t in (o_cross, o_auto_a, o_auto_b))
    gram = wa.T @ wb  # Dq x Dq
    inner = (gram * o_cross).reshape(n_q, hd, n_q, hd).sum(dim=(1, 3))

    def norms(w: torch.Tensor, auto: torch.Tensor) -> torch.Tensor:
        blocks = w.reshape(w.shape[0], n_q, hd).transpose(0, 1)  # n_q x hidden x hd
        g = torch.bmm(blocks.transpose(1, 2), blocks)  # n_q x hd x hd
        return (g * auto).sum(dim=(1, 2)).clamp_min(0.0).sqrt().clamp_min(1e-12)

    return (inner / norms(wa, o_auto_a)[:, None] / norms(wb, o_auto_b)[None, :]).clamp_(-1.0, 1.0)


def calibration_windows(
    folder: str | os.PathLike[str],
    calib: str,
    tokens: int,
    max_positions: int | None,
    purpose: str = "the activation variant",
):
    """Token windows of the calibration text (whole windows, at most ``tokens`` tokens); ``purpose``:
    what needs them, as a refusal names it."""
    from otdus_cli.study.data import load_documents, tokenize_windows
    from otdus_cli.verify.metrics import load_tokenizer

    if tokens < MIN_CALIB_TOKENS:
        raise OtdusError(f"--calib-tokens {tokens}: use at least {MIN_CALIB_TOKENS}")
    docs = load_documents(calib)
    seq_len = min(CALIB_SEQ_LEN, max_positions or CALIB_SEQ_LEN)
    tokenizer = load_tokenizer(folder)
    try:
        windows = tokenize_windows(tokenizer, docs, seq_len, max(1, math.ceil(tokens / seq_len)))
    except OtdusError:
        windows = torch.empty(0, seq_len, dtype=torch.long)
    if windows.numel() > tokens:
        windows = windows[: max(1, tokens // seq_len)]
    if windows.numel() < MIN_CALIB_TOKENS:
        raise OtdusError(
            f"--calib {calib}: {windows.numel()} tokens in whole windows of {seq_len}, fewer than the "
            f"{MIN_CALIB_TOKENS} {purpose} needs; give a longer text"
        )
    return windows


@torch.inference_mode()
def capture_pair_activations(
    folder: str | os.PathLike[str],
    pairs: Sequence[tuple[int, int]],
    windows: torch.Tensor,
    roles: dict[str, str],
    n_heads: int,
    sink: Callable[[PairActivations], None],
    device: str | torch.device = "cpu",
    batch_size: int = 8,
) -> int:
    """Run ``windows`` through the source layer by layer; hand each pair's statistics to ``sink``
    as soon as its second layer has run (so at most the open pairs' statistics are in memory).
    Returns the peak bytes of kept activations and statistics (measured after every batch).

    ``roles``: the family's role -> module path inside a layer ("o" and "down" are hooked).
    """
    from otdus_cli.verify.streaming import StreamedModel

    for a, b in pairs:
        if not 0 <= a < b:
            raise OtdusError(f"activation statistics need pairs (a, b) with a < b, not ({a}, {b})")
    model = StreamedModel(folder, device=device, dtype=torch.float32, batch_size=batch_size)
    acts = model.start([w.tolist() for w in windows])
    opening = {a: [p for p in pairs if p[0] == a] for a, _ in pairs}
    closing = {b: [p for p in pairs if p[1] == b] for _, b in pairs}
    moments: dict[tuple[int, int], dict[str, PairMoments]] = {}
    last = max(b for _, b in pairs)
    peak = 0
    total_rows = int(windows.numel())
    for i in range(last + 1):
        layer = model.weights.load_layer(i)
        kept: dict[str, torch.Tensor] = {}  # this layer's inputs, when it opens a pair
        rows = {"o": 0, "down": 0}

        def hook(key: str, i: int = i, kept=kept, rows=rows) -> Callable:
            def fn(module, args) -> None:
                x = args[0].detach().reshape(-1, args[0].shape[-1]).to("cpu", torch.float32)
                for pair in closing.get(i, []):
                    moments[pair][key].add_b(x, rows[key])
                if i in opening:
                    if key not in kept:  # one buffer for all the tokens: no concatenation later
                        kept[key] = torch.empty(total_rows, x.shape[1], dtype=torch.float32)
                    kept[key][rows[key] : rows[key] + x.shape[0]] = x
                rows[key] += x.shape[0]
                nonlocal peak
                held = sum(t.numel() * t.element_size() for t in kept.values())
                peak = max(peak, held + sum(m.nbytes() for d in moments.values() for m in d.values()))

            return fn

        handles = []
        if i in opening or i in closing:
            for key in ("o", "down"):
                handles.append(layer.get_submodule(roles[key]).register_forward_pre_hook(hook(key)))
        try:
            model.apply_layer(i, acts, layer=layer)
        finally:
            for h in handles:
                h.remove()
            model.weights.free_layer(i)
        for pair in closing.get(i, []):
            done = moments.pop(pair)
            o, down = done["o"].finish(), done["down"].finish()
            sink(
                PairActivations(
                    a=pair[0],
                    b=pair[1],
                    tokens=int(windows.numel()),
                    mlp=correlation_from(down["cross"], down["var_a"], down["var_b"]),
                    o_cross=o["cross"],
                    o_var_a=o["var_a"].to(torch.float32),
                    o_var_b=o["var_b"].to(torch.float32),
                    o_auto_a=o["auto_a"],
                    o_auto_b=o["auto_b"],
                )
            )
            del done, o, down
        for pair in opening.get(i, []):
            moments[pair] = {"o": PairMoments(blocks=n_heads), "down": PairMoments()}
            moments[pair]["o"].set_a(kept["o"])  # shared by pairs opening here (centring is idempotent)
            moments[pair]["down"].set_a(kept["down"])
        del kept
    model.weights.free_shell()
    return peak


def calibrate(pairs: Sequence[tuple[int, int]], ctx, settings, scratch: Path) -> tuple[dict, dict]:
    """The OT builder's pre-pass for the activation variant: statistics of every pair, saved in
    ``scratch``. Returns (the manifest's report, pair -> saved statistics)."""
    import time

    from otdus_cli.verify.metrics import model_max_positions

    family = ctx.family  # dense: an MoE family was refused at plan time (methods/ot/__init__.py)
    if ctx.source_folder is None:
        raise RuntimeError("the activation variant needs the source folder in the build context")
    calib = settings.calib or DEFAULT_CALIB
    tokens = settings.calib_tokens or DEFAULT_CALIB_TOKENS
    start = time.perf_counter()
    windows = calibration_windows(ctx.source_folder, calib, tokens, model_max_positions(ctx.config))
    scratch.mkdir(parents=True, exist_ok=True)
    saved: dict[tuple[int, int], Path] = {}
    n_heads = int(ctx.config["num_attention_heads"])

    def sink(stats: PairActivations) -> None:
        path = scratch / f"ot-activation-{stats.a}-{stats.b}.pt"
        stats.save(path)
        saved[stats.a, stats.b] = path

    device = settings.device if settings.device.type != "meta" else "cpu"
    peak = capture_pair_activations(
        ctx.source_folder, pairs, windows, family.role_modules or family.roles, n_heads, sink, device=device
    )
    report = {
        "calibration": {
            "text": calib,
            "tokens": int(windows.numel()),
            "tokens_asked": tokens,
            "windows": int(windows.shape[0]),
            "seq_len": int(windows.shape[1]),
            "pairs": [list(p) for p in sorted(saved)],
            "seconds": round(time.perf_counter() - start, 3),
            "peak_statistics_bytes": peak,  # kept activations + running sums, at their largest
        }
    }
    return report, saved
