"""Help text that stays readable at any width: plain click layout, wrapped only between words.

Rich's help panels (Typer's default) share a terminal's width between columns and cut what does not
fit with an ellipsis: at 80 columns option names and defaults were cut (`--allow-unknown-…`) and
descriptions squeezed to ~18 characters. Here an option's name is on its own line when it is long, the
description wraps under it, and no word is ever broken (not at a hyphen either), so every option name,
path and default can be read and copied whole.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from typer.core import TyperCommand, TyperGroup

# Typer vendors its own click (>= 0.20): take its classes from the command class it uses
_Context = TyperCommand.context_class

# widest help text, even on a wide terminal: long lines are hard to read
MAX_WIDTH = 100


def _wrap(text: str, width: int) -> list[str]:
    """Lines of at most ``width`` characters where words allow; "[default: X]" keeps X beside it."""
    lines: list[str] = []
    for paragraph in text.split("\n\n"):
        if lines:
            lines.append("")
        words = " ".join(paragraph.split()).replace("[default: ", "[default:\0")
        wrapped = textwrap.wrap(words, max(width, 20), break_on_hyphens=False, break_long_words=False)
        lines += [line.replace("\0", " ") for line in wrapped] or [""]
    return lines


class HelpFormatter(_Context.formatter_class):
    def __init__(self, indent_increment: int = 2, width: int | None = None, max_width: int | None = None):
        super().__init__(indent_increment, width, max_width or MAX_WIDTH)

    def write_text(self, text: str) -> None:
        indent = " " * self.current_indent
        for line in _wrap(text, self.width - self.current_indent):
            self.write(f"{indent}{line}".rstrip() + "\n")

    def write_dl(self, rows: Sequence[tuple[str, str]], col_max: int = 30, col_spacing: int = 2) -> None:
        rows = list(rows)
        col_max = min(col_max, max(12, self.width // 3))  # narrow terminals keep room for the text
        first_col = min(max((len(first) for first, _ in rows), default=0), col_max) + col_spacing
        indent = " " * self.current_indent
        pad = " " * (self.current_indent + first_col)
        for first, second in rows:
            lines = _wrap(second, self.width - self.current_indent - first_col) if second else []
            if not lines:
                self.write(f"{indent}{first}\n")
                continue
            if len(first) <= first_col - col_spacing:
                self.write(f"{indent}{first:<{first_col}}{lines[0]}\n")
                lines = lines[1:]
            else:
                self.write(f"{indent}{first}\n")
            for line in lines:
                self.write(f"{pad}{line}".rstrip() + "\n")


class HelpContext(_Context):
    formatter_class = HelpFormatter


class Command(TyperCommand):
    context_class = HelpContext

    def collect_usage_pieces(self, ctx: _Context) -> list[str]:
        """ "otdus expand [OPTIONS] MODEL": arguments in capitals, bare where they are required or carry
        their own name (one that --recipe may give instead, as its help says), else in brackets."""
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                name = param.metavar or param.name.upper()
                pieces.append(name if param.required or param.metavar else f"[{name}]")
        return pieces

    def format_epilog(self, ctx: _Context, formatter: HelpFormatter) -> None:
        """The epilog is the command's example: each line as typed, never wrapped, to copy whole."""
        if self.epilog:
            formatter.write_paragraph()
            formatter.write_text("Example:")
            with formatter.indentation():
                for line in self.epilog.splitlines():
                    formatter.write(f"{' ' * formatter.current_indent}{line}\n")


def format_panels(group: TyperGroup, ctx: _Context, formatter: HelpFormatter) -> None:
    """A group's commands under their help panels, in the order they were added, each with its whole
    first sentence (click cuts it at 45 characters with "...")."""
    panels: dict[str, list[tuple[str, str]]] = {}
    names = group.list_commands(ctx)
    width = max(map(len, names), default=0)  # one column for every panel
    for name in names:
        command = group.get_command(ctx, name)
        if command is not None and not command.hidden:
            panel = getattr(command, "rich_help_panel", None) or "Commands"
            panels.setdefault(panel, []).append((name.ljust(width), command.get_short_help_str(limit=10_000)))
    for panel, rows in panels.items():
        with formatter.section(panel):
            formatter.write_dl(rows)
