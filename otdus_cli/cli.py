"""The `otdus` command line: a thin Typer + rich layer over the library.

Errors in the user's input are one line on stderr and exit code 2; broken parity in `verify` is
exit code 1. Set OTDUS_DEBUG=1 to see tracebacks of unexpected failures.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rich.text import Text

from otdus_cli import __version__
from otdus_cli.errors import Interrupted, OtdusError, exit_on_signals

app = typer.Typer(
    help="Depth up-scaling checkpoint surgery for Hugging Face LLMs: OT-DUS and its baselines, streamed.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out_console = Console()
err_console = Console(stderr=True)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of tables.")]


def _fail(message: str, code: int) -> None:
    # one line whatever the message holds (wrapped library errors can span several), and printed as
    # plain text: a message such as "[default]" must not be read as rich markup
    line = " ".join(message.split())
    err_console.print(Text.assemble(("error:", "bold red"), " ", line), highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@contextmanager
def _user_errors():
    """Turn library errors into one line and an exit code; keep tracebacks for OTDUS_DEBUG."""
    try:
        yield
    except OtdusError as exc:
        _fail(str(exc), exc.exit_code)
    except KeyboardInterrupt as exc:
        # Interrupted (any signal, from the output life cycle) says what is where; a bare Ctrl-C
        # outside an expansion has nothing to report
        stopped = exc if isinstance(exc, Interrupted) else Interrupted()
        err_console.print(str(stopped), highlight=False, soft_wrap=True)
        raise typer.Exit(stopped.exit_code) from None
    except typer.Exit:
        raise
    except Exception as exc:
        if os.environ.get("OTDUS_DEBUG"):
            raise
        _fail(f"unexpected {exc.__class__.__name__}: {exc} (OTDUS_DEBUG=1 shows the traceback)", 3)


def _quiet_transformers() -> None:
    """Model loading inside a command should not print transformers' own bars and advisories."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


@contextmanager
def _byte_progress(enabled: bool, description: str):
    """A rich progress bar over bytes written (on stderr), or a no-op; yields (set_total, advance)."""
    if not enabled:
        yield (lambda total: None), (lambda n: None)
        return
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=err_console,
        transient=True,
    )
    with progress:
        task = progress.add_task(description, total=None)
        yield (lambda total: progress.update(task, total=total)), (lambda n: progress.advance(task, n))


# -- shared options -----------------------------------------------------------------------------
Model = Annotated[str | None, typer.Argument(help="Source model: a local folder or a Hugging Face hub id.")]
Recipe = Annotated[
    Path | None,
    typer.Option("--recipe", help="YAML recipe with the model and expand options (flags override it)."),
]
Method = Annotated[
    str | None,
    typer.Option(
        help="How new layers are made: ot, average, copy, interpose, random, llama-pro, solar, stack. "
        "\\[default: ot]"
    ),
]
Position = Annotated[
    str | None,
    typer.Option(help="Where new layers go: top, bottom, mid, top-bottom, uniform. \\[default: top]"),
]
Layers = Annotated[
    int | None, typer.Option(help="Number of new layers. \\[default: half the base depth; stack: L]")
]
Ratio = Annotated[
    float | None, typer.Option(help="New layers as a fraction of the base depth (instead of --layers).")
]
After = Annotated[
    str | None,
    typer.Option(help="Explicit base indices to insert after, e.g. '3,7,11' (overrides --position)."),
]
ZeroInit = Annotated[
    bool | None,
    typer.Option(
        "--zero-init/--no-zero-init",
        help="Zero o_proj and down_proj (and MoE expert downs) of new layers, making them exact identities. "
        "\\[default: on for ot and llama-pro, off otherwise]",
        show_default=False,
    ),
]
OtVariant = Annotated[
    str | None,
    typer.Option(help="OT-DUS variant: paper, official (the released code), structured. \\[default: paper]"),
]
Solver = Annotated[
    str | None, typer.Option(help="Transport solver: sinkhorn or emd (exact). \\[default: sinkhorn]")
]
Reg = Annotated[float | None, typer.Option(help="Sinkhorn entropic regularisation. \\[default: 0.06]")]
Tol = Annotated[
    float | None,
    typer.Option(
        help="Sinkhorn stopping tolerance: largest relative row/column mass error "
        "(the official variant pins the released code's 1e-9). \\[default: 1e-6]"
    ),
]
MaxIter = Annotated[
    int | None, typer.Option(help="Sinkhorn iteration cap (official pins 10000). \\[default: 2000]")
]
Device = Annotated[
    str | None, typer.Option(help="Device for transport: auto, cpu, cuda, cuda:N. \\[default: auto]")
]
Dtype = Annotated[
    str | None,
    typer.Option(
        help="Output dtype: auto (keep the source's), float32, bfloat16, float16. \\[default: auto]"
    ),
]
ShardSize = Annotated[
    str | None, typer.Option(help="Largest output shard, e.g. 5GB, 500MB. \\[default: 5GB]")
]
Seed = Annotated[int | None, typer.Option(help="Seed for random initialisation. \\[default: 0]")]
Revision = Annotated[str | None, typer.Option(help="Hub revision (branch, tag or commit) of the source.")]
AllowUnknown = Annotated[
    bool,
    typer.Option(help="Copy layers generically for an unknown architecture (copy-type methods only)."),
]


def _options(recipe: Path | None, model: str | None, **flags: Any):
    """Merge recipe and flags (flags win) into validated ExpandOptions."""
    from pydantic import ValidationError

    from otdus_cli.options import ExpandOptions, OTOptions, load_recipe

    base = load_recipe(recipe) if recipe else None
    model = model or (base.model if base else None)
    if not model:
        raise OtdusError("give a model (folder or hub id) or --recipe")
    options = base.expand if base else ExpandOptions()
    after = flags.pop("after")
    ot_flags = {k: flags.pop(k) for k in ("variant", "solver", "reg", "tol", "max_iter")}
    updates = {k: v for k, v in flags.items() if v is not None}
    if after is not None:
        try:
            updates["after"] = [int(x) for x in after.split(",") if x.strip()]
        except ValueError:
            raise OtdusError(f"--after takes comma-separated layer indices, got {after!r}") from None
    try:
        ot = OTOptions.model_validate(
            {**options.ot.model_dump(), **{k: v for k, v in ot_flags.items() if v is not None}}
        )
        merged = ExpandOptions.model_validate({**options.model_dump(), **updates, "ot": ot.model_dump()})
    except ValidationError as exc:
        err = exc.errors()[0]
        raise OtdusError(
            f"--{'-'.join(str(p) for p in err['loc']).replace('_', '-')}: {err['msg']}"
        ) from None
    return model, merged, base


def _layer_table(plan) -> Table:
    table = Table(title=f"{plan.method.name}: {plan.source.depth} -> {len(plan.layer_map)} layers")
    for col in ("out", "kind", "source", "parents", "builder", "zero-init"):
        table.add_column(col)
    for lay in plan.layer_map:
        table.add_row(
            str(lay.index),
            "[green]new[/]" if lay.new else "base",
            str(lay.source),
            ",".join(map(str, lay.parents)) if lay.new else "",
            lay.builder if lay.new else "copy",
            "yes" if lay.zero_init else "",
        )
    return table


def _plan_json(plan) -> dict:
    return {
        "source": plan.source.resolved.id,
        "family": plan.source.family.name,
        "method": plan.method.name,
        "base_layers": plan.source.depth,
        "num_hidden_layers": len(plan.layer_map),
        "function_preserving": plan.function_preserving,
        "layers": [lay.to_json() for lay in plan.layer_map],
        "options": plan.options.model_dump(),
        "output_bytes": sum(t.nbytes for t in plan.tensors),
    }


# -- commands -----------------------------------------------------------------------------------
@app.command()
def expand(
    model: Model = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Output folder (must not exist).")] = None,
    recipe: Recipe = None,
    method: Method = None,
    position: Position = None,
    layers: Layers = None,
    ratio: Ratio = None,
    after: After = None,
    zero_init: ZeroInit = None,
    ot_variant: OtVariant = None,
    solver: Solver = None,
    reg: Reg = None,
    tol: Tol = None,
    max_iter: MaxIter = None,
    device: Device = None,
    dtype: Dtype = None,
    max_shard_size: ShardSize = None,
    seed: Seed = None,
    revision: Revision = None,
    allow_unknown_arch: AllowUnknown = False,
    force: Annotated[
        bool,
        typer.Option(
            help="Replace an existing --out, only if it is an earlier otdus output (every file listed by "
            "its otdus.json) or an empty folder, and only once the new output is complete."
        ),
    ] = False,
    json_out: JsonFlag = False,
) -> None:
    """Insert new decoder layers and write the deeper checkpoint (streamed, atomic)."""
    from otdus_cli.expand import expand as run_expand

    with _user_errors():
        model, options, recipe_obj = _options(
            recipe,
            model,
            method=method,
            position=position,
            layers=layers,
            ratio=ratio,
            after=after,
            zero_init=zero_init,
            variant=ot_variant,
            solver=solver,
            reg=reg,
            tol=tol,
            max_iter=max_iter,
            device=device,
            dtype=dtype,
            max_shard_size=max_shard_size,
            seed=seed,
            revision=revision,
            allow_unknown_arch=allow_unknown_arch or None,
        )
        out = out or (Path(recipe_obj.out) if recipe_obj and recipe_obj.out else None)
        if out is None:
            raise OtdusError("give --out (the output folder)")
        with _byte_progress(not json_out and err_console.is_terminal, "expanding") as (set_total, advance):
            result = run_expand(
                model,
                out,
                options,
                force=force,
                progress=advance,
                on_plan=lambda plan: set_total(sum(t.nbytes for t in plan.tensors)),
            )
    warnings = _transport_warnings(result.manifest.get("transport", {}))
    for line in [*result.warnings, *warnings]:
        err_console.print(f"[yellow]warning:[/] {line}", highlight=False, soft_wrap=True)
    summary = {
        "out": str(result.out),
        "warnings": result.warnings,
        "transport_warnings": warnings,
        **_plan_json(result.plan),
        "bytes_written": result.bytes_written,
        "seconds": round(result.seconds, 3),
        "new_parameters": len(result.manifest["new_parameters"]),
    }
    if json_out:
        _emit_json(summary)
        return
    preserved = "function-preserving" if result.plan.function_preserving else "not function-preserving"
    out_console.print(
        f"[bold green]wrote[/] {result.out}: {summary['base_layers']} -> {summary['num_hidden_layers']} "
        f"layers with {summary['method']} ({preserved}), {result.bytes_written / 1e9:.2f} GB "
        f"in {result.seconds:.1f} s"
    )


def _transport_warnings(transport: dict) -> list[str]:
    """Transport solves that stopped at the iteration cap or hit numerical trouble, one line each."""
    lines = []
    for layer, stats in transport.items():
        for module, info in (stats.get("modules") or {}).items():
            if isinstance(info, dict) and info.get("status", "ok") != "ok":
                error = info.get("marginal_error", float("nan"))
                lines.append(
                    f"layer {layer} {module}: Sinkhorn {info['status']} after {info.get('iterations')} "
                    f"iterations (marginal error {error:.2g}); raise --max-iter or --reg"
                )
    return lines


@app.command()
def plan(
    model: Model = None,
    recipe: Recipe = None,
    method: Method = None,
    position: Position = None,
    layers: Layers = None,
    ratio: Ratio = None,
    after: After = None,
    zero_init: ZeroInit = None,
    revision: Revision = None,
    allow_unknown_arch: AllowUnknown = False,
    json_out: JsonFlag = False,
) -> None:
    """Show the layer map an expansion would produce; nothing is written."""
    from otdus_cli.expand import make_plan, open_source

    with _user_errors():
        model, options, _ = _options(
            recipe,
            model,
            method=method,
            position=position,
            layers=layers,
            ratio=ratio,
            after=after,
            zero_init=zero_init,
            variant=None,
            solver=None,
            reg=None,
            tol=None,
            max_iter=None,
            revision=revision,
            allow_unknown_arch=allow_unknown_arch or None,
        )
        the_plan = make_plan(open_source(model, options.revision, options.allow_unknown_arch), options)
    if json_out:
        _emit_json(_plan_json(the_plan))
        return
    out_console.print(_layer_table(the_plan))
    out_console.print(
        "function-preserving"
        if the_plan.function_preserving
        else "not function-preserving (perplexity will move)"
    )


@app.command()
def inspect(
    path: Annotated[
        Path, typer.Argument(help="A checkpoint folder (expanded or not) or an otdus.json manifest.")
    ],
    json_out: JsonFlag = False,
) -> None:
    """Describe a checkpoint or manifest: layers, parameters, dtypes, size, and how it was made."""
    from otdus_cli.io.reader import CheckpointReader
    from otdus_cli.manifest import MANIFEST, read_manifest

    with _user_errors():
        folder = path.parent if path.name == MANIFEST else path
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
            raise OtdusError(f"{path} is neither a checkpoint folder nor an otdus manifest")
        if manifest:
            info["manifest"] = manifest
    if json_out:
        _emit_json(info)
        return
    table = Table(title=str(folder), show_header=False)
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
            table.add_row(
                key, f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)
            )
    if manifest:
        table.add_row(
            "made by",
            f"otdus {manifest['otdus_version']} {manifest['method']} from {manifest['source']['id']}",
        )
        table.add_row("function-preserving", str(manifest["function_preserving"]))
        new = [str(lay["index"]) for lay in manifest["layers"] if lay["new"]]
        table.add_row("new layers", ", ".join(new))
        table.add_row("new parameters", f"{len(manifest['new_parameters'])} tensors")
    out_console.print(table)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# -- verify / ppl ------------------------------------------------------------------------------
Protocol = Annotated[
    str,
    typer.Option(
        help="wikitext: lm-eval's protocol (documents, detokeniser, rolling windows, word/byte perplexity); "
        "token: GPTQ-style disjoint --seq-len windows over the joined text."
    ),
]
TextFile = Annotated[
    Path | None, typer.Option("--text", help="Any text file (documents split at <|endoftext|> lines).")
]
Dataset = Annotated[
    str | None,
    typer.Option(help="A Hugging Face dataset NAME[:CONFIG] (needs `datasets` and network or cache)."),
]
SeqLen = Annotated[
    int, typer.Option(help="Token-protocol window length, capped by the model's max positions.")
]
MaxTokens = Annotated[int | None, typer.Option(help="Score at most this many tokens (quick checks).")]
MaxDocs = Annotated[int | None, typer.Option(help="Use at most this many documents.")]
EvalDevice = Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")]
EvalDtype = Annotated[
    str,
    typer.Option(help="Compute dtype: float32 (bitwise parity) or bfloat16/float16 (parity within 1e-3)."),
]
BatchSize = Annotated[int, typer.Option(help="Windows per forward pass.")]
TokenMode = Annotated[
    str,
    typer.Option(
        help="Token protocol: joined (documents joined with blank lines, GPTQ style) or documents "
        "(one BOS per document, windows inside documents, as TinyStories models are scored)."
    ),
]


def _corpus(text: Path | None, dataset: str | None, max_docs: int | None):
    from otdus_cli.verify.text import dataset_corpus, text_corpus, wikitext_corpus

    if text is not None and dataset is not None:
        raise OtdusError("give --text or --dataset, not both")
    if text is not None:
        return text_corpus(text, max_docs=max_docs)
    if dataset is not None:
        return dataset_corpus(dataset, max_docs=max_docs)
    return wikitext_corpus(max_docs=max_docs)


def _metrics_rows(table: Table, metrics, other=None) -> None:
    for key, value in metrics.values().items():
        if key == "loglikelihood":
            continue
        row = [key + (" *" if key == metrics.headline()[0] else ""), f"{value:.6g}"]
        if other is not None:
            theirs = other.values()[key]
            row += [f"{theirs:.6g}", f"{theirs - value:+.3g}"]
        table.add_row(*row)


def _local_model(model: str) -> str:
    """A folder for a model argument (hub ids are resolved through the local cache)."""
    from otdus_cli.source import resolve_source

    return str(resolve_source(model).folder)


def _evaluate(
    model: str,
    base: str | None,
    find_base: bool,
    eval_options: dict[str, Any],
    device: str,
    dtype: str,
    batch_size: int,
    json_out: bool,
) -> None:
    """Shared body of verify and ppl: a lockstep comparison when there is a base, else one model."""
    from otdus_cli.manifest import manifest_source
    from otdus_cli.source import resolve_source
    from otdus_cli.verify.compare import make_plan, perplexity, verify_expansion

    _quiet_transformers()
    label = "verifying" if find_base or base else "scoring"
    with _user_errors(), _task_progress(not json_out and err_console.is_terminal, label) as update:
        model_dir = _local_model(model)
        if base is None and find_base:
            recorded = manifest_source(model_dir)
            base = str(resolve_source(*recorded).folder) if recorded else None
        base_dir = _local_model(base) if base else None
        corpus = _corpus(eval_options.pop("text"), eval_options.pop("dataset"), eval_options["max_docs"])
        plan = make_plan(base_dir or model_dir, corpus=corpus, **eval_options)
        run = {"device": device, "dtype": dtype, "batch_size": batch_size}
        run["progress"] = lambda kind, done, total: update(done, total, kind)
        if base_dir is None:
            report = perplexity(model_dir, plan, **run)
        else:
            report = verify_expansion(base_dir, model_dir, plan, **run)
    if base_dir is None:
        _print_ppl(report, json_out)
        return
    if json_out:
        _emit_json(report.to_dict())
    else:
        table = Table(
            title=f"{report.base.corpus}: {report.base.protocol} protocol, {report.base.n_tokens:,} tokens, "
            f"{report.device} {report.dtype}"
        )
        for col in ("metric (* headline)", "base", "expanded", "delta"):
            table.add_column(col)
        _metrics_rows(table, report.base, report.expanded)
        out_console.print(table)
        if report.first_divergence is not None:
            d = report.first_divergence
            out_console.print(f"first divergence: {d.name} (max |diff| {d.max_abs_diff:.3g})")
        colour = "green" if report.exit_code == 0 else "red"
        out_console.print(f"[bold {colour}]{report.verdict}[/]")
    if report.exit_code:
        raise typer.Exit(report.exit_code)


def _print_ppl(report, json_out: bool) -> None:
    if json_out:
        _emit_json(report.to_dict())
        return
    m = report.metrics
    table = Table(title=f"{report.model}: {m.corpus}, {m.protocol} protocol, {m.n_tokens:,} tokens")
    for col in ("metric (* headline)", "value"):
        table.add_column(col)
    _metrics_rows(table, m)
    out_console.print(table)


@app.command()
def verify(
    expanded: Annotated[str, typer.Argument(help="The expanded checkpoint (or any model to compare).")],
    base: Annotated[
        str | None, typer.Option(help="The base model. \\[default: the source recorded in the manifest]")
    ] = None,
    protocol: Protocol = "wikitext",
    text: TextFile = None,
    dataset: Dataset = None,
    seq_len: SeqLen = 2048,
    token_mode: TokenMode = "joined",
    max_tokens: MaxTokens = None,
    max_docs: MaxDocs = None,
    device: EvalDevice = "auto",
    dtype: EvalDtype = "float32",
    batch_size: BatchSize = 1,
    json_out: JsonFlag = False,
) -> None:
    """Perplexity parity of an expansion with its base, layer by layer in lockstep (exit 1 if broken).

    With no --base and no manifest, reports the one model's perplexity.
    """
    options = dict(
        text=text,
        dataset=dataset,
        protocol=protocol,
        seq_len=seq_len,
        token_mode=token_mode,
        max_tokens=max_tokens,
        max_docs=max_docs,
    )
    _evaluate(expanded, base, True, options, device, dtype, batch_size, json_out)


@app.command()
def ppl(
    model: Annotated[str, typer.Argument(help="A model folder, hub id or bundled:stories260k.")],
    protocol: Protocol = "wikitext",
    text: TextFile = None,
    dataset: Dataset = None,
    seq_len: SeqLen = 2048,
    token_mode: TokenMode = "joined",
    max_tokens: MaxTokens = None,
    max_docs: MaxDocs = None,
    device: EvalDevice = "auto",
    dtype: EvalDtype = "float32",
    batch_size: BatchSize = 1,
    json_out: JsonFlag = False,
) -> None:
    """Perplexity of one model, streamed layer by layer (same protocols as verify)."""
    options = dict(
        text=text,
        dataset=dataset,
        protocol=protocol,
        seq_len=seq_len,
        token_mode=token_mode,
        max_tokens=max_tokens,
        max_docs=max_docs,
    )
    _evaluate(model, None, False, options, device, dtype, batch_size, json_out)


@app.command()
def demo(
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            "-o",
            help="Where the expanded demo model goes (an earlier demo output there is replaced).",
        ),
    ] = Path("demo-out"),
    method: Annotated[str, typer.Option(help="Expansion method.")] = "ot",
    max_tokens: Annotated[int, typer.Option(help="WikiText tokens to verify on.")] = 16384,
) -> None:
    """Expand the bundled real stories260K model (5 -> 7 layers) and verify parity on bundled WikiText."""
    from otdus_cli.bundled import TINYSTORIES_SAMPLE

    out_console.rule("1. otdus expand bundled:stories260k")
    expand(model="bundled:stories260k", out=out, method=method, force=True)
    out_console.rule("2. otdus inspect")
    inspect(path=out)
    out_console.rule("3. otdus verify (WikiText-2 test, lm-eval protocol)")
    verify(expanded=str(out), max_tokens=max_tokens, device="cpu")
    out_console.rule("4. otdus verify (TinyStories, token perplexity, in domain)")
    verify(expanded=str(out), protocol="token", token_mode="documents", text=TINYSTORIES_SAMPLE, device="cpu")


def _ints(text: str | None, flag: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise OtdusError(f"{flag} takes comma-separated integers, got {text!r}") from None


@contextmanager
def _task_progress(enabled: bool, description: str):
    """A rich progress bar over counted steps (on stderr); yields update(done, total, label)."""
    if not enabled:
        yield lambda done, total, label="": None
        return
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeRemainingColumn(),
        console=err_console,
        transient=True,
    )
    with progress:
        task = progress.add_task(description, total=None)

        def update(done: int, total: int, label: str = "") -> None:
            progress.update(task, completed=done, total=total, description=f"{description} {label}".strip())

        yield update


@app.command()
def study(
    base: Annotated[
        str | None, typer.Argument(help="Base model: folder, hub id or bundled:stories260k.")
    ] = None,
    train: Annotated[
        str | None,
        typer.Option(help="Training text: a file, bundled:tinystories-sample or bundled:wikitext-test."),
    ] = None,
    eval_text: Annotated[
        str | None,
        typer.Option(
            "--eval", help="Held-out text. \\[default: the last --eval-fraction of the training documents]"
        ),
    ] = None,
    recipe: Annotated[
        Path | None,
        typer.Option("--recipe", help="A study recipe (recipes/study-*.yaml); flags override it."),
    ] = None,
    methods: Annotated[
        str,
        typer.Option(
            help="Comma-separated method specs method[:variant][+zero|+nozero], "
            "e.g. ot,ot:structured,average+zero."
        ),
    ] = "ot,average,average+zero,copy,random",
    seeds: Annotated[str, typer.Option(help="Comma-separated seeds.")] = "0,1,2",
    steps: Annotated[int, typer.Option(help="Training steps per run.")] = 150,
    lr: Annotated[float, typer.Option(help="AdamW learning rate.")] = 2e-3,
    batch: Annotated[int, typer.Option(help="Windows per step.")] = 8,
    seq_len: Annotated[int, typer.Option(help="Tokens per window.")] = 128,
    eval_every: Annotated[int, typer.Option(help="Evaluate held-out loss every N steps.")] = 25,
    eval_windows: Annotated[int, typer.Option(help="Held-out windows per evaluation.")] = 32,
    eval_fraction: Annotated[
        float, typer.Option(help="Held-out share of documents when --eval is not given.")
    ] = 0.05,
    reference: Annotated[
        str, typer.Option(help="Method the others are compared with (paired by seed).")
    ] = "ot",
    train_all: Annotated[bool, typer.Option(help="Train every parameter, not only the new layers.")] = False,
    layers: Layers = None,
    position: Position = None,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N.")] = "cpu",
    threads: Annotated[
        int | None, typer.Option(help="torch CPU threads. \\[default: torch's choice]")
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Folder for study.json and loss_curves.png.")
    ] = None,
    json_out: JsonFlag = False,
) -> None:
    """Compare initialisations: expand with each method, train the new layers, held-out loss over seeds."""
    from otdus_cli.study import run_recipe, study_table
    from otdus_cli.study import study as run_study

    _quiet_transformers()
    with _user_errors(), _task_progress(not json_out and err_console.is_terminal, "study") as update:

        def on_event(event) -> None:
            if event.runs:
                update(event.run, event.runs, f"{event.label} seed {event.seed}")

        if recipe is not None:
            results = run_recipe(recipe, out_dir=out, progress=on_event)
        else:
            if not base or not train:
                raise OtdusError("give BASE and --train (or --recipe)")
            expand_options = {
                k: v for k, v in {"layers": layers, "position": position}.items() if v is not None
            }
            results = {
                "study": run_study(
                    base,
                    train,
                    eval_text,
                    methods=[m.strip() for m in methods.split(",") if m.strip()],
                    seeds=_ints(seeds, "--seeds") or [0],
                    steps=steps,
                    lr=lr,
                    batch=batch,
                    seq_len=seq_len,
                    eval_every=eval_every,
                    eval_windows=eval_windows,
                    eval_fraction=eval_fraction,
                    reference=reference,
                    train_new_only=not train_all,
                    device=device,
                    threads=threads,
                    expand_options=expand_options or None,
                    out_dir=out,
                    progress=on_event,
                )
            }
    if json_out:
        _emit_json({name: r.to_dict() for name, r in results.items()})
        return
    for r in results.values():
        out_console.print(study_table(r))


@app.command()
def diagnose(
    checkpoint: Annotated[str, typer.Argument(help="Checkpoint folder, hub id or bundled:stories260k.")],
    text: Annotated[
        str, typer.Option(help="Text: a file, bundled:tinystories-sample or bundled:wikitext-test.")
    ] = "bundled:tinystories-sample",
    pair: Annotated[
        str | None, typer.Option(help="One adjacent pair 'i,i+1'. \\[default: every adjacent pair]")
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="Tokens of text run through the model.")] = 4096,
    seq_len: Annotated[int, typer.Option(help="Tokens per window.")] = 256,
    reg: Annotated[float, typer.Option(help="Sinkhorn regularisation of the plans (as OT-DUS).")] = 0.06,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N.")] = "cpu",
    png: Annotated[
        Path | None, typer.Option(help="Also write the weight-norm profile as a PNG (matplotlib).")
    ] = None,
    json_out: JsonFlag = False,
) -> None:
    """Does OT pair neurons that really co-activate? Correlations, plan entropy, weight-norm profile."""
    from otdus_cli.study import diagnose as run_diagnose
    from otdus_cli.study import diagnose_tables

    _quiet_transformers()
    with _user_errors():
        pairs = None
        if pair is not None:
            ij = _ints(pair, "--pair") or []
            if len(ij) != 2 or ij[1] != ij[0] + 1:
                raise OtdusError(f"--pair takes two adjacent layer indices like 3,4, got {pair!r}")
            pairs = [(ij[0], ij[1])]
        result = run_diagnose(
            checkpoint,
            text,
            pairs=pairs,
            max_tokens=max_tokens,
            seq_len=seq_len,
            reg=reg,
            device=device,
            png=png,
        )
    if json_out:
        _emit_json(result.to_dict())
        return
    out_console.print(diagnose_tables(result))


@app.command()
def version(json_out: JsonFlag = False) -> None:
    """Print the otdus version (with --json: also Python's and the key libraries' versions)."""
    if not json_out:
        out_console.print(__version__)
        return
    from importlib.metadata import PackageNotFoundError  # noqa: PLC0415
    from importlib.metadata import version as dist_version  # noqa: PLC0415

    libs = {}
    for dist in ("torch", "transformers", "safetensors", "huggingface_hub", "POT", "typer", "pydantic"):
        try:
            libs[dist] = dist_version(dist)
        except PackageNotFoundError:
            libs[dist] = None
    _emit_json({"otdus": __version__, "python": platform.python_version(), "libraries": libs})


def main(argv: list[str] | None = None) -> Callable | None:
    exit_on_signals()  # SIGTERM/SIGHUP (timeout, Slurm) clean up like Ctrl-C
    app(args=argv)
    return None


if __name__ == "__main__":
    main()
