"""A planted control for `diagnose`: a checkpoint whose layer ``layer + 1`` is a permuted copy of ``layer``.

The copy computes the same function with its MLP neurons (gate/up rows, down columns) and,
optionally, its key/value head groups (with their query heads) permuted. ``layer``'s o_proj and
down_proj are scaled by 1e-3 in both copies, so ``layer`` barely changes the residual stream and
its copy sees nearly the same input: paired neurons then have nearly identical activations. A
diagnostic that cannot find this pairing cannot be trusted to find a weaker one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

__all__ = ["plant_permuted_copy", "planted_permutations"]


def plant_permuted_copy(
    checkpoint: str,
    folder: str | os.PathLike[str],
    layer: int,
    permute_heads: bool = False,
    seed: int = 0,
) -> tuple[int, int]:
    """Write ``checkpoint`` (a single-file Llama-style safetensors folder) to ``folder`` with layer
    ``layer + 1`` replaced as described above. Returns the planted pair (layer, layer + 1); the
    permutations are recoverable with :func:`planted_permutations` and the same seed."""
    from otdus_cli.source import resolve_source

    src = resolve_source(checkpoint).folder
    folder = Path(folder)
    shutil.copytree(src, folder)
    sd = load_file(str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    mlp_perm, q_perm, kv_perm = planted_permutations(cfg, permute_heads, seed)
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    pa, pb = f"model.layers.{layer}.", f"model.layers.{layer + 1}."
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        sd[pa + name] = sd[pa + name] * 1e-3
    for key in [k for k in sd if k.startswith(pa)]:
        sd[pb + key[len(pa) :]] = sd[key].clone()
    sd[pb + "mlp.gate_proj.weight"] = sd[pa + "mlp.gate_proj.weight"][mlp_perm].clone()
    sd[pb + "mlp.up_proj.weight"] = sd[pa + "mlp.up_proj.weight"][mlp_perm].clone()
    sd[pb + "mlp.down_proj.weight"] = sd[pa + "mlp.down_proj.weight"][:, mlp_perm].clone()

    def rows(w: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        return w.reshape(len(order), hd, -1)[order].reshape(w.shape).clone()

    sd[pb + "self_attn.q_proj.weight"] = rows(sd[pa + "self_attn.q_proj.weight"], q_perm)
    sd[pb + "self_attn.k_proj.weight"] = rows(sd[pa + "self_attn.k_proj.weight"], kv_perm)
    sd[pb + "self_attn.v_proj.weight"] = rows(sd[pa + "self_attn.v_proj.weight"], kv_perm)
    o = sd[pa + "self_attn.o_proj.weight"]
    n_q = cfg["num_attention_heads"]
    sd[pb + "self_attn.o_proj.weight"] = o.reshape(o.shape[0], n_q, hd)[:, q_perm].reshape(o.shape).clone()
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return layer, layer + 1


def planted_permutations(
    config: dict, permute_heads: bool, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(MLP neuron, query head, KV head) permutations: the copy's unit j is the original's perm[j].
    With ``permute_heads`` the KV permutation is never the identity."""
    n_q = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_q
    g = torch.Generator().manual_seed(seed)
    mlp_perm = torch.randperm(config["intermediate_size"], generator=g)
    kv_perm = torch.randperm(n_kv, generator=g) if permute_heads else torch.arange(n_kv)
    while permute_heads and n_kv > 1 and torch.equal(kv_perm, torch.arange(n_kv)):
        kv_perm = torch.randperm(n_kv, generator=g)
    group = n_q // n_kv
    q_perm = torch.tensor([int(kv) * group + r for kv in kv_perm for r in range(group)])
    return mlp_perm, q_perm, kv_perm
