"""Text for the study: documents from a file or a bundled corpus, tokenised into fixed windows.

A text spec is a path to a UTF-8 file, or one of the bundled names:

* ``bundled:tinystories-sample`` - the five TinyStories stories shipped in the package;
* ``bundled:tinystories-train-2mib`` - the first 2 MiB of the TinyStories training text (2,316 stories);
* ``bundled:wikitext-test`` / ``bundled:wikitext-valid`` - the WikiText-2 raw test / validation split.

Files whose stories are separated by ``<|endoftext|>`` lines are split into documents there (the
text after the last separator, usually a truncated story, is dropped); WikiText files
(``wiki.*.raw``) are split into articles at their top-level title lines; any other file is one
document. Every document is tokenised with a leading BOS token, the documents are concatenated
and the stream is cut into non-overlapping windows of ``seq_len`` tokens (evaluation windows are
taken evenly spaced over the whole held-out stream, so that they span its documents).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from otdus_cli.bundled import WIKITEXT_SPLITS, read_bundled_text
from otdus_cli.errors import OtdusError

SEPARATOR = "<|endoftext|>"


@dataclass(frozen=True)
class Documents:
    """A named list of documents (the unit kept disjoint between training and evaluation)."""

    name: str
    documents: list[str]


def _split_separated(text: str) -> list[str]:
    parts = text.split(SEPARATOR)
    if len(parts) > 1:
        parts = parts[:-1]  # whatever follows the last separator is an unfinished story
    return [p.strip() for p in parts if p.strip()]


def load_documents(spec: str | os.PathLike[str]) -> Documents:
    """Documents of a text spec (see the module docstring)."""
    from otdus_cli.verify.text import load_wikitext_raw, wikitext_pages

    name = str(spec)
    if name == "bundled:wikitext-test":
        return Documents(name, [p for p in wikitext_pages(load_wikitext_raw()) if p.strip()])
    if name in WIKITEXT_SPLITS:
        return Documents(name, [p for p in wikitext_pages(read_bundled_text(name)) if p.strip()])
    if name.startswith("bundled:"):
        return Documents(name, _split_separated(read_bundled_text(name)))
    path = Path(name)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise OtdusError(f"text file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise OtdusError(f"cannot read text file {path}: {exc}") from None
    if SEPARATOR in text:
        docs = _split_separated(text)
    elif path.name.startswith("wiki.") and path.suffix == ".raw":
        docs = [p for p in wikitext_pages(text) if p.strip()]
    else:
        docs = [text] if text.strip() else []
    if not docs:
        raise OtdusError(f"no text in {path}")
    return Documents(name, docs)


def split_documents(docs: Documents, eval_fraction: float) -> tuple[Documents, Documents]:
    """Hold out the last ``eval_fraction`` of the documents; evaluation documents whose exact text
    also occurs in the training part are dropped, so the two sets share no document."""
    if not 0 < eval_fraction < 1:
        raise OtdusError(f"eval fraction must lie in (0, 1), got {eval_fraction}")
    n_eval = max(1, round(len(docs.documents) * eval_fraction))
    if n_eval >= len(docs.documents):
        raise OtdusError(f"{docs.name}: {len(docs.documents)} document(s) are too few to hold some out")
    train = docs.documents[:-n_eval]
    seen = set(train)
    held = [d for d in docs.documents[-n_eval:] if d not in seen]
    return (
        Documents(f"{docs.name} (first {len(train)} docs)", train),
        Documents(f"{docs.name} (last {n_eval} docs, held out)", held),
    )


def window_documents(
    tokenizer, docs: Documents, seq_len: int, max_windows: int | None = None, spread: bool = False
) -> tuple[torch.Tensor, list[int]]:
    """:func:`tokenize_windows`'s windows and, for each, the index (in ``docs.documents``) of the
    document its first token belongs to: the cluster a by-document interval resamples."""
    bos = tokenizer.bos_token_id
    stream: list[int] = []
    owner: list[int] = []  # the document of each stream token
    need = None if max_windows is None or spread else max_windows * seq_len
    step = 256
    for s in range(0, len(docs.documents), step):
        batch = docs.documents[s : s + step]
        for k, ids in enumerate(tokenizer(batch, add_special_tokens=False)["input_ids"]):
            start = len(stream)
            if bos is not None:
                stream.append(bos)
            stream.extend(ids)
            owner.extend([s + k] * (len(stream) - start))
        if need is not None and len(stream) >= need:
            break
    n = len(stream) // seq_len
    if n == 0:
        raise OtdusError(f"{docs.name}: fewer than {seq_len} tokens of text")
    windows = torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)
    if max_windows is None or n <= max_windows:
        rows = torch.arange(n)
    elif not spread:
        rows = torch.arange(max_windows)
    else:
        rows = torch.arange(max_windows) * n // max_windows
    return windows[rows], [owner[int(r) * seq_len] for r in rows]


def tokenize_windows(
    tokenizer, docs: Documents, seq_len: int, max_windows: int | None = None, spread: bool = False
) -> torch.Tensor:
    """The documents as one BOS-separated token stream cut into ``[n, seq_len]`` windows (int64).

    At most ``max_windows`` windows: the first ones, or with ``spread`` windows evenly spaced over
    the whole stream (an evaluation sample that spans the documents instead of the first few; the
    whole text is tokenised for it).
    """
    return window_documents(tokenizer, docs, seq_len, max_windows, spread)[0]
