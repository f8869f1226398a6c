"""`otdus trainable`: the parameters of an otdus output to train first, in a trainer's own format.

stdout holds only what is pasted into a trainer's config; notes go to stderr.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from otdus_cli.cli.console import err_console, out_console, user_errors
from otdus_cli.cli.values import each_once
from otdus_cli.trainable import ALSO, FORMATS

# a closed set: --help shows the values, the shell completes them, a wrong one is refused at parse
Format = Literal[FORMATS]  # type: ignore[valid-type]


def _also(value: str) -> str:
    """One of ALSO (Typer takes no Literal inside a list: the values are checked and shown here)."""
    if value not in ALSO:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(map(repr, ALSO))}")
    return value


def trainable(
    out: Annotated[Path, typer.Argument(help="An otdus output folder (it holds otdus.json).")],
    fmt: Annotated[
        Format,
        typer.Option(
            "--format",
            "-f",
            help="axolotl: unfrozen_parameters regexes; llama-factory: freeze settings (when they can "
            "express the set); json: a JSON list of names; names: one name a line.",
        ),
    ] = "axolotl",
    also: Annotated[
        list[str] | None,
        typer.Option(
            "--also",
            metavar=f"<{'|'.join(ALSO)}>",
            parser=_also,
            help="Also train these (repeatable): embeddings, norms (every layer's and the final one), head.",
            callback=each_once,
        ),
    ] = None,
    zero_init_only: Annotated[
        bool,
        typer.Option(
            "--zero-init-only",
            help="Of the new layers, only the tensors expand initialised (zeroed, or a residual scale at 1).",
        ),
    ] = False,
) -> None:
    """Print the parameters to train first (the new layers, new experts and router rows)."""
    from otdus_cli.trainable import output_set, render

    with user_errors():
        chosen = output_set(out, also or (), zero_init_only)
        text = render(chosen, fmt)
    for note in chosen.notes:
        err_console.print(f"note: {note}", highlight=False)
    out_console.print(text, highlight=False, markup=False, soft_wrap=True)
