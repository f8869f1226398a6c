"""verify and ppl refuse to give figures when the streamed evaluator does not reproduce transformers.

The faults are planted in the evaluator (wrong rotary frequencies from the transformers adapter, wrong
recorded layer arguments), never in the check: the check must see them by itself.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from otdus_cli.bundled import TINYSTORIES_SAMPLE
from otdus_cli.cli import app
from otdus_cli.errors import OtdusError
from otdus_cli.expand import expand
from otdus_cli.options import ExpandOptions
from otdus_cli.verify import hf_compat, self_check
from otdus_cli.verify.compare import verify_expansion
from otdus_cli.verify.perplexity import perplexity
from otdus_cli.verify.streaming import StreamedModel
from tests.support.eval_sets import random_eval_set

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.compat]

PPL = ["ppl", "bundled:stories260k", "--protocol", "token", "--token-mode", "documents"]
PPL += ["--text", str(TINYSTORIES_SAMPLE), "--max-tokens", "300", "--json"]


@pytest.fixture()
def wrong_rotary_frequencies(monkeypatch):
    """The adapter hands the evaluator rotary frequencies 1% off (the 4.57 bug gave it garbage)."""
    build = hf_compat.build_skeleton

    def skewed(*args, **kwargs):
        model, values = build(*args, **kwargs)
        for buffers in values.values():
            for name, value in buffers.items():
                if "inv_freq" in name:
                    value.mul_(1.01)
        return model, values

    monkeypatch.setattr(hf_compat, "build_skeleton", skewed)


@pytest.fixture()
def same_arguments_for_every_layer(monkeypatch):
    """The stand-ins hand every layer the arguments recorded for layer 0 (for Gemma 2: its sliding-window
    mask, also for the global layers)."""
    record = StreamedModel._record

    def wrong(self, ids):
        first, kwargs = record(self, ids)
        return first, {i: kwargs[0] for i in kwargs}

    monkeypatch.setattr(StreamedModel, "_record", wrong)


def test_ppl_passes_its_self_check():
    result = CliRunner().invoke(app, PPL)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["metrics"]["n_tokens"] > 0


def test_ppl_refuses_when_the_evaluator_is_wrong(wrong_rotary_frequencies):
    result = CliRunner().invoke(app, PPL)
    assert result.exit_code == 2 and not result.stdout.strip()
    assert result.stderr.startswith("error: self-check failed") and len(result.stderr.splitlines()) == 1
    assert "whole model" in result.stderr and "stories260k" in result.stderr


def test_verify_refuses_when_the_evaluator_is_wrong(tiny_models, tmp_path, wrong_rotary_frequencies):
    out = tmp_path / "deeper"
    expand(str(tiny_models["qwen3"]), out, ExpandOptions(method="llama-pro", layers=2))
    with pytest.raises(OtdusError, match="self-check failed"):
        verify_expansion(tiny_models["qwen3"], out, random_eval_set())


def test_large_models_check_against_the_forward_with_layers_loaded_in_turn(
    tiny_models, monkeypatch, same_arguments_for_every_layer
):
    monkeypatch.setattr(self_check, "WHOLE_MODEL_MAX_BYTES", 0)  # as if too large to load whole
    with pytest.raises(OtdusError, match="self-check failed.*each decoder layer loaded in turn"):
        perplexity(tiny_models["gemma2"], random_eval_set())


@pytest.mark.parametrize("model_type", ["gemma2", "qwen2_moe"])
def test_large_model_check_passes_on_a_sound_evaluator(tiny_models, monkeypatch, model_type):
    monkeypatch.setattr(self_check, "WHOLE_MODEL_MAX_BYTES", 0)
    plan = random_eval_set()
    report = perplexity(tiny_models[model_type], plan)
    assert report.metrics.n_tokens == plan.n_tokens
    monkeypatch.setattr(self_check, "WHOLE_MODEL_MAX_BYTES", 2**40)
    assert perplexity(tiny_models[model_type], plan).metrics == report.metrics
