#!/usr/bin/env python
"""Perplexity of stories260K after `otdus shrink` removes 1 and 2 layers, by every method and selection.

Writes docs/shrink-ppl.md whole (the table, the conditions and the command): each shrink is written by
the library (otdus_cli.shrink), scored on the bundled WikiText-2 test text (token protocol, windows of
256, the first --wikitext-tokens tokens) and the bundled TinyStories sample (all of it), float32 on the
CPU, with a 95% interval on each perplexity from the spread of the per-window mean losses (normal
approximation over windows; windows, not tokens, are the independent units). The selection scores are
measured on other text than either evaluation: the first 4096 tokens of the bundled TinyStories
training head.

    python -m scripts.shrink_ppl                 # ~10 minutes on 2 busy cores
    python -m scripts.shrink_ppl --out /tmp/x.md
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from otdus_cli.bundled import BUNDLED_TEXT_FILES, STORIES260K
from otdus_cli.shrink import ShrinkOptions, shrink
from otdus_cli.verify.eval_set import make_eval_set
from otdus_cli.verify.metrics import EvalSet
from otdus_cli.verify.streaming import StreamedModel
from otdus_cli.verify.text import text_corpus, wikitext_corpus

ROOT = Path(__file__).resolve().parent.parent
CALIB = "bundled:tinystories-train-2mib"
# (label, method, OT options)
METHODS = [
    ("drop", "drop", {}),
    ("average", "average", {}),
    ("laco", "laco", {}),
    ("ot paper", "ot", {"variant": "paper"}),
    ("ot structured", "ot", {"variant": "structured"}),
]


def window_losses(folder: Path, plan: EvalSet) -> list[float]:
    """Mean token loss of every window (natural log), the model streamed layer by layer."""
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


def plans(wikitext_tokens: int) -> dict[str, EvalSet]:
    sample = replace(text_corpus(BUNDLED_TEXT_FILES["bundled:tinystories-sample"]), name="tinystories-sample")
    common = {"protocol": "token", "seq_len": 256}
    return {
        "WikiText-2 test": make_eval_set(
            STORIES260K, corpus=wikitext_corpus(), max_tokens=wikitext_tokens, **common
        ),
        "TinyStories sample": make_eval_set(STORIES260K, corpus=sample, **common),
    }


def cell(losses: list[float]) -> str:
    ppl, low, high = interval(losses)
    return f"{ppl:.2f} [{low:.2f}, {high:.2f}]"


def compare(a: list[float], b: list[float]) -> str:
    """How perplexity interval ``a`` stands against ``b``: lower, higher, or overlapping."""
    _, a_low, a_high = interval(a)
    _, b_low, b_high = interval(b)
    if a_high < b_low:
        return "lower"
    if a_low > b_high:
        return "higher"
    return "overlapping"


def verdicts(results: dict[tuple[str, str, int], list[list[float]]], names: list[str]) -> list[str]:
    """Per selection and count: the better OT variant (by WikiText) against drop and LaCo, text by text."""
    lines = []
    for select, removed in sorted({(k[1], k[2]) for k in results}, key=lambda x: (x[1], x[0])):
        ot = min(("ot paper", "ot structured"), key=lambda m: interval(results[m, select, removed][0])[0])
        parts = []
        for other in ("drop", "laco"):
            said = [
                f"{compare(results[ot, select, removed][t], results[other, select, removed][t])} on {name}"
                for t, name in enumerate(names)
            ]
            parts.append(f"against {other}: {', '.join(said)}")
        lines.append(f"- {select}, {removed} removed: {ot}'s perplexity is " + "; ".join(parts) + ".")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "shrink-ppl.md")
    ap.add_argument("--wikitext-tokens", type=int, default=32768)
    args = ap.parse_args()
    torch.set_num_threads(1)
    start = time.time()
    evals = plans(args.wikitext_tokens)
    rows = [("none (source)", "", "", [cell(window_losses(STORIES260K, p)) for p in evals.values()])]
    results: dict[tuple[str, str, int], list[list[float]]] = {}
    chosen: dict[tuple[str, int], list[int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for removed in (1, 2):
            for select in ("bi", "angular"):
                for label, method, ot in METHODS:
                    out = Path(tmp) / f"{label}-{select}-{removed}".replace(" ", "-")
                    options = ShrinkOptions(method=method, layers=removed, select=select, calib=CALIB, ot=ot)
                    result = shrink(str(STORIES260K), out, options)
                    record = result.manifest["shrink"]
                    which = ", ".join(map(str, record["removed"]))
                    chosen[select, removed] = record["removed"]
                    results[label, select, removed] = [window_losses(out, p) for p in evals.values()]
                    cells = [cell(losses) for losses in results[label, select, removed]]
                    rows.append((label, f"{select} ({removed})", which, cells))
                    print(rows[-1], flush=True)
    load = os.getloadavg()[0]
    minutes = (time.time() - start) / 60
    names = list(evals)
    tokens = {name: sum(len(w.targets) for w in p.windows) for name, p in evals.items()}
    windows = {name: len(p.windows) for name, p in evals.items()}
    lines = [
        "# Shrinking stories260K: perplexity after removing layers",
        "",
        "Generated by `python -m scripts.shrink_ppl` (do not edit by hand) on "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}, {platform.machine()} CPU, float32, load average "
        f"{load:.1f} when it finished ({minutes:.0f} min; the figures do not depend on the load).",
        "",
        "The bundled stories260K (5 layers) shrunk by `otdus shrink` with each method and selection, "
        f"scores measured on the first 4096 tokens of `{CALIB}`; token perplexity with a 95% interval "
        "(normal approximation over the windows' mean losses), windows of 256 tokens: "
        + "; ".join(f"{name}: {tokens[name]:,} tokens in {windows[name]} windows" for name in names)
        + ". The ot rows use `--ot-variant paper` (the default) and `structured`.",
        "",
        f"| method | selection (layers removed) | removed | {' | '.join(names)} |",
        "|---|---|---|" + "---:|" * len(names),
    ]
    lines += [f"| {label} | {sel} | {which} | {' | '.join(cells)} |" for label, sel, which, cells in rows]
    same = [n for n in (1, 2) if chosen["bi", n] == chosen["angular", n]]
    lines += [
        "",
        "Verdict (generated: an interval entirely below the other's is lower, entirely above higher):",
        "",
        *verdicts(results, names),
    ]
    if same:
        lines += [
            "",
            "Block Influence and angular distance chose the same layers when removing "
            + " and ".join(map(str, same))
            + ", so those rows repeat each other.",
        ]
    lines += [
        "",
        "No healing run follows the shrink here (`otdus study` has no shrink arms yet), so these are "
        "the shrunk models as written; a 5-layer model is a toy for this: each layer is a fifth of the "
        "depth. Commit: `" + _commit() + "`.",
        "",
    ]
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
