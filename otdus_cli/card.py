"""The model card (``README.md``) of every otdus output: what the Hub and a reader need to know.

Metadata (huggingface_hub's ``ModelCardData``, which the Hub's model tree reads): ``base_model``
(the source's hub id; for a local or bundled source, the base an otdus-made source names, else
none), ``library_name: transformers``, tags (``otdus``, ``depth-up-scaling``, the methods) and the
licence of the source's own card. The body: method and variant, layer map, new and zero-initialised
parameters, whether the function is preserved, the command that made it, and how to train only the
new parameters (trainable.py). A source's own README.md describes the source, never this model: it
is read for its licence only, never copied.

:func:`write_card` is the one place that writes the card: atomically (a temporary file in the same
folder, then a rename), returning the bytes written, so whatever records the output's files (the
manifest) can record these bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from otdus_cli import __version__
from otdus_cli.errors import OtdusError
from otdus_cli.markdown import code_block, code_span
from otdus_cli.markdown import text as md

CARD = "README.md"
MANIFEST = "otdus.json"  # otdus_cli.manifest.MANIFEST (not imported: the CLI imports this module at start-up)
VERIFICATION = "## Verification by otdus verify"
# the tag of each otdus operation, then each method's name, on the card
OPERATION_TAGS = {"expand": "depth-up-scaling", "shrink": "depth-pruning", "widen": "expert-growth"}
# Licences of the bundled models, from their README (which has no card metadata).
BUNDLED_LICENSES = {"bundled:stories260k": "mit"}
# The command line of this process, when it is the otdus CLI (set by cli.main); None for the library.
_invocation: list[str] | None = None


def set_invocation(argv: list[str]) -> None:
    """Record the otdus command line this process runs (``["otdus", "expand", ...]``) for the card."""
    global _invocation
    _invocation = list(argv)


def _source_card(source_folder: Path | None):
    """The source's own card (for its licence, and the base an otdus-made source names), or None."""
    from huggingface_hub import ModelCard  # seconds of import, only when writing a card

    # a hub source's card came with its side files (source.py), before any tensor was written: no
    # network call here, at the end of a run
    path = source_folder / CARD if source_folder is not None else None
    if path is None or not path.is_file():
        return None
    text = path.read_text(errors="replace")
    if not text.startswith("---"):  # no metadata block (e.g. the bundled model's README)
        return None
    try:
        return ModelCard(text)
    except Exception:  # a card whose metadata does not parse has nothing to carry over
        return None


def snapshot_repo(path: str | os.PathLike[str] | None) -> str | None:
    """The hub id of a huggingface_hub cache snapshot folder (``.../models--ORG--NAME/snapshots/REV``,
    the cache's own layout), else None."""
    from otdus_cli.source import is_hub_id

    if not path:
        return None
    folder = Path(path)
    repo = folder.parent.parent.name
    if folder.parent.name != "snapshots" or not repo.startswith("models--"):
        return None
    ident = repo.removeprefix("models--").replace("--", "/", 1)
    return ident if is_hub_id(ident) else None


def _named_base(step: dict) -> str | None:
    """The hub model one step was made from: --base-model, a hub id, or a hub cache snapshot path."""
    options, source = step.get("options") or {}, step.get("source") or {}
    if isinstance(options, dict) and isinstance(options.get("base_model"), str):
        return options["base_model"]
    if source.get("kind") == "hub":
        return source.get("id")
    return snapshot_repo(source.get("path")) if source.get("kind") == "local" else None


def _base_model(manifest: dict, source_folder: Path | None, source_card) -> str | None:
    for step in _steps(manifest):  # chained steps: the first step's base
        named = _named_base(step) if isinstance(step, dict) else None
        if named:
            return named
    made_by_otdus = source_folder is not None and (source_folder / MANIFEST).is_file()
    if made_by_otdus and source_card is not None:
        return source_card.data.base_model
    return None


def card_data(manifest: dict, source_folder: Path | None):
    """The card's metadata (ModelCardData) for an output made as ``manifest`` records."""
    from huggingface_hub import ModelCardData

    source = manifest["source"]
    source_card = _source_card(source_folder)
    steps = _steps(manifest)
    tags = ["otdus"]
    for tag in [*(OPERATION_TAGS[_operation(s)] for s in steps), *(s.get("method") for s in steps)]:
        if isinstance(tag, str) and tag not in tags:
            tags.append(tag)
    extra = {}
    license_ = BUNDLED_LICENSES.get(source["id"]) if source.get("kind") == "bundled" else None
    if source_card is not None:
        data = source_card.data
        license_ = data.license or license_
        extra = {k: getattr(data, k, None) for k in ("license_name", "license_link")}
    return ModelCardData(
        base_model=_base_model(manifest, source_folder, source_card),
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=tags,
        license=license_,
        **{k: v for k, v in extra.items() if v},
    )


def _portable(arg: str) -> str:
    """An argument as the card shows it: an absolute local path (``--out=PATH`` too) by its last part,
    since it names this machine's folders, not anything of the model's."""
    flag, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
    if os.path.isabs(value) or value.startswith("~"):
        value = Path(value).name or value
    return flag + eq + value


def _command(manifest: dict) -> str:
    if _invocation is not None:
        shown = [_portable(a) for a in _invocation]
        note = "  # local paths shown by their last part" if shown != _invocation else ""
        return shlex.join(shown) + note
    module = "widen" if manifest["method"] == "widen" else manifest.get("operation", "expand")
    return (
        f"# made through the Python API (otdus_cli.{module}); its options, as otdus.json records them: "
        f"{manifest.get('options', {})}"
    )


def _dtype(manifest: dict) -> str:
    """The dtype the output's weights were written in (the claim of preservation is in it)."""
    options = manifest.get("options") if isinstance(manifest.get("options"), dict) else {}
    if options.get("dtype") not in (None, "auto"):
        return str(options["dtype"])
    config = manifest["source"].get("config") or {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    found = config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or text.get("dtype")
    return str(found) if found else "the source's dtype"


def _variant(manifest: dict) -> str:
    options = manifest.get("options", {})
    own = options.get(manifest["method"]) if isinstance(options, dict) else None
    variant = own.get("variant") if isinstance(own, dict) else None
    return f"{manifest['method']} ({variant})" if variant else manifest["method"]


def _width(manifest: dict) -> str:
    """For a widened model: its experts and top-k, before -> after."""
    widened = manifest.get("widen")
    if not isinstance(widened, dict):
        return ""
    (e0, e1), (k0, k1) = widened["experts"], widened["top_k"]
    return f", {e0} -> {e1} experts per MoE layer, top-{k0} -> top-{k1} routing"


def _layer_table(manifest: dict) -> list[str]:
    rows = [
        "| layer | holds base layer | new | built by | zero-initialised |",
        "| --- | --- | --- | --- | --- |",
    ]
    for lay in manifest["layers"]:
        parents = lay.get("parents") or []
        step = lay.get("step", 1)
        of = f" of step {step - 1}'s output" if step > 1 else ""
        held = f"from {', '.join(map(str, parents))}{of}" if lay["new"] and parents else str(lay["source"])
        builder = md(lay.get("builder", "base")) + (" (widened)" if lay.get("widened") else "")
        zero = "yes" if lay.get("zero_init") and lay["new"] else ""
        new = (f"yes (step {step})" if "step" in lay else "yes") if lay["new"] else ""
        rows.append(f"| {lay['index']} | {held} | {new} | {builder} | {zero} |")
    return rows


def _chain_layers(steps: list[dict]) -> list[dict]:
    """The last step's layers traced back through the steps: a kept layer as the first source's layer
    it holds, a new one as the step that made it (``step``, counted from 1; its parents are layers of
    that step's source). Only for a chain seen_from_first_source accepts (indices checked there)."""
    rows = []
    for entry in steps[-1]["layers"]:
        lay, k = entry, len(steps)
        widened = bool(entry.get("widened"))
        while not lay["new"] and k > 1:
            k -= 1
            lay = steps[k - 1]["layers"][lay["source"]]
            widened |= bool(lay.get("widened"))
        rows.append({**lay, "index": entry["index"], "widened": widened, "step": k})
    return rows


def _new_parameters(manifest: dict, folder: Path) -> list[str]:
    from otdus_cli.io.reader import CheckpointReader
    from otdus_cli.trainable import axolotl_patterns, select, to_yaml

    reader = CheckpointReader(folder)
    chosen = select(manifest, reader.names, reader.config)
    new_layers = [lay["index"] for lay in manifest["layers"] if lay["new"]]
    zero_layers = [lay["index"] for lay in manifest["layers"] if lay["new"] and lay.get("zero_init")]
    lines = [f"{len(chosen.trainable)} tensors are new (the others are copies of the base model's):"]
    if new_layers:
        lines.append(f"- every tensor of the new layers {', '.join(map(str, new_layers))}")
    widened = [
        n for n in manifest.get("new_parameters", []) if n not in set(_layer_names(chosen, new_layers))
    ]
    if widened:
        lines.append(
            f"- {len(widened)} tensors of the widened mixture-of-experts blocks: the new experts, and the "
            "router weights (their rows for the new experts are new; the base's rows are kept)"
        )
    if zero_layers:
        try:
            zeros = select(manifest, reader.names, reader.config, zero_init_only=True).trainable
        except OtdusError:
            zeros = []
        suffixes = sorted({chosen.layer_of[n][1] for n in zeros})
        lines.append(
            f"- zero-initialised (so each new layer starts as the identity): {', '.join(suffixes)} "
            f"of layers {', '.join(map(str, zero_layers))}"
        )
    else:
        lines.append("- none is zero-initialised")
    lines += ["", "axolotl's `unfrozen_parameters` for exactly these tensors:", ""]
    return lines + code_block(to_yaml({"unfrozen_parameters": axolotl_patterns(chosen)}), "yaml")


def _layer_names(chosen, layers: list[int]) -> list[str]:
    wanted = set(layers)
    return [n for n, (i, _) in chosen.layer_of.items() if i in wanted]


def card_text(manifest: dict, folder: Path, source_folder: Path | None) -> str:
    """The whole card of the output in ``folder`` (its tensors and config written already)."""
    from huggingface_hub import ModelCard

    from otdus_cli.manifest import seen_from_first_source

    data = card_data(manifest, source_folder)
    steps = _steps(manifest)
    # a chain of steps is described from its first source: every step's layers over the first base's
    # (expand --experts records its layers over the first source already: "intermediate")
    chained = len(steps) > 1 and not manifest.get("intermediate") and seen_from_first_source(manifest)
    composed = _chain_layers(steps) if chained else None
    source = steps[0].get("source") or manifest["source"]
    depth = len(manifest["layers"])
    base_depth = source.get("num_hidden_layers", depth)
    preserving = all(step.get("function_preserving") for step in steps)
    shrunk = manifest.get("shrink") if manifest.get("operation") == "shrink" else None
    how = f"in {len(steps)} steps" if len(steps) > 1 else f"by {code_span(_variant(manifest))}"
    body = [
        f"# {md(Path(folder).name.split('.otdus-tmp-')[0].lstrip('.') or 'otdus output')}",
        "",
        f"Made with otdus {md(manifest['otdus_version'])} from "
        f"**{md(shown_source(source))}**"
        + (f" (revision {code_span(source['revision'])})" if source.get("revision") else "")
        + f" {how}: {base_depth} -> {depth} layers{_width(manifest)}.",
        "",
        "## How it was made",
        "",
        *code_block(_command(manifest), "bash"),
        "",
        *(_step_lines(steps) if len(steps) > 1 else [f"- method: {md(_variant(manifest))}"]),
        *_shrink_lines(shrunk),
        "- function-preserving: "
        + (
            f"yes by construction, in {md(_dtype(manifest))} (base layers copied byte for byte, each new "
            "layer's residual-writing projections zero); not measured on this card until `otdus verify . "
            "--card` adds its measurement"
            if preserving
            else "no: layers were removed or merged (`otdus verify` reports the perplexity change)"
            if shrunk
            else "no: the new parameters change what the base model computes (continued training is "
            "expected to recover and improve it)"
        ),
        f"- the full record (options, source fingerprints, layer map) is in `{MANIFEST}`",
        "",
        "## Layer map" + (" (over the first source's layers, through every step)" if composed else ""),
        "",
        *_layer_table({"layers": composed} if composed else manifest),
        "",
        *(_training(manifest, folder) if _adds_parameters(manifest) else []),
    ]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body) + "\n"))


def shown_source(source: dict) -> str:
    """A source as the card names it: its hub id or bundled name; a local folder by its name alone
    (the path is this machine's: otdus.json keeps it, for verify)."""
    ident = str(source.get("id", ""))
    kind = source.get("kind") or (
        "bundled" if ident.startswith("bundled:") else "hub" if source.get("revision") else "local"
    )
    return ident if kind in ("hub", "bundled") else f"{Path(ident).name or ident} (a local folder)"


def _steps(manifest: dict) -> list[dict]:
    """Every otdus step that made this output, first to last (this one last)."""
    return [*(r for r in manifest.get("history") or [] if isinstance(r, dict)), manifest]


def _operation(step: dict) -> str:
    """expand, shrink or widen (a manifest of expand has no ``operation``)."""
    operation = "widen" if step.get("method") == "widen" else step.get("operation") or "expand"
    return operation if operation in OPERATION_TAGS else "expand"


def _step_lines(steps: list[dict]) -> list[str]:
    """One line per step of a chain (expand, then expand or widen ...), the first's source named."""
    lines = []
    for k, step in enumerate(steps, 1):
        src = step.get("source") if isinstance(step.get("source"), dict) else {}
        origin = md(shown_source(src)) if k == 1 else "the previous step's output"
        before = len(steps[k - 2].get("layers") or []) if k > 1 else src.get("num_hidden_layers", "?")
        after = len(step.get("layers") or [])
        claim = "function-preserving" if step.get("function_preserving") else "not function-preserving"
        lines.append(
            f"- step {k}: {_operation(step)} by {code_span(_variant(step))} from {origin}, "
            f"{before} -> {after} layers{_width(step)} ({claim})"
        )
    return lines


def _adds_parameters(manifest: dict) -> bool:
    """Whether the output holds parameters its source did not (a new layer, a new expert): a shrink,
    or any output that only drops or keeps layers, has nothing to train first."""
    return bool(manifest.get("new_parameters")) or any(lay["new"] for lay in manifest["layers"])


def _training(manifest: dict, folder: Path) -> list[str]:
    """The card's sections on the new parameters and how to train them alone."""
    return [
        "## New parameters",
        "",
        *_new_parameters(manifest, folder),
        "",
        "## Train only the new parameters",
        "",
        "First train the new parameters alone, the base model's frozen (LLaMA PRO's recipe):",
        "",
        "```bash",
        "otdus trainable . --format axolotl        # unfrozen_parameters for axolotl",
        "otdus trainable . --format llama-factory  # freeze settings, when they can express this set",
        "otdus trainable . --format json           # the names, for any other trainer",
        "```",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        "from otdus_cli.trainable import apply",
        "",
        'model = AutoModelForCausalLM.from_pretrained("path/to/this/model")',
        'apply(model, "path/to/this/model")  # requires_grad only on the new parameters',
        "```",
    ]


def _shrink_lines(shrunk: dict | None) -> list[str]:
    """What a shrink removed and merged (`otdus shrink`'s record in the manifest)."""
    if not shrunk:
        return []
    lines = [
        f"- removed: source layers {', '.join(map(str, shrunk.get('removed', [])))} ({shrunk.get('select')})"
    ]
    for group in shrunk.get("merged") or []:
        lines.append(f"- merged into one layer: source layers {', '.join(map(str, sorted(group)))}")
    return lines


def _replace_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in its folder, fsync, rename."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".otdus-tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_card(folder: str | os.PathLike[str], text: str) -> bytes:
    """Write ``text`` as ``folder``'s card atomically; the bytes written (the one writer of cards)."""
    data = text.encode()
    _replace_atomically(Path(folder) / CARD, data)
    return data


def card_record(data: bytes) -> dict:
    """What the manifest records of the card otdus wrote (``manifest["card"]``), so a card edited
    since is told from otdus's own (io/output_dir.py, add_verification)."""
    return {"file": CARD, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def write_output_card(folder: Path, manifest: dict, source_folder: Path | None) -> dict:
    """Write the card of a new output into its staging folder; the manifest's record of it (the
    pipelines write the manifest after the card)."""
    return card_record(write_card(folder, card_text(manifest, folder, source_folder)))


# -- verify --card --------------------------------------------------------------------------------
def verification_section(report: dict) -> str:
    """The card section of one `otdus verify` run (report: VerifyReport.to_dict())."""
    base, expanded = report["base"], report["expanded"]
    key = (
        "word_perplexity"
        if base.get("protocol") == "wikitext" and base.get("word_perplexity")
        else "token_perplexity"
    )
    lines = [
        VERIFICATION,
        "",
        f"**{report['verdict']}** ({time.strftime('%Y-%m-%d', time.gmtime())}, otdus {__version__}, "
        f"{md(report['device'])} {md(report['dtype'])})",
        "",
        f"Text: {md(base['corpus'])}, {md(base['protocol'])} protocol, {base['n_tokens']:,} tokens scored.",
        "",
        "| | base | this model |",
        "| --- | --- | --- |",
        f"| {key.replace('_', ' ')} | {base[key]:.6g} | {expanded[key]:.6g} |",
        f"| token perplexity | {base['token_perplexity']:.6g} | {expanded['token_perplexity']:.6g} |",
        "",
        f"- logits bitwise equal to the base's: {'yes' if report['logits_equal'] else 'no'}",
        f"- largest difference of a scored token's log-probability: {report['logprob_max_abs_diff']:.3g}",
        f"- parity expected: {'yes' if report['expect_parity'] else 'no'}; tolerance: {report['tolerance']}",
        f"- base model: {md(report['base_model'])}",
    ]
    return "\n".join(lines) + "\n"


def with_results(text: str, report: dict, folder: Path) -> str:
    """The card ``text`` with the measured perplexities in its metadata: model-index results (what the
    Hub shows as evaluation results), through huggingface_hub's EvalResult, replacing earlier ones."""
    from huggingface_hub import EvalResult, ModelCard

    card = ModelCard(text)
    corpus = _portable(str(report["base"]["corpus"]))
    expanded = report["expanded"]
    keys = ["token_perplexity"] + (["word_perplexity"] if expanded.get("word_perplexity") else [])
    card.data.model_name = card.data.model_name or folder.name
    card.data.eval_results = [
        EvalResult(
            task_type="text-generation",
            dataset_type=corpus,
            dataset_name=corpus,
            metric_type="perplexity",
            metric_name=key.replace("_", " "),
            metric_value=float(expanded[key]),
            metric_config=f"otdus verify, {report['base']['protocol']} protocol, {report['dtype']}",
        )
        for key in keys
    ]
    return str(card)


def add_verification(
    folder: str | os.PathLike[str], report: dict, on_note: Callable[[str], None] | None = None
) -> bytes:
    """Put one verify run's verdict and figures on the card of the otdus output in ``folder`` (an
    earlier verification section is replaced); the card's bytes. Refused for a folder that is not an
    otdus output still as otdus wrote it (io/output_amend.py: the card and the manifest are replaced
    together, under the output's lock). ``on_note``: what the user should know (stale folders swept)."""
    from otdus_cli.io.output_amend import amended_output

    with amended_output(folder, [CARD], "--card") as amendment:
        for note in amendment.notes:
            if on_note:
                on_note(note)
        manifest = amendment.manifest
        path = Path(folder) / CARD
        _check_own_card(Path(folder), manifest)
        text = path.read_text() if path.is_file() else card_text(manifest, Path(folder), None)
        kept = text.split("\n" + VERIFICATION, 1)[0].rstrip("\n")
        recorded = manifest["source"].get("path")
        if recorded and Path(report["base_model"]).resolve() == Path(recorded).resolve():
            report = {**report, "base_model": shown_source(manifest["source"])}  # not this machine's path
        else:
            given = str(report["base_model"])
            report = {**report, "base_model": snapshot_repo(given) or _portable(given)}
        text = with_results(kept + "\n\n" + verification_section(report), report, Path(folder))
        data = write_card(amendment.folder, text)
        manifest["card"] = card_record(data)  # the manifest records the new card
    return data


def is_otdus_card(path: Path, manifest: dict) -> bool:
    """Whether ``path`` holds the card the manifest records (bytes unchanged since otdus wrote them)."""
    record = manifest.get("card")
    if not isinstance(record, dict) or record.get("file") != CARD:
        return False
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest() == record.get("sha256")
    except OSError:
        return False


def card_summary(folder: str | os.PathLike[str]) -> dict | None:
    """What `otdus inspect` shows of a folder's card: its metadata and verification verdict."""
    path = Path(folder) / CARD
    if not path.is_file():
        return None
    from huggingface_hub import ModelCard

    text = path.read_text(errors="replace")
    if not text.startswith("---"):  # a README without card metadata
        return {"metadata": None, "verified": None}
    try:
        card = ModelCard(text)
    except Exception:
        return {"metadata": None, "verified": None}
    data = card.data.to_dict()
    verified = None
    if VERIFICATION in card.text:
        section = card.text.split(VERIFICATION, 1)[1].strip().splitlines()
        verified = section[0].strip("*").split("**")[0] if section else None
    keys = ("base_model", "license", "library_name", "tags")
    return {"metadata": {k: data[k] for k in keys if data.get(k) is not None}, "verified": verified}


def check_card_target(model: str, static: bool) -> None:
    """Refuse `verify --card` before any work when it could not write: --static (no figures), a hub
    id or bundled model (a cache is not the user's copy), a link, a folder that is not an otdus
    output, or one changed since otdus wrote it (its card or any other file)."""
    if static:
        raise OtdusError("--card records the perplexity comparison, which --static skips; drop one of them")
    from otdus_cli.io.output_amend import check_amendable
    from otdus_cli.io.output_dir import read_output_manifest

    folder = Path(model)
    if not folder.is_dir():
        raise OtdusError(f"--card writes into a local otdus output folder; {model} is not a local folder")
    manifest = None if folder.is_symlink() else read_output_manifest(folder)
    if manifest is not None:  # an edited card first: the change most likely, and the user's text
        _check_own_card(folder, manifest)
    check_amendable(folder, "--card")


def _check_own_card(folder: Path, manifest: dict) -> None:
    """Refuse a card that is not the one the manifest records (its text is the user's)."""
    if (folder / CARD).is_file() and not is_otdus_card(folder / CARD, manifest):
        raise OtdusError(
            f"--card: {folder / CARD} is not the card otdus wrote (changed since, or older); it is left alone"
        )


def card_line(summary: dict, otdus_output: bool) -> str:
    """card_summary() as one line for `otdus inspect`."""
    meta = summary.get("metadata")
    if meta is None:
        return "README.md without card metadata"
    parts = [f"base_model {meta.get('base_model', 'none')}", f"license {meta.get('license', 'none')}"]
    if meta.get("tags"):
        parts.append("tags " + ", ".join(meta["tags"]))
    if summary.get("verified"):
        parts.append(f"verified: {summary['verified']}")
    elif otdus_output:
        parts.append("no verification on it (otdus verify --card adds one)")
    return "; ".join(parts)
