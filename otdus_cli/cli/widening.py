"""`otdus widen`: grow the experts of a mixture-of-experts checkpoint (E -> m E, top-k -> m k).

A command of its own rather than an `expand` option: expand grows depth and its options (method,
position, layers) mean nothing for width, and a user growing a MoE model's width looks for a verb
that says so. Depth and width compose: `otdus expand` then `otdus widen` on its output (the widened
manifest keeps the expansion's record under ``history``), or `otdus expand --experts M` for both in one output
(grow.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from otdus_cli.cli.console import (
    JsonFlag,
    Quiet,
    WarningLines,
    byte_progress,
    emit_json,
    human_bytes,
    out_console,
    replacing_note,
    user_errors,
    write_with_progress,
)
from otdus_cli.cli.flags import Force
from otdus_cli.cli.values import model_name


def widen(
    model: Annotated[
        str,
        typer.Argument(help="Source MoE model: a local folder or a Hugging Face hub id.", parser=model_name),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output folder (must not exist).")],
    factor: Annotated[
        int, typer.Option(min=2, help="m: experts E -> m E and top-k k -> m k (expert e + jE copies e).")
    ] = 2,
    noise: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="alpha: copies (experts and router rows) get N(0, (alpha std(W))^2) noise to break the "
            "symmetry; 0 keeps the base's function.",
        ),
    ] = 0.01,
    seed: Annotated[int, typer.Option(help="Seed of the noise (reproducible per output tensor).")] = 0,
    max_shard_size: Annotated[str, typer.Option(help="Largest output shard, e.g. 5GB, 500MB.")] = "5GB",
    revision: Annotated[str | None, typer.Option(help="Hub revision (branch, tag or commit).")] = None,
    force: Force = False,
    json_out: JsonFlag = False,
    quiet: Quiet = False,
) -> None:
    """Double (or multiply) the experts of every MoE layer and the router's top-k (streamed, atomic)."""
    from otdus_cli.widen import WidenOptions
    from otdus_cli.widen import widen as run_widen

    say = WarningLines()
    with user_errors():
        options = WidenOptions(
            factor=factor, noise=noise, seed=seed, max_shard_size=max_shard_size, revision=revision
        )
        with byte_progress("otdus widen", "widening", quiet, json_out) as report:
            result = write_with_progress(run_widen, model, out, options, report, force=force, on_note=say)
    plan = result.plan
    summary = {
        "out": str(result.out),
        "replaced_earlier_output": result.replaced,
        "source": plan.source.resolved.id,
        "family": plan.source.family.name,
        "experts": [plan.experts, plan.experts * options.factor],
        "top_k": [plan.top_k, plan.top_k * options.factor],
        "noise": options.noise,
        "seed": options.seed,
        "moe_layers": plan.moe_layers,
        "function_preserving": plan.function_preserving,
        "bytes_written": result.bytes_written,
        "seconds": round(result.seconds, 3),
        # the names, as otdus.json lists them (a count here once meant the same key as a number)
        "new_parameters": result.manifest["new_parameters"],
        "new_parameter_count": len(result.manifest["new_parameters"]),
        "warnings": result.warnings,
    }
    for line in result.warnings:
        say(line)  # the manifest's (a skipped config check); notes said as they happened are not repeated
    if json_out:
        emit_json(summary)
        return
    preserved = (
        "function-preserving up to rounding" if plan.function_preserving else "not function-preserving"
    )
    e, k = summary["experts"], summary["top_k"]
    out_console.print(
        f"[bold green]wrote[/] {result.out}{replacing_note(result.replaced)}: "
        f"{e[0]} -> {e[1]} experts, top-k {k[0]} -> {k[1]} in "
        f"{len(plan.moe_layers)} MoE layers, noise alpha={options.noise:g} ({preserved}), "
        f"{human_bytes(result.bytes_written)} in {result.seconds:.1f} s"
    )
