"""Evaluation text: bundled WikiText split into lm-eval's documents, its detokeniser, text files."""

from __future__ import annotations

import gzip
import sys
import types

import pytest

from otdus_cli.bundled import TINYSTORIES_SAMPLE
from otdus_cli.errors import OtdusError
from otdus_cli.verify.text import (
    WIKITEXT_TEST_DOCS,
    count_bytes,
    count_words,
    dataset_corpus,
    load_wikitext_raw,
    split_documents,
    text_corpus,
    wikitext_corpus,
    wikitext_detokenize,
    wikitext_pages,
    wikitext_rows,
)


def test_bundled_wikitext_is_the_original_file():
    raw = load_wikitext_raw()  # sha256-checked inside
    assert len(raw.encode("utf-8")) == 1_290_590
    assert raw.startswith(" \n = Robert Boulter = \n \n Robert Boulter is an English film , ")
    assert len(wikitext_rows(raw)) == 4358  # rows of the HF wikitext-2-raw-v1 test split


def test_document_split_matches_lm_eval_document_level():
    raw = load_wikitext_raw()
    pages = wikitext_pages(raw)
    assert len(pages) == WIKITEXT_TEST_DOCS == 62
    assert pages[0].startswith(" = Robert Boulter = \n")
    # every page starts at a top-level title; section headings stay inside their article
    assert all(p.startswith(" = ") and not p.startswith(" = = ") for p in pages)
    assert sum(p.count("\n = = ") for p in pages) > 100
    # nothing lost: only the leading blank line before the first title is dropped
    assert "\n".join(pages) == raw[len(" \n") :]
    # the last page keeps the file's final newline (the split on "\n" leaves an empty last line)
    assert pages[-1].endswith(" \n")


def test_split_keeps_text_before_first_title_when_not_blank():
    raw = "intro line\n = A = \n text a \n = = Sub = = \n more \n = B = \n text b \n"
    assert wikitext_pages(raw) == [
        "intro line",
        " = A = \n text a \n = = Sub = = \n more ",
        " = B = \n text b \n",
    ]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (" a @-@ b ", " a-b "),
        ("1 @,@ 000 @.@ 5", "1,000.5"),
        ("x , y . z : w ; v ! u ? t", "x, y. z: w; v! u? t"),
        ("( a b )", "(a b)"),
        ("[ a ]", "[a]"),
        ('" quoted words "', '"quoted words"'),
        ("Sam 's dogs ' toys", "Sam's dogs' toys"),
        (" = = = Heading = = = \n", " === Heading ===\n"),
        ("20 ° C", "20°C"),
        ("line one \n line two", "line one\nline two"),
        ("the N count", "the 1 count"),
    ],
)
def test_detokenizer(raw, expected):
    assert wikitext_detokenize(raw) == expected


def test_detokenizer_on_a_real_page():
    page = wikitext_pages(load_wikitext_raw())[0]
    text = wikitext_detokenize(page)
    assert text.startswith(
        " = Robert Boulter =\n\nRobert Boulter is an English film, television and theatre actor."
    )
    assert " @-@ " not in text and " , " not in text


def test_word_and_byte_counts_follow_lm_eval():
    # re.split on whitespace: the leading/trailing whitespace gives empty pieces, which count
    assert count_words(" a  b \n") == 4
    assert count_words("a b") == 2
    assert count_bytes("é") == 2
    corpus = wikitext_corpus()
    # all but the leading " \n" and the 61 newlines that joined the pages
    assert sum(count_bytes(p) for p in corpus.documents) == 1_290_590 - 2 - 61


def test_text_corpus_splits_tinystories_on_separator_lines():
    corpus = text_corpus(TINYSTORIES_SAMPLE)
    assert len(corpus.documents) == 5
    assert corpus.documents[0].startswith("Once upon a time there was a little boy named Ben.")
    assert all("<|endoftext|>" not in d and d == d.strip() for d in corpus.documents)
    assert len(text_corpus(TINYSTORIES_SAMPLE, max_docs=2).documents) == 2


def test_split_documents_variants(tmp_path):
    assert split_documents("a\n<|endoftext|>\n\nb\n<|endoftext|>\n") == ["a", "b"]
    assert split_documents("one text <|endoftext|> inline", None) == ["one text <|endoftext|> inline"]
    gz = tmp_path / "t.txt.gz"
    gz.write_bytes(gzip.compress(b"hello\n"))
    assert text_corpus(gz).documents == ["hello"]


def test_text_errors(tmp_path):
    with pytest.raises(OtdusError, match="not found"):
        text_corpus(tmp_path / "missing.txt")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(OtdusError, match="UTF-8"):
        text_corpus(bad)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n<|endoftext|>\n")
    with pytest.raises(OtdusError, match="no text"):
        text_corpus(empty)


def test_dataset_needs_the_datasets_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as if not installed
    with pytest.raises(OtdusError, match="datasets"):
        dataset_corpus("wikitext:wikitext-2-raw-v1")


def test_dataset_wikitext_rows_become_articles(monkeypatch):
    raw = load_wikitext_raw()
    rows = wikitext_rows(raw)

    class FakeSplit:
        column_names = ["text"]

        def __getitem__(self, column):
            return rows

    calls = []

    def load_dataset(name, config, split):
        calls.append((name, config, split))
        return FakeSplit()

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    corpus = dataset_corpus("Salesforce/wikitext:wikitext-2-raw-v1")
    assert calls == [("Salesforce/wikitext", "wikitext-2-raw-v1", "test")]
    assert corpus.kind == "wikitext" and corpus.raw_lines == rows
    assert corpus.documents == wikitext_pages(raw)
