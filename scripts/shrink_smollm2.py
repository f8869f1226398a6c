#!/usr/bin/env python
"""Perplexity of SmolLM2-135M (30 layers) after `otdus shrink` removes 1, 2, 4, 6 and 8 layers, by every
method and variant shrink offers, with Block Influence and angular selection, and with LaCo's own
selection loop; as written (no healing).

Needs `make smollm2` (models/smollm2-135m). Writes docs/shrink-smollm2.json (every per-window loss the
figures come from, the settings and the conditions) and renders docs/shrink-smollm2.md from it, whole;
tests/test_shrink_smollm2.py checks that the document is what the stored JSON renders and recomputes its
figures from the stored losses.

Each shrink is made by the library (otdus_cli.shrink) into a temporary folder under /tmp (deleted once
scored): the drop row of each count and selection measures the selection scores on the first
CALIB_TOKENS tokens of the bundled TinyStories training head; the other methods remove the layers it
chose, named (`--remove`), which is the same layer map without measuring the scores again. Every model
(the source and each shrink) is scored float32 on the CPU on the same windows of WINDOW tokens: the first
WINDOWS windows of the bundled WikiText-2 test text (token protocol), and the first WINDOWS windows of the
last HELD_OUT_STORIES stories of the TinyStories training head (text the selection and OT's calibration do
not read; the bundled TinyStories sample holds three such windows, too few for a paired test). Shrinks
whose weights are byte-identical (selections that chose the same layers) are scored once.

The comparisons (COMPARISONS, declared before anything runs) are paired per-window t tests of the two
models' window losses, Holm-adjusted over the whole family: per count, selection (distinct shrinks once)
and text, every merge against drop, and OT merging against averaging and both LaCo variants; LaCo's own
selection against drop of the same count by Block Influence. The verdict sentences are generated from
those tests by the rules in `verdicts`; the page also reads docs/shrink-ppl.json (the stories260K page)
and compares its verdicts with these.

    python -m scripts.shrink_smollm2              # everything (about 45 minutes at one thread), then the page
    python -m scripts.shrink_smollm2 --render     # the page from the stored JSON (seconds)
    python -m scripts.shrink_smollm2 --smoke --out /tmp/s.md --data /tmp/s.json   # the steps, a few minutes
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
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
    layers,
    outcome,
    paired,
    row,
    window_losses,
    word,
)

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "smollm2-135m"
DOC = ROOT / "docs" / "shrink-smollm2.md"
DATA = ROOT / "docs" / "shrink-smollm2.json"
TOY = ROOT / "docs" / "shrink-ppl.json"
CALIB = "bundled:tinystories-train-2mib"
# The run is cut to fit about 45 minutes at one thread on a 2-core machine shared with other work, where a
# SmolLM2 forward measured about 15 ms a token, not the 4 ms of an idle core: 8 windows of 128 tokens per
# text (the paired tests need windows more than length), and 1024 calibration tokens (shrink's default
# text, the bundled TinyStories sample, gives 512)
CALIB_TOKENS = 1024
WINDOW = 128  # tokens per window
WINDOWS = 8  # windows per text
HELD_OUT_STORIES = 200  # the TinyStories text: the last stories of the training head
COUNTS = (1, 2, 4, 6, 8)
SELECTIONS = ("bi", "angular")
# (label, method, its option group's settings): every method and variant `otdus shrink` offers
METHODS = [
    ("drop", "drop", {}),
    ("average", "average", {}),
    ("laco", "laco", {}),
    ("laco official", "laco", {"variant": "official"}),
    ("ot structured", "ot", {"variant": "structured"}),
    ("ot activation", "ot", {"variant": "activation"}),
]
MERGES = [label for label, method, _ in METHODS if method != "drop"]
OT_LABELS = ("ot structured", "ot activation")
# --select laco: LaCo's loop with its own merge (the paper's formula), capped at the most the page removes,
# once for each merge size C of LACO_MERGES. Threshold, interval and bounds: the released notebook's
# (shrink's defaults). Each merge tried is a pass over the calibration windows and the loop may try every
# layer, so its similarities are measured on the first LACO_CALIB_TOKENS tokens of the calibration text
# (the least shrink takes; the notebook scores five short sentences). The loop's first k kept merges are
# what it keeps with a cap of the layers they remove (below the cap it never skips a merge), so each
# prefix is one row, shrunk with those layers named: the same layer map.
LACO_MERGES = (3, 2)  # C = 2: LaCo's formula makes each merge the upper layer alone (docs/shrink.md)
LACO_CALIB_TOKENS = 512


def laco_label(merge: int) -> str:
    return f"laco, LaCo's selection (C = {merge})"


# what the page tests, each first-minus-second over the same windows, per distinct shrink and text
COMPARISONS = [(m, "drop") for m in MERGES] + [
    (ot, rival) for ot in OT_LABELS for rival in ("average", "laco", "laco official")
]
# LaCo's selection: against drop by Block Influence of as many layers
# --smoke: the same steps on a few windows and counts (what the script does, not figures)
SMOKE: dict[str, Any] = {"windows": 2, "counts": (1,), "laco": {"laco_bottom": 25}}
SELECTION_NAMES = {"bi": "Block Influence", "angular": "angular distance"}


# -- measuring ---------------------------------------------------------------------------------------


def eval_sets(windows: int) -> dict:
    """The two evaluation texts, ``windows`` windows of WINDOW tokens each, tokenized by SmolLM2."""
    from otdus_cli.bundled import BUNDLED_TEXT_FILES
    from otdus_cli.verify.eval_set import make_eval_set
    from otdus_cli.verify.text import text_corpus, wikitext_corpus

    train = text_corpus(BUNDLED_TEXT_FILES[CALIB])
    stories = replace(train, name="tinystories-held-out", documents=train.documents[-HELD_OUT_STORIES:])
    common = {"protocol": "token", "seq_len": WINDOW, "max_tokens": windows * WINDOW}
    sets = {
        "WikiText-2 test": make_eval_set(MODEL, corpus=wikitext_corpus(), **common),
        "TinyStories held out": make_eval_set(MODEL, corpus=stories, **common),
    }
    for name, plan in sets.items():
        if len(plan.windows) != windows:
            raise SystemExit(f"{name}: {len(plan.windows)} windows of {WINDOW} tokens, not {windows}")
    return sets


def options(method: str, group: dict, **how: Any):
    """The ShrinkOptions of one row: ``group`` is the method's option group (e.g. OT's variant)."""
    from otdus_cli.shrink import ShrinkOptions

    groups = {method: group} if group else {}
    return ShrinkOptions(**({"method": method, "calib": CALIB, "calib_tokens": CALIB_TOKENS} | groups | how))


def weights_hash(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as f:
            while block := f.read(1 << 24):
                digest.update(block)
    return digest.hexdigest()


class Scorer:
    """Scores models on the evaluation windows; byte-identical weights are scored once."""

    def __init__(self, evals: dict) -> None:
        self.evals = evals
        self.seen: dict[str, dict[str, list[float]]] = {}

    def __call__(self, folder: Path) -> tuple[dict[str, list[float]], str, bool]:
        key = weights_hash(folder)
        again = key in self.seen
        if not again:
            self.seen[key] = {name: window_losses(folder, plan) for name, plan in self.evals.items()}
        return self.seen[key], key, again


def one(scorer: Scorer, tmp: Path, label: str, select: str, count: int, opts) -> dict:
    """Shrink the source by ``opts`` into ``tmp``, score it, delete it: the row."""
    from otdus_cli.shrink import shrink

    out = tmp / "shrink"
    start = time.time()
    result = shrink(str(MODEL), out, opts)
    shrunk = time.time() - start
    losses, key, again = scorer(out)
    scored = time.time() - start - shrunk
    manifest = result.manifest["shrink"]
    shutil.rmtree(out)
    entry = {
        "label": label,
        "select": select,
        "count": count,
        "removed": manifest["removed"],
        "weights_sha256": key,
        "scored_before": again,  # the same weights as an earlier row: its losses
        "shrink_s": round(shrunk, 1),
        "score_s": round(scored, 1),
        "losses": losses,
    }
    print(
        f"{label}, {select}, {count}: layers {entry['removed']} ({shrunk:.0f} s to shrink, "
        f"{scored:.0f} s to score{', scored before' if again else ''})",
        flush=True,
    )
    return entry


def measure(evals: dict, counts: tuple[int, ...], laco: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    """The source, every shrink (selection x count x method), and LaCo's loops with their rows."""
    scorer = Scorer(evals)
    start = time.time()
    losses, key, _ = scorer(MODEL)
    rows = [
        {
            "label": "none (source)",
            "select": "",
            "count": 0,
            "removed": [],
            "weights_sha256": key,
            "losses": losses,
        }
    ]
    print(f"source scored in {time.time() - start:.0f} s", flush=True)
    with tempfile.TemporaryDirectory(prefix="shrink-smollm2-") as tmp:
        loops = [laco_loop(scorer, Path(tmp), merge, counts, laco) for merge in LACO_MERGES]
        for count in counts:
            for select in SELECTIONS:
                chosen: list[int] = []
                for label, method, group in METHODS:
                    how = {"remove": chosen} if chosen else {"layers": count, "select": select}
                    rows.append(one(scorer, Path(tmp), label, select, count, options(method, group, **how)))
                    chosen = rows[-1]["removed"]
                    same = [r for r in rows if r["count"] == count and r["select"] != select]
                    if label == "drop" and chosen in [r["removed"] for r in same]:
                        # the layers an earlier selection chose: the same shrinks, made and scored once
                        rows += [
                            r | {"select": select, "same_as": r["select"]}
                            for r in same
                            if r["label"] != "drop"
                        ]
                        break
    return rows + [r for loop in loops for r in loop.pop("rows")], loops


def laco_loop(scorer: Scorer, tmp: Path, merge: int, counts: tuple[int, ...], extra: dict[str, Any]) -> dict:
    """LaCo's loop merging ``merge`` layers at a time, capped at max(counts), by the library
    (otdus_cli.shrink.run_laco_selection): every merge it tried, and a row for each prefix of its kept
    merges that removes a count the page has."""
    from otdus_cli.shrink import run_laco_selection
    from otdus_cli.source import open_source

    how = {"layers": max(counts), "select": "laco", "laco_merge": merge, "calib_tokens": LACO_CALIB_TOKENS}
    opts = options("laco", {}, **how, **extra)
    start = time.time()
    trace = run_laco_selection(open_source(str(MODEL)), opts)
    kept = [t for t in trace.tried if t["accepted"]]
    print(f"LaCo's loop, C = {merge}: {len(kept)} of {len(trace.tried)} merges kept", flush=True)
    loop = {
        "merge": merge,
        "settings": trace.settings,
        "calib_tokens": trace.tokens,
        "seconds": round(time.time() - start, 1),
        "tried": trace.tried,
        "rows": [],
    }
    for k in range(1, len(kept) + 1):
        removed = sorted({i for t in kept[:k] for i in t["layers"][1:]})  # a merge keeps its lowest layer
        if len(removed) in counts:
            row = one(
                scorer, tmp, laco_label(merge), "laco", len(removed), options("laco", {}, remove=removed)
            )
            loop["rows"].append(row | {"merges": k})
    return loop


def run(windows: int, counts: tuple[int, ...], laco: dict[str, Any]) -> dict:
    import torch
    import transformers

    torch.set_num_threads(1)
    start, code = time.time(), commit()  # the code that computes the figures: HEAD when they start
    evals = eval_sets(windows)
    rows, loops = measure(evals, counts, laco)
    config = json.loads((MODEL / "config.json").read_text())
    return {
        "conditions": {
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "load_average": round(os.getloadavg()[0], 2),
            "minutes": round((time.time() - start) / 60, 1),
            "commit": code,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "model": "models/smollm2-135m",
        "source_layers": int(config["num_hidden_layers"]),
        "source_dtype": config.get("dtype") or config.get("torch_dtype"),
        "calib": CALIB,
        "calib_tokens": CALIB_TOKENS,
        "counts": list(counts),
        "laco_loops": loops,
        "evals": {
            name: {
                "tokens": sum(len(w.targets) for w in p.windows),
                "windows": len(p.windows),
                "seq_len": WINDOW,
            }
            for name, p in evals.items()
        },
        "held_out_stories": HELD_OUT_STORIES,
        "comparisons": [list(c) for c in COMPARISONS],
        "rows": rows,
    }


# -- rendering (from the stored JSON alone) ------------------------------------------------------------


def _rows(data: dict) -> dict[tuple[str, str, int], dict]:
    return {(r["label"], r["select"], r["count"]): r for r in data["rows"]}


def shrinks(data: dict) -> dict[tuple[int, tuple[int, ...]], str]:
    """Each distinct shrink by a selection, (count, removed layers), with the first selection that chose
    it (selections that chose the same layers made the same models: counted once)."""
    rows = _rows(data)
    return {
        (count, tuple(rows["drop", select, count]["removed"])): select
        for count in data["counts"]
        for select in SELECTIONS
    }


def comparisons(data: dict) -> dict[tuple, dict]:
    """Every declared comparison (the stored ``comparisons``, first minus second) per distinct shrink and
    text, and LaCo's selection against drop by Block Influence at each of its counts: paired per-window t
    tests, p Holm-adjusted over all of them."""
    rows = _rows(data)
    names = list(data["evals"])
    found = {
        (count, removed, a, b, n): paired(
            rows[a, select, count]["losses"][n], rows[b, select, count]["losses"][n]
        )
        for (count, removed), select in shrinks(data).items()
        for a, b in data["comparisons"]
        for n in names
    }
    for r in data["rows"]:  # LaCo's selection against drop of as many layers by Block Influence
        if r["select"] == "laco":
            for n in names:
                found[r["count"], tuple(r["removed"]), r["label"], "drop", n] = paired(
                    r["losses"][n], rows["drop", "bi", r["count"]]["losses"][n]
                )
    return adjust(found)


def _evals_sentence(data: dict) -> str:
    ev = data["evals"]
    return "; ".join(f"{n}: {e['tokens']:,} tokens in {e['windows']} windows" for n, e in ev.items())


def table_lines(data: dict) -> list[str]:
    """The perplexity of the source and of every shrink, one table per selection."""
    names = list(data["evals"])
    rows = _rows(data)
    source = rows["none (source)", "", 0]
    lines: list[str] = []
    for select in SELECTIONS:
        lines += [
            f"### Selected by {SELECTION_NAMES[select]} (`--select {select}`)",
            "",
            f"| removed | layers | method | {' | '.join(names)} |",
            "|---:|---|---|" + "---:|" * len(names),
            row(["0", "", "none (source)", *(cell(source["losses"][n]) for n in names)]),
        ]
        for count in data["counts"]:
            for label, _, _ in METHODS:
                r = rows[label, select, count]
                lines.append(
                    row([str(count), layers(r["removed"]), label, *(cell(r["losses"][n]) for n in names)])
                )
        lines.append("")
    same = [c for c in data["counts"] if len({k[1] for k in shrinks(data) if k[0] == c}) == 1]
    if same:
        lines += [
            "Block Influence and angular distance chose the same layers when removing "
            + ", ".join(map(str, same))
            + " (the same models, scored once).",
            "",
        ]
    return lines


def laco_lines(data: dict) -> list[str]:
    """LaCo's loops: what each tried and kept, and the rows its kept merges make."""
    names = list(data["evals"])
    lines = [
        "LaCo's loop (`--select laco`, docs/shrink.md) with its own merge, the paper's formula, once for "
        "each merge size C, capped at the most layers this page removes; the released notebook's threshold, "
        "interval and bounds. Each merge it tries is a pass over the calibration windows and it may try "
        "every layer, so its similarities are measured on fewer tokens than the scores above. Its first k "
        "kept merges are what it keeps with the cap those merges reach (below its cap it skips no merge), "
        "so each such prefix that removes a count of this page is a row, written by `otdus shrink` with its "
        "layers named (the same layer map) and compared below with dropping as many layers by Block "
        "Influence. With C = 2 LaCo's formula puts the upper layer of each pair in the lower one's place.",
        "",
    ]
    for loop in data["laco_loops"]:
        st, merge = loop["settings"], loop["merge"]
        tried = [t for t in loop["tried"] if t["similarity"] is not None]
        kept = [t for t in tried if t["accepted"]]
        best = max(tried, key=lambda t: t["similarity"])
        lines += [
            f"- `--select laco --method laco --laco-merge {merge} --layers {st['cap']}` (threshold "
            f"{st['threshold']:g}, interval {st['interval']}, from layer {st['top']} down to layer "
            f"{st['bottom']}; similarities on {loop['calib_tokens']} tokens): kept {len(kept)} of the "
            f"{len(tried)} merges it tried; the most similar was layers {layers(best['layers'])} at "
            f"{best['similarity']:.3f}"
            + (
                "; kept, in order: "
                + "; ".join(f"{layers(t['layers'])} ({t['similarity']:.3f})" for t in kept)
                if kept
                else ", so it removes nothing and `otdus shrink` refuses to write"
            )
            + "."
        ]
    rows = [r for r in data["rows"] if r["select"] == "laco"]
    if rows:
        lines += [
            "",
            f"| selection | removed | layers | {' | '.join(names)} |",
            "|---|---:|---|" + "---:|" * len(names),
            *(
                row(
                    [
                        r["label"],
                        str(r["count"]),
                        layers(r["removed"]),
                        *(cell(r["losses"][x]) for x in names),
                    ]
                )
                for r in rows
            ),
        ]
    return lines


def comparison_lines(data: dict, found: dict) -> list[str]:
    names = list(data["evals"])
    lines = [
        "First model's loss minus the second's (nats; negative: the first lower), paired by window: the mean "
        "difference over the windows with its 95% interval, p of a paired t test over the windows, "
        f"Holm-adjusted over all {len(found)} comparisons of this table (declared in "
        '`scripts/shrink_smollm2.py` before the run); "lower"/"higher": p < 0.05 after the adjustment.',
        "",
        "| removed | layers | comparison | " + " | ".join(names) + " |",
        "|---:|---|---|" + "---|" * len(names),
    ]
    pairs = dict.fromkeys((count, removed, a, b) for count, removed, a, b, _ in found)
    for count, removed, a, b in pairs:
        cells = [contrast_cell(found[count, removed, a, b, n]) for n in names]
        lines.append(row([str(count), layers(list(removed)), f"{a} − {b}", *cells]))
    return lines


def tally(found: dict, pair: tuple[str, str], counts=None) -> dict[str, int]:
    """How often the first side's loss is lower, higher or not clearly different (``word``), over the
    comparisons of ``pair`` (at ``counts`` when given)."""
    words = {"lower": 0, "higher": 0, "no clear difference": 0}
    for (count, _, a, b, _), c in found.items():
        if (a, b) == pair and (counts is None or count in counts):
            words[word(c)] += 1
    return words


def _said(a: str, b: str, w: dict[str, int]) -> str:
    total = sum(w.values())
    return (
        f"{outcome(a, b, w['lower'], w['higher'], total)} ({a}'s loss lower in {w['lower']} of {total} "
        f"comparisons, higher in {w['higher']}, no clear difference in {w['no clear difference']})"
    )


def _by_count(found: dict, pair: tuple[str, str], counts) -> str:
    parts = []
    for count in counts:
        w = tally(found, pair, (count,))
        parts.append(
            f"{count} removed: {w['lower']} lower, {w['higher']} higher, {w['no clear difference']} unclear"
        )
    return "; ".join(parts)


def best_merges(data: dict, found: dict) -> list[tuple[int, str, str, dict]]:
    """Per distinct shrink and text, the merge with the lowest mean loss and its comparison with drop:
    (count, text, merge, comparison)."""
    rows = _rows(data)
    out = []
    for (count, removed), select in shrinks(data).items():
        for n in data["evals"]:
            losses = {m: rows[m, select, count]["losses"][n] for m in MERGES}
            best = min(MERGES, key=lambda m: sum(losses[m]))
            out.append((count, n, best, found[count, removed, best, "drop", n]))
    return out


def verdicts(data: dict, found: dict) -> list[str]:
    """The verdict sentences, generated from the comparisons: a side "beats" the other where its loss is
    lower in most comparisons and higher in none (``outcome``), each with its limits beside it."""
    ev = data["evals"]
    windows = " and ".join(f"{e['windows']} windows of {e['seq_len']} tokens of {n}" for n, e in ev.items())
    limits = f"as written, unhealed; one model and calibration text; {windows}; Holm over {len(found)} tests"
    lines = []
    best = best_merges(data, found)
    winners = {m: sum(b == m for _, _, b, _ in best) for m in MERGES}
    against = {w: sum(word(c) == w for *_, c in best) for w in ("lower", "higher", "no clear difference")}
    lines.append(
        "- The best merge against drop: the merge with the lowest loss is "
        + ", ".join(f"{m} in {k}" for m, k in winners.items() if k)
        + f" of the {len(best)} cases (distinct shrink and text); its loss is lower than drop's in "
        f"{against['lower']}, higher in {against['higher']}, not clearly different in "
        f"{against['no clear difference']} ({limits})."
    )
    laco = dict.fromkeys((r["label"], "drop") for r in data["rows"] if r["select"] == "laco")
    for pair in [*(tuple(c) for c in data["comparisons"]), *laco]:
        here = sorted({k[0] for k in found if (k[2], k[3]) == pair})
        if not here:  # LaCo's loop removed no count the page has
            continue
        lines.append(
            f"- {pair[0]} against {pair[1]}: {_said(*pair, tally(found, pair))}; by count: "
            f"{_by_count(found, pair, here)} ({limits})."
        )
    return lines


# the toy's comparisons under this page's labels: its activation variant ran with --solver emd
TOY_LABELS = {"ot activation": "ot activation emd"}


def toy_comparisons(toy: dict, pairs: list[tuple[str, str]]) -> dict[tuple, dict]:
    """``pairs`` on the stories260K page's stored as-written losses (docs/shrink-ppl.json), by this page's
    tests: per distinct shrink and text, paired over the windows, Holm-adjusted over them all."""
    rows = {(r["label"], r["select"], r["count"]): r["losses"] for r in toy["as_written"] if r["count"]}
    distinct = {(r["count"], tuple(r["removed"])): r["select"] for r in toy["as_written"] if r["count"]}
    found = {}
    for (count, removed), select in distinct.items():
        for a, b in pairs:
            for n in toy["evals"]:
                ta, tb = TOY_LABELS.get(a, a), TOY_LABELS.get(b, b)
                found[count, removed, a, b, n] = paired(
                    rows[ta, select, count][n], rows[tb, select, count][n]
                )
    return adjust(found)


def _direction(w: dict[str, int]) -> str:
    """Which side a tally favours: the first, the second, both (mixed) or neither."""
    if w["lower"] and not w["higher"]:
        return "first"
    if w["higher"] and not w["lower"]:
        return "second"
    return "mixed" if w["lower"] else "neither"


def toy_lines(data: dict, found: dict, toy: dict) -> list[str]:
    """The stories260K page's verdicts beside this page's: which hold, which reverse."""
    pairs = [tuple(c) for c in data["comparisons"]]
    theirs = toy_comparisons(toy, pairs)
    toy_counts = sorted({k[0] for k in theirs})
    lines = [
        f"The same comparisons on the bundled stories260K ({toy['source_layers']} layers; "
        f"[shrink-ppl.md](shrink-ppl.md), removing {' and '.join(map(str, toy_counts))} layers), recomputed "
        "here from the window losses stored in `docs/shrink-ppl.json` by this page's tests and rules (Holm "
        f"over its {len(theirs)} tests), beside this page's, over all counts and only over the counts the "
        "toy has. A verdict holds where both favour the same side, reverses where they favour opposite "
        "sides, is undecided in both where neither favours a side, and differs otherwise (one favours a "
        "side, the other is mixed or unclear). The toy's activation variant used `--solver emd`, this "
        "page's the default solver (sinkhorn); the toy's TinyStories text is the bundled sample, this "
        "page's held-out stories of the training head.",
        "",
        "| comparison | stories260K | SmolLM2-135M, "
        + f"{' and '.join(map(str, toy_counts))} removed | SmolLM2-135M, all counts | toy against SmolLM2, "
        f"{' and '.join(map(str, toy_counts))} removed | toy against SmolLM2, all counts |",
        "|---|---|---|---|---|---|",
    ]
    statuses: dict[str, list[str]] = {status: [] for status in STATUSES}
    for pair in pairs:
        t, few, every = tally(theirs, pair), tally(found, pair, toy_counts), tally(found, pair)
        both = [_status(_direction(t), _direction(w)) for w in (few, every)]
        statuses[both[0]].append(f"{pair[0]} − {pair[1]}")
        lines.append(row([f"{pair[0]} − {pair[1]}", *(_brief(*pair, w) for w in (t, few, every)), *both]))
    lines += [
        "",
        f"Of these {len(pairs)} verdicts, at the counts both models have: "
        + "; ".join(f"{len(v)} {k}" + (f" ({', '.join(v)})" if v else "") for k, v in statuses.items())
        + ".",
    ]
    return lines


STATUSES = ("holds", "reverses", "differs", "undecided in both")


def _status(toy: str, real: str) -> str:
    """How a toy verdict fares on the real network (``_direction`` of each): it holds where both favour
    the same side, reverses where they favour opposite sides, is undecided in both where neither favours
    a side, and differs otherwise (one favours a side, the other is mixed or unclear)."""
    if toy == real and toy in ("first", "second"):
        return "holds"
    if {toy, real} == {"first", "second"}:
        return "reverses"
    if {toy, real} <= {"mixed", "neither"}:
        return "undecided in both"
    return "differs"


def _brief(a: str, b: str, w: dict[str, int]) -> str:
    """A tally in a table cell: what it says, and its lower / higher / unclear counts."""
    total = sum(w.values())
    return (
        f"{outcome(a, b, w['lower'], w['higher'], total)} ({w['lower']} lower, {w['higher']} higher, "
        f"{w['no clear difference']} unclear, of {total})"
    )


def render(data: dict, toy: dict) -> str:
    """docs/shrink-smollm2.md from the stored JSON (and the stories260K page's, for the comparison)."""
    c = data["conditions"]
    first = next(iter(data["evals"].values()))
    found = comparisons(data)
    variants = ", ".join(f"`{label}`" for label, _, _ in METHODS)
    lines = [
        f"# Shrinking SmolLM2-135M: perplexity after removing 1 to {max(data['counts'])} layers",
        "",
        "Generated by `python -m scripts.shrink_smollm2` (`make shrink-smollm2`; do not edit by hand; "
        "`python -m scripts.shrink_smollm2 --render` rewrites it from `docs/shrink-smollm2.json`) on "
        f"{c['date']}, {c['machine']} CPU ({c['cpus']} cores, {c['threads']} thread), float32, torch "
        f"{c['torch']}, transformers {c['transformers']}, load average {c['load_average']:.1f} when it "
        f"finished ({c['minutes']:.0f} min; the figures do not depend on the load), code at commit "
        f"`{c['commit']}`.",
        "",
        f"SmolLM2-135M ({data['source_layers']} layers, stored {data['source_dtype']}; `make smollm2` builds "
        f"`{data['model']}`) shrunk by `otdus shrink` (the library, `otdus_cli.shrink`) by every method and "
        f"variant it offers ({variants}; `ot` with its default solver), removing "
        f"{', '.join(map(str, data['counts']))} layers chosen by Block Influence and by angular distance, "
        f"both measured on the first {data['calib_tokens']} tokens of `{data['calib']}`, and by LaCo's own "
        "selection loop. Every model is scored on the same windows, as written (no healing): token "
        f"perplexity, float32 on the CPU, {_evals_sentence(data)} (WikiText-2: the first windows of the "
        f"bundled test text; TinyStories: the first windows of the last {data['held_out_stories']} stories "
        "of the bundled training head, which neither the selection nor OT's calibration reads). Each "
        "perplexity carries a 95% interval over the windows (normal approximation over the windows' mean "
        "losses); the comparisons below are paired tests, not these intervals. The run was cut to fit about "
        f"45 minutes at one thread on a 2-core machine shared with other work: {first['windows']} windows of "
        f"{first['seq_len']} tokens per text rather than 16 of 256, and {data['calib_tokens']:,} calibration "
        "tokens rather than 4,096; every method, selection and count was kept.",
        "",
        "## As written",
        "",
        *table_lines(data),
        "## LaCo's selection",
        "",
        *laco_lines(data),
        "",
        "## Paired comparisons",
        "",
        *comparison_lines(data, found),
        "",
        "## Verdict",
        "",
        "Generated from the comparisons above by the rules in `scripts/shrink_smollm2.py` (`verdicts`): a "
        "side beats the other where its loss is lower in most comparisons and higher in none; each count "
        "tallies both selections' distinct shrinks and both texts.",
        "",
        *verdicts(data, found),
        "",
        "## Against the toy",
        "",
        *toy_lines(data, found, toy),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--render", action="store_true", help="only render the document from the stored JSON")
    ap.add_argument("--out", type=Path, default=DOC)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="every step on a few windows and counts, to check the script (meaningless figures; "
        "give --out, --data)",
    )
    args = ap.parse_args()
    if args.smoke and (args.out == DOC or args.data == DATA):
        ap.error("--smoke writes elsewhere: give --out and --data")
    if not args.render:
        if not (MODEL / "config.json").is_file():
            raise SystemExit(f"{MODEL} holds no model: run `make smollm2` first")
        if args.smoke:
            data = run(SMOKE["windows"], SMOKE["counts"], SMOKE["laco"])
        else:
            data = run(WINDOWS, COUNTS, {})
        args.data.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {args.data}")
    args.out.write_text(render(json.loads(args.data.read_text()), json.loads(TOY.read_text())))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
