"""A checkpoint larger than a memory limit, and otdus run under that limit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from otdus_cli.io.writer import PlannedTensor, ShardedWriter


def write_random_checkpoint(folder: Path, layers: int, hidden: int, inter: int) -> int:
    """A Llama-shaped float32 checkpoint written tensor by tensor; returns its size in bytes."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        shapes = {
            n: tuple(p.shape)
            for n, p in AutoModelForCausalLM.from_config(config).state_dict().items()
            if n != "lm_head.weight"
        }
    folder.mkdir()
    config.save_pretrained(folder)
    writer = ShardedWriter(folder, [PlannedTensor(n, "F32", s) for n, s in shapes.items()], 10**12)
    gen = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        scale = 1.0 if "norm" in name else 0.02
        writer.write_tensor(name, torch.randn(shape, generator=gen) * scale)
    writer.finish()
    return writer.total_size


def run_limited(
    args: list[str], limit: int, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run Python under an address-space data limit (RLIMIT_DATA: heap and private mappings), with
    ``env`` added to this process's environment."""
    import os
    import resource

    def apply_limit() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))

    return subprocess.run(
        [sys.executable, *args],
        preexec_fn=apply_limit,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )
