"""`otdus shrink`: remove or merge decoder layers (and what `otdus plan --shrink` shows of it).

Its own verb, as widen is: expand's placement options mean nothing for a removal, and a user cutting a
model looks for a verb that says so. The output is written by expand's path (otdus_cli/shrink.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from otdus_cli.cli.console import (
    JsonFlag,
    Quiet,
    WarningLines,
    byte_progress,
    emit_json,
    human_bytes,
    out_console,
    quiet_transformers,
    replacing_note,
    user_errors,
    write_with_progress,
)
from otdus_cli.cli.flags import (
    Dtype,
    Force,
    Model,
    Out,
    Revision,
    ShardSize,
    model_and_recipe,
    validated_options,
    with_method_flags,
)
from otdus_cli.cli.values import (
    ShrinkMethodName,
    device_parser,
    distinct_int_list,
    ints,
    output_folder,
    text_spec,
)
from otdus_cli.methods.registry import SHRINK_METHODS, method_help
from otdus_cli.plan.shrink_map import SELECTIONS, Selection

# the shrink's own --calib/--calib-tokens stand for a method's options of the same name (OT's: one
# text scores the layers and calibrates OT; shrink.shrink_owned)
_SHRINK_OWNS = ("calib", "calib_tokens")

Select = Annotated[
    Selection | None,
    typer.Option(
        help="How the removed layers are chosen. "
        + "; ".join(f"{name}: {what}" for name, what in SELECTIONS.items())
        + ". Scores are measured on --calib text. [default: bi; explicit with --remove]"
    ),
]
Remove = Annotated[
    str | None,
    typer.Option(
        help="The source layers to remove, e.g. '3,4' (--select explicit).", parser=distinct_int_list
    ),
]
Calib = Annotated[
    str | None,
    typer.Option(
        help="Text the layers are scored on (and --ot-variant activation calibrates on): a UTF-8 file or "
        "bundled:NAME. [default: bundled:tinystories-sample]",
        parser=text_spec,
    ),
]
CalibTokens = Annotated[
    int | None,
    typer.Option(help="At most this many calibration tokens (whole windows of 256). [default: 4096]"),
]
ShrinkLayers = Annotated[
    int | None,
    typer.Option(
        help="Number of layers removed (--select laco: at most this many). [default: 1; laco: no cap]"
    ),
]
LacoMerge = Annotated[
    int | None, typer.Option(help="--select laco: layers merged into one per step (LaCo's C). [default: 7]")
]
LacoInterval = Annotated[
    int | None,
    typer.Option(
        help="--select laco: how far the loop moves down after a kept merge (LaCo's I). [default: 1]"
    ),
]
LacoThreshold = Annotated[
    float | None,
    typer.Option(
        help="--select laco: a merge is kept while the cosine of the last hidden states with the source's, "
        "mean over the calibration windows, exceeds this (LaCo's T). [default: 0.45]"
    ),
]
LacoTop = Annotated[
    int | None,
    typer.Option(
        help="--select laco: the first merge ends below this layer (LaCo's H). [default: the last layer]"
    ),
]
LacoBottom = Annotated[
    int | None, typer.Option(help="--select laco: no merge starts below this layer (LaCo's L). [default: 0]")
]
ShrinkRatio = Annotated[
    float | None, typer.Option(help="Layers removed, as a fraction of the depth (instead of --layers).")
]


def shrink_options(
    model: str | None,
    recipe: Path | None,
    method_flags: dict[str, Any] | None,
    **flags: Any,
):
    """Recipe and flags (flags win) merged into validated ShrinkOptions: (model, options, recipe);
    ``method_flags``: the shrink methods' flags by option (``{"ot.reg": 0.02}``, None where not given)."""
    from otdus_cli.shrink import ShrinkOptions, load_shrink_recipe

    model, base = model_and_recipe(model, recipe, load_shrink_recipe)
    remove = flags.pop("remove", None)
    flags["allow_unknown_arch"] = flags.get("allow_unknown_arch") or None
    updates = {k: v for k, v in flags.items() if v is not None}
    if remove is not None:
        updates["remove"] = ints(remove)
    defaults = base.shrink if base else ShrinkOptions()
    return model, validated_options(ShrinkOptions, defaults, updates, method_flags), base


def quiet_if_scoring(options) -> None:
    """The scores and OT's calibration run transformers' tokenizer and classes: without their
    advisories (a drop of named layers never imports transformers)."""
    if options.selection != "explicit" or options.method == "ot":
        quiet_transformers()


def shrink_table(plan) -> Table:
    """The shrink's layer map: each output layer and the source layer(s) it comes from."""
    table = Table(title=f"shrink by {plan.method.name}: {plan.source.depth} -> {len(plan.layer_map)} layers")
    for col in ("out", "from source", "built by"):
        table.add_column(col)
    for lay in plan.layer_map:
        merged = lay.new
        table.add_row(
            str(lay.index),
            f"{','.join(map(str, sorted(lay.parents)))} into {lay.source}" if merged else str(lay.source),
            f"[green]{lay.builder}[/]" if merged else "copy",
        )
    return table


def laco_table(trace) -> Table:
    """Each merge LaCo's loop tried, in order, with its similarity and whether it was kept."""
    table = Table(title=f"LaCo's merges tried on {trace.tokens} tokens of {trace.text}")
    for col in ("source layers", "similarity", ""):
        table.add_column(col)
    for t in trace.tried:
        similarity = "over the cap" if t["similarity"] is None else f"{t['similarity']:.4f}"
        table.add_row(",".join(map(str, t["layers"])), similarity, "[green]kept[/]" if t["accepted"] else "")
    return table


def scores_table(plan) -> Table | None:
    """Each source layer's scores and whether the shrink removes it (None: explicit selection); LaCo's
    tried merges for --select laco."""
    if plan.laco is not None:
        return laco_table(plan.laco)
    scores = plan.scores
    if scores is None:
        return None
    count = len(plan.removed)
    table = Table(title=f"scores on {scores.tokens} tokens of {scores.text}")
    for col in (
        "layer",
        "block influence",
        f"angular, layers i..i+{count - 1}" if count > 1 else "angular",
        "in this shrink",
    ):
        table.add_column(col)
    removed = set(plan.removed)
    for i, bi in enumerate(scores.block_influence):
        angular = scores.angular[count]
        table.add_row(
            str(i),
            f"{bi:.4f}",
            f"{angular[i]:.4f}" if i < len(angular) else "",
            "[red]removed[/]" if i in removed else "kept",
        )
    return table


def shrink_json(plan) -> dict:
    """What `plan --shrink --json` and `shrink --json` say of the plan."""
    return {
        "source": plan.source.resolved.id,
        "family": plan.source.family.name,
        "method": plan.method.name,
        "base_layers": plan.source.depth,
        "num_hidden_layers": len(plan.layer_map),
        "removed": plan.removed,
        "merged": plan.merged,
        "select": plan.options.selection,
        "scores": None if plan.scores is None else plan.scores.to_json(),
        "laco": None if plan.laco is None else plan.laco.to_json(),
        "layers": [lay.to_json() for lay in plan.layer_map],
        "options": plan.options.model_dump(),
        "output_bytes": sum(t.nbytes for t in plan.tensors),
    }


def show_shrink_plan(plan) -> None:
    out_console.print(shrink_table(plan))
    scores = scores_table(plan)
    if scores is not None:
        out_console.print(scores)
    layers = "layers" if len(plan.removed) != 1 else "layer"
    out_console.print(f"removes {layers} {', '.join(map(str, plan.removed))} (perplexity will move)")


@with_method_flags(keep=lambda f: f.field not in _SHRINK_OWNS, methods=SHRINK_METHODS)
def shrink(
    model: Model = None,
    out: Out = None,
    recipe: Annotated[
        Path | None,
        typer.Option("--recipe", help="YAML recipe with the model and shrink options (flags override it)."),
    ] = None,
    method: Annotated[
        ShrinkMethodName | None,
        typer.Option(help=method_help(SHRINK_METHODS, "What becomes of the removed layers.", "drop")),
    ] = None,
    layers: ShrinkLayers = None,
    ratio: ShrinkRatio = None,
    select: Select = None,
    remove: Remove = None,
    calib: Calib = None,
    calib_tokens: CalibTokens = None,
    laco_merge: LacoMerge = None,
    laco_interval: LacoInterval = None,
    laco_threshold: LacoThreshold = None,
    laco_top: LacoTop = None,
    laco_bottom: LacoBottom = None,
    method_flags: dict[str, Any] | None = None,  # the shrink methods' flags (OT's --ot-variant, --reg ...)
    device: Annotated[
        str | None,
        typer.Option(
            help="Device for the scores and OT: auto, cpu, cuda, cuda:N. [default: auto]",
            parser=device_parser(True),
        ),
    ] = None,
    dtype: Dtype = None,
    max_shard_size: ShardSize = None,
    revision: Revision = None,
    allow_unknown_arch: Annotated[
        bool, typer.Option(help="Drop layers of an unknown architecture (--method drop only).")
    ] = False,
    force: Force = False,
    json_out: JsonFlag = False,
    quiet: Quiet = False,
) -> None:
    """Remove decoder layers, or merge them into their neighbours, and write the shallower checkpoint
    (streamed, atomic)."""
    from otdus_cli.distributed import current_world
    from otdus_cli.shrink import shrink as run_shrink

    with user_errors():
        world = current_world()
        model, options, recipe_obj = shrink_options(
            model,
            recipe,
            method_flags,
            method=method,
            layers=layers,
            ratio=ratio,
            select=select,
            remove=remove,
            calib=calib,
            calib_tokens=calib_tokens,
            laco_merge=laco_merge,
            laco_interval=laco_interval,
            laco_threshold=laco_threshold,
            laco_top=laco_top,
            laco_bottom=laco_bottom,
            device=device,
            dtype=dtype,
            max_shard_size=max_shard_size,
            revision=revision,
            allow_unknown_arch=allow_unknown_arch,
        )
        out = output_folder(out, recipe_obj)
        quiet_if_scoring(options)
        say = WarningLines()
        with byte_progress("otdus shrink", "shrinking", quiet or not world.is_main, json_out) as report:
            result = write_with_progress(run_shrink, model, out, options, report, force=force, on_note=say)
    if not world.is_main:
        return
    plan = result.plan
    method_warnings = plan.method.report_warnings(result.manifest) if plan.method.report_warnings else []
    for line in [*result.warnings, *method_warnings]:
        say(line)  # the notes said as they happened are not said twice
    summary = {
        "out": str(result.out),
        "replaced_earlier_output": result.replaced,
        "warnings": result.warnings,
        "transport_warnings": method_warnings,
        **shrink_json(plan),
        "bytes_written": result.bytes_written,
        "seconds": round(result.seconds, 3),
        "new_parameters": result.manifest["new_parameters"],
    }
    if json_out:
        emit_json(summary)
        return
    merged = f", merged {' '.join('+'.join(map(str, g)) for g in plan.merged)}" if plan.merged else ""
    out_console.print(
        f"[bold green]wrote[/] {result.out}{replacing_note(result.replaced)}: "
        f"{summary['base_layers']} -> {summary['num_hidden_layers']} layers with {plan.method.name} "
        f"(removed {', '.join(map(str, plan.removed))}{merged}), {human_bytes(result.bytes_written)} "
        f"in {result.seconds:.1f} s"
    )
