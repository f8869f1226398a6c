"""`perplexity` (otdus ppl's library call): lm-eval's arithmetic with softmax_dtype="model"."""

from __future__ import annotations

import math

import pytest
import torch

from otdus_cli.bundled import STORIES260K
from otdus_cli.errors import OtdusError
from otdus_cli.verify.eval_set import make_eval_set
from otdus_cli.verify.perplexity import perplexity
from tests.support.tiny_models import load_causal_lm

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.compat]


def lm_eval_loglikelihood(eval_set, dtype: torch.dtype) -> float:
    """What lm-eval's hf model (batch size 1, no softmax_dtype argument) computes, written out: the
    transformers model in ``dtype``, log-softmax in the logits' dtype, each window's log-probs summed
    by torch in that dtype, the windows' sums added as Python floats."""
    model = load_causal_lm(STORIES260K, dtype=dtype)
    total = 0.0
    with torch.no_grad():
        for w in eval_set.windows:
            logprobs = torch.log_softmax(model(torch.tensor([w.input_ids])).logits, dim=-1)[:, w.offset :]
            picked = torch.gather(logprobs, 2, torch.tensor([w.targets])[..., None]).squeeze(-1)
            total += float(picked.sum())
    return total


def test_model_softmax_dtype_gives_lm_eval_s_bfloat16_figures_exactly():
    eval_set = make_eval_set(STORIES260K, max_docs=1)  # 7 windows of up to 512 tokens
    ours = perplexity(STORIES260K, eval_set, dtype="bfloat16", batch_size=1, softmax_dtype="model")
    expected = lm_eval_loglikelihood(eval_set, torch.bfloat16)
    m = ours.metrics
    assert m.loglikelihood == expected and m.settings["softmax_dtype"] == "bfloat16"
    assert m.word_perplexity == math.exp(-expected / m.n_words)
    # each window's bfloat16 sum is rounded to 8 significant bits: a whole number of nats here
    assert expected == int(expected)
    # the default takes the log-softmax in float32 and sums in float64: another figure
    default = perplexity(STORIES260K, eval_set, dtype="bfloat16", batch_size=1).metrics
    assert default.settings["softmax_dtype"] == "float32" and default.loglikelihood != expected
    assert abs(default.loglikelihood / expected - 1) < 1e-2


def test_model_softmax_dtype_in_float32_sums_each_window_in_float32():
    eval_set = make_eval_set(STORIES260K, max_docs=1)
    ours = perplexity(STORIES260K, eval_set, batch_size=1, softmax_dtype="model").metrics
    assert ours.settings["softmax_dtype"] == "float32"
    assert ours.loglikelihood == pytest.approx(lm_eval_loglikelihood(eval_set, torch.float32), rel=1e-6)


def test_an_unknown_softmax_dtype_is_refused():
    eval_set = make_eval_set(STORIES260K, max_docs=1, max_tokens=10)
    with pytest.raises(OtdusError, match="softmax dtype must be one of float32, model"):
        perplexity(STORIES260K, eval_set, softmax_dtype="bfloat16")
