"""lm-eval version presets: which release behaves how, applied to real and hand-built tokenizers."""

from __future__ import annotations

import pytest

from otdus_cli.bundled import STORIES260K
from otdus_cli.errors import OtdusError
from otdus_cli.verify.lm_eval_presets import (
    LM_EVAL_NEWEST,
    lm_eval_max_length,
    lm_eval_releases,
    wikitext_tokenization,
)
from otdus_cli.verify.metrics import load_tokenizer


@pytest.mark.parametrize(
    ("version", "releases"),
    [
        ("0.4.0", "0.4.0-0.4.1"),
        ("0.4.1", "0.4.0-0.4.1"),
        ("0.4.2", "0.4.2"),
        ("v0.4.2", "0.4.2"),
        ("0.4.3", "0.4.3"),
        ("0.4.4", "0.4.4-0.4.9.1"),
        ("0.4.9", "0.4.4-0.4.9.1"),
        ("0.4.9.1", "0.4.4-0.4.9.1"),
        ("0.4.9.2", "0.4.9.2-0.4.12"),
        ("0.4.10", "0.4.9.2-0.4.12"),  # 10 > 9: numbers, not text
        ("0.4.12", "0.4.9.2-0.4.12"),
        ("0.4.13", "0.4.13 onward"),
        ("0.4.13.dev0", "0.4.13 onward"),
        ("0.5", "0.4.13 onward"),
    ],
)
def test_versions_map_to_their_releases(version, releases):
    assert lm_eval_releases(version).label == releases


@pytest.mark.parametrize("version", ["0.3.0", "0.2", "latest", "0.4.x", ""])
def test_versions_outside_the_presets_are_refused(version):
    with pytest.raises(OtdusError, match="lm-eval"):
        lm_eval_releases(version)


class Tokenizer:
    """Characters as tokens (ids from 10); BOS/EOS as given; adds BOS when asked (if it has one)."""

    model_max_length = 1000000000000000019884624838656  # transformers' "no limit"

    def __init__(self, bos: int | None = 1, eos: int | None = 2):
        self.bos_token_id, self.eos_token_id = bos, eos

    def __call__(self, text, add_special_tokens=True):
        ids = [10 + ord(c) % 50 for c in text]
        if add_special_tokens and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return {"input_ids": ids}

    def decode(self, token_id):
        return f"<{token_id}>"

    def convert_ids_to_tokens(self, token_id):
        return f"<{token_id}>"


def test_prefix_and_special_tokens_per_release():
    llama = {"model_type": "llama", "max_position_embeddings": 64}
    seen = {}
    for version in ("0.4.0", "0.4.2", "0.4.3", "0.4.9.1", "0.4.9.2", "0.4.13"):
        t = wikitext_tokenization(version, llama, Tokenizer())
        seen[version] = (t.prefix_token_id, t.encode(Tokenizer(), "ab")[:1], t.max_length)
    a = [10 + ord("a") % 50]
    assert seen == {
        "0.4.0": (2, a, 64),  # EOS prefix, text alone
        "0.4.2": (2, a, 64),
        "0.4.3": (1, a, 64),  # BOS prefix
        "0.4.9.1": (1, a, 64),
        "0.4.9.2": (1, [1], 64),  # and the tokenizer's own BOS in the scored text
        "0.4.13": (1, [1], 64),
    }
    assert wikitext_tokenization(None, llama, Tokenizer()).version == LM_EVAL_NEWEST


def test_tokenizers_without_bos_or_eos_follow_lm_eval():
    cfg = {"model_type": "qwen2"}
    no_bos = Tokenizer(bos=None, eos=7)  # Qwen-style: EOS only, adds no special tokens
    for version in ("0.4.2", "0.4.5", "0.4.13"):
        t = wikitext_tokenization(version, cfg, no_bos)
        assert t.prefix_token_id == 7 and t.encode(no_bos, "ab") == [10 + ord(c) % 50 for c in "ab"]
    no_eos = Tokenizer(bos=1, eos=None)
    with pytest.raises(OtdusError, match="EOS"):
        wikitext_tokenization("0.4.2", cfg, no_eos)  # 0.4.2 starts with EOS and has no fallback
    assert wikitext_tokenization("0.4.3", cfg, no_eos).prefix_token_id == 1
    with pytest.raises(OtdusError, match="BOS or an EOS"):
        wikitext_tokenization("0.4.13", cfg, Tokenizer(bos=None, eos=None))


def test_gemma_gets_its_bos_where_lm_eval_forced_it():
    def specials(version, model_type):
        return wikitext_tokenization(version, {"model_type": model_type}, Tokenizer()).add_special_tokens

    assert not specials("0.4.1", "gemma")  # no Gemma rule yet
    assert specials("0.4.2", "gemma") and not specials("0.4.2", "gemma2")  # model_type == "gemma"
    assert specials("0.4.3", "gemma") and not specials("0.4.3", "gemma3_text")
    assert specials("0.4.4", "gemma2") and specials("0.4.9.1", "gemma3_text")  # "gemma" in model_type
    assert not specials("0.4.9.1", "llama")


def test_max_length_as_each_release_resolves_it():
    nested = {"model_type": "gemma3", "text_config": {"max_position_embeddings": 99}}
    assert wikitext_tokenization("0.4.12", nested, Tokenizer()).max_length == 2048  # top level only
    assert wikitext_tokenization("0.4.13", nested, Tokenizer()).max_length == 99
    assert wikitext_tokenization("0.4.13", nested, Tokenizer(), max_length=7).max_length == 7
    assert lm_eval_max_length({"n_positions": 1024, "max_position_embeddings": 512}) == 1024
    assert lm_eval_max_length({"max_position_embeddings": None, "n_ctx": 300}) == 300
    assert lm_eval_max_length({}, Tokenizer()) == 2048

    class Limited(Tokenizer):
        model_max_length = 300

    assert lm_eval_max_length({}, Limited()) == 300


def test_stories260k_tokenizer_per_release():
    """The bundled Llama tokenizer: 0.4.2 feeds [</s>, text], 0.4.3-0.4.9.1 [<s>, text], 0.4.9.2 on
    [<s>, <s>, text]; a text that already starts with <s> gets no second one."""
    tok = load_tokenizer(STORIES260K)
    cfg = {"model_type": "llama", "max_position_embeddings": 512}
    text = " = Robert Boulter = \n"
    body = tok(text, add_special_tokens=False)["input_ids"]
    firsts = {}
    for version in ("0.4.2", "0.4.9.1", "0.4.13"):
        t = wikitext_tokenization(version, cfg, tok)
        firsts[version] = [t.prefix_token_id, *t.encode(tok, text)]
    assert firsts == {"0.4.2": [2, *body], "0.4.9.1": [1, *body], "0.4.13": [1, 1, *body]}
    newest = wikitext_tokenization("0.4.13", cfg, tok)
    assert newest.encode(tok, "<s>" + text) == tok("<s>" + text, add_special_tokens=False)["input_ids"]
