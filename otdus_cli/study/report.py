"""Rendering of study and diagnose results: rich tables, Markdown tables, optional PNG figures.

matplotlib is optional (``pip install otdus[plot]``); without it the plotting functions return
None and nothing is written.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rich.table import Table


class StudyResult(Protocol):
    """What the report reads of a study's result (study/results.py: StudyResult, whose ``save``
    plots through this module)."""

    base: str
    reference: str
    config: dict[str, Any]
    data: dict[str, Any]
    base_loss: float
    methods: list[Any]  # MethodSummary
    runs: list[Any]  # RunResult
    notes: list[str]

    @property
    def base_ppl(self) -> float: ...


__all__ = ["plot_curves", "study_caption", "study_markdown", "study_table"]


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _ci_text(vs: dict | None, digits: int = 4) -> str:
    if not vs:
        return "-"
    if vs.get("low") is None:
        return f"{vs['mean']:+.{digits}f}"
    return f"{vs['mean']:+.{digits}f} [{vs['low']:+.{digits}f}, {vs['high']:+.{digits}f}]"


def _p_text(p: float | None) -> str:
    if p is None:
        return "-"
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def _seeds_text(vs: dict) -> str:
    """How many seeds' differences share the sign of the mean difference, e.g. "5/5"."""
    diffs = vs["diffs"]
    same = sum((x < 0) if vs["mean"] < 0 else (x > 0) for x in diffs)
    return f"{same}/{len(diffs)}"


def _verdict(vs: dict | None, alpha: float = 0.05) -> str:
    """ "better" / "worse" when the Holm-adjusted p-value is below ``alpha``, else "n.s."."""
    if not vs:
        return ""
    p = vs.get("p_holm", vs.get("p"))
    if p is None:
        return ""
    if p >= alpha:
        return "n.s."
    return "better" if vs["mean"] < 0 else "worse"


def _comparison_cells(m) -> list[str]:
    vs = m.vs_reference
    if not vs:
        return ["(reference)", "", "", "", ""]
    return [_ci_text(vs), _p_text(vs.get("p")), _p_text(vs.get("p_holm")), _seeds_text(vs), _verdict(vs)]


_ERROR_SOURCES = {
    "seeds and windows": "seed and evaluation-window error",
    "windows": "evaluation-window error only (one seed)",
    "seeds": "seed error only (no per-window losses stored)",
}


def study_caption(result: StudyResult) -> str:
    """What the difference columns are and what they can show (and the result's notes)."""
    lines = list(result.notes)
    compared = [m.vs_reference for m in result.methods if m.vs_reference]
    if compared:
        vs = compared[0]
        n_seeds = vs.get("n_seeds", vs["n"])
        windows = vs.get("n_windows", 1)
        error = vs.get("error", "seeds")
        pct = round(100 * vs.get("confidence", 0.95))
        lines.append(
            f"Δ: final loss minus {result.reference}'s (< 0: lower loss), mean over {n_seeds} seed(s)"
            + (f" x {windows} evaluation windows" if windows > 1 else "")
            + f"; {pct}% t interval from the {_ERROR_SOURCES.get(error, error)}"
            + f"; p: t test; Holm: adjusted over the {len(compared)} comparisons; verdict from Holm p < 0.05;"
            f" seeds: how many seeds share the sign (a sign test over {n_seeds} seeds cannot go below"
            f" p = {2 / 2**n_seeds:.3g})."
        )
        lines.append(
            f"Only differences to {result.reference} are tested: "
            "the order of the other rows is not a ranking."
        )
    return "\n".join(lines)


def study_table(result: StudyResult) -> Table:
    """A rich table: one row per method, sorted as given, paired differences to the reference."""
    from rich.table import Table

    n = len(result.config["seeds"])
    ref = result.reference
    plateau = result.config.get("until_plateau")
    steps = f"{result.config['steps']} steps"
    if plateau:
        steps = f"to a plateau (<= {plateau['max_steps']} steps)"
    title = (
        f"{result.base}: {steps} x {n} seed(s); base loss {result.base_loss:.4f} (ppl {result.base_ppl:.3f})"
    )
    table = Table(title=title, caption=study_caption(result) or None)
    for col in ("method", "layers", "start loss", "= base", "final loss", "± sd", "ppl"):
        table.add_column(col, justify="left" if col == "method" else "right")
    if ref:
        for col in (f"Δ vs {ref} (95% CI)", "p", "Holm p", "seeds", ""):
            table.add_column(col, justify="left" if not col else "right")
    for m in result.methods:
        row = [
            m.label,
            str(m.num_hidden_layers),
            f"{m.initial_loss:.4f}",
            "yes" if m.initial_equals_base else "no",
            f"{m.final_loss:.4f}",
            f"{m.final_loss_std:.4f}",
            f"{m.final_ppl:.3f}",
        ]
        if ref:
            row += _comparison_cells(m)
        table.add_row(*row)
    return table


def study_markdown(result: StudyResult) -> str:
    """The same table in Markdown (for docs/evidence.md), the caption below it."""
    ref = result.reference
    head = "| method | start loss | = base | final loss ± sd | ppl |"
    sep = "|---|---|---|---|---|"
    if ref:
        head += f" Δ vs {ref}, 95% CI | p | Holm p | seeds | |"
        sep += "---|---|---|---|---|"
    lines = [head, sep]
    for m in result.methods:
        line = (
            f"| {m.label} | {m.initial_loss:.4f} | {'yes' if m.initial_equals_base else 'no'} | "
            f"{m.final_loss:.4f} ± {m.final_loss_std:.4f} | {m.final_ppl:.3f} |"
        )
        if ref:
            line += " " + " | ".join(_comparison_cells(m)) + " |"
        lines.append(line)
    caption = study_caption(result)
    if caption:
        lines += ["", *caption.splitlines()]
    return "\n".join(lines)


def plot_curves(result: StudyResult, path: str | Path) -> Path | None:
    """Held-out loss against step, mean over seeds (shaded min..max), one line per method; for a
    study trained on a validation split (plateau rule, learning-rate sweep), the validation loss of
    every run up to its stop (the held-out text is scored only at step 0 and at the stop).

    Left: every method from step 0. Right: a zoom on the function-preserving methods (those that
    start exactly at the base's loss), whose differences are otherwise invisible; when there are
    none, every method after the first evaluation interval.
    """
    plt = _pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    zoom = [m.label for m in result.methods if m.initial_equals_base]
    validated = any(r.validation_steps for r in result.runs)
    for m in result.methods if validated else []:
        # each run stops at its own plateau: one line per seed, the validation loss that decided it
        color = None
        for r in (r for r in result.runs if r.label == m.label):
            for ax in axes[: 1 if m.label not in zoom else 2]:
                (line,) = ax.plot(
                    r.validation_steps, r.validation_loss, lw=1, color=color, label=None if color else m.label
                )
            color = line.get_color()
    for m in result.methods if not validated else []:
        runs = [r for r in result.runs if r.label == m.label]
        steps = runs[0].eval_steps
        mean = [sum(r.eval_loss[i] for r in runs) / len(runs) for i in range(len(steps))]
        lo = [min(r.eval_loss[i] for r in runs) for i in range(len(steps))]
        hi = [max(r.eval_loss[i] for r in runs) for i in range(len(steps))]
        (line,) = axes[0].plot(steps, mean, marker=".", label=m.label)
        axes[0].fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15)
        if (zoom and m.label in zoom) or (not zoom and len(steps) > 1):
            first = 0 if zoom else 1
            axes[1].plot(steps[first:], mean[first:], marker=".", color=line.get_color(), label=m.label)
            axes[1].fill_between(steps[first:], lo[first:], hi[first:], color=line.get_color(), alpha=0.15)
    for ax in axes:
        if not validated:  # the base's loss is a held-out figure
            ax.axhline(result.base_loss, color="black", lw=0.8, ls="--", label="base (unexpanded)")
        ax.set_xlabel(
            "training step (new layers only)" if result.config["train_new_only"] else "training step"
        )
        ax.set_ylabel(("validation" if validated else "held-out") + " loss (nats/token)")
        ax.grid(alpha=0.3)
    axes[0].set_title(
        "all methods, one line per seed, each to its stop"
        if validated
        else "all methods, from step 0 (mean over seeds, min-max shaded)",
        fontsize=9,
    )
    axes[1].set_title(
        "zoom: function-preserving methods" if zoom else "after the first evaluation interval", fontsize=9
    )
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)

    def short(name: str) -> str:
        return name if len(name) < 60 else "..." + name[-57:]

    fig.suptitle(
        f"{result.base}: train {short(result.data['train'])}\neval {short(result.data['eval'])}", fontsize=8
    )
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def ppl(loss: float) -> float:
    return math.exp(loss)
