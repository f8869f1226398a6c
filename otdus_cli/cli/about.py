"""Commands about otdus itself: `demo` (the guided tour on bundled files) and `version`."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Annotated

import typer

from otdus_cli import __version__
from otdus_cli.cli.checkpoint import expand, inspect
from otdus_cli.cli.console import JsonFlag, emit_json, heading, out_console
from otdus_cli.cli.evaluation import verify
from otdus_cli.cli.values import MethodName


def demo(
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            "-o",
            help="Where the expanded demo model goes (an earlier demo output there is replaced).",
        ),
    ] = Path("demo-out"),
    method: Annotated[MethodName, typer.Option(help="Expansion method.")] = "ot",
    max_tokens: Annotated[
        int, typer.Option(help="WikiText tokens to verify on (at least: whole articles).", min=1)
    ] = 16384,
) -> None:
    """Expand the bundled real stories260K model (5 -> 7 layers) and verify parity on bundled WikiText."""
    heading("1. otdus expand bundled:stories260k")
    expand(model="bundled:stories260k", out=out, method=method, force=True)
    heading("2. otdus inspect")
    inspect(path=str(out))
    heading("3. otdus verify (WikiText-2 test, lm-eval protocol)")
    verify(expanded=str(out), max_tokens=max_tokens, device="cpu")
    heading("4. otdus verify (TinyStories, token perplexity, in domain)")
    verify(
        expanded=str(out),
        protocol="token",
        token_mode="documents",
        text="bundled:tinystories-sample",
        device="cpu",
    )


def version(json_out: JsonFlag = False) -> None:
    """Print the otdus version (with --json: also Python's and the key libraries' versions)."""
    if not json_out:
        out_console.print(__version__)
        return
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    libs = {}
    for dist in ("torch", "transformers", "safetensors", "huggingface_hub", "POT", "typer", "pydantic"):
        try:
            libs[dist] = dist_version(dist)
        except PackageNotFoundError:
            libs[dist] = None
    emit_json({"otdus": __version__, "python": platform.python_version(), "libraries": libs})
