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

import shutil
import tempfile
from pathlib import Path

import torch

HEAD_DIM, KV_HEADS, GROUP = 8, 4, 2  # stories260K's attention: 8 query heads over 4 KV heads
RUNS = [
    ("structured", "emd"),
    ("structured", "sinkhorn"),
    ("activation", "emd"),
    ("paper", "emd"),
    ("paper", "sinkhorn"),
    ("official", "sinkhorn"),
]


def planted_twin(folder: Path, seed: int = 0) -> None:
    """Write stories260K to ``folder`` with layer 2 a permuted copy of layer 1 (module docstring)."""
    from safetensors.torch import load_file, save_file

    from otdus_cli.bundled import STORIES260K

    shutil.copytree(STORIES260K, folder)
    tensors = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    prefix = "model.layers.1."
    one = {n.removeprefix(prefix): t for n, t in tensors.items() if n.startswith(prefix)}
    neurons = torch.randperm(one["mlp.up_proj.weight"].shape[0], generator=gen)
    kv = torch.randperm(KV_HEADS, generator=gen)
    while torch.equal(kv, torch.arange(KV_HEADS)):  # a permutation that moves something
        kv = torch.randperm(KV_HEADS, generator=gen)
    q_heads = torch.cat([torch.arange(GROUP) + GROUP * int(j) for j in kv])

    def rows(heads: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.arange(HEAD_DIM) + HEAD_DIM * int(h) for h in heads])

    twin = dict(one)
    twin["mlp.gate_proj.weight"] = one["mlp.gate_proj.weight"][neurons]
    twin["mlp.up_proj.weight"] = one["mlp.up_proj.weight"][neurons]
    twin["mlp.down_proj.weight"] = one["mlp.down_proj.weight"][:, neurons]
    twin["self_attn.q_proj.weight"] = one["self_attn.q_proj.weight"][rows(q_heads)]
    twin["self_attn.k_proj.weight"] = one["self_attn.k_proj.weight"][rows(kv)]
    twin["self_attn.v_proj.weight"] = one["self_attn.v_proj.weight"][rows(kv)]
    twin["self_attn.o_proj.weight"] = one["self_attn.o_proj.weight"][:, rows(q_heads)]
    for suffix, t in twin.items():
        tensors[f"model.layers.2.{suffix}"] = t.clone()  # no storage shared with layer 1 (safetensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


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
