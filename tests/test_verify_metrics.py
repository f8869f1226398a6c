"""Perplexity protocols: lm-eval rolling windows, GPTQ windows, metric formulas."""

from __future__ import annotations

import math
import re

import pytest
import torch

from otdus_cli.errors import OtdusError
from otdus_cli.verify.lm_eval_presets import wikitext_tokenization
from otdus_cli.verify.metrics import (
    EvalSet,
    Window,
    batch_target_logprobs,
    metrics_from_logprobs,
    rolling_eval_set,
    rolling_windows,
    target_logprobs,
    token_eval_set,
    window_loglikelihood,
)
from otdus_cli.verify.text import Corpus

PREFIX = -1


@pytest.mark.parametrize("n", [0, 1, 2, 5, 7, 8, 9, 16, 17, 30])
@pytest.mark.parametrize("max_length", [1, 2, 3, 8])
def test_rolling_windows_score_every_token_once_with_full_context(n, max_length):
    tokens = list(range(100, 100 + n))
    windows = rolling_windows(tokens, PREFIX, max_length)
    scored = [t for _, targets in windows for t in targets]
    assert scored == tokens  # every token exactly once, in order
    for k, (inp, targets) in enumerate(windows):
        assert 1 <= len(targets) <= len(inp) <= max_length
        offset = len(inp) - len(targets)
        for t, target in enumerate(targets):
            pos = offset + t
            # the input position that predicts `target` holds the token just before it
            before = tokens[target - 100 - 1] if target > 100 else PREFIX
            assert inp[pos] == before
            # and the window is the contiguous history ending there (as much as fits)
            history = ([PREFIX] + tokens)[: target - 100 + 1][-(pos + 1) :]
            assert inp[: pos + 1] == history
        if k > 0:
            assert len(inp) == max_length  # later windows always carry a full context


def test_rolling_windows_example():
    assert rolling_windows([1, 2, 3, 4, 5], 0, 2) == [([0, 1], [1, 2]), ([2, 3], [3, 4]), ([3, 4], [5])]


class FakeTokenizer:
    """Characters as tokens; BOS 1, EOS 2 (ids of letters start at 10)."""

    bos_token_id = 1
    eos_token_id = 2
    model_max_length = int(1e30)  # transformers: "no limit"

    def __init__(self, add_bos=True):
        self.add_bos = add_bos

    def __call__(self, text, add_special_tokens=True):
        ids = [10 + ord(c) % 50 for c in text]
        if add_special_tokens and self.add_bos:
            ids = [self.bos_token_id] + ids
        return {"input_ids": ids}

    def decode(self, token_id):
        return {1: "<s>", 2: "</s>"}.get(token_id, "?")


def test_plan_rolling_detokenizes_but_counts_raw_words():
    pages = [" = T = \n a , b @-@ c \n", " = U = \n d \n"]
    corpus = Corpus("wiki", pages, "wikitext")
    tokenizer = FakeTokenizer()
    plan = rolling_eval_set(corpus, tokenizer, wikitext_tokenization("0.4.9.1", {}, tokenizer, 4))
    assert plan.protocol == "wikitext" and plan.n_docs == 2
    assert plan.words == [len(re.split(r"\s+", p)) for p in pages]
    assert plan.bytes == [len(p.encode()) for p in pages]
    detok = " = T =\na, b-c\n"
    assert plan.n_tokens == len(detok) + len(" = U =\nd\n")
    assert plan.windows[0].input_ids[0] == 1  # BOS prefix, no BOS inside the text
    assert all(w.doc in (0, 1) for w in plan.windows)
    assert plan.reproduces == "lm-eval 0.4.9.1" and plan.settings["lm_eval_releases"] == "0.4.4-0.4.9.1"
    with_specials = rolling_eval_set(corpus, tokenizer, wikitext_tokenization("0.4.13", {}, tokenizer, 4))
    assert with_specials.n_tokens == plan.n_tokens + 2  # the tokenizer's own BOS is scored too
    short = rolling_eval_set(corpus, tokenizer, wikitext_tokenization(None, {}, tokenizer, 4), max_tokens=1)
    assert short.n_docs == 1


def test_plan_token_joined_is_gptq_style():
    corpus = Corpus("t", ["a" * 30, "b" * 30], "text")
    plan = token_eval_set(corpus, FakeTokenizer(), 16)
    # "\n\n"-joined: 62 chars + BOS = 63 tokens -> 3 disjoint windows of 16, tail dropped
    assert len(plan.windows) == 3 and all(len(w.input_ids) == 16 for w in plan.windows)
    assert plan.n_tokens == 3 * 15
    assert plan.windows[0].input_ids[0] == 1
    assert all(w.targets == w.input_ids[1:] and w.offset == 0 for w in plan.windows)
    assert [t for w in plan.windows for t in w.input_ids] == FakeTokenizer()("\n\n".join(corpus.documents))[
        "input_ids"
    ][:48]
    short = token_eval_set(corpus, FakeTokenizer(), 16, max_tokens=10)
    assert len(short.windows) == 1 and len(short.windows[0].input_ids) == 10


def test_plan_token_documents_scores_every_token_after_bos():
    corpus = Corpus("t", ["x" * 40, "y" * 5], "text")
    plan = token_eval_set(corpus, FakeTokenizer(), 16, mode="documents")
    assert plan.n_tokens == 45
    for w in plan.windows:
        assert len(w.input_ids) <= 16 and w.targets == w.input_ids[1:]
    doc0 = [w for w in plan.windows if w.doc == 0]
    assert doc0[0].input_ids[0] == 1 and doc0[1].input_ids[0] == doc0[0].input_ids[-1]  # overlap by one
    assert token_eval_set(corpus, FakeTokenizer(), 16, mode="documents", max_tokens=20).n_tokens == 20
    with pytest.raises(OtdusError):
        token_eval_set(corpus, FakeTokenizer(), 16, mode="nope")


def test_metric_formulas():
    plan = EvalSet(
        "wikitext",
        "c",
        [Window([1, 5, 6], [5, 6, 7], 0, 0), Window([9], [9], 0, 1)],
        words=[3, 2],
        bytes=[10, 6],
        context=8,
    )
    lps = [torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64), torch.tensor([-0.5], dtype=torch.float64)]
    m = metrics_from_logprobs(plan, lps)
    assert m.loglikelihood == -4.0 and m.n_tokens == 4 and m.n_words == 5 and m.n_bytes == 16
    assert m.token_perplexity == pytest.approx(math.exp(1.0))
    assert m.word_perplexity == pytest.approx(math.exp(4 / 5))
    assert m.byte_perplexity == pytest.approx(math.exp(4 / 16))
    assert m.bits_per_byte == pytest.approx(4 / 16 / math.log(2))
    assert m.headline() == ("word_perplexity", m.word_perplexity)


def test_window_sums_in_bfloat16_round_as_lm_eval_s_do():
    """lm-eval sums a window's log-softmax output in its dtype: one rounding to bfloat16, whose values
    between 256 and 512 are 2 apart."""
    lps = torch.tensor([-100.0, -100.0, -100.0, -0.75], dtype=torch.float64)
    assert window_loglikelihood(lps) == -300.75
    assert window_loglikelihood(lps, torch.bfloat16) == -300.0
    assert window_loglikelihood(lps, torch.float32) == -300.75
    plan = EvalSet("wikitext", "c", [Window([1] * 4, [2] * 4, 0, 0)] * 2, words=[10], bytes=[40], context=8)
    assert metrics_from_logprobs(plan, [lps, lps], torch.bfloat16).loglikelihood == -600.0
    assert metrics_from_logprobs(plan, [lps, lps]).loglikelihood == -601.5


def test_target_logprobs_in_the_logits_dtype_are_lm_eval_s():
    logits = torch.randn(1, 5, 11).bfloat16()
    w = Window([3, 4, 5, 6, 7], [6, 7], 3, 0)
    ref = torch.gather(torch.log_softmax(logits, -1)[:, 3:], 2, torch.tensor([[[6], [7]]]))[0, :, 0]
    assert torch.equal(batch_target_logprobs(logits, [w], 0, torch.bfloat16)[0], ref.double())
    assert not torch.equal(batch_target_logprobs(logits, [w], 0)[0], ref.double())  # float32 by default


def test_target_logprobs_uses_the_right_positions():
    logits = torch.randn(5, 11)
    w = Window([3, 4, 5, 6, 7], [6, 7], 3, 0)  # positions 3, 4 predict 6, 7
    ref = torch.log_softmax(logits, -1)[[3, 4], [6, 7]].double()
    assert torch.equal(target_logprobs(logits, w, 0), ref)
    assert torch.equal(target_logprobs(logits[-2:], w, 3), ref)  # only the last 2 positions computed
    # chunks: positions 0-3 predict target 0 only, 4 target 1, 0-2 none
    assert torch.equal(target_logprobs(logits[:4], w, 0), ref[:1])
    assert torch.equal(target_logprobs(logits[4:], w, 4), ref[1:])
    assert target_logprobs(logits[:3], w, 0).numel() == 0
