"""Perplexity change of `otdus widen` (alpha 0 and 0.01) on each MoE family's tiny random model.

The tiny models are the test suite's (tests/support/tiny_models.py: built in-process with
transformers, vocab 96); the text is the bundled TinyStories sample, tokenised with stories260K's
tokenizer and folded into the tiny vocabulary (ids mod 96), 63 windows of 64 tokens. Figures:
docs/widen-ppl.md.

    python -m scripts.widen_tiny_ppl
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from otdus_cli.bundled import STORIES260K, TINYSTORIES_SAMPLE
from otdus_cli.verify.compare import verify_expansion
from otdus_cli.verify.metrics import EvalSet, Window, load_tokenizer
from otdus_cli.widen import WidenOptions, widen
from tests.support.tiny_models import MOE_TYPES, build_tiny


def main() -> None:
    torch.set_num_threads(1)
    ids = [i % 96 for i in load_tokenizer(str(STORIES260K))(TINYSTORIES_SAMPLE.read_text())["input_ids"]]
    ids = ids[:4096]
    windows = [Window(w, w[1:], 0, 0) for w in (ids[k : k + 64] for k in range(0, len(ids) - 64, 64))]
    plan = EvalSet("token", "tinystories-sample, ids mod 96", windows, [0], [0], 64)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for model_type in MOE_TYPES:
            src = build_tiny(model_type, root / model_type)
            for noise in (0.0, 0.01):
                out = root / f"{model_type}-{noise}"
                widen(str(src), out, WidenOptions(noise=noise))
                report = verify_expansion(src, out, plan)
                name, before = report.base.headline()
                after = report.expanded.values()[name]
                change = (after - before) / before
                verdict = report.verdict.split(":")[0]
                print(
                    f"| {model_type} | {noise:g} | {before:.6f} | {after:.6f} | {change:+.2e} "
                    f"| {verdict} (exit {report.exit_code}) |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
