"""How evaluation windows are grouped into forward passes: equal lengths (no padding), and how many.

Automatic batches stack windows of one length until a batch holds ``AUTO_BATCH_TOKENS`` tokens (a layer
call then lasts long enough that its Python and thread start-up costs vanish: 32 windows of 512 tokens,
as a plain forward would be batched), or until the layer's largest intermediate results would take
``AUTO_BATCH_TEMP_BYTES``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from otdus_cli.verify import hf_compat

AUTO_BATCH_TOKENS = 16384
AUTO_BATCH_TEMP_BYTES = 256 * 2**20


def group_windows(lengths: Sequence[int], batch_size: int | Callable[[int], int]) -> list[list[int]]:
    """Batches of window indices with equal lengths (no padding), in first-seen order; ``batch_size``
    is a window count, or a function of the windows' length giving it."""
    by_len: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_len.setdefault(n, []).append(i)
    groups = []
    for length, idx in by_len.items():
        size = max(1, int(batch_size(length) if callable(batch_size) else batch_size))
        for s in range(0, len(idx), size):
            groups.append(idx[s : s + size])
    return groups


def auto_windows_per_batch(
    length: int, layer_shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, config, text_config
) -> int:
    """Windows of ``length`` tokens per automatic batch, for decoder layers with tensors of
    ``layer_shapes`` computed in ``dtype``."""
    element = torch.empty((), dtype=dtype).element_size()
    widest = max((max(shape[-2:]) for shape in layer_shapes if len(shape) >= 2), default=1)
    per_token = 4 * widest * element  # a few intermediate results of the widest projection
    if hf_compat.attention_materialises_scores(config):  # eager attention: heads x T scores
        per_token += 2 * int(getattr(text_config, "num_attention_heads", 1) or 1) * length * element
    by_tokens = AUTO_BATCH_TOKENS // max(1, length)
    by_memory = AUTO_BATCH_TEMP_BYTES // max(1, per_token * length)
    return max(1, min(by_tokens, by_memory))


def layer_call_flop(windows: int, length: int, layer_numel: int, hidden_size: int) -> float:
    """Floating-point operations of one decoder-layer call on ``windows`` windows of ``length`` tokens:
    two per weight and token (``layer_numel`` weights; all experts of a MoE layer, an upper bound), and
    causal attention's two products."""
    return 2.0 * windows * length * (layer_numel + length * hidden_size)
