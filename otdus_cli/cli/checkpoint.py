"""Commands that make or describe a checkpoint: `expand`, `plan` and `inspect`."""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import asdict, dataclass
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
    replacing_note,
    user_errors,
    write_with_progress,
)
from otdus_cli.cli.flags import (
    BaseModelId,
    Dtype,
    Force,
    Model,
    Out,
    Revision,
    ShardSize,
    flag_name,
    model_and_recipe,
    validated_options,
    with_flags,
    with_method_flags,
)
from otdus_cli.cli.shrinking import (
    Calib,
    CalibTokens,
    LacoBottom,
    LacoInterval,
    LacoMerge,
    LacoThreshold,
    LacoTop,
    Remove,
    Select,
)
from otdus_cli.cli.values import (
    MethodName,
    ShrinkMethodName,
    device_parser,
    int_list,
    ints,
    model_name,
    output_folder,
)
from otdus_cli.errors import OtdusError
from otdus_cli.methods.registry import METHODS
from otdus_cli.plan.layer_map import Position as PositionName

Recipe = Annotated[
    Path | None,
    typer.Option("--recipe", help="YAML recipe with the model and expand options (flags override it)."),
]
Method = Annotated[
    MethodName | None,
    typer.Option(help="How new layers are made (README: Methods). [default: ot]"),
]
Position = Annotated[PositionName | None, typer.Option(help="Where new layers go. [default: top]")]
Layers = Annotated[
    int | None, typer.Option(help="Number of new layers. [default: half the base depth; stack: L]")
]
Ratio = Annotated[
    float | None, typer.Option(help="New layers as a fraction of the base depth (instead of --layers).")
]
After = Annotated[
    str | None,
    typer.Option(
        help="Explicit base indices to insert after, e.g. '3,7,11' (overrides --position).", parser=int_list
    ),
]


def _zero_init_default() -> str:
    """The zero-init defaults in words, from the method registry, e.g. "on for ot and llama-pro, off
    otherwise" (with the variants whose default is off in parentheses)."""
    on = [m.name for m in METHODS.values() if m.zero_init_default]
    text = "on for " + (f"{', '.join(on[:-1])} and {on[-1]}" if len(on) > 1 else on[0])
    off = [f"{m.name} {v}" for m in METHODS.values() for v in m.zero_init_off_for]
    return text + (f" (off for {', '.join(off)})" if off else "") + ", off otherwise"


ZeroInit = Annotated[
    bool | None,
    typer.Option(
        "--zero-init/--no-zero-init",
        help="Zero o_proj and down_proj (and MoE expert downs) of new layers, making them exact identities. "
        f"[default: {_zero_init_default()}]",
        show_default=False,
    ),
]
Device = Annotated[
    str | None,
    typer.Option(
        help="Device for the methods that compute new tensors: auto, cpu, cuda, cuda:N. [default: auto]",
        parser=device_parser(True),
    ),
]
Seed = Annotated[
    int | None,
    typer.Option(help="Seed for random initialisation and for methods that train. [default: 0]"),
]
AllowUnknown = Annotated[
    bool,
    typer.Option(help="Copy layers generically for an unknown architecture (copy-type methods only)."),
]


@dataclass
class LayoutFlags:
    """What decides the layer map: shared by `expand` and `plan`."""

    recipe: Recipe = None
    method: Method = None
    position: Position = None
    layers: Layers = None
    ratio: Ratio = None
    after: After = None
    zero_init: ZeroInit = None
    revision: Revision = None
    allow_unknown_arch: AllowUnknown = False


def _options(
    model: str | None, layout: LayoutFlags, method_flags: dict[str, Any] | None = None, **flags: Any
):
    """Merge recipe and flags (flags win) into validated ExpandOptions; ``method_flags``: the
    methods' flags by option (``{"ot.reg": 0.02}``, None where not given)."""
    from otdus_cli.options import ExpandOptions, load_recipe

    model, base = model_and_recipe(model, layout.recipe, load_recipe)
    flags.update(asdict(layout))
    del flags["recipe"]
    flags["allow_unknown_arch"] = flags["allow_unknown_arch"] or None
    after = flags.pop("after")
    updates = {k: v for k, v in flags.items() if v is not None}
    if after is not None:
        updates["after"] = ints(after)
    defaults = base.expand if base else ExpandOptions()
    return model, validated_options(ExpandOptions, defaults, updates, method_flags), base


def _layer_table(plan) -> Table:
    from otdus_cli.plan.layer_map import layer_kinds

    table = Table(title=f"{plan.method.name}: {plan.source.depth} -> {len(plan.layer_map)} layers")
    kinds = layer_kinds(plan.source.family, plan.source.text_config, plan.source.depth)
    hybrid = len(set(kinds)) > 1  # a hybrid stack: say which kind each output layer is
    for col in (
        "out",
        "kind",
        "source",
        "parents",
        "builder",
        "zero-init",
        *(["layer kind"] if hybrid else []),
    ):
        table.add_column(col)
    for lay in plan.layer_map:
        table.add_row(
            str(lay.index),
            "[green]new[/]" if lay.new else "base",
            str(lay.source),
            ",".join(map(str, lay.parents)) if lay.new else "",
            lay.builder if lay.new else "copy",
            "yes" if lay.zero_init else "",
            *([kinds[lay.source]] if hybrid else []),
        )
    return table


def _mixed_kinds_line(plan) -> str | None:
    """Where a pair method (a new layer built from layers i and i + 1) would meet layers of two kinds."""
    from otdus_cli.methods.registry import METHODS
    from otdus_cli.plan.layer_map import mixed_kind_gaps

    gaps = mixed_kind_gaps(plan.source.family, plan.source.text_config, plan.source.depth)
    if not gaps:
        return None
    pair_methods = ", ".join(m.name for m in METHODS.values() if m.pair)
    return (
        f"layers of different kinds meet after base layers {', '.join(map(str, gaps))}: a pair method "
        f"({pair_methods}) cannot place a new layer there; a copy-type method copies one layer's kind"
    )


def _roles_line(plan) -> str | None:
    """For a method that computes from roles on a derived template: whose roles, proved for which kinds."""
    proof = plan.source.family.roles_proof
    if not plan.method.needs_roles or not proof or not proof.get("template"):
        return None
    return (
        f"roles: {proof['template']}'s, matched by name and proved on a tiny instance for the "
        f"{', '.join(proof['kinds'])} layers (arch/derived_roles.py; otdus.json: source.roles_proof)"
    )


def _plan_json(plan) -> dict:
    from otdus_cli.plan.layer_map import layer_kinds, mixed_kind_gaps

    kinds = layer_kinds(plan.source.family, plan.source.text_config, plan.source.depth)
    return {
        "source": plan.source.resolved.id,
        "family": plan.source.family.name,
        "method": plan.method.name,
        "base_layers": plan.source.depth,
        "num_hidden_layers": len(plan.layer_map),
        "function_preserving": plan.function_preserving,
        "layers": [lay.to_json() for lay in plan.layer_map],
        "layer_kinds": [kinds[lay.source] for lay in plan.layer_map],
        "mixed_kind_gaps": mixed_kind_gaps(plan.source.family, plan.source.text_config, plan.source.depth),
        "options": plan.options.model_dump(),
        "output_bytes": sum(t.nbytes for t in plan.tensors),
        **({"roles_proof": plan.source.family.roles_proof} if _roles_line(plan) else {}),
    }


@with_flags(LayoutFlags)
@with_method_flags()
def expand(
    model: Model = None,
    out: Out = None,
    flags: LayoutFlags = None,
    method_flags: dict[str, Any] | None = None,  # the methods' own flags (--ot-variant, --reg...)
    device: Device = None,
    dtype: Dtype = None,
    max_shard_size: ShardSize = None,
    seed: Seed = None,
    experts: Annotated[
        int | None,
        typer.Option(
            min=2,
            help="MoE only: also widen, experts E -> M E and top-k k -> M k, as `otdus widen` on the deeper "
            "model, into the same --out (the deeper model lives in a scratch folder meanwhile).",
        ),
    ] = None,
    expert_noise: Annotated[
        float | None,
        typer.Option(
            min=0.0, help="With --experts: the copies' noise alpha (`otdus widen --noise`). [default: 0.01]"
        ),
    ] = None,
    base_model: BaseModelId = None,
    force: Force = False,
    json_out: JsonFlag = False,
    quiet: Quiet = False,
) -> None:
    """Insert new decoder layers and write the deeper checkpoint (streamed, atomic)."""
    from otdus_cli.distributed import current_world
    from otdus_cli.expand import expand as run_expand

    with user_errors():
        world = current_world()  # under torchrun/srun: this process's rank (see distributed.py)
        model, options, recipe_obj = _options(
            model,
            flags,
            method_flags,
            device=device,
            dtype=dtype,
            max_shard_size=max_shard_size,
            seed=seed,
            base_model=base_model,
        )
        out = output_folder(out, recipe_obj)
        say = WarningLines()
        if experts is None and expert_noise is not None:
            raise OtdusError("--expert-noise is the noise of --experts; give --experts too")
        if experts is not None:
            if world.size > 1:  # grow.py's scratch folder and widen step are one process's
                raise OtdusError("--experts runs in one process: start it without torchrun/srun")
            noise = 0.01 if expert_noise is None else expert_noise
            _expand_and_widen(model, out, options, experts, noise, force, json_out, quiet, say)
            return
        # every rank reports its errors; only rank 0 its progress and results
        with byte_progress("otdus expand", "expanding", quiet or not world.is_main, json_out) as report:
            result = write_with_progress(
                run_expand,
                model,
                out,
                options,
                report,
                force=force,
                on_note=say,  # stale temporary folders, said when removed (a later Ctrl-C keeps it said)
            )
    if not world.is_main:
        return
    method = result.plan.method
    # the method's warnings on its own report (OT: transport solves that did not converge); the
    # report names them "transport_warnings" for every method
    method_warnings = method.report_warnings(result.manifest) if method.report_warnings else []
    warnings = list(result.warnings)  # the manifest's, and the notes already said
    for option, why in result.manifest.get("ignored_options", {}).items():
        if (method_flags or {}).get(option) is not None:
            warnings.append(f"{flag_name(option.split('.'))} was ignored: {why}")
    for line in [*warnings, *method_warnings]:
        say(line)
    summary = {
        "out": str(result.out),
        "replaced_earlier_output": result.replaced,
        "warnings": warnings,
        "transport_warnings": method_warnings,
        **_plan_json(result.plan),
        "bytes_written": result.bytes_written,
        "seconds": round(result.seconds, 3),
        # the names, as otdus.json lists them (a count here once meant the same key as a number)
        "new_parameters": result.manifest["new_parameters"],
        "new_parameter_count": len(result.manifest["new_parameters"]),
        "timings": _timings_json(result.timings),
    }
    if method.report_json:
        summary |= method.report_json(result.manifest)
    if json_out:
        emit_json(summary)
        return
    for line in method.report_lines(result.manifest) if method.report_lines else []:
        out_console.print(line, highlight=False, soft_wrap=True)
    preserved = "function-preserving" if result.plan.function_preserving else "not function-preserving"
    out_console.print(
        f"[bold green]wrote[/] {result.out}{replacing_note(result.replaced)}: "
        f"{summary['base_layers']} -> {summary['num_hidden_layers']} "
        f"layers with {summary['method']} ({preserved}), {human_bytes(result.bytes_written)} "
        f"in {result.seconds:.1f} s"
    )


def _expand_and_widen(
    model, out, options, factor: int, noise: float, force: bool, json_out: bool, quiet: bool, say
) -> None:
    """`expand --experts M`: depth, then width, into one output (grow.py)."""
    from otdus_cli.grow import expand_and_widen
    from otdus_cli.widen import WidenOptions

    widen_options = WidenOptions(
        factor=factor, noise=noise, seed=options.seed, max_shard_size=options.max_shard_size
    )
    with byte_progress("otdus expand", "expanding, then widening", quiet, json_out) as report:

        def step(name: str):
            stage = f"{name} step"
            report.stage(stage)
            # each step's own stages ("layer 4 of 7 ...") said with the step they belong to
            steps.append(stage)
            return report.advance

        steps: list[str] = []
        result = expand_and_widen(
            model,
            out,
            options,
            widen_options,
            force=force,
            on_step=step,
            on_note=say,
            on_stage=lambda stage: report.stage(f"{steps[-1]}, {stage}"),
        )
    deep, wide = result.expanded, result.widened
    manifest = wide.manifest
    summary = {
        "out": str(wide.out),
        "replaced_earlier_output": wide.replaced,
        **{
            k: v for k, v in _plan_json(deep.plan).items() if k not in ("output_bytes", "function_preserving")
        },
        "function_preserving": manifest["function_preserving"],
        "experts": manifest["widen"]["experts"],
        "top_k": manifest["widen"]["top_k"],
        "noise": noise,
        "bytes_written": wide.bytes_written,
        "seconds": round(deep.seconds + wide.seconds, 3),
        "warnings": [*deep.warnings, *wide.warnings],
    }
    for line in summary["warnings"]:
        say(line)  # the sweeps' notes were said when they happened: not twice
    if json_out:
        emit_json(summary)
        return
    preserved = "function-preserving" if manifest["function_preserving"] else "not function-preserving"
    e, k = summary["experts"], summary["top_k"]
    out_console.print(
        f"[bold green]wrote[/] {wide.out}{replacing_note(wide.replaced)}: "
        f"{summary['base_layers']} -> {summary['num_hidden_layers']} layers "
        f"with {summary['method']}, then {e[0]} -> {e[1]} experts, top-k {k[0]} -> {k[1]} ({preserved}), "
        f"{human_bytes(wide.bytes_written)} in {summary['seconds']:.1f} s"
    )


def _process_started_at() -> float | None:
    """time.time() when this process started (Linux /proc, 10 ms resolution), else None."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def _timings_json(timings: dict) -> dict:
    """Seconds, rounded; ``startup_s``: from the process's start to the start of the work proper
    (imports, reading headers, planning; for copy-type methods, until the first tensor byte moves),
    the wait a user sees before the copy itself;
    ``startup_cpu_s``: the CPU time spent by then, which, unlike the wait, a busy machine does not
    stretch."""
    out = {k: round(v, 3) if isinstance(v, float) else v for k, v in timings.items() if k != "first_byte_at"}
    started, first = _process_started_at(), timings.get("first_byte_at")
    out["startup_s"] = round(first - started, 2) if started and first else None
    return out


@with_flags(LayoutFlags)
@with_method_flags(for_plan=True)
def plan(
    model: Model = None,
    flags: LayoutFlags = None,
    method_flags: dict[str, Any] | None = None,  # those that change the layer map (--ot-variant...)
    shrink: Annotated[
        ShrinkMethodName | None,
        typer.Option(
            "--shrink",
            help="Plan `otdus shrink` with this method instead of an expansion: the layers removed or merged "
            "(--layers/--ratio count them), with their scores.",
        ),
    ] = None,
    select: Select = None,
    remove: Remove = None,
    calib: Calib = None,
    calib_tokens: CalibTokens = None,
    laco_merge: LacoMerge = None,
    laco_interval: LacoInterval = None,
    laco_threshold: LacoThreshold = None,
    laco_top: LacoTop = None,
    laco_bottom: LacoBottom = None,
    json_out: JsonFlag = False,
) -> None:
    """Show the layer map an expansion (or, with --shrink, a shrink) would produce; nothing is written."""
    from otdus_cli.expand import make_plan
    from otdus_cli.source import open_source

    shrinking = {
        "select": select,
        "remove": remove,
        "calib": calib,
        "calib_tokens": calib_tokens,
        "laco_merge": laco_merge,
        "laco_interval": laco_interval,
        "laco_threshold": laco_threshold,
        "laco_top": laco_top,
        "laco_bottom": laco_bottom,
    }
    with user_errors():
        if shrink is not None:
            _plan_shrink(model, flags, method_flags, shrink, shrinking, json_out)
            return
        given = next((name for name, value in shrinking.items() if value is not None), None)
        if given:
            raise OtdusError(f"--{given.replace('_', '-')} plans a shrink: give --shrink METHOD too")
        model, options, _ = _options(model, flags, method_flags)
        the_plan = make_plan(open_source(model, options.revision, options.allow_unknown_arch), options)
    if json_out:
        emit_json(_plan_json(the_plan))
        return
    out_console.print(_layer_table(the_plan))
    out_console.print(
        "function-preserving"
        if the_plan.function_preserving
        else "not function-preserving (perplexity will move)"
    )
    mixed = _mixed_kinds_line(the_plan)
    if mixed:
        out_console.print(mixed)
    roles = _roles_line(the_plan)
    if roles:
        out_console.print(roles)


def _plan_shrink(model, flags: LayoutFlags, method_flags, method, shrinking: dict[str, Any], json_out):
    """`plan --shrink METHOD`: the shrink's selection and layer map (cli/shrinking.py); ``shrinking``:
    the shrink's own options by parameter (``{"select": "bi", ...}``, None where not given)."""
    from otdus_cli.cli.flags import method_flags as method_flag_list
    from otdus_cli.cli.shrinking import quiet_if_scoring, show_shrink_plan, shrink_json, shrink_options
    from otdus_cli.methods.registry import SHRINK_METHODS
    from otdus_cli.shrink import plan_shrink

    expanding = {"--method": flags.method, "--position": flags.position, "--after": flags.after}
    given = next((flag for flag, value in expanding.items() if value is not None), None)
    if given or flags.zero_init is not None:
        raise OtdusError(f"{given or '--zero-init'} places new layers; a shrink (--shrink) adds none")
    for flag in method_flag_list(for_plan=True):
        if flag.group not in SHRINK_METHODS and (method_flags or {}).get(flag.key) is not None:
            raise OtdusError(f"{flag.flag.name} is an option of --method {flag.group}, which no shrink has")
    model, options, _ = shrink_options(
        model,
        flags.recipe,
        method_flags,
        method=method,
        layers=flags.layers,
        ratio=flags.ratio,
        **shrinking,
        revision=flags.revision,
        allow_unknown_arch=flags.allow_unknown_arch,
    )
    quiet_if_scoring(options)
    the_plan = plan_shrink(model, options)
    if json_out:
        emit_json(shrink_json(the_plan))
    else:
        show_shrink_plan(the_plan)


def inspect(
    path: Annotated[
        str,
        typer.Argument(
            help="A checkpoint folder (expanded or not), an otdus.json manifest or bundled:stories260k.",
            parser=model_name,
        ),
    ],
    json_out: JsonFlag = False,
) -> None:
    """Describe a checkpoint or manifest: layers, parameters, dtypes, size, and how it was made."""
    from otdus_cli.bundled import BUNDLED_MODELS
    from otdus_cli.card import card_line, card_summary
    from otdus_cli.io.file_hashes import edited_line, manifest_check
    from otdus_cli.io.reader import CheckpointReader
    from otdus_cli.manifest import MANIFEST, changed_since_written, read_manifest

    with user_errors():
        given = BUNDLED_MODELS.get(path, Path(path))
        if not given.exists():  # a hub id (README: a model argument may be one), from the cache or the hub
            from otdus_cli.source import resolve_source

            given = resolve_source(path).folder
        folder = given.parent if given.name == MANIFEST else given
        manifest = read_manifest(folder)
        info: dict[str, Any] = {"path": str(folder)}
        if (folder / "config.json").is_file():
            reader = CheckpointReader(folder)
            dtypes = Counter(reader.meta(n).dtype for n in reader.names)
            params = sum(_numel(reader.meta(n).shape) for n in reader.names)
            info.update(
                model_type=reader.config.get("model_type"),
                num_hidden_layers=reader.config.get("num_hidden_layers"),
                parameters=params,
                tensors=len(reader.names),
                dtypes=dict(dtypes),
                bytes=reader.total_bytes(),
                tie_word_embeddings=reader.config.get("tie_word_embeddings"),
            )
        elif manifest is None:
            raise OtdusError(
                f"{path} is neither a checkpoint folder nor an otdus manifest (no config.json); give the "
                "folder holding config.json and the weights, its otdus.json, a hub id or bundled:stories260k"
            )
        changed = changed_since_written(folder, manifest) if manifest else []
        if manifest:
            info["manifest"] = manifest
            # whether otdus.json is what otdus wrote: unchanged, edited, or unrecorded (older otdus)
            info["manifest_check"] = manifest_check(manifest)
            info["changed_since_written"] = changed
        card = card_summary(folder)
        if card is not None:
            info["card"] = card
    if json_out:
        emit_json(info)
        return
    table = Table(title=path if path in BUNDLED_MODELS else str(folder), show_header=False)
    for key in (
        "model_type",
        "num_hidden_layers",
        "parameters",
        "tensors",
        "dtypes",
        "bytes",
        "tie_word_embeddings",
    ):
        if key in info:
            value = info[key]
            text = f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)
            if key == "dtypes":  # "F32: 65 tensors", not a Python dict
                text = ", ".join(f"{dtype}: {n} tensor{'s' * (n != 1)}" for dtype, n in value.items())
            table.add_row(key, f"{text} ({human_bytes(value)})" if key == "bytes" else text)
    if manifest:
        table.add_row(
            "made by",
            f"otdus {manifest['otdus_version']} {manifest['method']} from {manifest['source']['id']}",
        )
        claim = str(manifest["function_preserving"])
        if changed:  # the claim is of the files as otdus wrote them (trained in place since?)
            more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
            claim += f" as written; changed since otdus wrote it: {', '.join(changed[:3])}{more}"
        table.add_row("function-preserving", claim)
        new = [str(lay["index"]) for lay in manifest["layers"] if lay["new"]]
        table.add_row("new layers", ", ".join(new))
        table.add_row("new parameters", f"{len(manifest['new_parameters'])} tensors")
        if info["manifest_check"] != "unchanged":
            table.add_row(
                "manifest",
                edited_line(folder)
                if info["manifest_check"] == "edited"
                else "records no hash of itself (an earlier otdus): edits cannot be told",
            )
        method = METHODS.get(manifest["method"])  # None: a method this version does not offer
        for name, text in method.inspect_rows(manifest) if method and method.inspect_rows else []:
            table.add_row(name, text)
    if card is not None:
        table.add_row("model card", card_line(card, manifest is not None))
    out_console.print(table)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
