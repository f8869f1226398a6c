#!/usr/bin/env python
"""Regenerate docs/evidence.md's figures: run the studies and diagnoses, then render the tables.

    python -m scripts.evidence study                    # both studies of recipes/study-table6.yaml
    python -m scripts.evidence study --only in-domain   # one of them (two processes: one per core)
    python -m scripts.evidence study --only in-domain --runs lesa   # add an arm to a stored study
    python -m scripts.evidence study --recipe interpose-stack       # recipes/study-interpose-stack.yaml
    python -m scripts.evidence study --recipe plateau --only in-domain --runs average+zero,average,copy
    python -m scripts.evidence study ... --settings '{"eval_windows": 1024}'   # settings over the recipe's
    python -m scripts.evidence diagnose                 # stories260K and the two planted controls
    python -m scripts.evidence render                   # docs/evidence.md's generated blocks

`study` and `diagnose` write JSON (and PNG) under docs/evidence/ (a study set's results under
docs/evidence/SET/STUDY/, SET one of RECIPES) and log their wall time and the
machine's load average to docs/evidence/runs.json; `render` rewrites only the blocks between
`<!-- evidence:NAME -->` and `<!-- evidence:end -->`, and the inline values between `<!-- v:KEY -->`
and `<!-- /v -->`, in docs/evidence.md from that JSON and the recipes' declared primary families
(the prose around them is written by hand, carries no figure, and must follow from them; `make
evidence` runs `render`). tests/test_evidence.py fails when the blocks or values differ from what
`render` makes of the stored results, and on any figure typed into the prose.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EVIDENCE = ROOT / "docs" / "evidence"
DOC = ROOT / "docs" / "evidence.md"
# study sets: the folder under docs/evidence/ -> the recipe that produces it
RECIPES = {
    "table6": ROOT / "recipes" / "study-table6.yaml",
    "interpose-stack": ROOT / "recipes" / "study-interpose-stack.yaml",
    "plateau": ROOT / "recipes" / "study-plateau.yaml",
}
DIAGNOSE_TEXT = "bundled:tinystories-train-2mib"
DIAGNOSE_TOKENS = 8192
PLANTED_TEXT = "bundled:tinystories-sample"


def _load() -> float:
    return os.getloadavg()[0]


def _log(name: str, seconds: float, load_before: float, command: str) -> None:
    """Record how long a regeneration took and how busy the machine was (runs.json)."""
    path = EVIDENCE / "runs.json"
    runs = json.loads(path.read_text()) if path.exists() else {}
    runs[name] = {
        "command": command,
        "seconds": round(seconds, 1),
        "load_before": round(load_before, 2),
        "load_after": round(_load(), 2),
        "cpus": os.cpu_count(),
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    path.write_text(json.dumps(dict(sorted(runs.items())), indent=2) + "\n")


def _store(result, folder: Path) -> None:
    """Write a study's results into the repository's docs/evidence/ (files tracked by git, which
    keeps what they were): in place, where StudyResult.save would make an otdus study output."""
    folder.mkdir(parents=True, exist_ok=True)
    result.write_files(folder)


def run_studies(
    only: list[str] | None,
    runs: list[str] | None = None,
    study_set: str = "table6",
    overrides: dict | None = None,
    alone: bool = False,
) -> None:
    """Run the set's recipe's studies into docs/evidence/SET/NAME/; with ``runs``, only those arms
    (and the reference), added to the stored study (StudyResult.with_arms checks that the
    reference's runs reproduce the stored ones); ``overrides``: settings over the recipe's (the
    logged command carries them); ``alone``: the arms without the reference, merged without a
    shared run (StudyResult.with_arms(shared_run=False): the base's loss must agree instead)."""
    from otdus_cli.study import StudyResult, run_recipe
    from otdus_cli.study.recipe import load_study_recipe

    def progress(event) -> None:
        if event.kind in ("run", "data"):
            tail = event.message
            if event.loss is not None:
                tail = f"step {event.step}, final {event.message or 'held-out'} loss {event.loss:.6f}"
            when = time.strftime("%H:%M:%S")
            print(f"[{when}] {event.run}/{event.runs} {event.label} seed {event.seed}: {tail}", flush=True)

    path = RECIPES[study_set]
    recipe = load_study_recipe(path)
    flag = "" if study_set == "table6" else f" --recipe {study_set}"
    prefix = "study" if study_set == "table6" else study_set
    for name in only or [s.name for s in recipe.studies]:
        t0, load = time.perf_counter(), _load()
        command = f"python -m scripts.evidence study{flag} --only {name}"
        if overrides:
            command += f" --settings '{json.dumps(overrides)}'"
        if runs is None:
            (result,) = run_recipe(path, None, only=[name], progress=progress, overrides=overrides).values()
            _store(result, EVIDENCE / study_set / name)
            key = f"{prefix}/{name}"
        else:
            (later,) = run_recipe(
                path,
                None,
                only=[name],
                progress=progress,
                runs=runs,
                overrides=overrides,
                reference="" if alone else None,
            ).values()
            tag = ",".join(runs).replace("/", "_")
            kept = later.save(
                Path(tempfile.gettempdir()) / f"otdus-evidence-{name}-{tag}", plot=False, force=True
            )
            print(f"the added arms' runs: {kept[0]}", flush=True)  # kept should the merge refuse them
            if not (EVIDENCE / study_set / name / "study.json").exists():  # the first arms of a new set
                _store(later, EVIDENCE / study_set / name)
                command += f" --runs {','.join(runs)}" + (" --alone" if alone else "")
                _log(
                    f"{prefix}/{name} {','.join(runs)}" + (" (alone)" if alone else ""),
                    time.perf_counter() - t0,
                    load,
                    command,
                )
                continue
            stored = StudyResult.load(EVIDENCE / study_set / name)
            wanted = {m.label for m in stored.methods} | set(runs)
            order = [r.name for r in recipe.runs if r.name in wanted]
            merged = stored.with_arms(later, order=order, shared_run=not alone)
            if not merged.reference and recipe.reference in order:  # arms run alone have none
                merged = merged.recompute(recipe.reference)
            _store(merged, EVIDENCE / study_set / name)
            command += f" --runs {','.join(runs)}" + (" --alone" if alone else "")
            # an arm run alone is keyed the same whether it started the stored study or joined it
            key = (
                f"{prefix}/{name} {','.join(runs)} (alone)" if alone else f"{prefix}/{name} +{','.join(runs)}"
            )
        _log(key, time.perf_counter() - t0, load, command)


def run_diagnoses() -> None:
    from rich.console import Console

    from otdus_cli.study import diagnose, diagnose_tables
    from otdus_cli.study.planted import plant_permuted_copy

    out = EVIDENCE / "diagnose"
    out.mkdir(parents=True, exist_ok=True)
    t0, load = time.perf_counter(), _load()
    png = out / "stories260k_weight_norms.png"
    with tempfile.TemporaryDirectory(prefix="otdus-evidence-") as tmp:
        # diagnose writes a new file only: drawn beside, then over the repository's tracked copy
        result = diagnose(
            "bundled:stories260k", DIAGNOSE_TEXT, max_tokens=DIAGNOSE_TOKENS, png=Path(tmp) / png.name
        )
        if result.figures:
            shutil.copyfile(Path(tmp) / png.name, png)
    result.figures = [os.path.relpath(png, ROOT)] if result.figures else []
    (out / "stories260k.json").write_text(result.to_json() + "\n")
    with (out / "stories260k.txt").open("w") as fh:
        Console(file=fh, width=140, color_system=None).print(diagnose_tables(result))
    planted = {}
    with tempfile.TemporaryDirectory(prefix="otdus-planted-") as tmp:
        for name, permute_heads in (("mlp permuted", False), ("mlp+heads permuted", True)):
            folder = Path(tmp) / name.replace(" ", "-").replace("+", "-")
            a, b = plant_permuted_copy("bundled:stories260k", folder, layer=2, permute_heads=permute_heads)
            r = diagnose(
                str(folder), "bundled:tinystories-sample", pairs=[(a, b)], max_tokens=768, seq_len=128
            )
            (pair,) = r.pairs
            planted[name] = {
                "tokens": r.tokens,
                "mlp": pair.mlp,
                "heads": pair.heads,
                "entropy_normalized": {m: e["entropy_normalized"] for m, e in pair.entropy.items()},
            }
    (out / "planted.json").write_text(json.dumps(planted, indent=1) + "\n")
    _log("diagnose", time.perf_counter() - t0, load, "python -m scripts.evidence diagnose")


def render() -> bool:
    """Rewrite docs/evidence.md's generated blocks; True when anything changed."""
    from otdus_cli.study.evidence import render_document

    before = DOC.read_text()
    after = render_document(before, EVIDENCE, RECIPES)
    if after != before:
        DOC.write_text(after)
    return after != before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="what", required=True)
    st = sub.add_parser("study", help="run a recipe's studies (docs/evidence/SET/NAME/)")
    st.add_argument(
        "--recipe", choices=sorted(RECIPES), default="table6", help="the study set (default table6)"
    )
    st.add_argument("--only", action="append", help="a study of the recipe (repeatable)")
    st.add_argument("--runs", help="comma-separated arms to add to the stored study (with the reference)")
    st.add_argument("--settings", type=json.loads, help="study settings over the recipe's, as JSON")
    st.add_argument("--alone", action="store_true", help="with --runs: without the reference (no rerun)")
    sub.add_parser("diagnose", help="stories260K and the planted controls (docs/evidence/diagnose/)")
    sub.add_parser("render", help="docs/evidence.md's generated blocks from the stored results")
    args = parser.parse_args(argv)
    if args.what == "study":
        runs = args.runs.split(",") if args.runs else None
        run_studies(args.only, runs, args.recipe, args.settings, args.alone)
    elif args.what == "diagnose":
        run_diagnoses()
    else:
        print("docs/evidence.md " + ("updated" if render() else "unchanged"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
