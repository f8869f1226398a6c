"""Commands that score models: `verify` (an expansion against its base) and `ppl` (one model)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from otdus_cli.bundled import BUNDLED_MODELS
from otdus_cli.card import add_verification, check_card_target
from otdus_cli.cli.console import (
    JsonFlag,
    Quiet,
    WarningLines,
    emit_json,
    err_console,
    out_console,
    quiet_transformers,
    tick_progress,
    user_errors,
)
from otdus_cli.cli.flags import with_flags
from otdus_cli.cli.values import (
    EvalDtype,
    SoftmaxDtype,
    TokenMode,
    device_parser,
    lm_eval_version,
    model_name,
    text_spec,
)
from otdus_cli.cli.values import Protocol as ProtocolName
from otdus_cli.errors import OtdusError
from otdus_cli.verify.lm_eval_presets import LM_EVAL_NEWEST

Protocol = Annotated[
    ProtocolName,
    typer.Option(
        help="wikitext: lm-eval's protocol (documents, detokeniser, rolling windows, word/byte perplexity); "
        "token: GPTQ-style disjoint --seq-len windows over the joined text."
    ),
]
TextFile = Annotated[
    str | None,
    typer.Option(
        "--text",
        help="Any text file (documents split at <|endoftext|> lines), or a bundled text: "
        "bundled:tinystories-sample, bundled:tinystories-train-2mib, bundled:wikitext-test, "
        "bundled:wikitext-valid.",
        parser=text_spec,
    ),
]
Dataset = Annotated[
    str | None,
    typer.Option(help="A Hugging Face dataset NAME[:CONFIG] (needs `datasets` and network or cache)."),
]
SeqLen = Annotated[
    int, typer.Option(help="Token-protocol window length, capped by the model's max positions.", min=2)
]
MaxTokens = Annotated[
    int | None,
    typer.Option(
        help="Token budget for quick checks. wikitext protocol: whole documents until at least this many "
        "tokens are scored (word and byte counts stay exact); token protocol: at most this many. "
        "The count scored is reported.",
        min=1,
    ),
]
MaxDocs = Annotated[int | None, typer.Option(help="Use at most this many documents.", min=1)]
LmEval = Annotated[
    str,
    typer.Option(
        "--lm-eval",
        metavar="VERSION",
        help="wikitext protocol: the figures lm-eval VERSION's stock wikitext task gives. 0.4.0-0.4.2 "
        "(0.4.2: the paper's tables) start each document with EOS; 0.4.3-0.4.9.1 with BOS; 0.4.9.2 on "
        "with BOS and the tokenizer's own special tokens.",
        parser=lm_eval_version,
    ),
]
MaxLength = Annotated[
    int | None,
    typer.Option(
        help="wikitext protocol: window length (lm-eval's max_length model argument). "
        "[default: the model's context length, as lm-eval reads it from the config]",
        min=1,
    ),
]
EvalDevice = Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.", parser=device_parser(True))]
Dtype = Annotated[
    EvalDtype,
    typer.Option(
        help="Compute dtype. verify's parity rule: bitwise equal logits in float32/float64; in "
        "bfloat16/float16 every perplexity figure of the expansion within 1e-3 relative of the base's.",
        case_sensitive=False,
    ),
]
BatchSize = Annotated[
    int | None,
    typer.Option(
        help="Windows per forward pass. [default: windows of one length stacked up to 16,384 tokens, "
        "fewer where a layer's intermediate results would exceed 256 MiB]",
        min=1,
        show_default=False,
    ),
]
Threads = Annotated[
    int | None,
    typer.Option(
        help="CPU threads for torch's operators. [default: OMP_NUM_THREADS if set; else 1 for small "
        "models, else the CPUs this process may use (affinity, cgroup quota) less those other processes "
        "keep busy; the choice is in --json's compute.threads]",
        min=1,
        show_default=False,
    ),
]
TokenModeOption = Annotated[
    TokenMode,
    typer.Option(
        help="Token protocol: joined (documents joined with blank lines, GPTQ style) or documents "
        "(one BOS per document, windows inside documents, as TinyStories models are scored)."
    ),
]


@dataclass
class EvalFlags:
    """The corpus, protocol and compute settings: shared by `verify` and `ppl`."""

    protocol: Protocol = "wikitext"
    lm_eval: LmEval = LM_EVAL_NEWEST
    max_length: MaxLength = None
    text: TextFile = None
    dataset: Dataset = None
    seq_len: SeqLen = 2048
    token_mode: TokenModeOption = "joined"
    max_tokens: MaxTokens = None
    max_docs: MaxDocs = None
    device: EvalDevice = "auto"
    dtype: Dtype = "float32"
    batch_size: BatchSize = None
    threads: Threads = None
    quiet: Quiet = False


def _corpus(text: str | None, dataset: str | None, max_docs: int | None):
    from otdus_cli.bundled import BUNDLED_TEXT_FILES, WIKITEXT_SPLITS
    from otdus_cli.verify.text import dataset_corpus, text_corpus, wikitext_corpus

    if text is not None and dataset is not None:
        raise OtdusError("give --text or --dataset, not both")
    if text in WIKITEXT_SPLITS:
        return wikitext_corpus(max_docs=max_docs, bundled=text)
    if text in BUNDLED_TEXT_FILES:  # reported by its bundled name, not the installation's path
        return replace(text_corpus(BUNDLED_TEXT_FILES[text], max_docs=max_docs), name=text)
    if text is not None:
        return text_corpus(Path(text), max_docs=max_docs)
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


def _protocol_name(metrics) -> str:
    return f"{metrics.protocol} protocol" + (f" of {metrics.reproduces}" if metrics.reproduces else "")


def _local_model(model: str) -> str:
    """A folder for a model argument (hub ids are resolved through the local cache)."""
    from otdus_cli.source import resolve_source

    folder = resolve_source(model).folder
    if not (folder / "config.json").is_file():
        raise OtdusError(
            f"{model} holds no config.json, so it is not a model folder: give the folder holding config.json "
            "and the weights (for an expansion, the --out of `otdus expand`), a hub id or bundled:stories260k"
        )
    return str(folder)


def parse_layer_map(text: str | None) -> list[dict] | None:
    """--layer-map: '0,1,2,2,3,4' (base layer per expanded layer, 'new' for a layer with no source),
    or a JSON file holding such a list (null for new) or a manifest-style list of layer entries."""
    from otdus_cli.verify.proof import layer_map_from_sources

    if text is None:
        return None
    path = Path(text)
    if path.is_file():
        from otdus_cli.io.reader import read_json_object

        try:
            data = json.loads(path.read_text())
        except (ValueError, RecursionError):
            raise OtdusError(f"--layer-map {text}: not valid JSON") from None
        if isinstance(data, dict):
            data = read_json_object(path).get("layers")
        if not isinstance(data, list):
            raise OtdusError(f"--layer-map {text}: expected a JSON list")
        if all(isinstance(e, dict) for e in data):
            return data
        return layer_map_from_sources(data)
    sources: list[int | None] = []
    for token in (t.strip() for t in text.split(",")):
        if token in ("new", "-"):
            sources.append(None)
        elif token.isdigit():
            sources.append(int(token))
        else:
            raise OtdusError(
                f"--layer-map: {token!r} is neither a base layer index nor 'new' (e.g. 0,1,2,2,3, or a file)"
            )
    return layer_map_from_sources(sources)


def _evaluate(
    model: str,
    base: str | None,
    find_base: bool,
    flags: EvalFlags,
    json_out: bool,
    layer_map: str | None = None,
    static: bool = False,
    card: bool = False,
    softmax_dtype: str = "float32",
) -> None:
    """Shared body of verify and ppl: a lockstep comparison when there is a base, else one model
    (``softmax_dtype``: ppl's, see verify.perplexity)."""
    from otdus_cli.device import resolve_device
    from otdus_cli.distributed import current_world
    from otdus_cli.manifest import manifest_source
    from otdus_cli.source import resolve_source
    from otdus_cli.verify.threads import sample_cpus

    cpu_sample = sample_cpus()  # other processes' CPU use is measured from here to the first layer
    eval_options = asdict(flags)
    run = {k: eval_options.pop(k) for k in ("device", "dtype", "batch_size", "threads")}
    quiet = eval_options.pop("quiet")
    command = "otdus verify" if find_base else "otdus ppl"
    with user_errors():
        world = current_world()  # under torchrun/srun: this process's rank (see distributed.py)
    # every rank reports its errors; only rank 0 its progress and results
    edited: list[str] = []  # what to say of an edited manifest, once the model folder is known
    with (
        user_errors(),
        tick_progress(command, quiet or not world.is_main) as on_tick,
        _saying_in_errors(edited),
    ):
        # everything the user can get wrong is checked before torch and transformers are imported
        model_dir = _local_model(model)
        if card:
            check_card_target(model, static)  # an edited manifest refused here, in its own words
        if find_base:
            edited += _edited_manifest(Path(model_dir))
        claimed = parse_layer_map(layer_map)
        if base is None and find_base:
            recorded = manifest_source(model_dir)
            base = str(resolve_source(*recorded).folder) if recorded else None
        base_dir = _local_model(base) if base else None
        if find_base and base_dir is None:
            # parity needs a base: a perplexity table alone would look like a verdict it is not
            raise OtdusError(
                f"{model} has no otdus.json naming its base, so there is nothing to check parity against: "
                f"give --base BASE, or run `otdus ppl {model}` for its perplexity alone"
            )
        if static:
            from otdus_cli.verify.proof import static_check

            proof = static_check(base_dir, model_dir, claimed)
            if world.is_main:
                _warn(edited)
                _print_static(proof, json_out, _shrink_record(Path(model_dir)))
            return
        # "auto"/"cuda" under several ranks: this rank's GPU; a GPU that is not there fails here (after
        # the checks above, which need no torch)
        run["device"] = resolve_device(run["device"], world) if run["device"] != "cpu" else "cpu"
        corpus = _corpus(eval_options.pop("text"), eval_options.pop("dataset"), eval_options["max_docs"])
        from otdus_cli.verify.compare import verify_expansion
        from otdus_cli.verify.eval_set import make_eval_set
        from otdus_cli.verify.perplexity import perplexity

        quiet_transformers()
        eval_set = make_eval_set(base_dir or model_dir, corpus=corpus, **eval_options)
        run["progress"], run["cpu_sample"] = on_tick, cpu_sample
        if base_dir is None:
            report = perplexity(model_dir, eval_set, softmax_dtype=softmax_dtype, **run)
        else:
            report = verify_expansion(base_dir, model_dir, eval_set, layer_map=claimed, **run)
    if not world.is_main:
        if getattr(report, "exit_code", 0):
            raise typer.Exit(report.exit_code)
        return
    if base_dir is None:
        _print_ppl(report, json_out, model)
        _note_token_count(report.metrics, flags, json_out)
        return
    _warn(edited)
    if card:
        with user_errors():
            written = add_verification(Path(model), report.to_dict(), on_note=WarningLines())
    shrunk = _shrink_record(model_dir)  # `otdus shrink`'s output: what it removed, not a parity proof
    if json_out:
        emit_json(report.to_dict() | ({"shrink": shrunk} if shrunk else {}))
    else:
        table = Table(
            title=f"{report.base.corpus}: {_protocol_name(report.base)}, {report.base.n_tokens:,} tokens, "
            f"{report.device} {report.dtype}"
        )
        for col in ("metric (* headline)", "base", "shrunk" if shrunk else "expanded", "delta"):
            table.add_column(col)
        _metrics_rows(table, report.base, report.expanded)
        out_console.print(table)
        if shrunk:
            from otdus_cli.plan.shrink_map import describe_removal

            out_console.print(describe_removal(shrunk), highlight=False)
        if report.first_divergence is not None:
            d = report.first_divergence
            out_console.print(f"first divergence: {d.name} (max |diff| {d.max_abs_diff:.3g})")
        if report.proof is not None:
            from otdus_cli.verify.proof import shrink_summary, summary

            out_console.print((shrink_summary if shrunk else summary)(report.proof), highlight=False)
        colour = "green" if report.exit_code == 0 else "red"
        # as plain text: rich markup would eat "[wikitext figures of lm-eval X]", leaving a trailing space
        out_console.print(Text(report.verdict, style=f"bold {colour}"))
        _note_token_count(report.base, flags, json_out)
        if card:
            out_console.print(
                f"card: the verdict was added to {Path(model) / 'README.md'} ({len(written):,} bytes)"
            )
    if report.exit_code:
        raise typer.Exit(report.exit_code)


def _edited_manifest(model_dir: Path) -> list[str]:
    """What to say when the expansion's otdus.json is no longer what otdus wrote: its layer map and
    base are then a stranger's claims (checked all the same; the JSON has proof.manifest_check)."""
    from otdus_cli.io.file_hashes import edited_line, manifest_check
    from otdus_cli.manifest import read_manifest

    manifest = read_manifest(model_dir)
    if manifest is None or manifest_check(manifest) != "edited":
        return []
    return [f"{edited_line(model_dir)}; what it claims is checked, not trusted"]


def _warn(lines: list[str]) -> None:
    for line in lines:
        err_console.print(f"warning: {line}", highlight=False, markup=False, soft_wrap=True)


@contextmanager
def _saying_in_errors(notes: list[str]) -> Iterator[None]:
    """An error's one line also says ``notes`` (as they stand when it is raised)."""
    try:
        yield
    except OtdusError as exc:
        if notes:
            exc.args = (f"{exc} ({'; '.join(notes)})",)
        raise


def _shrink_record(model_dir: Path) -> dict | None:
    """The ``shrink`` record of an `otdus shrink` output's manifest (None: not a shrink)."""
    from otdus_cli.manifest import read_manifest

    manifest = read_manifest(model_dir)
    if manifest and manifest.get("operation") == "shrink" and isinstance(manifest.get("shrink"), dict):
        return manifest["shrink"]
    return None


def _note_token_count(metrics, flags: EvalFlags, json_out: bool) -> None:
    """Say how many tokens were scored when --max-tokens asked for another count (JSON has both)."""
    asked = flags.max_tokens
    if json_out or asked is None or metrics.n_tokens == asked:
        return
    if metrics.protocol == "wikitext":
        why = "the wikitext protocol scores whole documents, so word and byte counts stay exact"
    elif flags.token_mode == "joined":
        why = "the token protocol scores whole --seq-len windows of the first --max-tokens tokens"
    else:
        why = "that is all the text holds"
    out_console.print(f"--max-tokens {asked:,}: scored {metrics.n_tokens:,} tokens ({why})", highlight=False)


def _print_static(proof, json_out: bool, shrunk: dict | None = None) -> None:
    """--static: the proof alone; exit 1 when the layer map claims preservation the proof refutes.
    ``shrunk``: the manifest's shrink record (`otdus shrink`'s output: no preservation claimed; the
    report says what was removed and whether the kept layers are the source's)."""
    from otdus_cli.verify.proof import shrink_summary, summary

    exit_code = 1 if proof.claims_preserving and not proof.preserving else 0
    if json_out:
        emit_json({**proof.to_dict(), "exit_code": exit_code} | ({"shrink": shrunk} if shrunk else {}))
    else:
        table = Table(title="static check (no forward pass)")
        for col in ("layer", "found", "identity", "claimed"):
            table.add_column(col)
        for f in proof.layers:
            found = "new" if f.copy_of is None else f"copy of {f.copy_of}"
            found = f"base layer {f.copy_of}" if f.base else found
            claim = f.claim + (f" ({f.note})" if f.note else "")
            table.add_row(str(f.index), found, "yes" if f.identity else "", claim)
        out_console.print(table)
        if shrunk:
            from otdus_cli.plan.shrink_map import describe_removal

            out_console.print(describe_removal(shrunk, measured=False), highlight=False)
            out_console.print(shrink_summary(proof), highlight=False)
        else:
            out_console.print(summary(proof), highlight=False)
    if exit_code:
        raise typer.Exit(exit_code)


def _print_ppl(report, json_out: bool, model: str) -> None:
    if json_out:
        emit_json(report.to_dict())
        return
    m = report.metrics
    shown = model if model in BUNDLED_MODELS else report.model  # bundled:NAME, not the installation's path
    table = Table(title=f"{shown}: {m.corpus}, {_protocol_name(m)}, {m.n_tokens:,} tokens")
    for col in ("metric (* headline)", "value"):
        table.add_column(col)
    _metrics_rows(table, m)
    out_console.print(table)


@with_flags(EvalFlags)
def verify(
    expanded: Annotated[
        str, typer.Argument(help="The expanded checkpoint (or any model to compare).", parser=model_name)
    ],
    base: Annotated[
        str | None,
        typer.Option(
            help="The base model. [default: the source recorded in the manifest]", parser=model_name
        ),
    ] = None,
    layer_map: Annotated[
        str | None,
        typer.Option(
            help="Which base layer each expanded layer holds, for a checkpoint without otdus.json: "
            "'0,1,2,2,3,4' ('new' for a layer built from several), or a JSON file with such a list. "
            "[default: the manifest's, else found by matching tensor fingerprints]"
        ),
    ] = None,
    static: Annotated[
        bool,
        typer.Option(
            "--static",
            help="Stop after the static check (fingerprints and zero output projections; seconds, no "
            "forward pass): exit 0 if it proves the function preserved or none is claimed, 1 if the "
            "layer map claims it and the check refutes it.",
        ),
    ] = False,
    card: Annotated[
        bool,
        typer.Option(
            "--card",
            help="Add the verdict and figures to the model card (README.md) of the verified otdus output "
            "(a local folder), replacing an earlier verification there.",
        ),
    ] = False,
    flags: EvalFlags = None,
    json_out: JsonFlag = False,
) -> None:
    """Perplexity parity of an expansion with its base, layer by layer in lockstep (exit 1 if broken).

    A static check comes first: the base must be the one the manifest recorded (exit 2 if not), and
    each layer is matched to the base's by tensor fingerprints. With no --base and no manifest it
    refuses (exit 2) and points at `otdus ppl`.
    """
    _evaluate(expanded, base, True, flags, json_out, layer_map, static, card)


@with_flags(EvalFlags)
def ppl(
    model: Annotated[
        str, typer.Argument(help="A model folder, hub id or bundled:stories260k.", parser=model_name)
    ],
    softmax_dtype: Annotated[
        SoftmaxDtype,
        typer.Option(
            help="float32: log-softmax in float32, log-probs summed in float64 (as verify). model: "
            "log-softmax in --dtype and each window's log-likelihood summed in it, as lm-eval's hf model "
            "does unless given its softmax_dtype argument: lm-eval's stock figures for a bfloat16 run "
            "(on SmolLM2-135M 1e-3 to 6e-3 below the float32 ones; docs/perplexity.md).",
        ),
    ] = "float32",
    flags: EvalFlags = None,
    json_out: JsonFlag = False,
) -> None:
    """Perplexity of one model, streamed layer by layer (same protocols as verify)."""
    _evaluate(model, None, False, flags, json_out, softmax_dtype=softmax_dtype)
