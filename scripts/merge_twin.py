#!/usr/bin/env python
"""How far each OT variant's merge of a planted twin lands from dropping it (docs/ot.md, "Merging layers").

The twin: stories260K with layer 2 replaced by layer 1, its MLP neurons (gate/up rows, down columns)
and its KV heads (each with its group of query heads: q/k/v rows, o columns) permuted. It computes layer
1's function, so `shrink --method ot --remove 2` (layer 1 aligned to layer 2, then averaged) should
give the logits of `shrink --method drop --remove 2`. Prints the largest |logit difference| on two
random windows of 24 tokens, for each variant and solver. The variants a shrink refuses (paper,
official) are measured with the refusal lifted, to show why they are refused.

    python -m scripts.merge_twin
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from tests.support.planted_twin import planted_twin

RUNS = [
    ("structured", "emd"),
    ("structured", "sinkhorn"),
    ("activation", "emd"),
    ("paper", "emd"),
    ("paper", "sinkhorn"),
    ("official", "sinkhorn"),
]


def window_logits(folder: Path) -> torch.Tensor:
    """Logits of two random windows of 24 tokens (seed 0), by transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids).logits


def main() -> None:
    from otdus_cli.methods import merge
    from otdus_cli.shrink import ShrinkOptions, shrink

    torch.set_num_threads(1)
    merge.MERGING_VARIANTS = tuple(v for v, _ in RUNS)  # lift the refusal: measure the refused variants too
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        planted_twin(root / "twin")
        shrink(str(root / "twin"), root / "drop", ShrinkOptions(method="drop", remove=[2]))
        dropped = window_logits(root / "drop")
        print("| variant, solver | max abs logit difference against drop |")
        print("|---|---:|")
        for variant, solver in RUNS:
            out = root / f"{variant}-{solver}"
            ot = {"variant": variant, "solver": solver}
            shrink(str(root / "twin"), out, ShrinkOptions(method="ot", remove=[2], calib_tokens=512, ot=ot))
            print(f"| {variant}, {solver} | {float((window_logits(out) - dropped).abs().max()):.2g} |")


if __name__ == "__main__":
    main()
