"""What the shrink perplexity pages share (scripts/shrink_ppl.py on stories260K, scripts/shrink_smollm2.py on
SmolLM2-135M): per-window losses of a model, perplexity intervals over the windows, paired per-window
tests with Holm's adjustment, and the words and cells the pages render them with.

Windows, not tokens, are the independent units: every model of a page is scored on the same windows, so
one model minus another is a per-window loss difference, tested by a paired t test over the windows.
"""

from __future__ import annotations

import math
from pathlib import Path


def window_losses(folder: Path, plan) -> list[float]:
    """Mean token loss of every window (natural log), the model streamed layer by layer, float32."""
    import torch

    from otdus_cli.verify.streaming import StreamedModel

    model = StreamedModel(folder, device="cpu", dtype=torch.float32, batch_size=16)
    losses = []
    for window, logits in zip(plan.windows, model.logits([w.input_ids for w in plan.windows]), strict=True):
        n = len(window.targets)
        logp = torch.log_softmax(logits[window.offset : window.offset + n].double(), dim=-1)
        losses.append(float(-logp[torch.arange(n), torch.tensor(window.targets)].mean()))
    return losses


def interval(losses: list[float]) -> tuple[float, float, float]:
    """Perplexity exp(mean loss) and its 95% interval from the spread of the window losses."""
    n = len(losses)
    mean = sum(losses) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in losses) / (n - 1))
    half = 1.96 * sd / math.sqrt(n)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def number(x: float) -> str:
    """A perplexity to two decimals, in powers of ten past a million (LaCo's merges reach 1e8)."""
    return f"{x:.2f}" if x < 1e6 else f"{x:.3g}"


def cell(losses: list[float]) -> str:
    """A perplexity with its interval, e.g. ``32.65 [30.10, 35.41]``."""
    ppl, low, high = interval(losses)
    return f"{number(ppl)} [{number(low)}, {number(high)}]"


def paired(a: list[float], b: list[float]) -> dict:
    """Loss ``a`` minus loss ``b`` on the same windows: mean, 95% interval and p of a paired t test over
    the windows (study.stats with one seed)."""
    from otdus_cli.study.stats import crossed_mean_ci

    return crossed_mean_ci([[x - y for x, y in zip(a, b, strict=True)]])


def adjust(found: dict) -> dict:
    """Adds ``p_holm`` to every comparison of ``found``: Holm-adjusted over all of them (the family a
    verdict reads); returns ``found``."""
    from otdus_cli.study.stats import holm

    for c, q in zip(found.values(), holm([c["p"] for c in found.values()]), strict=True):
        c["p_holm"] = q
    return found


def word(contrast: dict, alpha: float = 0.05) -> str:
    """What a Holm-adjusted comparison says: the first side's loss lower, higher, or no clear difference."""
    if contrast["p_holm"] is not None and contrast["p_holm"] < alpha:
        return "lower" if contrast["mean"] < 0 else "higher"
    return "no clear difference"


def contrast_cell(c: dict) -> str:
    """A comparison as the pages show it: mean difference [interval], p after Holm: its word."""
    p_holm = "n/a" if c["p_holm"] is None else f"{c['p_holm']:.3g}"
    return f"{c['mean']:+.4f} [{c['low']:+.4f}, {c['high']:+.4f}], p {p_holm}: {word(c)}"


def outcome(a: str, b: str, lower: int, higher: int, total: int) -> str:
    """What a tally of ``a``-against-``b`` comparisons says: one side "beats" the other only where it is
    ahead in most comparisons and behind in none."""
    if lower and not higher:
        return f"{a} beats {b}" if 2 * lower > total else f"{a} is never shown worse than {b}"
    if higher and not lower:
        return f"{b} beats {a}" if 2 * higher > total else f"{b} is never shown worse than {a}"
    if lower and higher:
        return f"mixed: {a} is better in some comparisons and worse in others"
    return "no clear difference"


def row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def layers(removed: list[int]) -> str:
    return ", ".join(map(str, removed))
