"""`otdus ppl --lm-eval V` against the figures real lm-eval V computed on stories260K (and in bfloat16
on SmolLM2-135M, where `--softmax-dtype model` takes lm-eval's arithmetic).

The figures are data: tests/data/lm_eval_reference.json, written by `make lm-eval-record`
(scripts/check_lm_eval.py --record), each with the lm-eval, transformers and torch versions and the
command that produced it. Runs on the whole test split take minutes of CPU each: they are checked
here only with OTDUS_LM_EVAL_FULL=1 (`make lm-eval-check` checks them against fresh lm-eval runs).
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from otdus_cli.bundled import STORIES260K
from otdus_cli.cli import app
from otdus_cli.verify.lm_eval_presets import LM_EVAL_NEWEST, RELEASES, lm_eval_releases, wikitext_tokenization
from otdus_cli.verify.metrics import load_tokenizer

pytestmark = [pytest.mark.compat]

REFERENCE = json.loads((Path(__file__).parent / "data" / "lm_eval_reference.json").read_text())
# entries on the bundled stories260K in float32; those naming a model are lm-eval's bfloat16 runs
RUNS = {entry["run"]: entry for entry in REFERENCE["runs"] if entry.get("model") is None}
BF16_RUNS = {entry["run"]: entry for entry in REFERENCE["runs"] if entry.get("model") is not None}
METRICS = ("word_perplexity", "byte_perplexity", "bits_per_byte")
RTOL = 1e-6
WHOLE_SPLIT = os.environ.get("OTDUS_LM_EVAL_FULL") == "1"
runner = CliRunner()


def ppl(version: str | None, max_docs: int | None, max_length: int | None) -> dict:
    args = ["ppl", "bundled:stories260k", "--batch-size", "8", "--device", "cpu", "--json"]
    args += [] if version is None else ["--lm-eval", version]
    args += [] if max_docs is None else ["--max-docs", str(max_docs)]
    args += [] if max_length is None else ["--max-length", str(max_length)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["metrics"]


def rel_diff(metrics: dict, entry: dict) -> float:
    return max(abs(metrics[m] / entry["figures"][m] - 1) for m in METRICS)


def entries() -> list:
    skip = pytest.mark.skip(reason="whole split: minutes of CPU; OTDUS_LM_EVAL_FULL=1 runs it")
    params = []
    for key, entry in RUNS.items():
        slow = entry["max_docs"] is None and not WHOLE_SPLIT
        params.append(pytest.param(entry, id=key, marks=skip if slow else ()))
    return params


@pytest.mark.parametrize("entry", entries())
def test_ppl_matches_real_lm_eval(entry):
    m = ppl(entry["lm_eval"], entry["max_docs"], entry["max_length"])
    assert m["reproduces"] == f"lm-eval {entry['lm_eval']}"
    assert m["context"] == (entry["max_length"] or 512)
    assert rel_diff(m, entry) < RTOL, {k: (m[k], entry["figures"][k]) for k in METRICS}


def test_the_default_is_the_newest_lm_eval():
    entry = RUNS[f"lm-eval {LM_EVAL_NEWEST}, 1 document(s)"]
    m = ppl(None, 1, None)
    assert m["reproduces"] == f"lm-eval {LM_EVAL_NEWEST}" and rel_diff(m, entry) < RTOL


def test_a_wrong_prefix_or_max_length_misses_the_pinned_figures():
    """The pins tell settings apart: lm-eval 0.4.2's figures on two documents at max_length 128 are
    missed, by a hundred times the tolerance or more, with 0.4.3's prefix (BOS, not EOS) or one token
    less of window."""
    entry = RUNS["lm-eval 0.4.2, 2 document(s), max_length 128"]
    assert rel_diff(ppl("0.4.2", 2, 128), entry) < RTOL
    assert rel_diff(ppl("0.4.3", 2, 128), entry) > 100 * RTOL
    assert rel_diff(ppl("0.4.2", 2, 127), entry) > 100 * RTOL


def test_every_preset_row_was_checked_against_real_lm_eval():
    """A run on the first document for every row of the preset table, and one on the whole split for
    each way the bundled Llama tokenizer's documents are fed (</s> t..., <s> t..., <s> <s> t...)."""
    first_doc = {lm_eval_releases(e["lm_eval"]) for e in RUNS.values() if e["max_docs"] == 1}
    assert first_doc == set(RELEASES)
    tok = load_tokenizer(STORIES260K)
    cfg = {"model_type": "llama", "max_position_embeddings": 512}

    def feeding(version: str) -> tuple:
        t = wikitext_tokenization(version, cfg, tok)
        return t.prefix_token_id, t.add_special_tokens

    whole = {feeding(e["lm_eval"]) for e in RUNS.values() if e["max_docs"] is None}
    assert whole == {feeding(r.first) for r in RELEASES} and len(whole) == 3


@pytest.mark.slow
@pytest.mark.parametrize("entry", list(BF16_RUNS.values()), ids=list(BF16_RUNS))
def test_ppl_in_bfloat16_with_lm_eval_s_softmax_dtype_matches_its_stock_run(entry, smollm2):
    """lm-eval's stock bfloat16 run takes the log-softmax in bfloat16 and sums each window in it:
    `--softmax-dtype model` gives its figures; otdus's default (float32 log-softmax) its own, recorded
    beside them (docs/perplexity.md gives the difference)."""
    default = entry["otdus_float32_softmax"]
    for command, figures in (
        (entry["otdus_command"], entry["figures"]),
        (default["otdus_command"], default["figures"]),
    ):
        args = shlex.split(command)[1:]
        assert args[1] == entry["model"] and Path(entry["model"]).name == smollm2.name
        result = runner.invoke(app, [args[0], str(smollm2), *args[2:]])
        assert result.exit_code == 0, result.output
        m = json.loads(result.stdout)["metrics"]
        assert rel_diff(m, {"figures": figures}) < RTOL, {k: (m[k], figures[k]) for k in METRICS}
    assert "--softmax-dtype model" in entry["otdus_command"] and entry["dtype"] == "bfloat16"


def test_each_figure_names_the_release_and_command_that_produced_it():
    for key, entry in {**RUNS, **BF16_RUNS}.items():
        assert entry["environment"]["lm_eval"] == entry["lm_eval"], key
        assert {"transformers", "torch", "tokenizers"} <= set(entry["environment"]), key
        assert entry["recorded_by"].startswith(
            ("python -m scripts.check_lm_eval", "python scripts/check_lm_eval.py")
        ), key
        assert entry["lm_eval_command"].startswith("lm_eval --model hf"), key
