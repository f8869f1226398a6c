"""The generated parts of docs/evidence.md: tables and verdict lists made from stored results.

docs/evidence.md is prose written by hand around blocks

    <!-- evidence:NAME -->
    ...generated...
    <!-- evidence:end -->

and inline values ``<!-- v:KEY -->0.038<!-- /v -->`` that :func:`render_document` fills from the JSON
under docs/evidence/ (scripts/evidence.py writes both); the prose itself carries no figure.
Verdicts are not written by hand: :func:`verdict_lines` lists, for one study, what the
Holm-adjusted tests show and what they do not, so a rerun with other figures changes them too, and
:func:`primary_markdown` gives the verdicts of the primary family a recipe declares
(:class:`~otdus_cli.study.recipe.PrimaryFamily`); every other table is labelled exploratory.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from otdus_cli.errors import OtdusError
from otdus_cli.study.diagnose import MODULES, DiagnoseResult, PairDiagnosis, norm_bars
from otdus_cli.study.recipe import PrimaryFamily, load_study_recipe
from otdus_cli.study.report import study_markdown
from otdus_cli.study.results import StudyResult
from otdus_cli.study.stats import crossed_mean_ci, holm, tost

__all__ = [
    "ALIGNMENT_VS_AVERAGE",
    "DOSE",
    "SHARPNESS",
    "TWO_BY_TWO",
    "contrasts_markdown",
    "dose_response_markdown",
    "error_parts",
    "primary_markdown",
    "render_document",
    "strip_generated",
    "training_markdown",
    "values",
    "verdict_lines",
]

# The 2x2 ablation (OT / Average x with / without zero-init): (label, minus, what the difference is)
TWO_BY_TWO = (
    ("ot", "ot+nozero", "zero-init, with OT"),
    ("average+zero", "average", "zero-init, with Average"),
    ("ot", "average+zero", "OT vs Average, with zero-init"),
    ("ot+nozero", "average", "OT vs Average, without zero-init"),
)
# Does any alignment beat the 2x2 ablation's control, plain average with zero-init? Every OT
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
# The dose-response: the paper-variant flow at ever sharper plans, least sharp first (reg 0.06 is
# OT-DUS's default; exact assignment is the limit reg -> 0), each step tested against the one before.
DOSE = (
    ("ot", "Sinkhorn reg 0.06"),
    ("ot/reg0.03", "Sinkhorn reg 0.03"),
    ("ot/reg0.02", "Sinkhorn reg 0.02"),
    ("ot/reg0.01", "Sinkhorn reg 0.01"),
    ("ot/emd", "exact assignment"),
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


def _equivalence(vs: dict[str, Any], margin: float | None, alpha: float = ALPHA) -> str:
    """ ", within ±margin (TOST p ...)" when the difference is shown smaller than ``margin``,
    ", not shown within ±margin (TOST p ...)" when not; nothing without a margin."""
    if margin is None:
        return ""
    p = tost(vs["mean"], vs.get("se"), vs.get("df"), margin)
    if p is None:
        return ""
    shown = "within" if p < alpha else "not shown within"
    return f", {shown} ±{margin:g} (TOST p {_p(p)})"


def verdict_lines(result: StudyResult, alpha: float = ALPHA, margin: float | None = None) -> list[str]:
    """Markdown bullets: the methods whose final loss is lower / higher than the reference's at
    Holm-adjusted p < alpha, and those the study cannot tell apart from it; with ``margin`` (nats)
    each of those also says whether TOST shows the difference smaller than the margin."""
    ref = result.reference
    rows = [m for m in result.methods if m.vs_reference]
    if not rows:
        return [f"* No comparisons: {'; '.join(result.notes) or 'no reference among the methods'}."]

    def item(m, equivalence: bool = False) -> str:
        vs = m.vs_reference
        tail = _equivalence(vs, margin, alpha) if equivalence else ""
        return f"`{m.label}` ({_ci(vs)}, Holm p {_p(vs['p_holm'])}, {_agree(vs)}{tail})"

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
        + ("; ".join(item(m, equivalence=True) for m in unclear) if unclear else "none")
        + "."
    )
    return lines


def by_document(vs: dict[str, Any]) -> dict[str, Any]:
    """A contrast with documents as the sampled unit (its ``by_document`` interval, p and standard
    error; the per-seed ``diffs`` kept) when the study recorded each window's document, else as is."""
    doc = vs.get("by_document")
    return {**vs, **doc, "unit": "documents"} if doc else {**vs, "unit": "windows"}


def primary_markdown(studies: dict[str, StudyResult], family: PrimaryFamily, recipe: str) -> str:
    """The primary family's table: ``family.reference`` minus each of ``family.against`` in every
    study, Holm within the study, TOST at the declared margin; then one verdict line per study.
    A study that lacks an arm of the family is an error (the family is fixed, not what was run)."""
    m, alpha = family.equivalence_margin, family.alpha
    head = (
        f"Declared in `{recipe}`, {family.declared}: `{family.reference}` minus each of "
        + ", ".join(f"`{a}`" for a in family.against)
        + f", per study, Holm over these {len(family.against)} within the study, alpha {alpha:g}; "
        f"equivalence margin ±{m:g} nats (TOST). Unit: what the interval, p and TOST resample besides "
        "seeds: held-out documents (each document's windows averaged) where the study recorded each "
        "window's document, else windows."
    )
    lines = [
        head,
        "",
        f"| study | contrast | Δ final loss, 95% CI | p | Holm p | TOST p (±{m:g}) | unit | seeds "
        "| difference | equivalence |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for name, r in studies.items():
        labels = {x.label for x in r.methods}
        missing = [a for a in [family.reference, *family.against] if a not in labels]
        if missing:
            raise KeyError(f"study {name!r} lacks the primary family's arm(s) {', '.join(missing)}")
        stats = [by_document(r.contrast(family.reference, a)) for a in family.against]
        adjusted = holm([s["p"] for s in stats])
        said = []
        for a, vs, q in zip(family.against, stats, adjusted, strict=True):
            e = tost(vs["mean"], vs.get("se"), vs.get("df"), m)
            diff = "n.s." if q is None or q >= alpha else ("lower" if vs["mean"] < 0 else "higher")
            equivalent = e is not None and e < alpha
            lines.append(
                f"| {name} | `{family.reference}` - `{a}` | {_ci(vs)} | {_p(vs['p'])} | {_p(q)} | {_p(e)} "
                f"| {vs['unit']} | {_agree(vs)} | {diff} "
                f"| {'within ±' + format(m, 'g') if equivalent else 'not shown'} |"
            )
            if diff != "n.s.":
                said.append(f"{diff} than `{a}`'s ({_ci(vs, 3)})")
            elif equivalent:
                said.append(f"within ±{m:g} of `{a}`'s ({_ci(vs, 4)})")
            else:
                said.append(f"not told apart from `{a}`'s, nor shown within ±{m:g} ({_ci(vs, 3)})")
        verdicts.append(f"* **{name}**: `{family.reference}`'s final loss is " + "; ".join(said) + ".")
    return "\n".join(lines + [""] + verdicts)


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
    result: StudyResult,
    contrasts: Sequence[tuple[str, str, str]] = TWO_BY_TWO,
    alpha: float = ALPHA,
    margin: float | None = None,
) -> str:
    """A table of chosen contrasts (each ``label - minus``), Holm-adjusted over these contrasts; with
    ``margin`` (nats) a TOST column: p of "|Δ| >= margin" (below alpha: shown within ±margin)."""
    labels = {m.label for m in result.methods}
    chosen = [c for c in contrasts if c[0] in labels and c[1] in labels]
    stats = [result.contrast(a, b) for a, b, _ in chosen]
    adjusted = holm([s["p"] for s in stats])
    tost_head = f" TOST p (±{margin:g}) |" if margin is not None else ""
    lines = [
        f"| contrast | Δ final loss, 95% CI | p | Holm p | seeds |{tost_head} |",
        "|---|---|---|---|---|" + ("---|" if margin is not None else "") + "---|",
    ]
    for (a, b, what), vs, q in zip(chosen, stats, adjusted, strict=True):
        verdict = "n.s." if q is None or q >= alpha else ("lower" if vs["mean"] < 0 else "higher")
        equivalence = ""
        if margin is not None:
            equivalence = f" {_p(tost(vs['mean'], vs.get('se'), vs.get('df'), margin))} |"
        lines.append(
            f"| {what}: `{a}` - `{b}` | {_ci(vs)} | {_p(vs['p'])} | {_p(q)} | {_agree(vs)} |{equivalence} "
            f"{verdict} |"
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
    if any(r.config.get("until_plateau") or r.config.get("lr_sweep") for r in results.values()):
        return validated_setup_markdown(results)
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


def validated_setup_markdown(results: dict[str, StudyResult]) -> str:
    """The settings of studies that decide on a validation split (plateau rule, learning-rate sweep)."""
    lines = [
        "| study | train text | validation text (windows) | eval text | seeds | batch x seq | stop rule "
        "| learning rates | eval windows (tokens) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        c, d = r.config, r.data
        rule = c.get("until_plateau")
        stop = (
            f"plateau: every {rule['eval_every']} steps, last {rule['window']} evaluations < "
            f"max({rule['tolerance']:g} nats, {rule['noise']:g} SE); at most {rule['max_steps']} steps"
            if rule
            else f"{c['steps']} steps"
        )
        rates = ", ".join(f"{x:g}" for x in c["lr_sweep"]) if c.get("lr_sweep") else f"{c['lr']:g}"
        lines.append(
            f"| {name} | {_text(d['train'], d['train_documents'])} | "
            f"{_text(d['validation'], d['validation_documents'])} ({d['validation_windows']}) | "
            f"{_text(d['eval'], d['eval_documents'])} | {', '.join(map(str, c['seeds']))} | "
            f"{c['batch']} x {c['seq_len']} | {stop} | {rates} | "
            f"{d['eval_windows']} ({d['eval_tokens_scored']:,}) |"
        )
    return "\n".join(lines)


def training_markdown(result: StudyResult) -> str:
    """Per method: the learning rate its sweep chose (each rate's final validation loss on the first
    seed, and the step it stopped at), the steps each seed trained, and how many runs plateaued."""
    lines = [
        "| method | lr chosen | sweep: lr -> validation loss (stop step) | steps per seed | plateaued |",
        "|---|---|---|---|---|",
    ]
    for m in result.methods:
        runs = [r for r in result.runs if r.label == m.label]
        sweep = "; ".join(
            f"{x['lr']:g} -> {x['validation_loss']:.4f} ({x['steps']})" for x in m.lr_sweep or []
        )
        lr = f"{m.lr:g}" if m.lr is not None else f"{result.config['lr']:g}"
        plateaued = sum(bool(r.plateaued) for r in runs)
        lines.append(
            f"| {m.label} | {lr} | {sweep or '-'} | {', '.join(str(r.eval_steps[-1]) for r in runs)} "
            f"| {plateaued}/{len(runs)} |"
        )
    return "\n".join(lines)


def dose_response_markdown(
    result: StudyResult,
    levels: Sequence[tuple[str, str]] = DOSE,
    alpha: float = ALPHA,
    margin: float | None = None,
) -> str:
    """Each sharpness level's final loss, then every step to the next sharper level as a contrast
    (sharper minus the one before; Holm over these steps), and a generated verdict: monotone only
    when every step lowers the loss at Holm p < alpha."""
    labels = {m.label for m in result.methods}
    present = [(a, what) for a, what in levels if a in labels]
    if len(present) < 2:
        return "*Fewer than two sharpness levels in this study.*"
    lines = ["| level | method | final loss ± sd |", "|---|---|---|"]
    for a, what in present:
        m = result.summary(a)
        lines.append(f"| {what} | `{a}` | {m.final_loss:.4f} ± {m.final_loss_std:.4f} |")
    steps = [(b, a, f"{wa} -> {wb}") for (a, wa), (b, wb) in zip(present, present[1:], strict=False)]
    lines += ["", contrasts_markdown(result, steps, alpha, margin)]
    stats = [result.contrast(b, a) for b, a, _ in steps]
    adjusted = holm([x["p"] for x in stats])
    lower = sum(q < alpha and x["mean"] < 0 for x, q in zip(stats, adjusted, strict=True))
    higher = sum(q < alpha and x["mean"] > 0 for x, q in zip(stats, adjusted, strict=True))
    means = [result.summary(a).final_loss for a, _ in present]
    falling = all(y < x for x, y in zip(means, means[1:], strict=False))
    verdict = (
        "monotone: every sharper level ends lower than the one before (Holm p < " + f"{alpha:g})"
        if lower == len(steps)
        else f"not shown monotone: {lower} of {len(steps)} steps lower and {higher} higher at Holm p < "
        f"{alpha:g}; the mean final loss {'falls' if falling else 'does not fall'} at every step"
    )
    return "\n".join([*lines, "", f"* **{len(present)} levels**: {verdict}."])


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


EXPLORATORY = "*Exploratory: not in the primary family the recipe declares.*"


def _study_blocks(
    studies: dict[str, StudyResult], prefix: str, family: PrimaryFamily | None, recipe: str
) -> dict[str, Callable[[], str]]:
    """The blocks of one study set (one recipe's studies), their names prefixed with ``prefix``;
    with the recipe's declared primary family a ``primary`` block, every other table labelled
    exploratory."""
    margin = family.equivalence_margin if family else None
    label = EXPLORATORY if family else "*Exploratory: the recipe declares no primary family.*"
    out: dict[str, Callable[[], str]] = {}
    if studies:
        out[f"{prefix}study-setup"] = lambda: setup_markdown(studies)
        out[f"{prefix}across-studies"] = lambda: label + "\n\n" + "\n".join(across_studies_lines(studies))
        if family:
            out[f"{prefix}primary"] = lambda: primary_markdown(studies, family, recipe)
    for name, r in studies.items():
        out[f"{prefix}study:{name}"] = lambda r=r: (
            label + "\n\n" + study_markdown(r) + "\n\n" + "\n".join(verdict_lines(r, margin=margin))
        )
        out[f"{prefix}errors:{name}"] = lambda r=r: error_markdown(r)
        out[f"{prefix}contrasts:{name}"] = lambda r=r: label + "\n\n" + contrasts_markdown(r, margin=margin)
        out[f"{prefix}alignment:{name}"] = lambda r=r: (
            label + "\n\n" + contrasts_markdown(r, ALIGNMENT_VS_AVERAGE, margin=margin)
        )
        out[f"{prefix}sharpness:{name}"] = lambda r=r: (
            label + "\n\n" + contrasts_markdown(r, SHARPNESS, margin=margin)
        )
        out[f"{prefix}training:{name}"] = lambda r=r: training_markdown(r)
        out[f"{prefix}dose:{name}"] = lambda r=r: label + "\n\n" + dose_response_markdown(r, margin=margin)
    return out


def _study_sets(evidence: Path) -> dict[str, dict[str, StudyResult]]:
    """Every study set under ``evidence`` (``SET/STUDY/study.json``), re-derived with the current
    statistics (a result saved by an older version is still read)."""
    sets = {}
    for folder in sorted(p for p in evidence.iterdir() if p.is_dir()) if evidence.exists() else []:
        studies = {
            p.name: StudyResult.load(p).recompute()
            for p in sorted(folder.iterdir())
            if (p / "study.json").exists()
        }
        if studies:
            sets[folder.name] = studies
    return sets


def blocks(evidence: Path, recipes: Mapping[str, Path] | None = None) -> dict[str, Callable[[], str]]:
    """Every generated block by name, computed from the results stored under ``evidence``: a study
    set is a folder of studies (``SET/STUDY/study.json``); the Table 6 set's blocks are named
    ``study:STUDY`` etc., another set's ``SET:study:STUDY``. ``recipes`` maps a set to the recipe
    that produced it: its declared primary family (if any) gives the set's ``primary`` block."""
    out: dict[str, Callable[[], str]] = {}
    for set_name, studies in _study_sets(evidence).items():
        recipe = (recipes or {}).get(set_name)
        family = load_study_recipe(recipe).primary if recipe else None
        prefix = "" if set_name == "table6" else f"{set_name}:"
        out.update(_study_blocks(studies, prefix, family, f"recipes/{recipe.name}" if recipe else ""))
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


# -- inline values --------------------------------------------------------------------------------
def _range(values: Sequence[float], digits: int) -> str:
    if min(values) < 0:  # signed: "-1.3 to +1.6"
        lo, hi = f"{min(values):+.{digits}f}", f"{max(values):+.{digits}f}"
        return lo if lo == hi else f"{lo} to {hi}"
    lo, hi = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return lo if lo == hi else f"{lo}-{hi}"


def _contrast_value(vs: dict[str, Any], field: str) -> str:
    fields: dict[str, Callable[[], str]] = {
        "abs3": lambda: f"{abs(vs['mean']):.3f}",
        "abs4": lambda: f"{abs(vs['mean']):.4f}",
        "d3": lambda: f"{vs['mean']:+.3f}",
        "d4": lambda: f"{vs['mean']:+.4f}",
        "ci3": lambda: f"[{vs['low']:+.3f}, {vs['high']:+.3f}]",
        "ci4": lambda: f"[{vs['low']:+.4f}, {vs['high']:+.4f}]",
        "absci3": lambda: (
            "[" + ", ".join(f"{x:.3f}" for x in sorted((abs(vs["low"]), abs(vs["high"])))) + "]"
        ),
        "p": lambda: _p(vs["p"]),
        "seeds": lambda: _agree(vs),
    }
    if field not in fields:
        raise KeyError(f"unknown contrast field {field!r} (known: {', '.join(fields)})")
    return fields[field]()


def _gaps(result: StudyResult, a: str, b: str) -> str:
    """A's held-out loss minus B's at each evaluation step (mean over the seeds both ran)."""
    by = {(r.label, r.seed): r for r in result.runs}
    seeds = sorted(s for label, s in by if label == a and (b, s) in by)
    if not seeds:
        raise KeyError(f"no seed with both {a!r} and {b!r}")
    steps = by[a, seeds[0]].eval_steps
    gaps = [
        sum(by[a, s].eval_loss[i] - by[b, s].eval_loss[i] for s in seeds) / len(seeds)
        for i in range(len(steps))
    ]
    return " -> ".join(f"{g:+.3f}" for g in gaps)


def values(evidence: Path) -> Callable[[str], str]:
    """The inline value of a key, from the stored results:

    * ``STUDY|A|B|FIELD``: contrast A minus B (unadjusted) in a Table 6 study, or ``SET/STUDY|...``
      in another set; FIELD one of abs3/abs4 (|Δ|), d3/d4 (signed Δ), ci3/ci4, absci3, p, seeds,
      or gaps (A's held-out loss minus B's at each evaluation step, mean over seeds);
    * ``STUDY|A|start3`` / ``final3``: an arm's mean start / final loss; ``STUDY|base|loss3``;
    * ``STUDY|data|KEY``: a count in the study's ``data`` (e.g. eval_windows);
    * ``diagnose|mlp|KEY|range`` (or ``heads``), ``|zrange``: the range over the layer pairs of a
      score, or of its distance from the random-pairing mean in SDs; ``diagnose|entropy|MODULE|range``
      (normalised entropy)."""
    sets = _study_sets(evidence)

    def study(key: str) -> StudyResult:
        set_name, _, name = key.rpartition("/")
        return sets[set_name or "table6"][name]

    def get(key: str) -> str:
        parts = key.split("|")
        if parts[0] == "diagnose":
            d = _diagnose_result(evidence / "diagnose" / "stories260k.json")
            table, field, how = parts[1:]
            if table == "entropy":
                return _range([p.entropy[field]["entropy_normalized"] for p in d.pairs], 2)
            rows = [getattr(p, table) for p in d.pairs]
            if how == "zrange":
                return _range([(x[field] - x["random_mean"]) / x["random_sd"] for x in rows], 1)
            return _range([x[field] for x in rows], 3)
        r = study(parts[0])
        if parts[1] == "data":  # a count the study recorded (windows, documents)
            return f"{r.data[parts[2]]:,}"
        if len(parts) == 4 and parts[3] == "gaps":
            return _gaps(r, parts[1], parts[2])
        if len(parts) == 4:
            return _contrast_value(r.contrast(parts[1], parts[2]), parts[3])
        arm, field = parts[1:]
        if arm == "base" and field == "loss3":
            return f"{r.base_loss:.3f}"
        m = r.summary(arm)
        return f"{m.initial_loss if field == 'start3' else m.final_loss:.3f}"

    return get


_BLOCK = re.compile(r"(<!-- evidence:(?P<name>[\w:.-]+) -->\n)(?P<body>.*?)(<!-- evidence:end -->)", re.S)
_VALUE = re.compile(r"(<!-- v:(?P<key>[^ ]+) -->)(?P<body>[^\n]*?)(<!-- /v -->)")


def render_document(text: str, evidence: str | Path, recipes: Mapping[str, Path] | None = None) -> str:
    """``text`` with every ``<!-- evidence:NAME -->`` block and every ``<!-- v:KEY -->`` value replaced
    by its generated content. A NAME or KEY with no stored result is an error (a typo would otherwise
    go stale silently)."""
    made = blocks(Path(evidence), recipes)
    value = values(Path(evidence))

    def fill(match: re.Match) -> str:
        name = match.group("name")
        if name not in made:
            raise KeyError(f"docs block {name!r}: no such generated block (known: {', '.join(sorted(made))})")
        return match.group(1) + made[name]().rstrip("\n") + "\n" + match.group(4)

    def fill_value(match: re.Match) -> str:
        key = match.group("key")
        try:
            got = value(key)
        except (KeyError, ValueError, AttributeError, OtdusError) as exc:
            raise KeyError(f"docs value {key!r}: {exc}") from None
        return match.group(1) + got + match.group(4)

    return _VALUE.sub(fill_value, _BLOCK.sub(fill, text))


def strip_generated(text: str) -> str:
    """``text`` without its generated blocks and values: what is written by hand."""
    return _VALUE.sub("", _BLOCK.sub("", text))
