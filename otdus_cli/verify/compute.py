"""How a run computes: threads, batches, each rank's share of the windows, and the time of each phase.

The windows are split across ranks (torchrun / srun; see distributed.py) in whole batches of the
single-process grouping, so every window is computed in the very batch a single process computes it in
and every figure is the same bits.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from otdus_cli.distributed import World, shard
from otdus_cli.errors import OtdusError
from otdus_cli.verify.batching import group_windows
from otdus_cli.verify.metrics import EvalSet
from otdus_cli.verify.threads import CpuSample, ThreadChoice, choose_threads

if TYPE_CHECKING:
    from otdus_cli.verify.streaming import StreamedModel


@dataclass
class ComputeSettings:
    """What a run chose for speed (reported in --json as ``compute``): intra-op threads, windows per
    forward pass (those of the eval_set's longest windows) and the number of forward passes per layer."""

    threads: ThreadChoice
    batch_size: int
    batches: int
    ranks: int = 1  # processes the windows were split across (torchrun / srun; see distributed.py)

    def to_dict(self) -> dict:
        return {
            "threads": self.threads.to_dict(),
            "batch_size": self.batch_size,
            "batches": self.batches,
            "ranks": self.ranks,
        }


def compute_settings(
    model: StreamedModel, eval_set: EvalSet, threads: int | None = None, since: CpuSample | None = None
) -> ComputeSettings:
    """Threads (see verify/threads.py) and batches for running ``model`` over ``eval_set``'s windows."""
    lengths = [len(w.input_ids) for w in eval_set.windows]
    longest = max(lengths, default=1)
    batch = min(model.windows_per_batch(longest), max(1, lengths.count(longest)))
    batches = len(group_windows(lengths, model.windows_per_batch))
    if model.device.type == "cpu":
        choice = choose_threads(threads, model.layer_call_flop(batch, longest), since)
    else:  # the work is on the accelerator; CPU threads only feed it
        choice = ThreadChoice(
            torch.get_num_threads(), 0, None, f"device {model.device.type}: left as they are"
        )
    return ComputeSettings(choice, batch, batches)


def rank_windows(model: StreamedModel, eval_set: EvalSet, world: World) -> list[int]:
    """The windows this rank evaluates: whole batches of the single-process grouping (a contiguous
    block of them, balanced by tokens), so every window is computed in the very batch a single
    process computes it in and its logits are the same bits."""
    lengths = [len(w.input_ids) for w in eval_set.windows]
    groups = group_windows(lengths, model.windows_per_batch)
    mine = shard([sum(lengths[i] for i in g) for g in groups], world)
    return sorted(i for g in groups[mine.start : mine.stop] for i in g)


def in_window_order(parts: Sequence[list[tuple[int, torch.Tensor]]], n_windows: int) -> list[torch.Tensor]:
    """Every rank's (window index, log-probs) pairs as one list in window order."""
    out: list[torch.Tensor | None] = [None] * n_windows
    for part in parts:
        for i, lp in part:
            out[i] = lp
    if any(lp is None for lp in out):
        raise OtdusError("internal: a window was scored by no rank")
    return out  # type: ignore[return-value]


class PhaseClock:
    """Seconds spent in each phase of a run (reported in --json as ``timings``)."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[f"{phase}_s"] = round(self.seconds.get(f"{phase}_s", 0.0) + now - self.last, 3)
        self.last = now

    def total(self) -> dict[str, float]:
        return {**self.seconds, "total_s": round(time.perf_counter() - self.start, 3)}
