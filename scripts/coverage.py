"""Architecture coverage, measured: every causal LM of the installed transformers, expanded and reloaded.

For each model_type of transformers' causal-LM auto mapping: build a tiny random model from its config
class, save it, expand it with `copy` (2 new layers) and, where the template offers it, `copy
--zero-init`; reload each output with AutoModelForCausalLM and compare logits with the base (bit-identical
for zero-init). Writes docs/compatibility.md (one row per architecture) and prints the counts.

    .venv/bin/python -m scripts.coverage [--out docs/compatibility.md] [model_type ...]

Takes a few minutes on two cores; not part of `make test` (tests/test_arch_breadth.py and
tests/test_derived.py hold a fast representative subset).
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from otdus_cli.errors import OtdusError
from otdus_cli.expand import expand
from otdus_cli.options import ExpandOptions
from scripts.tiny_configs import attempts, make_config, smaller_vocabularies, why_not_built, wrapper_attempts

MAX_PARAMETERS = 20_000_000  # a config whose sizes our tiny fields do not reach is reported, not built


def build(model_type: str, folder: Path) -> torch.Tensor:
    """Save a tiny random model; return its logits on fixed ids. Each set of tiny fields is tried in
    turn until one builds a small model that runs and saves; else the error of the first that built a
    config."""
    tries = [*attempts(model_type), *wrapper_attempts(model_type)]
    refused: list[Exception] = []  # configs transformers refused
    failed: list[Exception] = []  # configs that built, then failed: their errors say more
    for fields in tries:
        try:
            configs = [make_config(model_type, fields)]
        except Exception as exc:
            refused.append(exc)
            continue
        # then with its other vocabularies (per-layer embeddings, an unpadded size) as small as its own
        if (smaller := smaller_vocabularies(configs[0], fields)) is not None:
            try:
                configs.append(make_config(model_type, smaller))
            except Exception as exc:
                refused.append(exc)
        for config in configs:
            try:
                return _save_tiny(config, folder)
            except Exception as exc:
                shutil.rmtree(folder, ignore_errors=True)
                failed.append(exc)
    raise (failed or refused)[0]


def _save_tiny(config, folder: Path) -> torch.Tensor:
    """Build the model of a tiny config (its vectors perturbed so an identity is not luck), run it and
    save it; its logits. RuntimeError where the config is not tiny."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shapes = {n: p.shape for n, p in AutoModelForCausalLM.from_config(config).named_parameters()}
    size = sum(shape.numel() for shape in shapes.values())
    if size > MAX_PARAMETERS:
        name = max(shapes, key=lambda n: shapes[n].numel())
        raise RuntimeError(
            f"the tiny config still has {size / 1e6:.0f}M parameters (the largest: {name}, "
            f"{list(shapes[name])})"
        )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1 and p.is_floating_point():
                p.add_(torch.randn_like(p) * 0.1)
    logits = logits_of(model)
    model.save_pretrained(folder)
    return logits


def _one_line(exc: BaseException) -> str:
    """An error message whole, on one line (a table cell): never cut mid-word."""
    return " ".join(str(exc).split())


def logits_of(model) -> torch.Tensor:
    ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(0))
    # no cache: some hybrids' caches cannot be asked their length before attention; torch's generator
    # seeded alike for every model: one that draws in its forward (Reformer's LSH hashing) then compares
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return model(input_ids=ids, use_cache=False).logits.float()


def reload(folder: Path):
    """AutoModelForCausalLM's model for the folder; else the class that built the base, where the Auto
    class cannot read the config that class saves (Mllama's text model: mllama_text_model)."""
    import json

    import transformers
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    except ValueError:
        (name,) = json.loads((folder / "config.json").read_text())["architectures"]
        return getattr(transformers, name).from_pretrained(str(folder), dtype=torch.float32).eval()


def check(model_type: str, root: Path) -> tuple[str, str, str, dict[str, str]]:
    """(kind, family, detail, columns) for one model_type; columns: zero-init, OT, LESA, verify. Where
    OT or LESA is refused, the detail ends with why (_roles_note)."""
    columns = dict.fromkeys(COLUMNS, "")
    src = root / model_type
    try:
        base = build(model_type, src)
    except Exception as exc:
        return "not built", "", f"tiny model: {why_not_built(model_type, exc)}", columns
    placement, elsewhere = {"method": "copy", "layers": 2}, ""
    try:
        result = expand(str(src), root / "copy", ExpandOptions(**placement))
    except OtdusError as exc:
        if ELSEWHERE not in str(exc):
            return "refused", "", _one_line(exc), columns
        found = _placement_keeping_kinds(src, root / "copy")
        if found is None:
            return "refused", "", _one_line(exc) + NO_PLACEMENT, columns
        placement, result = found
        elsewhere = f"; expands with {_flags(placement)} (otdus at --layers 2: {_one_line(exc)})"
    except Exception as exc:
        return "failed", "", f"expand: {type(exc).__name__}: {_one_line(exc)}", columns
    family = result.plan.source.family
    kind = "derived" if family.copy_only else "exact"
    try:
        grown = reload(root / "copy")
        assert _depth(grown, root / "copy") == result.manifest["num_hidden_layers"]
        logits_of(grown)
    except Exception as exc:
        failure = f"copy does not reload: {type(exc).__name__}: {_one_line(exc)}"
        return "failed", family.name, failure + elsewhere, columns
    refusals = {column: _refusal(src, method) for method, column in (("ot", "OT"), ("lesa", "LESA"))}
    for column, why in refusals.items():
        columns[column] = "refused" if why else "plans"
    elsewhere += _roles_note(refusals)
    if not family.zero_init:
        columns["zero-init"] = "refused"
        note = family.zero_init_note or "no targets"
        return kind, family.name, f"zero-init refused: {note}{elsewhere}", columns
    placed = ""
    try:
        try:
            expand(str(src), root / "zero", ExpandOptions(**placement, zero_init=True))
        except OtdusError as exc:
            # layers whose index enters their computation keep it with the new layers after the last one
            last = result.plan.source.depth - 1
            try:
                top = ExpandOptions(method="copy", after=[last, last], zero_init=True)
                expand(str(src), root / "zero", top)
            except OtdusError:
                raise exc from None
            placed = f" with the new layers after the last one (in the middle: {_one_line(exc)})"
        same = torch.equal(base, logits_of(reload(root / "zero")))
    except OtdusError as exc:  # refused at plan time, saying why (names, positions)
        columns["zero-init"] = "refused"
        return kind, family.name, f"zero-init refused: {_one_line(exc)}{elsewhere}", columns
    except Exception as exc:
        return "failed", family.name, f"zero-init: {type(exc).__name__}: {_one_line(exc)}{elsewhere}", columns
    if not same:
        return "failed", family.name, f"zero-init logits differ from the base{elsewhere}", columns
    columns["zero-init"] = "bitwise"
    columns["verify"] = _verify(src, root / "zero")
    detail = "zero-init bit-identical" + (" (targets proved on the tiny model)" if family.derived else "")
    return kind, family.name, detail + placed + elsewhere, columns


# otdus's refusal where the new layers' kinds would not be what transformers builds from the config
ELSEWHERE = "place the new layers elsewhere"
NO_PLACEMENT = (
    "; no other placement keeps each layer's kind either (coverage tried 2 copied layers after every pair"
    " of base layers, and --method solar and stack, which copy whole runs of layers)"
)
MAX_PAIR_DEPTH = 8  # deeper tiny stacks: only the placements that copy whole runs of layers are tried


def _placement_keeping_kinds(src: Path, out: Path):
    """Where otdus refuses 2 copied layers at its default place (a new layer's kind would not be the one
    transformers builds at its index, for kinds that follow the layer index: a period, a pattern), the
    first placement otdus accepts: 2 copies after any pair of base layers (``--after i,j``), then SOLAR
    and stack, which copy whole runs of layers and so keep a periodic pattern; (placement, result) or
    None."""
    import json

    from otdus_cli.arch.depth import DEPTH, depth_field
    from otdus_cli.arch.wrappers import text_config

    config = text_config(json.loads((src / "config.json").read_text()))
    depth = config.get(depth_field(config) or DEPTH)
    pairs = (
        [[i, j] for i in range(depth) for j in range(i, depth)]
        if isinstance(depth, int) and depth <= MAX_PAIR_DEPTH
        else []
    )
    candidates = [
        *({"method": "copy", "after": pair} for pair in pairs),
        {"method": "solar", "layers": 2},
        *([{"method": "stack", "layers": depth}] if isinstance(depth, int) else []),
    ]
    for placement in candidates:
        try:
            return placement, expand(str(src), out, ExpandOptions(**placement))
        except OtdusError:
            continue
    return None


def _flags(placement: dict) -> str:
    """The expand flags of a placement: ``--method copy --after 3,3``."""
    return " ".join(
        f"--{k} {','.join(map(str, v)) if isinstance(v, list) else v}" for k, v in placement.items()
    )


COLUMNS = ("zero-init", "OT", "LESA", "verify")


def _depth(model, folder: Path) -> int:
    """The depth transformers loaded, under the name the saved config gives it (BART: decoder_layers)."""
    import json

    from otdus_cli.arch.depth import DEPTH, depth_field
    from otdus_cli.arch.wrappers import text_config

    field = depth_field(text_config(json.loads((folder / "config.json").read_text()))) or DEPTH
    return getattr(model.config.get_text_config(), field)


def _refusal(src: Path, method: str) -> str:
    """Why otdus refuses the method for this model at plan time (before any tensor is built), in short
    form (_short_refusal); "" where it accepts it."""
    from otdus_cli.expand import make_plan
    from otdus_cli.source import open_source

    try:
        make_plan(open_source(str(src)), ExpandOptions(method=method, layers=2))
    except OtdusError as exc:
        return _short_refusal(_one_line(exc), method)
    return ""


# otdus's refusals of a roles method, shortened for a table cell: what every derived template's shares,
# the reasons repeated per layer kind, and the alternatives it suggests (the copy-type methods) dropped
_SHORTER = (
    (re.compile(r"^cannot build \S+ layers \((.*)\); use copy, interpose, average or random$"), r"\1"),
    (re.compile(r"(?:[:;,] (?:or )?use (?:copy|ot|a copy-type)\b.*)$"), ""),
    (
        re.compile(
            r"computes new tensors from the layer roles \(q/k/v/o, gate/up/down\); \S+ was read off "
            r"transformers' class, and no kind of its layers has an exact template's roles"
        ),
        "no layer kind has roles",
    ),
    (re.compile(r"its tensors are no exact template's roles"), "no template's roles"),
    (re.compile(r"its tensors \(([^()]*)\) are no exact template's roles"), r"no template's roles (\1)"),
    (
        re.compile(
            r"a mixture-of-experts layer: its experts would need an expert layout \(arch/experts.py\), "
            r"which only exact templates have"
        ),
        "experts (no expert layout)",
    ),
)


def _short_refusal(message: str, method: str) -> str:
    """otdus's refusal of ``method`` in short form (_SHORTER), without the method's name, so that OT's and
    LESA's read alike where the cause is the same."""
    text = message.removeprefix(f"--method {method}").lstrip(" :")
    for pattern, shorter in _SHORTER:
        text = pattern.sub(shorter, text)
    return text


def _roles_note(refusals: dict[str, str]) -> str:
    """The detail's last part: why OT and LESA are refused (once where the reason is the same)."""
    refused = {column: why for column, why in refusals.items() if why}
    if not refused:
        return ""
    if len(refused) == 2 and len(set(refused.values())) == 1:
        return f"; OT, LESA refused: {next(iter(refused.values()))}"
    return "".join(f"; {column} refused: {why}" for column, why in refused.items())


def _verify(src: Path, out: Path) -> str:
    """verify's verdict for a zero-init output on random token ids: PARITY, BROKEN or why it did not run."""
    from otdus_cli.verify.compare import verify_expansion
    from otdus_cli.verify.metrics import EvalSet, Window

    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, 90, (n,), generator=gen).tolist() for n in (20, 20, 13)]
    plan = EvalSet("token", "random ids", [Window(w, w[1:], 0, 0) for w in ids], [0], [0], 20)
    try:
        return verify_expansion(src, out, plan).verdict.split(":")[0]
    except OtdusError as exc:
        return f"not run: {_one_line(exc)}"
    except Exception as exc:
        return f"not run: {type(exc).__name__}"


def main() -> int:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="*")
    parser.add_argument("--out", default="docs/compatibility.md")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    model_types = args.model_types or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    rows = []
    start = time.perf_counter()
    for mt in model_types:
        root = Path(tempfile.mkdtemp(prefix="otdus-coverage-"))
        try:
            kind, family, detail, columns = check(mt, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        rows.append((mt, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[mt], kind, family, detail, columns))
        print(f"{mt:28s} {kind:9s} {family:24s} {' '.join(columns.values())} {detail}", flush=True)
    counts = {k: sum(r[2] == k for r in rows) for k in ("exact", "derived", "refused", "failed", "not built")}
    seconds = time.perf_counter() - start
    print(counts, f"{seconds:.0f} s")
    if not args.model_types:
        write_table(Path(args.out), rows, counts, transformers.__version__, run_stamp())
    return 0


def run_stamp() -> str:
    """When and from which commit the table was made."""
    import datetime
    import subprocess

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=Path(__file__).parent, capture_output=True)
    commit = (commit or "unknown") + (" with uncommitted changes" if dirty.stdout.strip() else "")
    return f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, git {commit}"


def write_table(path: Path, rows: list, counts: dict, version: str, stamp: str) -> None:
    expandable = counts["exact"] + counts["derived"]
    proven = sum(r[5]["zero-init"] == "bitwise" for r in rows)
    parity = sum(r[5]["verify"] == "PARITY" for r in rows)
    lines = [
        "# Compatibility",
        "",
        f"Generated by `make coverage` (scripts/coverage.py) on {stamp}, with transformers {version}:",
        "every model_type of its causal-LM auto mapping, built as a tiny random model from its config",
        "class, expanded with `copy` (2 new layers) and `copy --zero-init` where otdus knows or proves the",
        "zero-init targets, then reloaded with AutoModelForCausalLM (the class that built it where that",
        "cannot read the saved config: Mllama's text model). Multimodal wrappers are built with the tiny",
        "vision towers of tests/support/tiny_models.py, or else with each vision / audio sub-config shrunk",
        "by scripts/tiny_configs.py (which also holds the few per-model_type fields, each with its reason).",
        "Where otdus refuses 2 copied layers because a new layer's kind would not be the one transformers",
        "builds at its index, the placements that keep the kinds are tried (`--after i,j`, then `solar`",
        "and `stack`) and the detail names the one otdus accepts, after otdus's refusal.",
        "",
        f"**{expandable} of {len(rows)} architectures expand and reload**: {counts['exact']} with an exact",
        f"template, {counts['derived']} with a template derived from transformers; zero-init gives",
        f"bit-identical logits for {proven} of them, and verify says PARITY for {parity};",
        f"{counts['refused']} refused with a reason, {counts['failed']} failed, {counts['not built']}",
        "could not be built tiny here.",
        "",
        "- **exact**: a template in otdus_cli/arch/families.py; every method it allows.",
        "- **derived**: the layer list and each layer's kind read off transformers' class on the meta device",
        "  (arch/derived.py); copy, interpose, llama-pro, solar, stack. Its zero-init targets (the tensors",
        "  that write into the residual stream) are proved on a tiny instance: with them zeroed, a layer's",
        "  output equals its input bit for bit (arch/identity.py). OT and LESA where its layer kinds' roles",
        "  are derived (arch/derived_roles.py).",
        "- **refused**: otdus stops with one line before writing anything; the reason is given.",
        "- **not built**: this script could not build the tiny config (not a verdict on the architecture);",
        "  the detail says why in words, then the error.",
        "- **zero-init**: `bitwise` when `copy --zero-init` reloads with the base's logits bit for bit",
        "  (where otdus refuses the new layers in the middle of the stack, as for layers whose index enters",
        "  their computation: with them after the last layer, and the detail says so); `refused` when otdus",
        "  refuses it at plan time (the detail says why).",
        "- **OT**, **LESA**: `plans` when otdus accepts the method at plan time (2 new layers); `refused`",
        "  otherwise, and the detail ends with otdus's reason, shortened. They compute tensors from roles",
        "  (q/k/v/o, gate/up/down ...): a derived template has them for the layer kinds whose attention and",
        "  MLP tensors are exactly an exact template's roles (a pre-norm template's output norms, or its",
        "  MLP's gate, may be missing; tensors outside the attention and MLP are averaged), with the shapes",
        "  its config gives, proved on the tiny instance (permuting a layer's heads and MLP neurons by them",
        "  leaves its output unchanged); LESA needs them in every layer, OT in the pair it builds from.",
        "- **verify**: `otdus verify`'s verdict on the zero-init output (random token ids, float32).",
        "",
        "| model_type | class | result | template | zero-init | OT | LESA | verify | detail |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mt, cls, kind, family, detail, columns in rows:
        cells = " | ".join(v.replace("|", "/") for v in columns.values())
        lines.append(f"| {mt} | {cls} | {kind} | {family} | {cells} | {detail.replace('|', '/')} |")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
