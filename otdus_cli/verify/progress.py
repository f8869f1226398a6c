"""Progress of an evaluation, as the library reports it: the phase, how far it is, and how many tokens
that represents (a front end turns ticks into bars, log lines or nothing)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Tick:
    """One step of an evaluation.

    ``done`` of ``total`` ``unit`` s of the phase are finished; ``tokens`` is how many tokens have gone
    through the whole phase's work so far (in the layers phase, window tokens times the fraction of the
    layers they have been through), for a tokens/s figure; ``detail`` says where the phase is (``layer
    3/12``)."""

    phase: str  # "layers" (every layer pass of the run), "scoring" or "scoring base" / "scoring expanded"
    done: int
    total: int
    unit: str  # "window passes", "tokens"
    tokens: float
    detail: str = ""


Progress = Callable[[Tick], None]


class LayerTicks:
    """Ticks of the layers phase: ``passes`` layer passes over ``windows`` windows (``tokens`` tokens)."""

    def __init__(self, progress: Progress | None, windows: int, tokens: int, passes: int):
        self.progress, self.windows, self.tokens, self.passes = progress, windows, tokens, passes

    def layer(self, done_passes: int, name: str | None = None):
        """The ``on_batch(windows, tokens)`` callback of the pass after ``done_passes`` finished ones
        (None without a progress callback); ``name`` says which layer it is."""
        progress = self.progress
        if progress is None:
            return None
        label = f"layer {done_passes + 1}/{self.passes}" + (f" ({name})" if name else "")
        if done_passes == 0:  # the phase starts now: a front end times its rate from here
            progress(Tick("layers", 0, self.passes * self.windows, "window passes", 0.0, label))

        def on_batch(windows: int, tokens: int) -> None:
            progress(
                Tick(
                    "layers",
                    done_passes * self.windows + windows,
                    self.passes * self.windows,
                    "window passes",
                    (done_passes * self.tokens + tokens) / self.passes,
                    label,  # the count is done/total window passes: it only grows, layer after layer
                )
            )

        return on_batch
