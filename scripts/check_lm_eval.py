#!/usr/bin/env python3
"""Run real lm-eval releases on a checkpoint and compare their ``wikitext`` figures with otdus's presets.

For each version asked for, this script

1. creates a throwaway virtual environment (``--venv-root``, default /tmp/otdus-lm-eval/<version>;
   kept between runs unless ``--fresh``) and pip-installs ``lm_eval==<version>`` with the torch and
   transformers versions of the project's environment, plus ``accelerate``; releases 0.4.0-0.4.1 and
   0.4.5-0.4.9.2 cannot be imported with transformers 5 (they import
   ``transformers.data.metrics`` or read ``transformers.AutoModelForVision2Seq``, both gone in 5.0)
   and get transformers 4.57.6 instead (``--transformers`` overrides both);
2. inside it (this same file with ``--worker``) copies lm-eval's own ``wikitext`` task
   (``lm_eval/tasks/wikitext/wikitext.yaml`` and ``preprocess_wikitext.py`` of that release) and
   changes only where the data comes from: ``EleutherAI/wikitext_document_level`` from the Hub
   (unreachable here) becomes a local JSON-lines file holding the same 62 test documents, split from
   the bundled raw WikiText-2 test file exactly as that dataset splits it (the train and validation
   splits, loaded only as a few-shot pool and unused at zero shots, point at the same file); the
   task is renamed so it does not clash with the stock one and sits beside it in the venv's
   ``lm_eval/tasks``. lm-eval 0.4.0-0.4.2 load HF evaluate's ``exact_match`` metric from the Hub
   when imported (wikitext never uses it): the worker answers that load with a placeholder. Then
   it runs ``lm_eval.simple_evaluate(model="hf", model_args="pretrained=<checkpoint>")`` on the
   CPU: windows, prefix token, special tokens, max length, detokeniser and aggregation are all that
   release's;
3. computes otdus's figures with ``make_plan(lm_eval=<version>)`` (what ``otdus ppl --lm-eval
   <version>`` does) and prints both, with their relative differences.

Usage (from the repository root, with the project's venv; PyPI must be reachable, the Hub need not):

    .venv/bin/python scripts/check_lm_eval.py --versions 0.4.2,0.4.9.1,0.4.13 [--max-docs N]
        [--model DIR] [--batch-size 16] [--json out.json]

``--max-docs N`` scores the first N documents (lm-eval's ``limit``). Exit status 0 when every
figure agrees within ``--rtol`` (default 1e-6) and otdus's detokeniser gives lm-eval's text.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASK = "wikitext_local_docs"
METRICS = ("word_perplexity", "byte_perplexity", "bits_per_byte")
# keys of the stock task YAML that say where the data comes from (replaced, nothing else is)
SOURCE_KEYS = ("dataset_path", "dataset_name", "dataset_kwargs")
# releases that cannot be imported with transformers 5, and the transformers they get instead
NEED_TRANSFORMERS_4 = (((0, 4, 0), (0, 4, 1)), ((0, 4, 5), (0, 4, 9, 2)))
TRANSFORMERS_4 = "4.57.6"


# -- worker (runs inside an lm-eval venv; stdlib + lm_eval only) -------------------------------------
def local_task_yaml(stock: str, docs: Path) -> str:
    """The stock wikitext.yaml with its dataset source replaced by a local JSON-lines file."""
    out: list[str] = []
    skipping = False
    for line in stock.splitlines():
        key = line.split(":", 1)[0].strip() if line and not line[0].isspace() else None
        if key is not None:
            skipping = key in SOURCE_KEYS
            if key == "task":
                line = f"task: {TASK}"
        if not skipping:
            out.append(line)
    # the train and validation splits are only loaded as a few-shot pool, never used at zero shots
    files = [f"    {split}: {json.dumps(str(docs))}" for split in ("train", "validation", "test")]
    out += ["dataset_path: json", "dataset_kwargs:", "  data_files:", *files]
    return "\n".join(out) + "\n"


def offline_exact_match() -> None:
    """lm-eval 0.4.0-0.4.2 fetch HF evaluate's ``exact_match`` metric from the Hub when imported; the
    wikitext task never uses it, so with no Hub it is answered with a placeholder."""
    try:
        import evaluate
    except ImportError:
        return
    hub_load = evaluate.load

    def load(name, *args, **kwargs):
        return None if name == "exact_match" else hub_load(name, *args, **kwargs)

    evaluate.load = load


def worker(args: argparse.Namespace) -> None:
    offline_exact_match()
    import lm_eval
    import lm_eval.tasks
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

    stock = Path(lm_eval.tasks.__file__).parent / "wikitext"
    # beside the stock tasks, in this throwaway venv: lm-eval 0.4.9.2 fails to list a task from
    # an include_path outside its own tasks folder
    task_dir = stock.parent / "otdus_local_wikitext"
    task_dir.mkdir(exist_ok=True)
    shutil.copy(stock / "preprocess_wikitext.py", task_dir / "preprocess_wikitext.py")
    (task_dir / "wikitext_local.yaml").write_text(
        local_task_yaml((stock / "wikitext.yaml").read_text(), Path(args.docs))
    )
    pages = [json.loads(line)["page"] for line in Path(args.docs).read_text().splitlines()]
    manager = lm_eval.tasks.TaskManager()
    start = time.time()
    res = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={args.model}",
        tasks=[TASK],
        task_manager=manager,
        batch_size=args.batch_size,
        device="cpu",
        limit=args.max_docs,
    )
    result = res["results"][TASK]
    versions = {
        p: metadata.version(p) for p in ("lm_eval", "transformers", "tokenizers", "torch", "datasets")
    }
    out = {
        "versions": versions,
        "seconds": time.time() - start,
        "detokenized": [wikitext_detokenizer({"page": p}) for p in pages],
        **{m: result[f"{m},none"] for m in METRICS},
    }
    Path(args.out).write_text(json.dumps(out))


# -- driver (runs in the project venv) ------------------------------------------------------------
def transformers_for(version: str) -> str:
    from otdus_cli.verify.lm_eval_presets import parse_version

    release = parse_version(version)
    if any(first <= release <= last for first, last in NEED_TRANSFORMERS_4):
        return TRANSFORMERS_4
    return metadata.version("transformers")


def ensure_venv(version: str, root: Path, fresh: bool, transformers: str | None) -> Path:
    """A venv with lm_eval==version, the project's torch and the given transformers (created once)."""
    venv = root / version
    python = venv / "bin" / "python"
    marker = venv / ".otdus-installed"
    torch = metadata.version("torch").split("+")[0]
    pins = [f"lm_eval=={version}", f"torch=={torch}"]
    pins += [f"transformers=={transformers or transformers_for(version)}", "accelerate"]
    wanted = " ".join(pins) + "\n"
    if fresh or not marker.is_file() or marker.read_text() != wanted:
        if venv.exists():
            shutil.rmtree(venv)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        print(f"installing {' '.join(pins)} into {venv} ...", flush=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *pins], check=True)
        marker.write_text(wanted)
    return python


def run_lm_eval(python: Path, model: Path, docs: Path, max_docs: int | None, batch_size: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [str(python), __file__, "--worker", "--model", str(model), "--docs", str(docs)]
        cmd += ["--out", str(out), "--batch-size", str(batch_size)]
        if max_docs is not None:
            cmd += ["--max-docs", str(max_docs)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        env.pop("PYTHONPATH", None)
        subprocess.run(cmd, check=True, env=env, cwd=tmp)
        return json.loads(out.read_text())


def run_otdus(model: Path, version: str, max_docs: int | None, batch_size: int) -> dict:
    from otdus_cli.verify.compare import make_plan, perplexity

    plan = make_plan(model, lm_eval=version, max_docs=max_docs)
    start = time.time()
    m = perplexity(model, plan, device="cpu", dtype="float32", batch_size=batch_size).metrics
    return {
        "seconds": time.time() - start,
        "settings": m.settings,
        **{k: getattr(m, k) for k in ("n_docs", "n_windows", "n_tokens", "n_words", "n_bytes", *METRICS)},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", default="0.4.2,0.4.9.1,0.4.13", help="comma-separated lm-eval versions")
    ap.add_argument(
        "--model", type=Path, default=None, help="HF checkpoint folder (default: bundled stories260K)"
    )
    ap.add_argument("--max-docs", type=int, default=None, help="first N documents only (default: all 62)")
    ap.add_argument("--batch-size", type=int, default=16, help="windows per forward pass, both sides")
    ap.add_argument("--venv-root", type=Path, default=Path(tempfile.gettempdir()) / "otdus-lm-eval")
    ap.add_argument("--fresh", action="store_true", help="recreate the venvs")
    ap.add_argument("--transformers", help="transformers version for every lm-eval venv")
    ap.add_argument("--rtol", type=float, default=1e-6)
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--docs", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0

    sys.path.insert(0, str(ROOT))
    from otdus_cli.bundled import STORIES260K
    from otdus_cli.verify.text import load_wikitext_raw, wikitext_detokenize, wikitext_pages

    model = (args.model or STORIES260K).resolve()
    pages = wikitext_pages(load_wikitext_raw())
    report: dict = {"model": str(model), "max_docs": args.max_docs, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        docs = Path(tmp) / "wikitext_document_level_test.jsonl"
        docs.write_text("".join(json.dumps({"page": p}) + "\n" for p in pages))
        for version in [v.strip() for v in args.versions.split(",") if v.strip()]:
            try:
                python = ensure_venv(version, args.venv_root, args.fresh, args.transformers)
                print(f"lm-eval {version}: running its wikitext task on {model.name} ...", flush=True)
                theirs = run_lm_eval(python, model, docs, args.max_docs, args.batch_size)
            except subprocess.CalledProcessError as exc:
                print(f"lm-eval {version} failed: {exc}", flush=True)
                report["runs"][version] = {"error": str(exc)}
                continue
            detok = theirs.pop("detokenized")
            mismatched = sum(wikitext_detokenize(p) != d for p, d in zip(pages, detok, strict=True))
            print(f"otdus --lm-eval {version} ...", flush=True)
            ours = run_otdus(model, version, args.max_docs, args.batch_size)
            report["runs"][version] = {
                "lm_eval": theirs,
                "otdus": ours,
                "rel_diff": {m: abs(ours[m] - theirs[m]) / abs(theirs[m]) for m in METRICS},
                "detokenizer_mismatches": mismatched,
            }
            if args.json:  # after every version, so a later failure keeps what was measured
                args.json.write_text(json.dumps(report, indent=2) + "\n")
    runs = {v: r for v, r in report["runs"].items() if "error" not in r}
    worst = max((x for r in runs.values() for x in r["rel_diff"].values()), default=0.0)
    detok_ok = all(r["detokenizer_mismatches"] == 0 for r in runs.values())

    n = len(pages) if args.max_docs is None else min(args.max_docs, len(pages))
    print(f"\n{model.name}, first {n} of {len(pages)} WikiText-2 test documents, float32 CPU")
    print("| lm-eval | transformers | metric | lm-eval | otdus --lm-eval | rel. diff |")
    print("|---|---|---|---|---|---|")
    for run in runs.values():
        v = run["lm_eval"]["versions"]
        for m in METRICS:
            a, b = run["lm_eval"][m], run["otdus"][m]
            print(
                f"| {v['lm_eval']} | {v['transformers']} | {m} | {a!r} | {b!r} | {run['rel_diff'][m]:.1e} |"
            )
    for version, run in runs.items():
        o = run["otdus"]
        print(
            f"lm-eval {version}: {o['n_docs']} documents, {o['n_words']:,} words, {o['n_bytes']:,} bytes, "
            f"{o['n_windows']:,} windows, {o['n_tokens']:,} tokens (otdus settings {o['settings']}); "
            f"lm-eval {run['lm_eval']['seconds']:.0f} s, otdus {o['seconds']:.0f} s; detokeniser "
            f"mismatches: {run['detokenizer_mismatches']}"
        )
    report["max_rel_diff"] = worst
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    ok = worst <= args.rtol and detok_ok and len(runs) == len(report["runs"])
    print(
        "\nMATCH" if ok else "\nMISMATCH", f"(max relative difference {worst:.2e}, tolerance {args.rtol:g})"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
