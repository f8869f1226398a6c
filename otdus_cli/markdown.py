"""Markdown for strings a user or a checkpoint controls (folder names, paths, commands): shown as
text, never read as Markdown or HTML by the Hub's renderer or any CommonMark one.

:func:`text` escapes a string for a line of prose or a table cell; :func:`code_span` and
:func:`code_block` delimit it by more backticks than any run inside it, so nothing in it can end the
code early.
"""

from __future__ import annotations

import re

# the punctuation that can start or end inline markup (emphasis, code, links and images by their
# brackets, GFM's tables and strike-through, a heading's closing #s) on a line that starts with other
# text; <, > and & become entities (an escaped "<" is still HTML to some renderers)
_PUNCTUATION = re.compile(r"([\\`*_\[\]|~#])")
_ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_BACKTICKS = re.compile(r"`+")


def text(value: object) -> str:
    """``value`` as literal Markdown text on one line: control characters (line breaks) shown as
    escapes, Markdown punctuation backslash-escaped, HTML's specials as entities."""
    raw = _CONTROL.sub(lambda m: ascii(m.group())[1:-1], str(value))
    escaped = _PUNCTUATION.sub(r"\\\1", raw)
    return "".join(_ENTITIES.get(c, c) for c in escaped)


def code_span(value: object) -> str:
    """``value`` as an inline code span (literal: no Markdown or HTML inside one) on one line."""
    raw = _CONTROL.sub(lambda m: ascii(m.group())[1:-1], str(value))
    ticks = "`" * (max((len(run) for run in _BACKTICKS.findall(raw)), default=0) + 1)
    pad = " " if raw.startswith("`") or raw.endswith("`") else ""
    return f"{ticks}{pad}{raw}{pad}{ticks}"


def code_block(body: str, info: str = "") -> list[str]:
    """``body`` as the lines of a fenced code block whose fence no line of ``body`` can close."""
    longest = max((len(run) for run in _BACKTICKS.findall(body)), default=0)
    fence = "`" * max(3, longest + 1)
    return [fence + info, *body.split("\n"), fence]
