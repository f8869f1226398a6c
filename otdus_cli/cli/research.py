"""Commands that weigh the evidence for an initialisation: `study` and `diagnose`."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Annotated

import typer

from otdus_cli.cli.checkpoint import Layers, Position
from otdus_cli.cli.console import (
    JsonFlag,
    WarningLines,
    emit_json,
    err_console,
    out_console,
    quiet_transformers,
    show_progress,
    task_progress,
    user_errors,
)
from otdus_cli.cli.flags import Force
from otdus_cli.cli.values import (
    device_parser,
    distinct,
    distinct_int_list,
    int_list,
    ints,
    items,
    method_specs,
    model_name,
    text_spec,
)
from otdus_cli.errors import OtdusError
from otdus_cli.study_settings import DEFAULT_METHODS, StudySettings

# the study's defaults and help texts come from its settings model (the library's, the recipes')
_DEFAULTS = StudySettings()


def _help(field: str, text: str | None = None) -> str:
    return text or StudySettings.model_fields[field].description or ""


def float_list(value: str) -> str:
    """Comma-separated distinct positive finite numbers (kept as text; the command splits them)."""
    try:
        numbers = floats(value)
    except ValueError:
        numbers = []
    if not numbers or not all(0 < x < math.inf for x in numbers):
        raise typer.BadParameter(f"takes comma-separated positive numbers, got {value!r}")
    distinct(numbers, value)
    return value


def floats(text: str) -> list[float]:
    return [float(x) for x in items(text)]


def window_count(value: str) -> str:
    """A positive number of windows, or 'all'."""
    if value != "all" and not (value.isdigit() and int(value) >= 1):
        raise typer.BadParameter(f"takes a number of windows >= 1 or 'all', got {value!r}")
    return value


Device = Annotated[
    str, typer.Option(help="auto (a GPU when there is one), cpu, cuda or cuda:N.", parser=device_parser(True))
]
SeqLen = Annotated[int, typer.Option(help="Tokens per window.", min=2)]


# what a recipe defines itself: these flags and a recipe are refused together
_NOT_WITH_RECIPE = {"base": "BASE", "train": "--train", "eval_text": "--eval", "methods": "--methods"}


def _given(ctx: typer.Context) -> set[str]:
    """Parameters set on the command line (not left at their defaults)."""

    def source(name: str) -> str:  # by name: Typer may vendor its own click and ParameterSource
        found = ctx.get_parameter_source(name)
        return getattr(found, "name", "")

    return {name for name in ctx.params if source(name) in ("COMMANDLINE", "ENVIRONMENT")}


def study(
    ctx: typer.Context,
    base: Annotated[
        str | None,
        typer.Argument(
            metavar="BASE",  # shown bare in the usage line: required, but a recipe may name it instead
            help="Base model: folder, hub id or bundled:stories260k. [required unless --recipe names it]",
            parser=model_name,
        ),
    ] = None,
    train: Annotated[
        str | None,
        typer.Option(
            help="Training text: a file or a bundled text (bundled:tinystories-train-2mib, "
            "bundled:tinystories-sample, bundled:wikitext-test, bundled:wikitext-valid).",
            parser=text_spec,
        ),
    ] = None,
    eval_text: Annotated[
        str | None,
        typer.Option(
            "--eval",
            help="Held-out text. [default: the last --eval-fraction of the training documents]",
            parser=text_spec,
        ),
    ] = None,
    recipe: Annotated[
        Path | None,
        typer.Option(
            "--recipe",
            help="A study recipe (recipes/study-*.yaml); setting flags given with it override "
            "its settings (BASE, --train, --eval and --methods come from the recipe).",
            exists=True,
            dir_okay=False,
        ),
    ] = None,
    methods: Annotated[
        str,
        typer.Option(
            help="Comma-separated method specs method[:variant][+zero|+nozero], "
            "e.g. ot,ot:structured,average+zero, or interpose,stack (with --layers the base depth); "
            "or arms that shrink the base and heal it (with --train-all), "
            "shrink:METHOD[:VARIANT][@SELECTION], e.g. shrink:drop,shrink:laco,shrink:ot@angular "
            "(--layers: the layers removed).",
            parser=method_specs,
        ),
    ] = ",".join(DEFAULT_METHODS),
    seeds: Annotated[
        str, typer.Option(help=_help("seeds", "Comma-separated seeds."), parser=distinct_int_list)
    ] = (",".join(map(str, _DEFAULTS.seeds))),
    steps: Annotated[int, typer.Option(help=_help("steps"), min=1)] = _DEFAULTS.steps,
    lr: Annotated[float, typer.Option(help=_help("lr"), min=0)] = _DEFAULTS.lr,
    lr_sweep: Annotated[
        str | None,
        typer.Option(
            help=_help(
                "lr_sweep",
                "Comma-separated learning rates to choose from, per method, on a validation split.",
            ),
            parser=float_list,
        ),
    ] = None,
    batch: Annotated[int, typer.Option(help=_help("batch"), min=1)] = _DEFAULTS.batch,
    seq_len: SeqLen = _DEFAULTS.seq_len,
    eval_every: Annotated[int, typer.Option(help=_help("eval_every"), min=1)] = _DEFAULTS.eval_every,
    eval_windows: Annotated[
        str,
        typer.Option(
            help=_help("eval_windows", "Held-out windows scored (evenly spaced), or 'all'."),
            parser=window_count,
        ),
    ] = str(_DEFAULTS.eval_windows),
    eval_fraction: Annotated[
        float, typer.Option(help=_help("eval_fraction"), min=0, max=1)
    ] = _DEFAULTS.eval_fraction,
    reference: Annotated[
        str,
        typer.Option(
            help="Method the others are compared with (paired by seed and evaluation window; Holm-adjusted)."
        ),
    ] = "ot",
    train_all: Annotated[
        bool, typer.Option(help="Train every parameter, not only the new layers.")
    ] = not _DEFAULTS.train_new_only,
    layers: Layers = None,
    position: Position = None,
    device: Device = _DEFAULTS.device,
    threads: Annotated[
        int | None, typer.Option(help="torch CPU threads. [default: torch's choice]", min=1)
    ] = _DEFAULTS.threads,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "-o",
            help="Folder for study.json and loss_curves.png (must not exist); with --recipe, a folder "
            "holding one such folder per study.",
        ),
    ] = None,
    force: Force = False,
    json_out: JsonFlag = False,
) -> None:
    """Compare initialisations: expand with each method, train the new layers, held-out loss over seeds."""
    given = _given(ctx)
    with user_errors():
        if recipe is None and (not base or not train):
            raise OtdusError("give BASE and --train (or --recipe)")
        clash = [flag for name, flag in _NOT_WITH_RECIPE.items() if name in given]
        if recipe is not None and clash:
            raise OtdusError(
                f"{', '.join(clash)} with --recipe: the recipe sets the base, the texts and the methods "
                "(edit it, or drop --recipe)"
            )
    from otdus_cli.study import run_recipe, study_table
    from otdus_cli.study import study as run_study

    # every setting by its StudySettings field, with the CLI parameter that carries it
    settings = {
        "seeds": ("seeds", ints(seeds) or [0]),
        "steps": ("steps", steps),
        "lr": ("lr", lr),
        "lr_sweep": ("lr_sweep", floats(lr_sweep) if lr_sweep else None),
        "batch": ("batch", batch),
        "seq_len": ("seq_len", seq_len),
        "eval_every": ("eval_every", eval_every),
        "eval_windows": ("eval_windows", eval_windows if eval_windows == "all" else int(eval_windows)),
        "eval_fraction": ("eval_fraction", eval_fraction),
        "train_new_only": ("train_all", not train_all),
        "device": ("device", device),
        "threads": ("threads", threads),
    }
    expand_options = {k: v for k, v in {"layers": layers, "position": position}.items() if v is not None}
    shrink_options = {"layers": layers} if layers is not None else {}  # shrink arms: the layers removed
    quiet_transformers()
    say = WarningLines()
    with user_errors(), task_progress(show_progress(json_out), "study", "runs") as update:

        def on_event(event) -> None:
            if event.runs:
                update(event.run - (event.kind != "run"), event.runs, f"{event.label} seed {event.seed}")
            line = study_progress_line(event, every_eval=not err_console.is_terminal)
            if line:
                err_console.print(line, highlight=False, markup=False, soft_wrap=True)

        if recipe is not None:  # the recipe's settings, except those given as flags
            results = run_recipe(
                recipe,
                out_dir=out,
                overrides={key: value for key, (flag, value) in settings.items() if flag in given},
                reference=reference if "reference" in given else None,
                expand_overrides={k: v for k, v in expand_options.items() if k in given} or None,
                shrink_overrides={k: v for k, v in shrink_options.items() if k in given} or None,
                progress=on_event,
                force=force,
                on_note=say,
            )
        else:
            results = {
                "study": run_study(
                    base,
                    train,
                    eval_text,
                    methods=items(methods),
                    reference=reference,
                    expand_options=expand_options or None,
                    shrink_options=shrink_options or None,
                    out_dir=out,
                    progress=on_event,
                    force=force,
                    on_note=say,
                    **{key: value for key, (_, value) in settings.items()},
                )
            }
    if json_out:
        emit_json({name: r.to_dict() for name, r in results.items()})
        return
    for r in results.values():
        out_console.print(study_table(r))


def study_progress_line(event, every_eval: bool) -> str | None:
    """One stderr line for a study event: the data, each run's start and end, and (in a log, where no
    bar shows) each held-out evaluation. Runs are counted over the whole study, so the count only grows."""
    where = f"study: run {event.run}/{event.runs}, {event.label} seed {event.seed}"
    if event.kind == "data":
        return f"study: {event.message}"
    if event.kind == "expand":
        return f"{where}: {event.message or 'expanding, then training'}"
    if event.kind == "eval" and every_eval:
        return f"{where}: step {event.step}, {event.message or 'held-out'} loss {event.loss:.4f}"
    if event.kind == "run":
        scored = event.message or "held-out"
        return f"{where}: done at step {event.step}, final {scored} loss {event.loss:.4f}"
    return None


def _step_lines(command: str):
    """A line on stderr per step of a run (each pair of diagnose: one OT solve and its scores, minutes
    on a large model), with the time since the run began, for a terminal and a log alike."""
    start = time.monotonic()

    def say(step: str) -> None:
        line = f"{command}: {step}, {time.monotonic() - start:.0f} s so far"
        err_console.print(line, highlight=False, markup=False, soft_wrap=True)

    return say


def _adjacent_pair(value: str) -> str:
    ij = ints(int_list(value))
    if len(ij) != 2 or ij[1] != ij[0] + 1:
        raise typer.BadParameter(f"takes two adjacent layer indices like 3,4, got {value!r}")
    return value


def diagnose(
    checkpoint: Annotated[
        str, typer.Argument(help="Checkpoint folder, hub id or bundled:stories260k.", parser=model_name)
    ],
    text: Annotated[
        str,
        typer.Option(
            help="Text: a file or a bundled text (bundled:tinystories-train-2mib, "
            "bundled:tinystories-sample, bundled:wikitext-test, bundled:wikitext-valid).",
            parser=text_spec,
        ),
    ] = "bundled:tinystories-train-2mib",
    pair: Annotated[
        str | None,
        typer.Option(help="One adjacent pair 'i,i+1'. [default: every adjacent pair]", parser=_adjacent_pair),
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="Tokens of text run through the model.", min=1)] = 4096,
    seq_len: SeqLen = 256,
    reg: Annotated[
        float, typer.Option(help="Sinkhorn regularisation of the plans (as OT-DUS).", min=0)
    ] = 0.06,
    device: Device = "auto",
    png: Annotated[
        Path | None, typer.Option(help="Also write the weight-norm profile as a PNG (matplotlib).")
    ] = None,
    json_out: JsonFlag = False,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="No progress on stderr (by default a line per step).")
    ] = False,
) -> None:
    """Does OT pair neurons that really co-activate? Correlations, plan entropy, weight-norm profile."""
    from otdus_cli.study import diagnose as run_diagnose
    from otdus_cli.study import diagnose_tables

    quiet_transformers()
    with user_errors():
        pairs = [tuple(ints(pair))] if pair is not None else None
        result = run_diagnose(
            checkpoint,
            text,
            pairs=pairs,
            max_tokens=max_tokens,
            seq_len=seq_len,
            reg=reg,
            device=device,
            png=png,
            progress=None if quiet else _step_lines("otdus diagnose"),
        )
    for line in result.warnings:
        err_console.print(f"[yellow]warning:[/] {line}", highlight=False, soft_wrap=True)
    if json_out:
        emit_json(result.to_dict())
        return
    out_console.print(diagnose_tables(result))
