"""Base and expanded streamed side by side over the same windows, compared at every corresponding point.

After every expanded layer that corresponds to a point of the base stack (``layer_map.correspondence``),
the hidden states of all windows are compared with the base's; then each model's logits are computed
one model at a time and compared chunk by chunk through digests, so neither model's head or logits
need to be held next to the other's.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from otdus_cli.verify.compute import PhaseClock
from otdus_cli.verify.layer_calls import Activations
from otdus_cli.verify.layer_map import LayerEntry, describe
from otdus_cli.verify.metrics import Window, score_activations
from otdus_cli.verify.progress import LayerTicks, Progress
from otdus_cli.verify.streaming import StreamedModel


@dataclass
class LayerCheck:
    expanded_layer: int  # -1: embeddings
    base_layer: int  # -1: embeddings
    name: str
    max_abs_diff: float
    equal: bool


def max_abs_diff(a: Activations, b: Activations) -> tuple[float, bool]:
    worst, equal = 0.0, True
    for x, y in zip(a.hidden, b.hidden, strict=True):
        if x.shape != y.shape:
            return math.inf, False
        if not torch.equal(x, y):
            equal = False
            diff = (x.float() - y.float()).abs()
            d = float(diff.max()) if diff.numel() else 0.0
            worst = max(worst, d if not math.isnan(d) else math.inf)
    return worst, equal


def _digest(logits: torch.Tensor) -> str:
    data = logits.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    return f"{tuple(logits.shape)}:{hashlib.sha256(data).hexdigest()}"


def score_with_digests(
    model: StreamedModel, acts: Activations, windows: Sequence[Window], progress: Progress | None, label: str
) -> tuple[list, list[str]]:
    """Log-probs per window and a digest per logits chunk."""
    digests: list[str] = []
    logprobs = score_activations(
        model, acts, windows, lambda chunk: digests.append(_digest(chunk)), progress, label
    )
    return logprobs, digests


def run_layers(
    base: StreamedModel,
    expd: StreamedModel,
    entries: Sequence[LayerEntry],
    points: Sequence[int | None],
    windows: Sequence[Window],
    clock: PhaseClock,
    progress: Progress | None,
) -> tuple[Activations, Activations, list[LayerCheck]]:
    """Both stacks over ``windows`` in lockstep, comparing hidden states at each corresponding point."""
    inputs = [w.input_ids for w in windows]
    acts_b = base.start(inputs)
    acts_e = expd.start(inputs)
    clock.lap("start")
    checks: list[LayerCheck] = []
    diff, eq = max_abs_diff(acts_e, acts_b)
    checks.append(LayerCheck(-1, -1, "embeddings", diff, eq))
    n_tokens = sum(len(w.targets) for w in windows)
    ticks = LayerTicks(progress, len(inputs), n_tokens, base.num_layers + expd.num_layers)
    passes = 0

    def apply(model: StreamedModel, index: int, acts: Activations, name: str) -> None:
        nonlocal passes
        model.apply_layer(index, acts, on_batch=ticks.layer(passes, f"{name} {index}"))
        passes += 1

    base_done = 0  # base layers applied so far
    for j, target in enumerate(points):
        if target is not None:
            while base_done <= target:
                apply(base, base_done, acts_b, "base")
                base_done += 1
        apply(expd, j, acts_e, "expanded")
        if target is not None:
            diff, eq = max_abs_diff(acts_e, acts_b)
            checks.append(LayerCheck(j, target, describe(entries[j], j), diff, eq))
    while base_done < base.num_layers:
        apply(base, base_done, acts_b, "base")
        base_done += 1
    clock.lap("layers")
    return acts_b, acts_e, checks


@dataclass
class RankPart:
    """What one rank computed of a verify run: its windows' log-probs, the lockstep checks on them."""

    windows: list[int]
    base: list[torch.Tensor]
    expanded: list[torch.Tensor]
    logits_equal: bool
    checks: list[LayerCheck]


def combine_checks(per_rank: Sequence[list[LayerCheck]]) -> list[LayerCheck]:
    """Each comparison point over all ranks' windows: the largest difference, equal only if equal on
    every rank (what one process finds over all windows at once)."""
    first, *others = per_rank
    out = []
    for k, check in enumerate(first):
        same_point = [c[k] for c in others]
        out.append(
            LayerCheck(
                check.expanded_layer,
                check.base_layer,
                check.name,
                max([check.max_abs_diff, *(c.max_abs_diff for c in same_point)]),
                check.equal and all(c.equal for c in same_point),
            )
        )
    return out
