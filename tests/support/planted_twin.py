"""A planted twin of stories260K: layer 2 a copy of layer 1 with its neurons and heads permuted, so it
computes layer 1's function (what an OT merge of the two must recover; scripts/merge_twin.py,
tests/test_merge.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

HEAD_DIM, KV_HEADS, GROUP = 8, 4, 2  # stories260K's attention: 8 query heads over 4 KV heads


def planted_twin(folder: Path, seed: int = 0) -> None:
    """Write stories260K to ``folder`` with layer 2 replaced by layer 1, its MLP neurons (gate/up rows,
    down columns) and its KV heads (each with its group of query heads: q/k/v rows, o columns) permuted."""
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
