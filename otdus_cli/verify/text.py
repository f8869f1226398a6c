"""Evaluation text: the bundled WikiText-2 raw test split, user text files, optional HF datasets.

WikiText handling follows lm-eval-harness's ``wikitext`` task (0.4.x), which reads the
``EleutherAI/wikitext_document_level`` dataset: one document per Wikipedia article. That dataset is
built from the raw file by starting a new page at every top-level title line (`` = Title = ``;
section headings `` = = Sub = = `` do not count), so the split is reproduced here from the raw file
with no download. The detokeniser undoes WikiText's spacing before tokenisation; word and byte counts
are taken from the page *before* detokenisation, as lm-eval does.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from otdus_cli.errors import OtdusError

WIKITEXT_RESOURCE = "wikitext-2-raw-test.txt.gz"
# sha256 of the decompressed original `wiki.test.raw` (WikiText-2 raw, 1,290,590 bytes, 4,358 lines)
WIKITEXT_TEST_SHA256 = "173c87a53759e0201f33e0ccf978e510c2042d7f2cb78229d9a50d79b9e7dd08"
WIKITEXT_TEST_DOCS = 62  # articles in the test split

DEFAULT_DOC_SEPARATOR = "<|endoftext|>"


@dataclass(frozen=True)
class Corpus:
    """Evaluation text, with the documents it is made of.

    ``documents`` are what the rolling (lm-eval) protocol scores one by one; ``kind`` tells how the
    text was obtained, so reports can name it.
    """

    name: str
    documents: list[str]
    kind: str  # "wikitext" | "text" | "dataset"
    raw_lines: list[str] | None = None  # WikiText rows as the HF `wikitext` dataset yields them


# -- WikiText --------------------------------------------------------------------------------------
def load_wikitext_raw() -> str:
    """The bundled WikiText-2 raw test split, exactly as the original ``wiki.test.raw``."""
    try:
        data = resources.files("otdus_cli.data").joinpath(WIKITEXT_RESOURCE).read_bytes()
    except (FileNotFoundError, ModuleNotFoundError):
        raise OtdusError(f"bundled {WIKITEXT_RESOURCE} is missing from the installation") from None
    raw = gzip.decompress(data)
    if hashlib.sha256(raw).hexdigest() != WIKITEXT_TEST_SHA256:
        raise OtdusError(f"bundled {WIKITEXT_RESOURCE} is corrupt (sha256 mismatch)")
    return raw.decode("utf-8")


def _is_article_title(line: str) -> bool:
    """A top-level `` = Title = `` line; `` = = Section = = `` headings are not titles."""
    squeezed = line.replace("= = =", "===").replace("= =", "==").strip()
    return squeezed.startswith("= ") and squeezed.endswith(" =")


def wikitext_pages(raw: str) -> list[str]:
    """Split raw WikiText into one page per article, as ``EleutherAI/wikitext_document_level``.

    Lines are split on ``\\n`` and re-joined with ``\\n`` (a page has no trailing newline of its own,
    except the last, which keeps the file's final empty line). Text before the first title is dropped
    when it is blank.
    """
    pages: list[str] = []
    current: list[str] = []
    for line in raw.split("\n"):
        if _is_article_title(line):
            page = "\n".join(current)
            if page.strip():
                pages.append(page)
            current = []
        current.append(line)
    pages.append("\n".join(current))
    return pages


def wikitext_rows(raw: str) -> list[str]:
    """Rows as the HF ``wikitext`` (line-level) dataset yields them: each line keeps its ``\\n``,
    blank lines become empty strings. GPTQ-style evaluation joins these with ``\\n\\n``."""
    rows = []
    for line in raw.splitlines(keepends=True):
        rows.append(line if line.strip() else "")
    return rows


_BRACKETS = (
    re.compile(r"\(\s*([^\)]*?)\s*\)"),
    re.compile(r"\[\s*([^\]]*?)\s*\]"),
    re.compile(r"{\s*([^}]*?)\s*}"),
    re.compile(r"\"\s*([^\"]*?)\s*\""),
    re.compile(r"'\s*([^']*?)\s*'"),
)
_BRACKET_REPL = (r"(\1)", r"[\1]", r"{\1}", r'"\1"', r"'\1'")


def wikitext_detokenize(text: str) -> str:
    """Undo WikiText's tokenised spacing, step for step as lm-eval's ``wikitext_detokenizer``.

    The order of the replacements matters (each acts on the previous one's output).
    """
    s = text.replace("s '", "s'")
    # lm-eval's pattern is written with literal slashes, so it almost never matches; kept for parity
    s = re.sub(r"/' [0-9]/", r"/'[0-9]/", s)
    for old, new in ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", ".")):
        s = s.replace(old, new)
    for mark in (":", ";", ".", "!", "?", ","):
        s = s.replace(f" {mark} ", f"{mark} ")
    for pattern, repl in zip(_BRACKETS, _BRACKET_REPL, strict=True):
        s = pattern.sub(repl, s)
    for old, new in (
        ("= = = =", "===="),
        ("= = =", "==="),
        ("= =", "=="),
        (" \u00b0 ", "\u00b0"),
        (" \n", "\n"),
        ("\n ", "\n"),
        (" N ", " 1 "),
        (" 's", "'s"),
    ):
        s = s.replace(old, new)
    return s


def count_words(page: str) -> int:
    """Words as lm-eval counts them: ``len(re.split(r"\\s+", page))`` on the page before detokenising
    (leading/trailing whitespace yields empty pieces, and they count)."""
    return len(re.split(r"\s+", page))


def count_bytes(page: str) -> int:
    return len(page.encode("utf-8"))


def wikitext_corpus(max_docs: int | None = None, bundled: str = "bundled:wikitext-test") -> Corpus:
    """A bundled WikiText-2 raw split (``bundled:wikitext-test`` or ``bundled:wikitext-valid``) as
    article documents."""
    from otdus_cli.bundled import WIKITEXT_SPLITS, read_bundled_text

    raw = load_wikitext_raw() if bundled == "bundled:wikitext-test" else read_bundled_text(bundled)
    pages = wikitext_pages(raw)
    if max_docs is not None:
        pages = pages[: max(0, max_docs)]
    name = f"wikitext-2-raw-v1 {WIKITEXT_SPLITS[bundled]}"
    return Corpus(name, pages, "wikitext", raw_lines=wikitext_rows(raw))


# -- other text -----------------------------------------------------------------------------------
def read_text_file(path: str | os.PathLike[str]) -> str:
    p = Path(path)
    if not p.is_file():
        raise OtdusError(f"text file not found: {p}")
    data = p.read_bytes()
    if p.suffix == ".gz":
        try:
            data = gzip.decompress(data)
        except OSError:
            raise OtdusError(f"{p} is not a valid gzip file") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise OtdusError(f"{p} is not UTF-8 text") from None


def split_documents(text: str, separator: str | None = DEFAULT_DOC_SEPARATOR) -> list[str]:
    """Split on lines that hold only ``separator`` (TinyStories style); each document is stripped and
    empty ones dropped. With no separator (or none present) the whole text is one document."""
    if separator:
        pattern = re.compile(r"^[ \t]*" + re.escape(separator) + r"[ \t]*$", re.MULTILINE)
        pieces = pattern.split(text)
    else:
        pieces = [text]
    docs = [p.strip() for p in pieces]
    return [d for d in docs if d]


def text_corpus(
    path: str | os.PathLike[str], separator: str | None = DEFAULT_DOC_SEPARATOR, max_docs: int | None = None
) -> Corpus:
    docs = split_documents(read_text_file(path), separator)
    if not docs:
        raise OtdusError(f"{path} holds no text")
    if max_docs is not None:
        docs = docs[: max(0, max_docs)]
    return Corpus(str(path), docs, "text")


def dataset_corpus(
    spec: str, split: str = "test", field: str | None = None, max_docs: int | None = None
) -> Corpus:
    """Documents from a Hugging Face dataset, ``NAME`` or ``NAME:CONFIG`` (needs ``datasets``).

    The text column is ``field`` or, when not given, the first of ``page``/``text``/``content``.
    WikiText datasets (``wikitext`` line-level, ``wikitext_document_level``) get the WikiText treatment
    (article documents, detokeniser).
    """
    try:
        import datasets  # optional dependency, imported only when asked for
    except ImportError:
        raise OtdusError(
            "--dataset needs the 'datasets' package (pip install datasets); use --text PATH"
        ) from None
    name, _, config = spec.partition(":")
    try:
        ds = datasets.load_dataset(name, config or None, split=split)
    except Exception as exc:  # datasets raises many types (network, missing config, ...)
        raise OtdusError(
            f"cannot load dataset {spec!r} split {split!r}: {exc.__class__.__name__}: {exc}"
        ) from None
    columns = list(ds.column_names)
    column = field or next((c for c in ("page", "text", "content") if c in columns), None)
    if column is None or column not in columns:
        raise OtdusError(
            f"dataset {spec!r} has no text column (columns: {', '.join(columns)}); pass a field name"
        )
    values = [str(x) for x in ds[column]]
    base = name.rsplit("/", 1)[-1]
    if base == "wikitext" and column == "text":
        # line-level WikiText rows (each line keeps its newline): rebuild the articles like lm-eval's
        # document-level dataset, and keep the rows for GPTQ-style joining
        docs = wikitext_pages("".join(v or " \n" for v in values))  # blank rows were " \n"
        kind, rows = "wikitext", values
    else:
        docs = [v for v in values if v.strip()]
        kind, rows = ("wikitext" if base == "wikitext_document_level" else "dataset"), None
    if max_docs is not None:
        docs = docs[: max(0, max_docs)]
    return Corpus(f"{spec}[{split}]", docs, kind, raw_lines=rows)
