"""verify on every family's tiny model: PARITY for every zero-init expansion, the same verdict every time.

The tiny models are built with the installed transformers (tests/support/tiny_models.py), so under
`make test-compat` this is the expand -> verify pass on transformers 4.57.6, and under `make test` on the
newest 5.x.
"""

from __future__ import annotations

import pytest

from otdus_cli.expand import expand
from otdus_cli.methods.lesa import LesaOptions
from otdus_cli.options import ExpandOptions
from otdus_cli.verify.compare import verify_expansion
from tests.support.eval_sets import random_eval_set
from tests.support.tiny_models import DENSE_TYPES, MOE_TYPES, quick_or_slow

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.compat]


# longer than the tiny models' sliding windows (16); two equal lengths batch together
def zero_init_expansions(model_type: str) -> list[ExpandOptions]:
    """Every way otdus expands a model function-preservingly: each method with zero-init, at the
    placements the methods use (LESA: dense families only; it refuses MoE)."""
    depth = 6 if model_type == "gemma3_text" else 4
    options = [
        ExpandOptions(method="llama-pro", layers=depth // 2),
        ExpandOptions(method="copy", layers=2, zero_init=True, position="bottom"),
        ExpandOptions(method="average", layers=2, zero_init=True, position="mid"),
        ExpandOptions(method="random", layers=2, zero_init=True),
        ExpandOptions(method="interpose", layers=2, zero_init=True),
        ExpandOptions(method="stack", layers=depth, zero_init=True),
        ExpandOptions(method="ot", layers=depth // 2),  # MoE: experts, then neurons (methods/ot/moe.py)
    ]
    if model_type in DENSE_TYPES:
        options.append(ExpandOptions(method="lesa", layers=depth // 2, lesa=LesaOptions(epochs=2)))
    return options


@pytest.mark.parametrize("model_type", quick_or_slow(DENSE_TYPES + MOE_TYPES))
def test_every_zero_init_expansion_holds_parity(tiny_models, tmp_path, model_type):
    plan = random_eval_set()
    for i, options in enumerate(zero_init_expansions(model_type)):
        out = tmp_path / f"{i}-{options.method}"
        expand(str(tiny_models[model_type]), out, options)
        report = verify_expansion(tiny_models[model_type], out, plan)
        assert report.expect_parity, options.method
        assert report.exit_code == 0 and report.verdict.startswith("PARITY"), (options.method, report.verdict)
        assert report.logits_equal and report.first_divergence is None


@pytest.mark.parametrize("model_type", DENSE_TYPES + MOE_TYPES)
def test_verify_gives_the_same_report_every_time(tiny_models, tmp_path, model_type):
    # the evaluator once ran RoPE on uninitialised memory under transformers 4.57: a verdict that
    # changed from run to run
    depth = 6 if model_type == "gemma3_text" else 4
    out = tmp_path / "llama-pro"
    expand(str(tiny_models[model_type]), out, ExpandOptions(method="llama-pro", layers=depth // 2))
    plan = random_eval_set(seed=1)
    reports = [verify_expansion(tiny_models[model_type], out, plan).to_dict() for _ in range(3)]
    for report in reports:  # seconds per phase differ from run to run; everything else may not
        assert report.pop("timings")["total_s"] > 0
    assert reports[0]["verdict"].startswith("PARITY")
    assert reports[1] == reports[0] and reports[2] == reports[0]
