"""Study results made from given losses, for tests of the statistics and the evidence tables."""

from __future__ import annotations

import math

from otdus_cli.study import MethodSummary, RunResult, StudyResult


def study_from_window_losses(per_window: dict[str, list[list[float]]], reference: str = "ref"):
    """A StudyResult made from given per-seed, per-window final losses (no training), compared with
    ``reference`` as study() compares."""
    seeds = list(range(len(next(iter(per_window.values())))))
    runs, methods = [], []
    for label, table in per_window.items():
        for seed, losses in zip(seeds, table, strict=True):
            final = math.fsum(losses) / len(losses)
            runs.append(
                RunResult(label, seed, [0], [final], [], final, final, True, True, 1, 1, 0.0, list(losses))
            )
        finals = [math.fsum(t) / len(t) for t in table]
        methods.append(
            MethodSummary(label, {}, seeds, True, 0.0, True, math.fsum(finals) / len(finals), 0.0, 1.0, 1, 1)
        )
    result = StudyResult("b", "", {"seeds": seeds, "steps": 1}, {}, 0.0, methods, runs, 0.0)
    return result.recompute(reference)
