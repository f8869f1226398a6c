"""The generated parts of docs/evidence.md: tables and verdict lists made from stored results.

docs/evidence.md is prose written by hand around blocks

    <!-- evidence:NAME -->
    ...generated...
    <!-- evidence:end -->

that :func:`render_document` fills from the JSON under docs/evidence/ (scripts/evidence.py writes
both). Verdicts are not written by hand: :func:`verdict_lines` lists, for one study, what the
Holm-adjusted tests show and what they do not, so a rerun with other figures changes them too.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from otdus_cli.study.diagnose import MODULES, DiagnoseResult, PairDiagnosis, norm_bars
from otdus_cli.study.report import study_markdown
from otdus_cli.study.runner import StudyResult
from otdus_cli.study.stats import crossed_mean_ci, holm

__all__ = [
    "ALIGNMENT_VS_AVERAGE",
    "SHARPNESS",
    "TWO_BY_TWO",
    "contrasts_markdown",
    "error_parts",
    "render_document",
    "verdict_lines",
]

# The review's 2x2 (OT / Average x with / without zero-init): (label, minus, what the difference is)
TWO_BY_TWO = (
    ("ot", "ot+nozero", "zero-init, with OT"),
    ("average+zero", "average", "zero-init, with Average"),
    ("ot", "average+zero", "OT vs Average, with zero-init"),
    ("ot+nozero", "average", "OT vs Average, without zero-init"),
)
# Does any alignment beat the review's control, plain average with zero-init (issue 16)? Every OT
# arm with zero-init minus `average+zero`. An arm a study lacks is left out of its table (e.g.
# an arm not yet added to the stored studies), so the table grows when it is run.
ALIGNMENT_VS_AVERAGE = (
    ("ot", "average+zero", "paper, Sinkhorn reg 0.06 (OT-DUS)"),
    ("ot:structured", "average+zero", "structured, reg 0.06"),
    ("ot:official", "average+zero", "official (released script)"),
    ("ot/emd", "average+zero", "paper, exact assignment"),
    ("ot/reg0.01", "average+zero", "paper, Sinkhorn reg 0.01"),
    ("ot:activation/emd", "average+zero", "activation-matched, exact assignment"),
)
# Does sharper alignment help or hurt? The same paper-variant flow with ever sharper plans.
SHARPNESS = (
    ("ot/reg0.01", "ot", "reg 0.06 -> 0.01"),
    ("ot/emd", "ot", "reg 0.06 -> exact assignment"),
    ("ot/emd", "ot/reg0.01", "reg 0.01 -> exact assignment"),
)
ALPHA = 0.05


def _p(p: float | None) -> str:
    if p is None:
        return "-"
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def _ci(vs: dict[str, Any], digits: int = 4) -> str:
    if vs.get("low") is None:
        return f"{vs['mean']:+.{digits}f}"
    return f"{vs['mean']:+.{digits}f} [{vs['low']:+.{digits}f}, {vs['high']:+.{digits}f}]"


def _agree(vs: dict[str, Any]) -> str:
    same = sum((x < 0) if vs["mean"] < 0 else (x > 0) for x in vs["diffs"])
    return f"{same}/{len(vs['diffs'])} seeds"


def verdict_lines(result: StudyResult, alpha: float = ALPHA) -> list[str]:
    """Markdown bullets: the methods whose final loss is lower / higher than the reference's at
    Holm-adjusted p < alpha, and those the study cannot tell apart from it."""
    ref = result.reference
    rows = [m for m in result.methods if m.vs_reference]
    if not rows:
        return [f"* No comparisons: {'; '.join(result.notes) or 'no reference among the methods'}."]

    def item(m) -> str:
        vs = m.vs_reference
        return f"`{m.label}` ({_ci(vs)}, Holm p {_p(vs['p_holm'])}, {_agree(vs)})"

    lower = [m for m in rows if m.vs_reference["p_holm"] < alpha and m.vs_reference["mean"] < 0]
    higher = [m for m in rows if m.vs_reference["p_holm"] < alpha and m.vs_reference["mean"] > 0]
    unclear = [m for m in rows if m.vs_reference["p_holm"] >= alpha]
    lines = []
    for name, group in (("lower", lower), ("higher", higher)):
        lines.append(
            f"* Final loss {name} than `{ref}`'s: " + ("; ".join(map(item, group)) if group else "none") + "."
        )
    lines.append(
        f"* Not told apart from `{ref}` (Holm p >= {alpha:g}): "
        + ("; ".join(map(item, unclear)) if unclear else "none")
        + "."
    )
    return lines


def error_parts(vs: dict[str, Any]) -> dict[str, float]:
    """A difference's standard error split into its seed, window and residual parts (the two-way
    crossed model's sigma_a / sqrt(S), sigma_b / sqrt(W), sigma_e / sqrt(S W); their squares add up
    to SE^2 unless a component was truncated at zero), the interval's half-width, and the half-width
    of a t interval over the seed means alone (what the report gave before, blind to the windows)."""
    s, w = vs["n_seeds"], vs["n_windows"]
    seeds_only = crossed_mean_ci([[x] for x in vs["diffs"]])
    return {
        "se": vs["se"],
        "seed": vs["seed_sd"] / math.sqrt(s),
        "window": vs["window_sd"] / math.sqrt(w),
        "residual": vs["residual_sd"] / math.sqrt(s * w),
        "half_width": vs["high"] - vs["mean"],
        "seeds_only_half_width": seeds_only["high"] - seeds_only["mean"],
    }


def error_markdown(result: StudyResult) -> str:
    """:func:`error_parts` of every comparison with the reference, in nats."""
    lines = [
        "| method | SE of Δ | seed part | window part | residual part | 95% half-width "
        "| seeds-only half-width |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in result.methods:
        vs = m.vs_reference
        if vs and vs.get("error") == "seeds and windows":
            lines.append(f"| {m.label} | " + " | ".join(f"{x:.5f}" for x in error_parts(vs).values()) + " |")
    return "\n".join(lines)


def contrasts_markdown(
    result: StudyResult, contrasts: Sequence[tuple[str, str, str]] = TWO_BY_TWO, alpha: float = ALPHA
) -> str:
    """A table of chosen contrasts (each ``label - minus``), Holm-adjusted over these contrasts."""
    labels = {m.label for m in result.methods}
    chosen = [c for c in contrasts if c[0] in labels and c[1] in labels]
    stats = [result.contrast(a, b) for a, b, _ in chosen]
    adjusted = holm([s["p"] for s in stats])
    lines = ["| contrast | Δ final loss, 95% CI | p | Holm p | seeds | |", "|---|---|---|---|---|---|"]
    for (a, b, what), vs, q in zip(chosen, stats, adjusted, strict=True):
        verdict = "n.s." if q is None or q >= alpha else ("lower" if vs["mean"] < 0 else "higher")
        lines.append(
            f"| {what}: `{a}` - `{b}` | {_ci(vs)} | {_p(vs['p'])} | {_p(q)} | {_agree(vs)} | {verdict} |"
        )
    return "\n".join(lines)


def across_studies_lines(results: dict[str, StudyResult], alpha: float = ALPHA) -> list[str]:
    """Which verdicts survive Holm over every comparison with the reference in all the studies."""
    tests = [(name, m) for name, r in results.items() for m in r.methods if m.vs_reference]
    adjusted = holm([m.vs_reference["p"] for _, m in tests])
    kept = [
        f"`{m.label}` ({name}, Holm p {_p(q)})"
        for (name, m), q in zip(tests, adjusted, strict=True)
        if q < alpha
    ]
    lost = [
        f"`{m.label}` ({name}, Holm p {_p(q)})"
        for (name, m), q in zip(tests, adjusted, strict=True)
        if q >= alpha and m.vs_reference["p_holm"] < alpha
    ]
    return [
        f"* Holm over all {len(tests)} comparisons of the {len(results)} studies at once: "
        f"{len(kept)} stay below {alpha:g}: " + ("; ".join(kept) or "none") + ".",
        "* Significant within their own study but not over all of them: " + ("; ".join(lost) or "none") + ".",
    ]


def _text(name: str, documents: int) -> str:
    """A text's file name (its folder differs between machines) and how many documents it gave."""
    base = Path(name.split(" (")[0]).name
    rest = name[len(name.split(" (")[0]) :]
    return f"`{base}`{rest}" if "docs" in rest else f"`{base}` ({documents} docs)"


def setup_markdown(results: dict[str, StudyResult]) -> str:
    """The settings every figure depends on, from the stored results themselves."""
    lines = ["| study | train text | eval text | seeds | steps x batch x seq | lr | eval windows (tokens) |"]
    lines.append("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        c, d = r.config, r.data
        lines.append(
            f"| {name} | {_text(d['train'], d['train_documents'])} | "
            f"{_text(d['eval'], d['eval_documents'])} | "
            f"{', '.join(map(str, c['seeds']))} | "
            f"{c['steps']} x {c['batch']} x {c['seq_len']} | {c['lr']:g} | "
            f"{d['eval_windows']} ({d['eval_tokens_scored']:,}) |"
        )
    return "\n".join(lines)


_PLANS = ("ot_gate", "ot_up", "ot_joint")


# -- diagnose -------------------------------------------------------------------------------------
def _margin(value: float, mean: float, sd: float) -> str:
    return f"{value:.3f} ({(value - mean) / sd:+.1f})" if sd > 0 else f"{value:.3f}"


def diagnose_mlp_markdown(result: DiagnoseResult) -> str:
    head = (
        "| pair | ot_gate w / 1:1 | ot_up w / 1:1 | ot_joint w / 1:1 | same index | random (mean ± sd) "
        "| best held-out | best in-sample | best misaligned |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for p in result.pairs:
        m = p.mlp
        mean, sd = m["random_mean"], m["random_sd"]
        plans = [
            f"{m[k]:.3f} / {_margin(m[k + '_1to1'], mean, sd)}" for k in ("ot_gate", "ot_up", "ot_joint")
        ]
        lines.append(
            f"| {p.a}-{p.b} | "
            + " | ".join(plans)
            + f" | {_margin(m['same_index'], mean, sd)} | {mean:.3f} ± {sd:.3f} | "
            + f"{_margin(m['best_held_out'], mean, sd)} | "
            + " | ".join(f"{m[k]:.3f}" for k in ("best_in_sample", "best_misaligned"))
            + " |"
        )
    return "\n".join(lines)


def diagnose_heads_markdown(result: DiagnoseResult) -> str:
    lines = [
        "| pair | matched | same index | all pairs (mean ± sd of a pairing) | best held-out | best in-sample "
        "| best misaligned |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in result.pairs:
        h = p.heads
        mean, sd = h["random_mean"], h["random_sd"]
        lines.append(
            f"| {p.a}-{p.b} | {_margin(h['matched'], mean, sd)} | {_margin(h['same_index'], mean, sd)} | "
            f"{mean:.3f} ± {sd:.3f} | {_margin(h['best_held_out'], mean, sd)} | "
            + " | ".join(f"{h[k]:.3f}" for k in ("best_in_sample", "best_misaligned"))
            + " |"
        )
    return "\n".join(lines)


def entropy_markdown(pairs: Sequence[PairDiagnosis]) -> str:
    lines = ["| pair | " + " | ".join(MODULES) + " |", "|---" * (len(MODULES) + 1) + "|"]
    for p in pairs:
        cells = [f"{p.entropy[m]['entropy']:.2f} ({p.entropy[m]['entropy_normalized']:.2f})" for m in MODULES]
        lines.append(f"| {p.a}-{p.b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def planted_markdown(planted: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| planted | ot_gate w / 1:1 | ot_up w / 1:1 | ot_joint w / 1:1 | same index | random (mean ± sd) "
        "| best held-out / misaligned | heads matched / same index | o plan entropy (norm.) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, d in planted.items():
        m, h = d["mlp"], d["heads"]
        plans = [f"{m[k]:.4f} / {m[k + '_1to1']:.4f}" for k in _PLANS]
        lines.append(
            f"| {name} | "
            + " | ".join(plans)
            + f" | {m['same_index']:.3f} | {m['random_mean']:.3f} ± {m['random_sd']:.3f} | "
            f"{m['best_held_out']:.4f} / {m['best_misaligned']:.3f} | "
            f"{h['matched']:.3f} / {h['same_index']:.3f} | "
            f"{d['entropy_normalized']['o']:.4f} |"
        )
    return "\n".join(lines)


def _diagnose_result(path: Path) -> DiagnoseResult:
    data = json.loads(path.read_text())
    data["pairs"] = [PairDiagnosis(**p) for p in data["pairs"]]
    return DiagnoseResult(**data)


def _runs_markdown(runs: dict[str, dict[str, Any]]) -> str:
    lines = ["| regeneration | command | wall time | load average (1 min) before / after | CPUs |"]
    lines.append("|---|---|---|---|---|")
    for name, r in runs.items():
        minutes = f"{r['seconds'] / 60:.1f} min"
        lines.append(
            f"| {name} | `{r['command']}` | {minutes} | "
            f"{r['load_before']:.1f} / {r['load_after']:.1f} | {r['cpus']} |"
        )
    return "\n".join(lines)


def _study_blocks(studies: dict[str, StudyResult], prefix: str) -> dict[str, Callable[[], str]]:
    """The blocks of one study set (one recipe's studies), their names prefixed with ``prefix``."""
    out: dict[str, Callable[[], str]] = {}
    if studies:
        out[f"{prefix}study-setup"] = lambda: setup_markdown(studies)
        out[f"{prefix}across-studies"] = lambda: "\n".join(across_studies_lines(studies))
    for name, r in studies.items():
        out[f"{prefix}study:{name}"] = lambda r=r: study_markdown(r) + "\n\n" + "\n".join(verdict_lines(r))
        out[f"{prefix}errors:{name}"] = lambda r=r: error_markdown(r)
        out[f"{prefix}contrasts:{name}"] = lambda r=r: contrasts_markdown(r)
        out[f"{prefix}alignment:{name}"] = lambda r=r: contrasts_markdown(r, ALIGNMENT_VS_AVERAGE)
        out[f"{prefix}sharpness:{name}"] = lambda r=r: contrasts_markdown(r, SHARPNESS)
    return out


def blocks(evidence: Path) -> dict[str, Callable[[], str]]:
    """Every generated block by name, computed from the results stored under ``evidence``: a study
    set is a folder of studies (``SET/STUDY/study.json``); the Table 6 set's blocks are named
    ``study:STUDY`` etc., another set's ``SET:study:STUDY``."""
    out: dict[str, Callable[[], str]] = {}
    for folder in sorted(p for p in evidence.iterdir() if p.is_dir()) if evidence.exists() else []:
        # re-derived with the current statistics (a result saved by an older version is still read)
        studies = {
            p.name: StudyResult.load(p).recompute()
            for p in sorted(folder.iterdir())
            if (p / "study.json").exists()
        }
        out.update(_study_blocks(studies, "" if folder.name == "table6" else f"{folder.name}:"))
    diag = evidence / "diagnose" / "stories260k.json"
    if diag.exists():
        d = _diagnose_result(diag)
        out["diagnose-mlp"] = lambda: diagnose_mlp_markdown(d)
        out["diagnose-heads"] = lambda: diagnose_heads_markdown(d)
        out["diagnose-entropy"] = lambda: entropy_markdown(d.pairs)
        out["diagnose-norms"] = lambda: "```\n" + norm_bars(d) + "\n```"
    planted = evidence / "diagnose" / "planted.json"
    if planted.exists():
        out["planted"] = lambda: planted_markdown(json.loads(planted.read_text()))
    runs = evidence / "runs.json"
    if runs.exists():
        out["runs"] = lambda: _runs_markdown(json.loads(runs.read_text()))
    return out


_BLOCK = re.compile(r"(<!-- evidence:(?P<name>[\w:.-]+) -->\n)(?P<body>.*?)(<!-- evidence:end -->)", re.S)


def render_document(text: str, evidence: str | Path) -> str:
    """``text`` with every ``<!-- evidence:NAME -->`` block replaced by its generated content.
    A block whose NAME has no stored result is an error (a typo would otherwise go stale silently)."""
    made = blocks(Path(evidence))

    def fill(match: re.Match) -> str:
        name = match.group("name")
        if name not in made:
            raise KeyError(f"docs block {name!r}: no such generated block (known: {', '.join(sorted(made))})")
        return match.group(1) + made[name]().rstrip("\n") + "\n" + match.group(4)

    return _BLOCK.sub(fill, text)
