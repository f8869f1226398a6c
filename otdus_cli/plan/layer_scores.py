"""How much each layer changes the hidden states on calibration text: the scores a shrink selects by.

The source runs through verify's streamed evaluator (verify/streaming.py, passed in by the caller:
plan/ sits below verify/), one decoder layer in memory at a time. Besides that layer, the pass keeps
the hidden states of the calibration tokens at ``block + 1`` depths (tokens x hidden, float32 each):
the inputs of the last ``block`` layers and the current output, so the angular distance over a block
of ``block`` layers is measured without a second pass. Only the two block sizes a shrink reads are
measured: one layer (Block Influence, and the single-layer angular distance) and ``block``, the
removal count (the angular selection).

Every output is a decoder layer's own, the last layer's too: taken before the model's final norm
(transformers' last hidden state comes after it, so scoring from it would fold the norm into the last
layer's Block Influence). Both scores average over every calibration token: ShortGPT's Block
Influence is defined so; Gromov et al. measure the angular distance at each sequence's final token,
which on a few thousand calibration tokens would leave a handful of samples, so otdus averages it
over all positions too.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

import torch

from otdus_cli.plan.shrink_map import LayerScores


class LayerRun(Protocol):
    """A model run one decoder layer at a time (verify/streaming.py: StreamedModel)."""

    num_layers: int

    def start(self, windows: list[list[int]]) -> Any:
        """The activations entering layer 0 (``.hidden``: one [B, T, H] tensor per batch)."""
        ...

    def apply_layer(self, index: int, acts: Any) -> None:
        """Run layer ``index`` on ``acts``, replacing the tensors of ``acts.hidden``."""
        ...


def _cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-token cosine similarity of two [B, T, H] hidden states (float64)."""
    a, b = a.to(torch.float64), b.to(torch.float64)
    return ((a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(1e-30)).clamp(-1.0, 1.0)


@torch.inference_mode()
def layer_scores(model: LayerRun, windows: torch.Tensor, calib: str, block: int) -> LayerScores:
    """Block Influence of every layer and angular distances over blocks of one and of ``block``
    layers, of ``model`` run on the calibration ``windows`` (token ids, one row each) of ``calib``."""
    acts = model.start([w.tolist() for w in windows])
    depth = model.num_layers
    tokens = int(windows.numel())
    bi: list[float] = []
    sizes = sorted({1, block})
    angular = {n: [0.0] * (depth - n + 1) for n in sizes}
    inputs: deque[list[torch.Tensor]] = deque([list(acts.hidden)], maxlen=block)
    for i in range(depth):
        model.apply_layer(i, acts)  # replaces acts.hidden's tensors: the kept inputs stay as they were
        out = list(acts.hidden)
        for n in sizes:
            if n > i + 1:  # the block would start before layer 0
                break
            before = inputs[-n]  # the input of layer i - n + 1
            cos = torch.cat([_cosines(a, b).flatten() for a, b in zip(before, out, strict=True)])
            if n == 1:
                bi.append(float(1.0 - cos.mean()))
            angular[n][i - n + 1] = float((torch.arccos(cos) / torch.pi).mean())
        inputs.append(out)
    return LayerScores(bi, angular, tokens, calib)
