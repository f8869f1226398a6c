#!/usr/bin/env python3
"""Compare otdus's lm-eval-style WikiText perplexity with lm-evaluation-harness itself.

lm-eval lives in its own virtual environment (it pins its own dependencies), e.g.

    python3 -m venv /work/lmeval-venv
    /work/lmeval-venv/bin/pip install torch==2.13.0 lm-eval transformers accelerate

and is run here as a subprocess (this same file with ``--worker``). lm-eval's ``wikitext`` task reads
``EleutherAI/wikitext_document_level`` from the Hub; with no network, this script writes the same
documents (one per article, split from the bundled raw test file) as a local JSON-lines file and a
task YAML that points lm-eval's ``json`` loader at it, reusing lm-eval's own ``wikitext_detokenizer``
and ``process_results`` from ``lm_eval.tasks.wikitext.preprocess_wikitext``. Everything else (rolling
windows, BOS prefix, max length, metric aggregation) is lm-eval's.

Two tokenisation variants are compared:
  * ``no-bos``: lm-eval with ``add_bos_token=False`` (what the paper's lm-eval 0.4.2 did by default for
    causal models) vs otdus's default;
  * ``default``: recent lm-eval defaults (0.4.13: the tokenizer adds its BOS to each document, which the
    BOS prefix then precedes) vs otdus with ``add_special_tokens=True``.

Usage (from the repository root, with the project's venv):

    python scripts/check_lm_eval.py [--model DIR] [--limit N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TASK = "otdus_wikitext_local"
HOOKS = (
    "from lm_eval.tasks.wikitext.preprocess_wikitext import process_results, wikitext_detokenizer  # noqa\n"
)
YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: !function otdus_hooks.wikitext_detokenizer
process_results: !function otdus_hooks.process_results
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 2.0
"""
METRICS = ("word_perplexity", "byte_perplexity", "bits_per_byte")


# -- worker (runs inside the lm-eval venv; stdlib + lm_eval only) ---------------------------------
def worker(args: argparse.Namespace) -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

    pages = [json.loads(line)["page"] for line in Path(args.docs).read_text().splitlines()]
    detok = [wikitext_detokenizer({"page": p}) for p in pages]
    out: dict = {"lm_eval_version": getattr(lm_eval, "__version__", "?"), "detokenized": detok, "runs": {}}
    manager = TaskManager(include_path=str(Path(args.docs).parent))
    for variant in args.variants.split(","):
        model_args = f"pretrained={args.model},dtype=float32"
        if variant == "no-bos":
            model_args += ",add_bos_token=False"
        start = time.time()
        res = lm_eval.simple_evaluate(
            model="hf",
            model_args=model_args,
            tasks=[TASK],
            task_manager=manager,
            batch_size=args.batch_size,
            device="cpu",
            limit=args.limit,
            log_samples=False,
        )
        r = res["results"][TASK]
        out["runs"][variant] = {
            "model_args": model_args,
            "seconds": time.time() - start,
            **{m: r[f"{m},none"] for m in METRICS},
        }
    Path(args.out).write_text(json.dumps(out))


# -- driver (runs in the project venv) ------------------------------------------------------------
def find_fixture() -> Path | None:
    root = Path(__file__).resolve().parent.parent
    for cand in (
        root / "otdus_cli" / "data" / "stories260k",
        root / "otdus_cli" / "data" / "stories260k",
        root.parent / "shared" / "fixtures" / "stories260k-hf",
    ):
        if (cand / "config.json").is_file():
            return cand
    return None


def ours(model: Path, limit: int | None, add_special_tokens: bool, pages: list[str], batch_size: int) -> dict:
    from otdus_cli.verify.metrics import (
        lm_eval_max_length,
        load_tokenizer,
        metrics_from_logprobs,
        plan_rolling,
        score_plan,
    )
    from otdus_cli.verify.streaming import StreamedModel
    from otdus_cli.verify.text import Corpus

    tok = load_tokenizer(model)
    streamed = StreamedModel(model, device="cpu", dtype="float32", batch_size=batch_size)
    corpus = Corpus("wikitext-2-raw-v1 test", pages, "wikitext")
    plan = plan_rolling(
        corpus,
        tok,
        lm_eval_max_length(streamed.reader.config, tok),
        add_special_tokens=add_special_tokens,
        max_docs=limit,
    )
    start = time.time()
    m = metrics_from_logprobs(plan, score_plan(streamed, plan))
    return {
        "seconds": time.time() - start,
        "windows": m.n_windows,
        "tokens": m.n_tokens,
        "words": m.n_words,
        "bytes": m.n_bytes,
        **{k: getattr(m, k) for k in METRICS},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="HF checkpoint folder (default: the stories260K fixture)")
    ap.add_argument("--limit", type=int, default=None, help="first N documents only (default: all 62)")
    ap.add_argument(
        "--lm-eval-python", default=os.environ.get("LM_EVAL_PYTHON", "/work/lmeval-venv/bin/python")
    )
    ap.add_argument("--variants", default="no-bos,default")
    ap.add_argument("--batch-size", type=int, default=16, help="windows per forward pass, both sides")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--docs", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.model = str(args.model)
        worker(args)
        return 0

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from otdus_cli.verify.text import load_wikitext_raw, wikitext_detokenize, wikitext_pages

    model = args.model or find_fixture()
    if model is None:
        print("no model given and the stories260K fixture was not found", file=sys.stderr)
        return 2
    if not Path(args.lm_eval_python).is_file():
        print(f"lm-eval python not found at {args.lm_eval_python} (see the docstring)", file=sys.stderr)
        return 2
    pages = wikitext_pages(load_wikitext_raw())
    with tempfile.TemporaryDirectory() as tmp:
        docs = Path(tmp) / "wikitext_test_docs.jsonl"
        docs.write_text("".join(json.dumps({"page": p}) + "\n" for p in pages))
        (Path(tmp) / "otdus_hooks.py").write_text(HOOKS)
        (Path(tmp) / "task.yaml").write_text(YAML.format(task=TASK, docs=json.dumps(str(docs))))
        out = Path(tmp) / "lm_eval_result.json"
        cmd = [
            args.lm_eval_python,
            __file__,
            "--worker",
            "--model",
            str(model.resolve()),
            "--docs",
            str(docs),
            "--out",
            str(out),
            "--variants",
            args.variants,
        ]
        if args.limit is not None:
            cmd += ["--limit", str(args.limit)]
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONPATH": tmp,
        }
        print(f"running lm-eval ({args.lm_eval_python}) on {model} ...", flush=True)
        subprocess.run(cmd, check=True, env=env, cwd=tmp)
        theirs = json.loads(out.read_text())

    n = len(pages) if args.limit is None else min(args.limit, len(pages))
    mismatched = [i for i, p in enumerate(pages) if wikitext_detokenize(p) != theirs["detokenized"][i]]
    report: dict = {
        "model": str(model),
        "lm_eval_version": theirs["lm_eval_version"],
        "documents": n,
        "detokenizer_mismatches": len(mismatched),
        "variants": {},
    }
    for variant, run in theirs["runs"].items():
        mine = ours(model, args.limit, variant == "default", pages, args.batch_size)
        report["variants"][variant] = {"lm_eval": run, "otdus": mine}

    print(f"\nlm-eval {report['lm_eval_version']} vs otdus, {n} WikiText-2 test documents, {model.name}")
    print(f"detokeniser: {report['detokenizer_mismatches']} of {len(pages)} pages differ from lm-eval's")
    print("| variant | metric | lm-eval | otdus | rel. diff |")
    print("|---|---|---|---|---|")
    worst = 0.0
    for variant, pair in report["variants"].items():
        for m in METRICS:
            a, b = pair["lm_eval"][m], pair["otdus"][m]
            rel = abs(a - b) / abs(a)
            worst = max(worst, rel)
            print(f"| {variant} | {m} | {a:.10g} | {b:.10g} | {rel:.2e} |")
    report["max_rel_diff"] = worst
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    ok = worst < 1e-5 and report["detokenizer_mismatches"] == 0
    print("\nMATCH" if ok else "\nMISMATCH", f"(max relative difference {worst:.2e})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
