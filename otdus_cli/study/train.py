"""Continued pre-training of one checkpoint: AdamW on a fixed data order, held-out loss on a curve.

Only the parameters named in ``trainable`` are updated (the expansion manifest's ``new_parameters``
when the study trains the new layers only); everything else is frozen. The data order depends on
the seed alone, so every method sees exactly the same batches for a given seed. A run is either a
fixed number of steps (linear warmup, cosine decay to 10%) or, with a plateau rule
(otdus_cli.study_settings.PlateauRule), as long as the loss on the curve's windows keeps falling (linear
warmup over ``warmup`` x max_steps, then a constant learning rate).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from otdus_cli.errors import OtdusError
from otdus_cli.io.reader import CheckpointReader
from otdus_cli.study_settings import PlateauRule, plateau_reached

__all__ = [
    "TrainConfig",
    "TrainCurve",
    "attention",
    "batch_order",
    "evaluate",
    "load_model",
    "train",
    "window_losses",
]


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 150
    lr: float = 2e-3
    batch: int = 8
    eval_every: int = 25
    weight_decay: float = 0.0
    warmup: float = 0.1  # fraction of the steps with a linear warmup; cosine decay to 10% after
    grad_clip: float = 1.0
    eval_batch: int = 16
    plateau: PlateauRule | None = None  # stop on the rule (eval_every and steps come from it)
    eval_attention: str = "eager"  # the attention kernel of the evaluations (training: eager)

    @property
    def max_steps(self) -> int:
        return self.plateau.max_steps if self.plateau else self.steps

    @property
    def every(self) -> int:
        return self.plateau.eval_every if self.plateau else self.eval_every


@dataclass
class TrainCurve:
    """Held-out loss (mean token NLL, nats) at each evaluated step, and the training loss per step.

    ``final_window_loss``: the last evaluation's loss on each held-out window (same window order for
    every run), so that paired comparisons can account for the sampling of the evaluation text.
    ``plateaued``: with a plateau rule, whether it stopped the run (False: it ran to max_steps).
    """

    eval_steps: list[int] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    final_window_loss: list[float] = field(default_factory=list)
    trainable_parameters: int = 0
    seconds: float = 0.0
    plateaued: bool | None = None


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """torch.use_deterministic_algorithms for the duration (restored afterwards)."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def load_model(folder: str, device: torch.device):
    """A checkpoint as a float32 causal LM (transformers, never remote code), in train mode."""
    from transformers import AutoModelForCausalLM  # heavy import

    # our reader first: it validates every safetensors header and loads pickles only with
    # weights_only, so a corrupt or malicious checkpoint is one clear error before transformers sees it
    CheckpointReader(folder)
    try:
        # Eager attention: deterministic, and faster than SDPA's backward for small CPU models.
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=torch.float32, attn_implementation="eager", trust_remote_code=False
        )
    except (OSError, ValueError, RuntimeError) as exc:
        raise OtdusError(f"transformers cannot load {folder}: {str(exc).splitlines()[0][:300]}") from None
    return model.to(device)


@torch.no_grad()
def window_losses(model, windows: torch.Tensor, batch: int = 16) -> list[float]:
    """Mean next-token NLL of each window (scored on its own), in nats."""
    was_training = model.training
    model.eval()
    out: list[float] = []
    device = next(model.parameters()).device
    for s in range(0, windows.shape[0], batch):
        x = windows[s : s + batch].to(device)
        logits = model(input_ids=x).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="none"
        )
        out.extend(nll.view(x.shape[0], -1).double().mean(dim=1).tolist())
    model.train(was_training)
    return out


def evaluate(model, windows: torch.Tensor, batch: int = 16) -> float:
    """Mean next-token NLL over every window, in nats (windows are equally long: the mean of
    :func:`window_losses`)."""
    losses = window_losses(model, windows, batch)
    return math.fsum(losses) / len(losses)


def batch_order(n_windows: int, steps: int, batch: int, seed: int) -> list[torch.Tensor]:
    """Window indices of every step: seeded permutations, epoch after epoch (method-independent)."""
    g = torch.Generator().manual_seed(10_007 + seed)
    order: list[int] = []
    while len(order) < steps * batch:
        order.extend(torch.randperm(n_windows, generator=g).tolist())
    return [torch.tensor(order[i * batch : (i + 1) * batch]) for i in range(steps)]


def _lr_factor(step: int, steps: int, warmup: float, constant: bool = False) -> float:
    w = max(1, int(round(steps * warmup))) if warmup > 0 else 0
    if step < w:
        return (step + 1) / w
    if constant:
        return 1.0
    progress = (step - w) / max(1, steps - w)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def train(
    model,
    train_windows: torch.Tensor,
    eval_windows: torch.Tensor,
    config: TrainConfig,
    seed: int,
    trainable: Sequence[str] | None = None,
    on_eval: Callable[[int, float], None] | None = None,
) -> TrainCurve:
    """Train ``model`` in place; ``trainable`` = parameter names to update (None: all of them)."""
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    params = dict(model.named_parameters())
    if trainable is not None:
        missing = sorted(set(trainable) - set(params))
        if missing:
            raise OtdusError(f"parameters to train are not in the model: {', '.join(missing[:5])}")
        wanted = set(trainable)
        for name, p in params.items():
            p.requires_grad_(name in wanted)
    chosen = [p for p in params.values() if p.requires_grad]
    if not chosen:
        raise OtdusError("nothing to train: the expansion added no new parameters")
    curve = TrainCurve(trainable_parameters=sum(p.numel() for p in chosen))
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(chosen, lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay)
    steps, constant = config.max_steps, config.plateau is not None
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, steps, config.warmup, constant))
    order = batch_order(train_windows.shape[0], steps, config.batch, seed)
    history: list[list[float]] = []  # per-window losses of every evaluation (the plateau rule's input)

    def record(step: int) -> None:
        with attention(model, config.eval_attention):
            per_window = window_losses(model, eval_windows, config.eval_batch)
        loss = math.fsum(per_window) / len(per_window)
        curve.final_window_loss = per_window
        history.append(per_window)
        curve.eval_steps.append(step)
        curve.eval_loss.append(loss)
        if on_eval is not None:
            on_eval(step, loss)

    with deterministic():
        model.train()
        record(0)
        for step, idx in enumerate(order, start=1):
            x = train_windows[idx].to(device)
            loss = model(input_ids=x, labels=x).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if config.grad_clip:
                torch.nn.utils.clip_grad_norm_(chosen, config.grad_clip)
            opt.step()
            sched.step()
            curve.train_loss.append(float(loss.detach()))
            if step % config.every == 0 or step == steps:
                record(step)
                if config.plateau is not None:
                    curve.plateaued = plateau_reached(config.plateau, history)
                    if curve.plateaued:
                        break
    curve.seconds = time.perf_counter() - t0
    return curve


@contextlib.contextmanager
def attention(model, kind: str) -> Iterator[None]:
    """The model's attention kernel set to ``kind`` ("eager", "sdpa") for the duration."""
    before = model.config._attn_implementation
    if kind != before:
        model.set_attn_implementation(kind)
    try:
        yield
    finally:
        if kind != before:
            model.set_attn_implementation(before)
