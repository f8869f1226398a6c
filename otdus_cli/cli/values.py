"""Option values checked while the command line is parsed, before torch or transformers is imported.

A bad value ends as a usage error naming the flag (one `error:` line, exit 2) within the parse, not
seconds later. Closed sets are `Literal` types (Typer shows them in --help and completes them);
the parsers here check open-ended values (devices, text specs, index lists).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import typer

from otdus_cli.bundled import BUNDLED_MODELS, BUNDLED_TEXTS
from otdus_cli.errors import OtdusError
from otdus_cli.methods.registry import METHODS, SHRINK_METHODS

MethodName = Literal[tuple(METHODS)]  # type: ignore[valid-type]
ShrinkMethodName = Literal[tuple(SHRINK_METHODS)]  # type: ignore[valid-type]
Protocol = Literal["wikitext", "token"]
TokenMode = Literal["joined", "documents"]
# compute dtypes of verify/ppl (the names verify.streaming.DTYPES maps to torch dtypes)
EvalDtype = Literal["float32", "bfloat16", "float16", "float64", "fp32", "bf16", "fp16"]
# ppl's log-softmax: float32, or the compute dtype as lm-eval takes it (verify.perplexity.SOFTMAX_DTYPES)
SoftmaxDtype = Literal["float32", "model"]

_DEVICE = re.compile(r"cpu|mps|cuda(:\d+)?")


def device_parser(allow_auto: bool) -> Callable[[str], str]:
    """A parser for a torch device name: cpu, cuda, cuda:N, mps (and auto where the command has it)."""
    names = "auto, cpu, cuda or cuda:N" if allow_auto else "cpu, cuda or cuda:N"

    def parse(value: str) -> str:
        if (allow_auto and value == "auto") or _DEVICE.fullmatch(value):
            return value
        raise typer.BadParameter(f"unknown device {value!r}; give {names}")

    return parse


def text_spec(value: str) -> str:
    """A text file that exists, or a bundled text name."""
    if value.startswith("bundled:"):
        if value not in BUNDLED_TEXTS:
            raise typer.BadParameter(
                f"unknown bundled text {value!r}; choose one of {', '.join(BUNDLED_TEXTS)}"
            )
        return value
    if not Path(value).is_file():
        raise typer.BadParameter(f"text file not found: {value}")
    return value


def items(value: str) -> list[str]:
    """The comma-separated items of a list option, stripped; an empty one ('', '1,,2', '3,') is
    refused rather than skipped (`--remove ''` would otherwise remove layers chosen by score)."""
    parts = [part.strip() for part in value.split(",")]
    if not all(parts):
        raise typer.BadParameter(f"an empty item in {value!r}; separate the values by single commas")
    return parts


def distinct(values: list, value: str) -> None:
    """Refuse a list option naming one value twice ('0,0', '1,01'), where twice means nothing more."""
    twice = sorted({str(v) for v in values if values.count(v) > 1})
    if twice:
        raise typer.BadParameter(f"{', '.join(twice)} given twice in {value!r}; name each once")


def each_once(values: list[str] | None) -> list[str] | None:
    """A repeatable option given the same value twice (`--also head --also head`) is refused."""
    twice = sorted({v for v in values or () if values.count(v) > 1})
    if twice:
        raise typer.BadParameter(f"{', '.join(twice)} given twice; give each once")
    return values


def int_list(value: str) -> str:
    """Comma-separated integers (kept as text; the command splits them with :func:`ints`)."""
    try:
        [int(x) for x in items(value)]
    except ValueError:
        raise typer.BadParameter(f"takes comma-separated integers, got {value!r}") from None
    return value


def distinct_int_list(value: str) -> str:
    """Comma-separated integers, each named once."""
    distinct(ints(int_list(value)), value)
    return value


def ints(text: str) -> list[int]:
    return [int(x) for x in items(text)]


def method_specs(value: str) -> str:
    """Comma-separated study method specs, each checked as the study will read it."""
    from otdus_cli.study_arms import parse_method

    specs = items(value)
    distinct(specs, value)
    for spec in specs:
        try:
            parse_method(spec)
        except OtdusError as exc:
            raise typer.BadParameter(str(exc)) from None
    return value


def lm_eval_version(value: str) -> str:
    """An lm-eval version the wikitext presets cover (any 0.4.x or later version string)."""
    from otdus_cli.verify.lm_eval_presets import lm_eval_releases

    try:
        lm_eval_releases(value)
    except OtdusError as exc:
        raise typer.BadParameter(str(exc)) from None
    return value.strip().removeprefix("v")


def model_name(value: str) -> str:
    """A bundled model name is checked here; folders and hub ids are resolved by the command."""
    if value.startswith("bundled:") and value not in BUNDLED_MODELS:
        raise typer.BadParameter(
            f"unknown bundled model {value!r}; choose one of {', '.join(BUNDLED_MODELS)}"
        )
    return value


def output_folder(out: Path | None, recipe) -> Path:
    """--out, else the recipe's ``out``; one of them is required."""
    folder = out or (Path(recipe.out) if recipe is not None and recipe.out else None)
    if folder is None:
        raise OtdusError("give --out (the output folder)")
    return folder
