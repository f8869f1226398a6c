"""`--max-tokens` bounds the work of the wikitext (rolling) protocol even on one huge document."""

from __future__ import annotations

from otdus_cli.bundled import STORIES260K
from otdus_cli.verify.lm_eval_presets import wikitext_tokenization
from otdus_cli.verify.metrics import load_tokenizer, rolling_eval_set, token_eval_set
from otdus_cli.verify.text import Corpus, count_words


class Recording:
    """The real stories260K tokenizer, noting the longest text it was asked to tokenise."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.longest = 0

    def __call__(self, text, **kwargs):
        self.longest = max(self.longest, len(text))
        return self.tokenizer(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_one_huge_document_is_cut_before_tokenising():
    tokenizer = Recording(load_tokenizer(STORIES260K))
    huge = "Once upon a time there was a little dog who liked to run. " * 20_000  # 1.2 MB, one line
    corpus = Corpus("huge", [huge, "never reached"], "text")
    plan = rolling_eval_set(corpus, tokenizer, wikitext_tokenization(None, {}, tokenizer, 32), max_tokens=64)
    assert tokenizer.longest <= 64 * 64
    assert plan.n_docs == 1 and plan.n_tokens >= 64
    assert plan.settings["cut_document"] == 0
    assert 0 < plan.words[0] <= count_words(huge[: 64 * 64])


def test_documents_within_the_budget_are_scored_whole():
    tokenizer = Recording(load_tokenizer(STORIES260K))
    docs = ["The cat sat on the mat. " * 40, "A bird sang. " * 10]
    corpus = Corpus("small", docs, "text")
    plan = rolling_eval_set(corpus, tokenizer, wikitext_tokenization(None, {}, tokenizer, 32), max_tokens=64)
    assert "cut_document" not in plan.settings
    assert plan.words[0] == count_words(docs[0]) and tokenizer.longest == len(docs[0])


def test_token_protocol_tokenises_only_the_start_it_keeps():
    # the token protocol (joined) keeps the first --max-tokens tokens of the joined text: it tokenised
    # the whole text (a 1.3 MB WikiText split) for them; now a start that surely holds them, same ids
    docs = [f"Story {i}: the little dog number {i} ran to the park and met a cat. " * 30 for i in range(300)]
    corpus = Corpus("long", docs, "text")
    whole = token_eval_set(corpus, load_tokenizer(STORIES260K), 64)
    tokenizer = Recording(load_tokenizer(STORIES260K))
    short = token_eval_set(corpus, tokenizer, 64, max_tokens=300)
    assert tokenizer.longest <= 300 * 64 < len("\n\n".join(docs))
    assert short.n_tokens == 4 * 63  # 300 tokens: 4 whole windows of 64, each scoring all but its first
    assert [w.input_ids for w in short.windows] == [w.input_ids for w in whole.windows[:4]]
