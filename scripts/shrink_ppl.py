#!/usr/bin/env python
"""Perplexity of stories260K after `otdus shrink` removes 1 and 2 layers, by every method and selection,
as written and after a short healing run with `otdus study`'s shrink arms.

Writes docs/shrink-ppl.json (every loss the figures come from, the settings and the conditions) and
renders docs/shrink-ppl.md from it, whole; tests/test_shrink_ppl.py checks that the document is what
the stored JSON renders.

As written: each shrink is made by the library (otdus_cli.shrink), scored on the bundled WikiText-2
test text (token protocol, windows of 256, the first --wikitext-tokens tokens) and the bundled
TinyStories sample (all of it), float32 on the CPU, with a 95% interval on each perplexity from the
spread of the per-window mean losses (normal approximation over windows; windows, not tokens, are the
independent units). Methods are compared by paired tests: every shrink is scored on the same windows,
so OT merging minus a rival is a per-window loss difference, tested by a paired t test over the windows
and Holm-adjusted over every comparison the verdict reads. The selection scores are measured on other
text than either evaluation: the first 4096 tokens of the bundled TinyStories training head.

Healed: for each count and each distinct set of layers the selections chose, `otdus_cli.study.study`
with one `shrink:` arm per method (the selection an arm setting) trains every parameter of each shrunk
model on the bundled TinyStories training head until its validation loss plateaus (study_settings'
plateau rule), over several seeds (HEALING, at least 3), and scores each of the two texts before and
after (its own windows: every window of the sample, evenly spread windows of WikiText); the healed
perplexity intervals are the study's (seeds crossed with windows), the comparisons seed-level tests: each
seed's mean loss difference over the windows, a paired t test over the seeds, Holm-adjusted. The studies
run in --workers processes.

    python -m scripts.shrink_ppl              # everything (minutes on 2 cores), then the document
    python -m scripts.shrink_ppl --render     # the document from the stored JSON (seconds)
    python -m scripts.shrink_ppl --smoke --out /tmp/s.md --data /tmp/s.json   # the steps, in a minute
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from scripts.measuring import commit
from scripts.paired_windows import (
    adjust,
    cell,
    contrast_cell,
    interval,  # noqa: F401 - tests/test_shrink_ppl.py reads it here
    layers,
    outcome,
    paired,
    row,
    window_losses,
    word,
)

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "shrink-ppl.md"
DATA = ROOT / "docs" / "shrink-ppl.json"
CALIB = "bundled:tinystories-train-2mib"
CALIB_TOKENS = 4096
COUNTS = (1, 2)
SELECTIONS = ("bi", "angular")
# (label, method, its option group's settings); ot: the variants a shrink merges with
METHODS = [
    ("drop", "drop", {}),
    ("average", "average", {}),
    ("laco", "laco", {}),
    ("laco official", "laco", {"variant": "official"}),
    ("ot structured", "ot", {"variant": "structured"}),
    ("ot activation emd", "ot", {"variant": "activation", "solver": "emd"}),
]
OT_LABELS = ("ot structured", "ot activation emd")
RIVALS = ("drop", "laco", "laco official")  # what the verdict weighs OT merging against
# the healing run: StudySettings fields (every parameter trained: a shrink adds no layer to train alone)
HEALING: dict[str, Any] = {
    "seeds": [0, 1, 2],  # seed-level tests: at least 3
    "lr": 5e-4,
    "until_plateau": {"eval_every": 15, "window": 3, "tolerance": 0.002, "noise": 2.0, "max_steps": 600},
    "batch": 4,
    "seq_len": 128,
    "validation_fraction": 0.05,
    "validation_windows": 32,
    "warmup": 0.05,
    "train_new_only": False,
    "eval_attention": "sdpa",
    "device": "cpu",
    "threads": 1,
}
# --smoke: the same steps in seconds (what the script does, not figures)
SMOKE: dict[str, Any] = {
    "seeds": [0, 1, 2],
    "until_plateau": {"eval_every": 2, "window": 1, "max_steps": 4},
    "validation_windows": 4,
    "max_train_windows": 64,
}
HEAL_TRAIN = "bundled:tinystories-train-2mib"
# the healed models' evaluation texts, each with its own StudySettings over HEALING
HEAL_EVALS = {
    "WikiText-2 test": ("bundled:wikitext-test", {"eval_windows": 128}),
    "TinyStories sample": ("bundled:tinystories-sample", {"eval_windows": "all"}),
}


# -- measuring ---------------------------------------------------------------------------------------


def eval_sets(wikitext_tokens: int) -> dict:
    from otdus_cli.bundled import BUNDLED_TEXT_FILES, STORIES260K
    from otdus_cli.verify.eval_set import make_eval_set
    from otdus_cli.verify.text import text_corpus, wikitext_corpus

    sample = replace(text_corpus(BUNDLED_TEXT_FILES["bundled:tinystories-sample"]), name="tinystories-sample")
    common = {"protocol": "token", "seq_len": 256}
    return {
        "WikiText-2 test": make_eval_set(
            STORIES260K, corpus=wikitext_corpus(), max_tokens=wikitext_tokens, **common
        ),
        "TinyStories sample": make_eval_set(STORIES260K, corpus=sample, **common),
    }


def shrink_options(method: str, removed: int, select: str, group: dict):
    """The shrink of one row: ``group`` is the method's option group (e.g. OT's variant)."""
    from otdus_cli.shrink import ShrinkOptions

    groups = {method: group} if group else {}
    return ShrinkOptions(
        method=method, layers=removed, select=select, calib=CALIB, calib_tokens=CALIB_TOKENS, **groups
    )


def measure_as_written(evals: dict, tmp: Path) -> list[dict]:
    """The source and every shrink (method x selection x count): removed layers, window losses."""
    from otdus_cli.bundled import STORIES260K
    from otdus_cli.shrink import shrink

    rows = [{"label": "none (source)", "select": "", "count": 0, "removed": [], "losses": {}}]
    rows[0]["losses"] = {name: window_losses(STORIES260K, p) for name, p in evals.items()}
    for count in COUNTS:
        for select in SELECTIONS:
            for label, method, ot in METHODS:
                out = tmp / f"{label}-{select}-{count}".replace(" ", "-")
                result = shrink(str(STORIES260K), out, shrink_options(method, count, select, ot))
                removed = result.manifest["shrink"]["removed"]
                losses = {name: window_losses(out, p) for name, p in evals.items()}
                rows.append(
                    {"label": label, "select": select, "count": count, "removed": removed, "losses": losses}
                )
                print(f"as written: {label}, {select}, {count} removed: layers {removed}", flush=True)
    return rows


def heal_one(count: int, select: str, name: str, healing: dict[str, Any]) -> dict:
    """The study of one count's shrinks (selected by ``select``) scored on evaluation text ``name``:
    every method's shrink healed on the same batches, scored before and after."""
    import torch

    from otdus_cli.study import RunSpec, study

    torch.set_num_threads(1)
    text, settings = HEAL_EVALS[name]

    def progress(event) -> None:
        if event.kind == "run":
            where = f"{count} removed, {name}"
            print(
                f"  {where}: {event.run}/{event.runs} {event.label} seed {event.seed}: step {event.step}",
                flush=True,
            )

    arms = [RunSpec(label, shrink_options(m, count, select, ot)) for label, m, ot in METHODS]
    result = study(
        "bundled:stories260k",
        HEAL_TRAIN,
        text,
        methods=arms,
        reference=OT_LABELS[0],
        progress=progress,
        **(healing | settings),
    ).to_dict()
    for r in result["runs"]:
        r["train_loss"] = []  # per-step training losses: not rendered, and long
    return result


def heal(rows: list[dict], healing: dict[str, Any], workers: int) -> list[dict]:
    """One study per count, distinct set of removed layers (selections that chose the same layers
    share it) and evaluation text, ``workers`` processes at a time (the runs are single-threaded)."""
    from concurrent.futures import ProcessPoolExecutor

    groups = []
    for count in COUNTS:
        chosen: dict[tuple[int, ...], list[str]] = {}
        for select in SELECTIONS:
            removed = next(r["removed"] for r in rows if r["count"] == count and r["select"] == select)
            chosen.setdefault(tuple(removed), []).append(select)
        groups += [(count, list(removed), selects) for removed, selects in chosen.items()]
    jobs = [(count, selects[0], name, healing) for count, _, selects in groups for name in HEAL_EVALS]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        done = list(pool.map(heal_one, *zip(*jobs, strict=True)))
    results = dict(zip(((j[0], j[1], j[2]) for j in jobs), done, strict=True))
    return [
        {
            "count": count,
            "removed": removed,
            "selections": selects,
            "results": {name: results[count, selects[0], name] for name in HEAL_EVALS},
        }
        for count, removed, selects in groups
    ]


def run(wikitext_tokens: int, healing: dict[str, Any], workers: int) -> dict:
    import torch

    from otdus_cli.study_settings import study_settings

    torch.set_num_threads(1)
    start, code = time.time(), commit()  # the code that computes the figures: HEAD when they start
    evals = eval_sets(wikitext_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure_as_written(evals, Path(tmp))
    healed = heal(rows, healing, workers)
    return {
        "conditions": {
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "load_average": round(os.getloadavg()[0], 2),
            "minutes": round((time.time() - start) / 60, 1),
            "commit": code,
            "torch": torch.__version__,
        },
        "calib": CALIB,
        "calib_tokens": CALIB_TOKENS,
        "source_layers": _depth(),
        "evals": {
            name: {
                "tokens": sum(len(w.targets) for w in p.windows),
                "windows": len(p.windows),
                "seq_len": 256,
            }
            for name, p in evals.items()
        },
        "as_written": rows,
        "healing": {
            "train": HEAL_TRAIN,
            "settings": study_settings(healing).model_dump(),  # every setting, defaults included
            "evals": HEAL_EVALS,
            "studies": healed,
        },
    }


def _depth() -> int:
    from otdus_cli.bundled import STORIES260K

    return int(json.loads((Path(STORIES260K) / "config.json").read_text())["num_hidden_layers"])


# -- rendering (from the stored JSON alone) ------------------------------------------------------------


def written_comparisons(data: dict) -> dict[tuple, dict]:
    """Every OT variant against each rival as written, per distinct shrink (count, removed layers) and
    text, paired over the windows; p Holm-adjusted over all of them (the family the verdict reads)."""
    names = list(data["evals"])
    rows = [r for r in data["as_written"] if r["count"]]
    by = {(r["label"], r["select"], r["count"]): r["losses"] for r in rows}
    distinct = {(r["count"], tuple(r["removed"])): r["select"] for r in rows}
    found = {
        (count, removed, ot, rival, n): paired(by[ot, select, count][n], by[rival, select, count][n])
        for (count, removed), select in distinct.items()
        for ot in OT_LABELS
        for rival in RIVALS
        for n in names
    }
    return adjust(found)


def written_tally(data: dict) -> dict[str, dict[str, int]]:
    """How often OT merging's loss is lower, higher or not clearly different from each rival's as
    written (written_comparisons' words)."""
    tally = {rival: {"lower": 0, "higher": 0, "no clear difference": 0} for rival in RIVALS}
    for (_, _, _, rival, _), c in written_comparisons(data).items():
        tally[rival][word(c)] += 1
    return tally


def written_lines(data: dict) -> list[str]:
    """The as-written table and its verdict lines."""
    names = list(data["evals"])
    rows = data["as_written"]
    ev = data["evals"]
    lines = [
        f"The bundled stories260K ({data['source_layers']} layers) shrunk by `otdus shrink` with each method "
        f"and selection, scores measured on the first {data['calib_tokens']} tokens of `{data['calib']}`; "
        "token perplexity with a 95% interval (normal approximation over the windows' mean losses), "
        f"windows of {ev[names[0]]['seq_len']} tokens: "
        + "; ".join(f"{n}: {ev[n]['tokens']:,} tokens in {ev[n]['windows']} windows" for n in names)
        + ". The ot rows use `--ot-variant structured` (the default) and `activation` with `--solver emd` "
        "(the variants a shrink merges with); `laco` is the paper's formula, `laco official` the released "
        "notebooks' variant. LaCo's merge of one layer into its kept neighbour is the removed layer itself "
        "(theta_l + (theta_{l+1} - theta_l)), so with 1 removed the laco row is the model without the kept "
        "layer, and laco official, whose projections are the removed layer's, differs from it only in the "
        "kept layer's norms.",
        "",
        f"| method | selection (layers removed) | removed | {' | '.join(names)} |",
        "|---|---|---|" + "---:|" * len(names),
    ]
    for r in rows:
        sel = f"{r['select']} ({r['count']})" if r["count"] else ""
        cells = " | ".join(cell(r["losses"][n]) for n in names)
        lines.append(f"| {r['label']} | {sel} | {layers(r['removed'])} | {cells} |")
    comparisons = written_comparisons(data)
    lines += [
        "",
        "Loss of OT merging minus its rivals' as written (nats; negative: OT lower), paired by window: the "
        "mean difference over the windows with its 95% interval, p of a paired t test over the windows, "
        f"Holm-adjusted over all {len(comparisons)} comparisons of this table:",
        "",
        "| removed | comparison | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    shrinks = dict.fromkeys((count, removed) for count, removed, *_ in comparisons)
    for count, removed in shrinks:
        for ot in OT_LABELS:
            for rival in RIVALS:
                cells = [contrast_cell(comparisons[count, removed, ot, rival, n]) for n in names]
                lines.append(f"| {layers(list(removed))} | {ot} − {rival} | {' | '.join(cells)} |")
    same = [c for c in COUNTS if len({tuple(r["removed"]) for r in rows if r["count"] == c}) == 1]
    if same:
        lines += [
            "",
            "Block Influence and angular distance chose the same layers when removing "
            + " and ".join(map(str, same))
            + ", so those rows repeat each other.",
        ]
    return lines


def _healed_interval(result, label: str) -> tuple[float, float, float]:
    """Healed perplexity of an arm and its 95% interval (seeds crossed with windows, study.stats)."""
    from otdus_cli.study.stats import crossed_mean_ci

    table = [r.final_window_loss for r in result.runs if r.label == label]
    ci = crossed_mean_ci(table)
    return math.exp(ci["mean"]), math.exp(ci["low"]), math.exp(ci["high"])


def _stop_tokens(result, label: str) -> tuple[float, int, int]:
    """Mean tokens of healing text an arm's runs saw before they stopped, how many reached the plateau
    rule, and how many runs."""
    runs = [r for r in result.runs if r.label == label]
    per_step = result.config["batch"] * result.config["seq_len"]
    tokens = sum(r.eval_steps[-1] * per_step for r in runs) / len(runs)
    return tokens, sum(bool(r.plateaued) for r in runs), len(runs)


def seed_contrast(result, label: str, rival: str) -> dict:
    """``label``'s healed loss minus ``rival``'s, tested at the seed level: each seed's mean difference
    over the windows (the runs of one seed share their batches), a paired t test over the seeds."""
    from otdus_cli.study.stats import crossed_mean_ci

    final = {(r.label, r.seed): r.final_window_loss for r in result.runs}
    per_seed = []
    for seed in (int(x) for x in result.config["seeds"]):
        diffs = [x - y for x, y in zip(final[label, seed], final[rival, seed], strict=True)]
        per_seed.append([sum(diffs) / len(diffs)])
    return crossed_mean_ci(per_seed)


def _contrasts(result) -> dict[tuple[str, str], dict]:
    """Each OT variant's healed loss minus each rival's (seed_contrast), Holm-adjusted over these
    comparisons (the family the verdict reads)."""
    from otdus_cli.study.stats import holm

    pairs = [(ot, rival) for ot in OT_LABELS for rival in RIVALS]
    found = {pair: seed_contrast(result, *pair) for pair in pairs}
    for pair, q in zip(pairs, holm([found[p]["p"] for p in pairs]), strict=True):
        found[pair]["p_holm"] = q
    return found


def healed_lines(data: dict) -> tuple[list[str], list[str]]:
    """The healing tables and the verdict lines they support."""
    from otdus_cli.study.results import StudyResult

    healing = data["healing"]
    s = healing["settings"]
    rule = s["until_plateau"]
    names = list(healing["evals"])
    arms = ", ".join(f"`shrink:{m}`" for m in dict.fromkeys(m for _, m, _ in METHODS))
    lines = [
        f"Each shrink above, healed by `otdus study` with shrink arms ({arms}; the ot and laco arms in the "
        "variants of the table above, the selection an arm setting): every parameter trained with AdamW at "
        f"learning rate {s['lr']:g} on `{healing['train']}` (windows of {s['seq_len']} tokens, batches of "
        f"{s['batch']}, the same batches for every arm), until the validation loss (the last "
        f"{s['validation_fraction']:.0%} of the training stories, {s['validation_windows']} windows) "
        f"plateaus: evaluated every {rule['eval_every']} steps, stopped when the last {rule['window']} "
        f"evaluations improved on the one before them by less than max({rule['tolerance']:g} nats, "
        f"{rule['noise']:g} paired standard errors), at most {rule['max_steps']} steps; seeds "
        f"{', '.join(map(str, s['seeds']))}. Each text is scored before and after healing in windows of "
        f"{s['seq_len']} tokens of its own ("
        + "; ".join(f"{n}: {_study(healing, 0, n).data['eval_windows']} windows" for n in names)
        + "), so the before column differs from the table above, which scores windows of a different length. "
        "Perplexity after healing with a 95% interval over seeds crossed with windows; the source's "
        "perplexity on the same windows for scale.",
    ]
    tally = {rival: {"lower": 0, "higher": 0, "no clear difference": 0} for rival in RIVALS}
    needed: dict[str, list[float]] = {}
    stopped = (0, 0)  # runs the plateau rule stopped, runs
    for st in healing["studies"]:
        results = {n: StudyResult.from_dict(st["results"][n]) for n in names}
        first = results[names[0]]
        lines += [
            "",
            f"### {st['count']} removed: layers {layers(st['removed'])} "
            f"({' and '.join(st['selections'])} selection)",
            "",
            "| arm | "
            + " | ".join(f"{n} before | {n} healed" for n in names)
            + " | healing text (tokens, mean over seeds) | runs stopped by the plateau rule |",
            "|---|" + "---:|---:|" * len(names) + "---:|---:|",
            row(
                ["source", *(c for n in names for c in (f"{math.exp(results[n].base_loss):.2f}", "")), "", ""]
            ),
        ]
        for label, _, _ in METHODS:
            cells = []
            for n in names:
                before = math.exp(results[n].summary(label).initial_loss)
                ppl, low, high = _healed_interval(results[n], label)
                cells += [f"{before:.2f}", f"{ppl:.2f} [{low:.2f}, {high:.2f}]"]
            stops = [_stop_tokens(results[n], label)[0] for n in names]  # the same runs, scored twice
            tokens, plateaued, runs = _stop_tokens(first, label)
            shown = f"{tokens:,.0f}" if len(set(stops)) == 1 else " / ".join(f"{t:,.0f}" for t in stops)
            needed.setdefault(label, []).append(tokens)
            stopped = (stopped[0] + plateaued, stopped[1] + runs)
            lines.append(row([label, *cells, shown, f"{plateaued} of {runs}"]))
        lines += [
            "",
            "Healed loss of OT merging minus its rivals' (nats; negative: OT lower), tested at the seed "
            "level: each seed's mean difference over the windows, the mean over the seeds with its 95% "
            f"interval, p of a paired t test over the {len(s['seeds'])} seeds, Holm-adjusted over these "
            f"{len(OT_LABELS) * len(RIVALS)} comparisons:",
            "",
            "| comparison | " + " | ".join(names) + " |",
            "|---|" + "---|" * len(names) + "",
        ]
        contrasts = {n: _contrasts(results[n]) for n in names}
        for ot in OT_LABELS:
            for rival in RIVALS:
                cells = []
                for n in names:
                    c = contrasts[n][ot, rival]
                    tally[rival][word(c)] += 1
                    cells.append(contrast_cell(c))
                lines.append(f"| {ot} − {rival} | {' | '.join(cells)} |")
    verdict = [
        f"- After healing, OT merging against {rival}: "
        f"{outcome('OT merging', rival, words['lower'], words['higher'], sum(words.values()))} "
        f"(OT's loss lower in {words['lower']} of {sum(words.values())} comparisons, higher in "
        f"{words['higher']}, no clear difference in {words['no clear difference']}; paired over the seeds, "
        "p < 0.05 after Holm's adjustment within each table)."
        for rival, words in tally.items()
    ]
    mean_needed = {label: sum(v) / len(v) for label, v in needed.items()}
    ot_needed = sum(mean_needed[ot] for ot in OT_LABELS) / len(OT_LABELS)
    cap = rule["max_steps"] * s["batch"] * s["seq_len"]
    verdict.append(
        "- Text the healing needed (tokens of training text until the plateau rule stopped it, mean over "
        f"seeds and shrinks): OT merging {ot_needed:,.0f}, "
        + ", ".join(f"{label} {t:,.0f}" for label, t in mean_needed.items() if label not in OT_LABELS)
        + f"; {stopped[0]} of {stopped[1]} runs reached the plateau, the others ran to the cap of {cap:,} "
        "tokens with their validation loss still falling by more than the rule's noise floor (for them the "
        "figure is a lower bound)."
    )
    return lines, verdict


def _study(healing: dict, k: int, name: str):
    from otdus_cli.study.results import StudyResult

    return StudyResult.from_dict(healing["studies"][k]["results"][name])


def render(data: dict) -> str:
    """docs/shrink-ppl.md from the stored JSON."""
    c = data["conditions"]
    healed, verdict = healed_lines(data)
    lines = [
        "# Shrinking stories260K: perplexity after removing layers, as written and healed",
        "",
        "Generated by `python -m scripts.shrink_ppl` (do not edit by hand; `python -m scripts.shrink_ppl "
        f"--render` rewrites it from `docs/shrink-ppl.json`) on {c['date']}, {c['machine']} CPU "
        f"({c['cpus']} cores), float32, torch {c['torch']}, load average {c['load_average']:.1f} when it "
        f"finished ({c['minutes']:.0f} min; the figures do not depend on the load), code at commit "
        f"`{c['commit']}`.",
        "",
        "## As written",
        "",
        *written_lines(data),
        "",
        "## After healing",
        "",
        *healed,
        "",
        "## Verdict",
        "",
        "Generated from the tables above, over both OT variants, both texts and every distinct shrink "
        "(selections that chose the same layers counted once):",
        "",
        *(
            f"- As written, OT merging against {rival}: "
            f"{outcome('OT merging', rival, w['lower'], w['higher'], sum(w.values()))} "
            f"(OT's loss lower in {w['lower']} of {sum(w.values())} comparisons, higher in "
            f"{w['higher']}, no clear difference in {w['no clear difference']}; paired over the windows, "
            "p < 0.05 after Holm's adjustment over the table)."
            for rival, w in written_tally(data).items()
        ),
        *verdict,
        "",
        f"A {data['source_layers']}-layer model is a toy for this: each layer is a sizeable share of the "
        "depth, and the healing text is the model's own training distribution.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--render", action="store_true", help="only render the document from the stored JSON")
    ap.add_argument("--out", type=Path, default=DOC)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--wikitext-tokens", type=int, default=32768)
    ap.add_argument("--workers", type=int, default=2, help="healing studies run at once (one core each)")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="every step with tiny settings, to check the script (meaningless figures; give --out, --data)",
    )
    args = ap.parse_args()
    if args.smoke and (args.out == DOC or args.data == DATA):
        ap.error("--smoke writes elsewhere: give --out and --data")
    if not args.render:
        healing = HEALING | SMOKE if args.smoke else HEALING
        data = run(2048 if args.smoke else args.wikitext_tokens, healing, args.workers)
        args.data.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {args.data}")
    args.out.write_text(render(json.loads(args.data.read_text())))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
