"""Hash the outputs and `--json` reports of a fixed set of expansions, to show a refactoring changed
no byte.

Runs 25 `otdus expand` / `otdus widen` commands (every method and OT variant on the bundled
stories260K, and tiny Gemma 2, Qwen 3 and Mixtral checkpoints written by make_synthetic.py), each
with `--json`, and records the sha256 of every output file and of each report (JSON with its keys
in the order written). What legitimately differs between two runs is left out: the manifest's
creation time, timings and per-plan seconds (and its hash of itself, which covers them), a report's
seconds and timings (wall-clock figures), and the path of a bundled source (inside the checkout that
runs, so the old and the new code may sit in different worktrees).

    python -m scripts.output_hashes --record before.json     # on the old code
    python -m scripts.output_hashes --compare before.json    # on the new code: exit 1 on a difference
    python -m scripts.output_hashes --compare before.json --added-keys layer_kinds,mixed_kind_gaps
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = "bundled:stories260k"
# (name, source, command arguments after the source); "tiny-*" sources are written by make_synthetic.py
CASES: list[tuple[str, str, list[str]]] = [
    ("ot-paper", BUNDLED, []),
    ("ot-official", BUNDLED, ["--ot-variant", "official", "--max-iter", "300"]),
    ("ot-structured", BUNDLED, ["--ot-variant", "structured"]),
    ("ot-activation", BUNDLED, ["--ot-variant", "activation", "--calib-tokens", "512"]),
    ("ot-emd", BUNDLED, ["--solver", "emd"]),
    ("ot-reg", BUNDLED, ["--reg", "0.02", "--tol", "1e-5"]),
    ("ot-mid-bf16", BUNDLED, ["--position", "mid", "--dtype", "bfloat16"]),
    ("ot-after", BUNDLED, ["--after", "0,3", "--no-zero-init"]),
    ("lesa-pair", BUNDLED, ["--method", "lesa", "--lesa-epochs", "2"]),
    ("lesa-published", BUNDLED, ["--method", "lesa", "--lesa-variant", "published", "--lesa-epochs", "2"]),
    ("lesa-rank", BUNDLED, ["--method", "lesa", "--lesa-epochs", "2", "--lesa-rank", "4", "--lesa-loo", "0"]),
    ("average", BUNDLED, ["--method", "average"]),
    ("average-zero", BUNDLED, ["--method", "average", "--zero-init"]),
    ("copy", BUNDLED, ["--method", "copy", "--position", "bottom"]),
    ("interpose", BUNDLED, ["--method", "interpose", "--layers", "3"]),
    ("random", BUNDLED, ["--method", "random", "--seed", "3"]),
    ("llama-pro", BUNDLED, ["--method", "llama-pro", "--layers", "5"]),
    ("solar", BUNDLED, ["--method", "solar", "--layers", "3"]),
    ("stack", BUNDLED, ["--method", "stack"]),
    ("ot-shards", BUNDLED, ["--max-shard-size", "300KB"]),
    ("gemma2-ot", "tiny-gemma2", ["--layers", "2"]),
    ("qwen3-lesa", "tiny-qwen3", ["--method", "lesa", "--lesa-epochs", "2", "--lesa-loo", "0"]),
    ("mixtral-ot", "tiny-mixtral", ["--layers", "1"]),
    ("mixtral-experts", "tiny-mixtral", ["--layers", "1", "--experts", "2", "--expert-noise", "0"]),
    ("mixtral-widen", "tiny-mixtral", ["widen"]),
]
# manifest_sha256 hashes the manifest's whole content: its creation time and source path included
_VOLATILE_MANIFEST = {"created", "timings", "seconds", "manifest_sha256"}
_VOLATILE_REPORT = {"seconds", "timings"}
# manifests and cards name their source's path, inside the run's temporary work folder: hashed under
# this one name (the fixed folder earlier recordings were made in), so two runs compare equal
WORK_NAME = str(Path(tempfile.gettempdir()) / "otdus-output-hashes")


def _scrub(value: object, volatile: set[str]) -> object:
    if isinstance(value, dict):
        return {k: _scrub(v, volatile) for k, v in value.items() if k not in volatile}
    if isinstance(value, list):
        return [_scrub(v, volatile) for v in value]
    return value


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _output_hashes(out: Path, work: Path) -> dict[str, str]:
    hashes = {}
    for path in sorted(out.rglob("*")):
        if not path.is_file():
            continue
        data = path.read_bytes()
        if path.name == "otdus.json":
            manifest = _scrub(json.loads(data), _VOLATILE_MANIFEST)
            if manifest.get("source", {}).get("kind") == "bundled":
                # where a bundled model lies is where otdus's checkout is, not what was written: two
                # checkouts (a worktree of the old code, one of the new) compare equal
                del manifest["source"]["path"]
            data = json.dumps(manifest, indent=2).encode()  # the keys' order is part of the bytes
        if path.suffix in (".json", ".md"):  # a source's path names the run's work folder: one name
            data = data.replace(str(work).encode(), WORK_NAME.encode())
        hashes[str(path.relative_to(out))] = _digest(data)
    return hashes


def run_cases(
    work: Path, only: list[str] | None, added_keys: frozenset[str] = frozenset()
) -> dict[str, dict]:
    otdus = [sys.executable, "-m", "otdus_cli.cli"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    results = {}
    for name, source, args in CASES:
        if only and name not in only:
            continue
        if source.startswith("tiny-") and not (work / source).exists():
            subprocess.run(
                [sys.executable, str(ROOT / "scripts" / "make_synthetic.py"), source, "--out", source],
                cwd=work, check=True, capture_output=True,
            )  # fmt: skip
        if args[:1] == ["widen"]:
            command = [*otdus, "widen", source, "--out", name, "--json", *args[1:]]
        else:
            command = [*otdus, "expand", source, "--out", name, "--json", *args]
        done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            results[name] = {"exit": done.returncode, "stderr": done.stderr.strip().splitlines()[-1:]}
        else:
            report = json.dumps(_scrub(json.loads(done.stdout), _VOLATILE_REPORT | added_keys), indent=2)
            results[name] = {
                "exit": 0,
                "report": _digest(report.encode()),
                "files": _output_hashes(work / name, work),
            }
        print(f"{name}: exit {done.returncode}", file=sys.stderr, flush=True)
    return results


def compare(old: dict[str, dict], new: dict[str, dict]) -> list[str]:
    differences = []
    for name in old.keys() | new.keys():
        if old.get(name) != new.get(name):
            a, b = old.get(name, {}), new.get(name, {})
            what = [k for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]
            files = a.get("files", {}), b.get("files", {})
            changed = sorted(
                f for f in files[0].keys() | files[1].keys() if files[0].get(f) != files[1].get(f)
            )
            differences.append(
                f"{name}: {', '.join(what)} differ" + (f" ({', '.join(changed)})" if changed else "")
            )
    return sorted(differences)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--record", type=Path, help="write the hashes to this JSON file")
    action.add_argument("--compare", type=Path, help="compare against hashes recorded earlier")
    parser.add_argument("--only", help="comma-separated case names (default: all 25)")
    parser.add_argument(
        "--added-keys",
        default="",
        help="comma-separated --json report keys that a feature added since the recording, left out of "
        "the new reports before hashing (a refactoring adds none; the files are compared whole)",
    )
    args = parser.parse_args(argv)
    only = args.only.split(",") if args.only else None
    work = Path(tempfile.mkdtemp(prefix="otdus-output-hashes-"))  # its own: only it is removed after
    try:
        results = run_cases(work, only, frozenset(filter(None, args.added_keys.split(","))))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    failed = [name for name, r in results.items() if r["exit"] != 0]
    if args.record:
        args.record.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        print(f"recorded {len(results)} cases in {args.record}; {len(failed)} failed: {failed}")
        return 1 if failed else 0
    old = json.loads(args.compare.read_text())
    if only:
        old = {k: v for k, v in old.items() if k in only}
    differences = compare(old, results)
    for line in differences:
        print(line)
    print(f"{len(results) - len(differences)} of {len(results)} cases byte-identical")
    return 1 if differences or failed else 0


if __name__ == "__main__":
    sys.exit(main())
