"""Run real lm-eval releases on stories260K and compare their ``wikitext`` figures with ``otdus ppl``.

For each run (an lm-eval version, a number of documents, an optional ``max_length``) this script

1. creates a throwaway virtual environment (``--venv-root``, default /tmp/otdus-lm-eval/<version>;
   kept between runs unless ``--fresh``) and pip-installs ``lm_eval==<version>`` with the project's
   torch and transformers, plus ``accelerate``. Releases 0.4.0-0.4.1 and 0.4.5-0.4.9.2 cannot be
   imported with transformers 5 (they import ``transformers.data.metrics`` or read
   ``transformers.AutoModelForVision2Seq``, both gone in 5.0) and get transformers 4.57.6 instead
   (``--transformers`` overrides every venv's); 0.4.0-0.4.1 also import ``datasets.load_metric``
   (gone in datasets 3) and get datasets < 3;
2. inside it (this same file with ``--worker``, which imports nothing from otdus) builds the
   document-level WikiText-2 test split from the bundled raw file (``wiki.test.raw``, sha256-checked)
   by the rule of the Hub dataset ``EleutherAI/wikitext_document_level`` (a new document at each
   `` = Title = `` line): the 62 test documents, written as a JSON-lines file. The Hub is unreachable,
   so that file is how lm-eval gets the data: the release's own ``wikitext`` task
   (``lm_eval/tasks/wikitext/wikitext.yaml`` and ``preprocess_wikitext.py``) is copied with only
   its dataset source changed (``dataset_path: json`` and that file for every split; the train and
   validation splits are only a few-shot pool, unused at zero shots) and a new task name, beside the
   stock tasks in the venv. lm-eval 0.4.0-0.4.2 load HF evaluate's ``exact_match`` metric from the Hub
   when imported (wikitext never uses it): the worker answers that load with a placeholder. Then it
   calls ``lm_eval.simple_evaluate(model="hf", model_args="pretrained=<stories260K>[,max_length=L]")``
   on the CPU, which is what ``lm_eval --model hf --model_args ... --tasks wikitext`` runs: windows,
   prefix token, special tokens, max length, detokeniser and aggregation are all that release's;
3. runs ``otdus ppl bundled:stories260k --lm-eval <version> [--max-docs N] [--max-length L] --json``
   and prints both sets of figures with their relative differences, and checks that otdus splits and
   detokenises the text exactly as the worker and that release did.

The reference runs (:data:`REFERENCE_RUNS`, the default) cover every row of otdus's preset table
(otdus_cli/verify/lm_eval_presets.py) on the first document, a ``max_length`` model argument on two
documents, and the whole test split for one release of each of the three behaviours. Their lm-eval
figures are recorded, with the versions and the command that produced them, in
tests/data/lm_eval_reference.json, which the tests read (tests/test_verify_lm_eval_reference.py).

``--bf16`` runs :data:`BF16_RUNS` instead: lm-eval's stock bfloat16 run (``dtype=bfloat16``, batch
size 1) on SmolLM2-135M (``make smollm2``), against ``otdus ppl --dtype bfloat16 --softmax-dtype model``
(lm-eval's log-softmax and window sums in bfloat16), with otdus's default float32 log-softmax measured
beside it; ``--model``, ``--dtype`` and ``--batch-size`` make such runs of ``--versions``. ``--steps``
runs neither tool but lm-eval's bfloat16 arithmetic one step at a time (docs/perplexity.md).

Usage (from the repository root, with the project's venv; PyPI must be reachable, the Hub need not):

    make lm-eval-check                    # the reference runs; fresh lm-eval figures are also compared
                                          # with the recorded ones
    make lm-eval-check LM_EVAL_ARGS=--quick               # without the whole-split runs
    make lm-eval-record                   # the reference runs, written to tests/data/lm_eval_reference.json
    make lm-eval-check LM_EVAL_ARGS=--bf16                # the bfloat16 run on SmolLM2-135M
    .venv/bin/python -m scripts.check_lm_eval --versions 0.4.5,0.4.11 --max-docs 3 [--max-length 256]

Exit status 0 when every figure agrees within ``--rtol`` (default 1e-6), otdus's split and
detokeniser give lm-eval's documents, and (without ``--record``) each fresh lm-eval figure agrees with
its recorded one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import date
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REFERENCE_FILE = ROOT / "tests" / "data" / "lm_eval_reference.json"
TASK = "wikitext_local_docs"
METRICS = ("word_perplexity", "byte_perplexity", "bits_per_byte")
# keys of the stock task YAML that say where the data comes from (replaced, nothing else is)
SOURCE_KEYS = ("dataset_path", "dataset_name", "dataset_kwargs")
# releases that cannot be imported with transformers 5, and the transformers they get instead
# releases that cannot be imported with today's transformers or datasets, and the pins they get instead
OLDER_DEPENDENCIES = (
    # transformers.data.metrics and datasets.load_metric, imported with lm_eval.tasks
    ("0.4.0", "0.4.1", ("transformers==4.57.6", "datasets<3")),
    ("0.4.5", "0.4.9.2", ("transformers==4.57.6",)),  # transformers.AutoModelForVision2Seq
)
BATCH_SIZE = 16
QUICK_MAX_DOCS = 2  # --quick: the runs on at most this many documents
PACKAGES = ("lm_eval", "transformers", "tokenizers", "torch", "datasets", "accelerate")


@dataclass(frozen=True)
class Run:
    """One lm-eval run: a release, the first ``max_docs`` documents (None: all 62), a max_length; by
    default on the bundled stories260K in float32 at batch size 16, else on ``model`` (a folder,
    relative to the repository root) in ``dtype`` (lm-eval's ``dtype`` model argument, otdus's
    ``--dtype``) at ``batch_size``."""

    version: str
    max_docs: int | None = None
    max_length: int | None = None
    model: str | None = None
    dtype: str | None = None
    batch_size: int = BATCH_SIZE

    @property
    def key(self) -> str:
        docs = "all documents" if self.max_docs is None else f"{self.max_docs} document(s)"
        length = "" if self.max_length is None else f", max_length {self.max_length}"
        model = "" if self.model is None else f", {Path(self.model).name}"
        dtype = "" if self.dtype is None else f", {self.dtype}"
        batch = "" if self.batch_size == BATCH_SIZE else f", batch size {self.batch_size}"
        return f"lm-eval {self.version}, {docs}{length}{model}{dtype}{batch}"

    def model_path(self) -> Path:
        from otdus_cli.bundled import STORIES260K  # the driver's side only: the worker gets a path

        return STORIES260K.resolve() if self.model is None else (ROOT / self.model).resolve()

    def model_args(self, model: str) -> str:
        args = f"pretrained={model}"
        args += "" if self.max_length is None else f",max_length={self.max_length}"
        return args + ("" if self.dtype is None else f",dtype={self.dtype}")

    def lm_eval_command(self) -> str:
        """The lm-eval command line this run is (its task's dataset source changed, see above)."""
        placeholder = "<stories260k>" if self.model is None else self.model
        cmd = ["lm_eval", "--model", "hf", "--model_args", self.model_args(placeholder)]
        cmd += ["--tasks", "wikitext", "--batch_size", str(self.batch_size), "--device", "cpu"]
        return shlex.join(cmd + ([] if self.max_docs is None else ["--limit", str(self.max_docs)]))

    def otdus_args(self, *extra: str) -> list[str]:
        args = ["ppl", self.model or "bundled:stories260k", "--lm-eval", self.version]
        if self.max_docs is not None:
            args += ["--max-docs", str(self.max_docs)]
        if self.max_length is not None:
            args += ["--max-length", str(self.max_length)]
        if self.dtype is not None:
            args += ["--dtype", self.dtype]
        return [*args, *extra, "--batch-size", str(self.batch_size), "--json"]

    def otdus_command(self, *extra: str) -> str:
        return shlex.join(["otdus", *self.otdus_args(*extra)])

    def compared_options(self) -> tuple[str, ...]:
        """otdus's options for lm-eval's figures: in a low-precision dtype, lm-eval's log-softmax and
        window sums in that dtype (the default float32 log-softmax is measured beside it)."""
        return () if self.dtype is None else ("--softmax-dtype", "model")


# One release per row of otdus's preset table on the first document (the last row's also on two, with
# a max_length argument, as is the paper's), and one per behaviour on the whole split.
REFERENCE_RUNS = (
    *(Run(v, 1) for v in ("0.4.0", "0.4.2", "0.4.3", "0.4.9.1", "0.4.9.2", "0.4.13")),
    Run("0.4.2", 2, 128),
    Run("0.4.13", 2, 128),
    *(Run(v) for v in ("0.4.2", "0.4.9.1", "0.4.13")),
)


# lm-eval's stock bfloat16 run (dtype=bfloat16, its default batch size 1) on SmolLM2-135M (`make smollm2`),
# first document (--bf16): otdus ppl --softmax-dtype model against it, otdus's default float32
# log-softmax measured beside it
BF16_RUNS = (Run("0.4.13", 1, None, "models/smollm2-135m", "bfloat16", 1),)


# -- worker (runs inside an lm-eval venv; stdlib + lm_eval only, nothing from otdus) --------------------
def document_level_pages(raw: str) -> list[str]:
    """WikiText split into articles by the rule of the ``EleutherAI/wikitext_document_level`` dataset:
    lines split on ``\\n``; a line that reads `` = Title = `` once ``= = =`` and ``= =`` are squeezed
    starts a new page; pages are their lines joined with ``\\n``; a blank page before the first title
    is dropped. (Written here, apart from otdus's own split, so lm-eval's input does not depend on it.)"""
    pages: list[str] = []
    lines: list[str] = []
    for line in raw.split("\n"):
        squeezed = line.replace("= = =", "===").replace("= =", "==").strip()
        if squeezed.startswith("= ") and squeezed.endswith(" ="):
            if "\n".join(lines).strip():
                pages.append("\n".join(lines))
            lines = []
        lines.append(line)
    pages.append("\n".join(lines))
    return pages


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

    run = Run(args.version, args.max_docs, args.max_length, args.model, args.dtype, args.batch_size)
    pages = document_level_pages(Path(args.raw).read_text(encoding="utf-8"))
    docs = Path(args.out).with_name("wikitext_document_level_test.jsonl")
    docs.write_text("".join(json.dumps({"page": p}) + "\n" for p in pages))
    stock = Path(lm_eval.tasks.__file__).parent / "wikitext"
    # beside the stock tasks, in this throwaway venv: lm-eval 0.4.9.2 fails to list a task from
    # an include_path outside its own tasks folder
    task_dir = stock.parent / "otdus_local_wikitext"
    task_dir.mkdir(exist_ok=True)
    shutil.copy(stock / "preprocess_wikitext.py", task_dir / "preprocess_wikitext.py")
    (task_dir / "wikitext_local.yaml").write_text(
        local_task_yaml((stock / "wikitext.yaml").read_text(), docs)
    )
    if hasattr(lm_eval.tasks, "TaskManager"):
        registry = {"task_manager": lm_eval.tasks.TaskManager()}
    else:  # 0.4.0-0.4.1: a global registry that initialize_tasks() fills, as their command line does
        lm_eval.tasks.initialize_tasks()
        registry = {}
    start = time.time()
    res = lm_eval.simple_evaluate(
        model="hf",
        model_args=run.model_args(args.model),
        tasks=[TASK],
        **registry,
        batch_size=run.batch_size,
        device="cpu",
        limit=run.max_docs,
        log_samples=True,
    )
    result = res["results"][TASK]
    # each document's log-likelihood (the sum over its windows), in document order
    samples = sorted(res["samples"][TASK], key=lambda s: s["doc_id"])
    doc_ll = [float(s["filtered_resps"][0]) for s in samples]
    out = {
        "environment": {
            **{p: metadata.version(p) for p in PACKAGES},
            "python": platform.python_version(),
        },
        "seconds": round(time.time() - start, 1),
        "pages": pages,
        "detokenized": [wikitext_detokenizer({"page": p}) for p in pages],
        "figures": {m: result[f"{m},none"] for m in METRICS},
        "doc_loglikelihoods": doc_ll,
    }
    Path(args.out).write_text(json.dumps(out))


# -- driver (runs in the project venv) ------------------------------------------------------------
def dependency_pins(version: str, transformers: str | None) -> list[str]:
    """What goes into lm-eval ``version``'s venv besides lm_eval itself: the project's torch, and its
    transformers unless the release needs older ones (``transformers`` overrides)."""
    from otdus_cli.verify.lm_eval_presets import parse_version

    release = parse_version(version)
    older = [
        p
        for first, last, pins in OLDER_DEPENDENCIES
        if parse_version(first) <= release <= parse_version(last)
        for p in pins
    ]
    pins = [f"torch=={metadata.version('torch').split('+')[0]}"]
    pins += [p for p in older if not p.startswith("transformers")]
    default = next(
        (p for p in older if p.startswith("transformers")),
        f"transformers=={metadata.version('transformers')}",
    )
    pins.append(f"transformers=={transformers}" if transformers else default)
    return [*pins, "accelerate"]


def ensure_venv(version: str, root: Path, fresh: bool, transformers: str | None) -> Path:
    """A venv with lm_eval==version and :func:`dependency_pins` (created once, kept)."""
    venv = root / version
    python = venv / "bin" / "python"
    marker = venv / ".otdus-installed"
    pins = [f"lm_eval=={version}", *dependency_pins(version, transformers)]
    wanted = " ".join(pins) + "\n"
    if fresh or not marker.is_file() or marker.read_text() != wanted:
        if venv.exists():
            shutil.rmtree(venv)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        print(f"installing {' '.join(pins)} into {venv} ...", flush=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *pins], check=True)
        marker.write_text(wanted)
    return python


def run_lm_eval(python: Path, run: Run, raw: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [str(python), __file__, "--worker", "--version", run.version, "--model", str(run.model_path())]
        cmd += ["--raw", str(raw), "--out", str(out), "--batch-size", str(run.batch_size)]
        if run.dtype is not None:
            cmd += ["--dtype", run.dtype]
        if run.max_docs is not None:
            cmd += ["--max-docs", str(run.max_docs)]
        if run.max_length is not None:
            cmd += ["--max-length", str(run.max_length)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        env.pop("PYTHONPATH", None)
        subprocess.run(cmd, check=True, env=env, cwd=tmp)
        return json.loads(out.read_text())


def run_otdus(run: Run, *extra: str) -> dict:
    """``otdus ppl ... [extra] --json`` in this venv: the figures, counts and settings it reports."""
    start = time.time()
    cmd = [sys.executable, "-c", "from otdus_cli.entry import main; main()", *run.otdus_args(*extra)]
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    m = json.loads(proc.stdout)["metrics"]
    counts = ("n_docs", "n_windows", "n_tokens", "n_words", "n_bytes")
    return {
        "seconds": round(time.time() - start, 1),
        "settings": m["settings"],
        "loglikelihood": m["loglikelihood"],
        **{k: m[k] for k in counts},
        "figures": {k: m[k] for k in METRICS},
    }


def lm_eval_steps(run: Run) -> dict:
    """lm-eval's low-precision arithmetic one step at a time, on otdus's windows (the script checks that
    they are lm-eval's documents) with the transformers model in ``run.dtype``, one window per forward:
    each step's log-likelihood and word perplexity. ``float32_softmax``: otdus's default (log-softmax
    in float32, sums in float64); ``dtype_softmax``: the log-softmax in the model's dtype, sums in
    float64; ``dtype_softmax_dtype_sums``: each window's sum also in that dtype, as lm-eval."""
    import torch
    from transformers import AutoModelForCausalLM

    from otdus_cli.verify.eval_set import make_eval_set

    folder = run.model_path()
    eval_set = make_eval_set(folder, lm_eval=run.version, max_docs=run.max_docs, max_length=run.max_length)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, run.dtype)).eval()
    sums: dict[str, list[float]] = {
        "float32_softmax": [],
        "dtype_softmax": [],
        "dtype_softmax_dtype_sums": [],
    }
    with torch.inference_mode():
        for w in eval_set.windows:
            logits = model(torch.tensor([w.input_ids])).logits[0, w.offset :]
            targets = torch.tensor(w.targets)[:, None]
            in_dtype = torch.log_softmax(logits, dim=-1).gather(-1, targets)[:, 0]
            sums["float32_softmax"].append(
                float(torch.log_softmax(logits.float(), -1).gather(-1, targets).double().sum())
            )
            sums["dtype_softmax"].append(float(in_dtype.double().sum()))
            sums["dtype_softmax_dtype_sums"].append(float(in_dtype.sum()))
    words = sum(eval_set.words)
    return {
        step: {"window_loglikelihoods": v, "word_perplexity": math.exp(-sum(v) / words)}
        for step, v in sums.items()
    }


def rel_diffs(ours: dict, theirs: dict) -> dict:
    return {m: abs(ours[m] - theirs[m]) / abs(theirs[m]) for m in METRICS}


def read_reference(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {"runs": []}


def write_reference(path: Path, reference: dict, measured: dict[Run, dict], command: str) -> None:
    """Replace (or add) the entries of the runs just measured; keep the others."""
    entries = {e["run"]: e for e in reference.get("runs", [])}
    for run, result in measured.items():
        lm, ours = result["lm_eval"], result["otdus"]
        entries[run.key] = {
            "run": run.key,
            "lm_eval": run.version,
            "max_docs": run.max_docs,
            "max_length": run.max_length,
            "model": run.model,  # None: the bundled stories260K
            "dtype": run.dtype,  # None: the checkpoint's float32
            "batch_size": run.batch_size,
            "figures": lm["figures"],  # lm-eval's: what the tests pin
            "lm_eval_doc_loglikelihoods": lm.get("doc_loglikelihoods"),
            "environment": lm["environment"],
            "lm_eval_command": run.lm_eval_command(),
            "recorded_by": command,
            "recorded_on": date.today().isoformat(),
            "otdus_command": run.otdus_command(*run.compared_options()),
            "otdus_loglikelihood": ours["loglikelihood"],
            "otdus_rel_diff": result["rel_diff"],
            "otdus_counts": {k: ours[k] for k in ("n_docs", "n_windows", "n_tokens", "n_words", "n_bytes")},
            "otdus_settings": ours["settings"],
        }
        if "otdus_float32_softmax" in result:  # otdus's default beside lm-eval's arithmetic
            entries[run.key]["otdus_float32_softmax"] = result["otdus_float32_softmax"]
    order = {r.key: i for i, r in enumerate((*REFERENCE_RUNS, *BF16_RUNS))}
    runs = sorted(entries.values(), key=lambda e: (order.get(e["run"], len(order)), e["run"]))
    out = {
        "about": (
            "wikitext figures (word perplexity, byte perplexity, bits per byte) of real lm-eval releases "
            "on the bundled stories260K, float32 CPU (and, where an entry names a model and a dtype, "
            "on that model folder in that dtype), stock hf model and wikitext task with only the "
            "dataset source changed: the document-level WikiText-2 test split rebuilt from "
            "otdus_cli/data/wikitext-2-raw-test.txt.gz (scripts/check_lm_eval.py). "
            "tests/test_verify_lm_eval_reference.py pins otdus ppl --lm-eval (with the entry's "
            "otdus_command options) to them."
        ),
        "runs": runs,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", help="comma-separated lm-eval versions (default: the reference runs)")
    ap.add_argument("--max-docs", type=int, help="with --versions: the first N documents (default all 62)")
    ap.add_argument("--max-length", type=int, help="with --versions: lm-eval's max_length model argument")
    ap.add_argument("--model", help="with --versions: a model folder (default: the bundled stories260K)")
    ap.add_argument("--dtype", help="with --versions: lm-eval's dtype model argument, otdus's --dtype")
    ap.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="with --versions (default 16)")
    ap.add_argument(
        "--steps",
        action="store_true",
        help="instead of lm-eval and otdus: lm-eval's arithmetic step by step (the runs with a --dtype)",
    )
    ap.add_argument("--quick", action="store_true", help="only the runs on one or two documents")
    ap.add_argument(
        "--bf16", action="store_true", help="the bfloat16 runs on SmolLM2-135M (make smollm2) instead"
    )
    ap.add_argument("--record", type=Path, help="write the lm-eval figures here (reference file format)")
    ap.add_argument("--reference", type=Path, default=REFERENCE_FILE, help="recorded figures to compare")
    ap.add_argument("--venv-root", type=Path, default=Path(tempfile.gettempdir()) / "otdus-lm-eval")
    ap.add_argument("--fresh", action="store_true", help="recreate the venvs")
    ap.add_argument("--transformers", help="transformers version for every lm-eval venv")
    ap.add_argument("--rtol", type=float, default=1e-6)
    ap.add_argument("--json", type=Path, help="write every measurement here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--version", help=argparse.SUPPRESS)
    ap.add_argument("--raw", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0

    from otdus_cli.bundled import STORIES260K
    from otdus_cli.verify.text import load_wikitext_raw, wikitext_detokenize, wikitext_pages

    if args.versions:
        versions = [v.strip() for v in args.versions.split(",") if v.strip()]
        options = (args.max_docs, args.max_length, args.model, args.dtype, args.batch_size)
        runs = [Run(v, *options) for v in versions]
    else:
        chosen = BF16_RUNS if args.bf16 else REFERENCE_RUNS
        runs = [r for r in chosen if not (args.quick and (r.max_docs or QUICK_MAX_DOCS + 1) > QUICK_MAX_DOCS)]
    if args.steps:
        steps = {r.key: lm_eval_steps(r) for r in runs if r.dtype is not None}
        for key, result in steps.items():
            for step, x in result.items():
                print(
                    f"{key}: {step}: window sums {x['window_loglikelihoods']}, "
                    f"word_perplexity {x['word_perplexity']!r}"
                )
        if args.json:
            args.json.write_text(json.dumps(steps, indent=2) + "\n")
        return 0
    command = shlex.join(["python", "-m", "scripts.check_lm_eval", *sys.argv[1:]])
    recorded = {e["run"]: e for e in read_reference(args.reference)["runs"]}
    raw_text = load_wikitext_raw()  # sha256-checked
    ours_pages = wikitext_pages(raw_text)
    measured: dict[Run, dict] = {}
    failed: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "wiki.test.raw"
        raw.write_text(raw_text, encoding="utf-8")
        for run in runs:
            try:
                python = ensure_venv(run.version, args.venv_root, args.fresh, args.transformers)
                print(f"{run.key}: running lm-eval's wikitext task ...", flush=True)
                theirs = run_lm_eval(python, run, raw)
                print(f"{run.key}: {run.otdus_command(*run.compared_options())} ...", flush=True)
                ours = run_otdus(run, *run.compared_options())
                if run.compared_options():
                    print(f"{run.key}: {run.otdus_command()} ...", flush=True)
                    default = run_otdus(run)
            except subprocess.CalledProcessError as exc:
                print(f"{run.key} failed: {exc}\n{exc.stderr or ''}", flush=True)
                failed[run.key] = str(exc)
                continue
            pages, detok = theirs.pop("pages"), theirs.pop("detokenized")
            result = {
                "lm_eval": theirs,
                "otdus": ours,
                "rel_diff": rel_diffs(ours["figures"], theirs["figures"]),
                **(
                    {
                        "otdus_float32_softmax": {
                            "otdus_command": run.otdus_command(),
                            "figures": default["figures"],
                            "loglikelihood": default["loglikelihood"],
                            "rel_diff": rel_diffs(default["figures"], theirs["figures"]),
                        }
                    }
                    if run.compared_options()
                    else {}
                ),
                "split_mismatch": pages != ours_pages,
                "detokenizer_mismatches": sum(
                    wikitext_detokenize(p) != d for p, d in zip(pages, detok, strict=True)
                ),
            }
            if run.key in recorded and not args.record:
                result["drift"] = rel_diffs(theirs["figures"], recorded[run.key]["figures"])
            measured[run] = result
            if args.record:  # after every run, so a later failure keeps what was measured
                write_reference(args.record, read_reference(args.record), {run: result}, command)
            if args.json:
                report = {r.key: x for r, x in measured.items()}
                args.json.write_text(json.dumps({"runs": report, "failed": failed}, indent=2) + "\n")
    if args.record:
        print(f"recorded {len(measured)} run(s) in {args.record}")

    print(f"\nWikiText-2 test documents, CPU ({STORIES260K.name} in float32 unless the run names a model)")
    print("| run | transformers | metric | lm-eval | otdus --lm-eval | rel. diff |")
    print("|---|---|---|---|---|---|")
    for run, r in measured.items():
        env, a, b = r["lm_eval"]["environment"], r["lm_eval"]["figures"], r["otdus"]["figures"]
        options = " ".join(run.compared_options())
        for m in METRICS:
            print(
                f"| {run.key} | {env['transformers']} | {m} | {a[m]!r} | {b[m]!r} {options} | "
                f"{r['rel_diff'][m]:.1e} |"
            )
            if "otdus_float32_softmax" in r:
                f32 = r["otdus_float32_softmax"]
                print(
                    f"| {run.key} | {env['transformers']} | {m} | {a[m]!r} | {f32['figures'][m]!r} "
                    f"--softmax-dtype float32 | {f32['rel_diff'][m]:.1e} |"
                )
    problems = [f"{key}: lm-eval failed" for key in failed]
    for run, r in measured.items():
        o = r["otdus"]
        print(
            f"{run.key}: {o['n_docs']} documents, {o['n_words']:,} words, {o['n_bytes']:,} bytes, "
            f"{o['n_windows']:,} windows, {o['n_tokens']:,} tokens (otdus settings {o['settings']}); "
            f"lm-eval {r['lm_eval']['seconds']:.0f} s, otdus {o['seconds']:.0f} s"
            + (f"; lm-eval vs its recorded figures {max(r['drift'].values()):.1e}" if "drift" in r else "")
        )
        worst = max(r["rel_diff"].values())
        if worst > args.rtol:
            problems.append(f"{run.key}: otdus differs from lm-eval by {worst:.2e}")
        if r["split_mismatch"] or r["detokenizer_mismatches"]:
            problems.append(
                f"{run.key}: otdus's documents differ from lm-eval's (split differs: {r['split_mismatch']}, "
                f"detokenised documents that differ: {r['detokenizer_mismatches']})"
            )
        if "drift" in r and max(r["drift"].values()) > args.rtol:
            problems.append(
                f"{run.key}: lm-eval now differs from its recorded figures by {max(r['drift'].values()):.2e}"
            )
    for line in problems:
        print(f"MISMATCH {line}")
    if not problems:
        worst = max((x for r in measured.values() for x in r["rel_diff"].values()), default=0.0)
        print(f"\nMATCH ({len(measured)} runs, max relative difference {worst:.2e}, tolerance {args.rtol:g})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
