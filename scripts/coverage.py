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
from tests.support.tiny_models import COMMON as TESTED_COMMON
from tests.support.tiny_models import TINY_CONFIGS as TESTED_CONFIGS
from tests.support.tiny_models import WRAPPERS as TESTED_WRAPPERS  # multimodal: tiny vision towers too

TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    head_dim=8,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# small expert counts and latent ranks for MoE / MLA configs (tried first; dropped if a config refuses them)
TINY_MOE = dict(
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    n_group=1,
    topk_group=1,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=8,  # = head_dim, which MLA's rotary part uses
    qk_nope_head_dim=8,
    v_head_dim=8,
)
MAX_PARAMETERS = 20_000_000  # a config whose sizes our tiny fields do not reach is reported, not built


def build(model_type: str, folder: Path) -> torch.Tensor:
    """Save a tiny random model; return its logits on fixed ids."""
    from transformers import AutoConfig, AutoModelForCausalLM

    no_head_dim = {k: v for k, v in TINY.items() if k != "head_dim"}  # for classes that compute it
    tested = TESTED_CONFIGS.get(model_type)  # the test suite's tiny config, where it has one
    attempts = ([{**TESTED_COMMON, **tested}] if tested is not None else []) + [
        *([TESTED_WRAPPERS[model_type]] if model_type in TESTED_WRAPPERS else []),
        {**TINY, **TINY_MOE},
        {**no_head_dim, **TINY_MOE},
        TINY,
        no_head_dim,
    ]
    for fields in attempts:
        try:
            config = AutoConfig.for_model(model_type, **fields)
            with torch.device("meta"):
                size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
            break
        except Exception:
            if fields is no_head_dim:
                raise
    if size > MAX_PARAMETERS:
        raise RuntimeError(f"the tiny config still has {size / 1e6:.0f}M parameters")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1 and p.is_floating_point():
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return logits_of(model)


def _one_line(exc: BaseException) -> str:
    """An error message whole, on one line (a table cell): never cut mid-word."""
    return " ".join(str(exc).split())


def logits_of(model) -> torch.Tensor:
    ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


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


def check(model_type: str, root: Path) -> tuple[str, str, str]:
    """(kind, family, detail) for one model_type."""
    src = root / model_type
    try:
        base = build(model_type, src)
    except Exception as exc:
        return "not built", "", f"tiny model: {type(exc).__name__}: {_one_line(exc)}"
    try:
        result = expand(str(src), root / "copy", ExpandOptions(method="copy", layers=2))
    except OtdusError as exc:
        return "refused", "", _one_line(exc)
    except Exception as exc:
        return "failed", "", f"expand: {type(exc).__name__}: {_one_line(exc)}"
    family = result.plan.source.family
    try:
        grown = reload(root / "copy")
        assert grown.config.get_text_config().num_hidden_layers == result.manifest["num_hidden_layers"]
        logits_of(grown)
    except Exception as exc:
        return "failed", family.name, f"copy does not reload: {type(exc).__name__}: {_one_line(exc)}"
    if family.copy_only or not family.zero_init:
        return "derived", family.name, "copy-type methods; no zero-init (no exact template)"
    try:
        expand(str(src), root / "zero", ExpandOptions(method="copy", layers=2, zero_init=True))
        same = torch.equal(base, logits_of(reload(root / "zero")))
    except Exception as exc:
        return "failed", family.name, f"zero-init: {type(exc).__name__}: {_one_line(exc)}"
    if not same:
        return "failed", family.name, "zero-init logits differ from the base"
    return (
        "exact",
        family.name,
        "copy-type methods; zero-init bit-identical"
        + ("; OT" if "ot" not in family.refuses and family.roles else ""),
    )


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
            kind, family, detail = check(mt, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        rows.append((mt, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[mt], kind, family, detail))
        print(f"{mt:28s} {kind:9s} {family:24s} {detail}", flush=True)
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
    lines = [
        "# Compatibility",
        "",
        f"Generated by `make coverage` (scripts/coverage.py) on {stamp}, with transformers {version}:",
        "every model_type",
        "of its causal-LM auto mapping, built as a tiny random model from its config class, expanded with",
        "`copy` (2 new layers) and, where the template offers it, `copy --zero-init`, then reloaded with",
        "AutoModelForCausalLM (the class that built it where that cannot read the saved config: Mllama's",
        "text model). Multimodal wrappers are built with the tiny vision towers of tests/test_wrappers.py.",
        "",
        f"**{expandable} of {len(rows)} architectures expand and reload**: {counts['exact']} with an exact",
        f"template (zero-init gives bit-identical logits), {counts['derived']} with a template derived from",
        f"transformers (copy-type methods only); {counts['refused']} refused with a reason, "
        f"{counts['failed']} failed, {counts['not built']} could not be built tiny here.",
        "",
        "- **exact**: a template in otdus_cli/arch/families.py; every method (OT where listed).",
        "- **derived**: the layer list read off transformers' class on the meta device (arch/derived.py);",
        "  copy, interpose, llama-pro, solar, stack without zero-init.",
        "- **refused**: otdus stops with one line before writing anything; the reason is given.",
        "- **not built**: this script could not build the tiny config (not a verdict on the architecture).",
        "",
        "| model_type | class | result | template | detail |",
        "|---|---|---|---|---|",
    ]
    for mt, cls, kind, family, detail in rows:
        lines.append(f"| {mt} | {cls} | {kind} | {family} | {detail.replace('|', '/')} |")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
