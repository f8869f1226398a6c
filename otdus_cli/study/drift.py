"""How far an expansion moves its base's function, measured right after expansion.

On the same token windows, the base and the expanded checkpoint are run in full (float32, eager
attention), and compared:

* after every base layer i: the expanded model's hidden state at the point that corresponds to it
  (the output of the last expanded layer that stands for base layer i, so a new layer inserted
  after i counts; the correspondence of verify/layer_map.py) against the base's, as a relative L2
  distance over every token, ||H_expanded - H_base|| / ||H_base|| (Frobenius norms);
* the last hidden state transformers returns (after the final norm) the same way;
* the next-token distributions: the mean KL(base || expanded) per token, in nats;
* each model's mean next-token loss on the windows.

A function-preserving expansion (zero-init) gives exactly 0 everywhere. Where the layer order
stops matching the base's (SOLAR-style repeats), later layers have no corresponding point and are
left out.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from otdus_cli.arch.modules import NOT_TEXT
from otdus_cli.errors import OtdusError
from otdus_cli.manifest import read_manifest
from otdus_cli.study.train import load_model
from otdus_cli.verify.hf_compat import hidden_states_of
from otdus_cli.verify.layer_map import correspondence, layer_entries

__all__ = ["FunctionDistance", "function_distance"]


@dataclass
class FunctionDistance:
    """What :func:`function_distance` measures (JSON-ready with :meth:`to_dict`)."""

    tokens: int  # next-token positions scored (the hidden states cover one more per window)
    base_layers: int
    expanded_layers: int
    layer_relative_l2: list[float | None]  # per base layer; None: no corresponding point
    layer_points: list[int | None]  # the expanded layer compared with each base layer
    final_relative_l2: float  # the last hidden state (after the final norm)
    kl: float  # mean KL(base || expanded) of the next-token distributions, nats
    base_loss: float
    expanded_loss: float
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Norms:
    """Running sums of squared differences and squared base values, per compared point."""

    def __init__(self, n: int):
        self.diff = [0.0] * n
        self.ref = [0.0] * n

    def add(self, k: int, expanded: torch.Tensor, base: torch.Tensor) -> None:
        d, b = expanded.double() - base.double(), base.double()
        self.diff[k] += float((d * d).sum())
        self.ref[k] += float((b * b).sum())

    def relative(self, k: int) -> float:
        return math.sqrt(self.diff[k]) / math.sqrt(self.ref[k]) if self.ref[k] > 0 else math.nan


def _layer_list(model) -> torch.nn.ModuleList:
    """The text stack's decoder layers: the one ModuleList as long as the config says, outside any
    vision or audio tower."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n = int(config.num_hidden_layers)
    found = [
        module
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList)
        and len(module) == n
        and not any(part in name for part in NOT_TEXT)
    ]
    if len(found) != 1:
        raise OtdusError(f"cannot tell the decoder layers apart ({len(found)} module lists of {n} layers)")
    return found[0]


@contextmanager
def _layer_outputs(model, wanted: set[int]) -> Iterator[dict[int, torch.Tensor]]:
    """The hidden states leaving the decoder layers in ``wanted``, filled on each forward."""
    caught: dict[int, torch.Tensor] = {}
    handles = []
    for j, layer in enumerate(_layer_list(model)):
        if j in wanted:

            def hook(module, args, output, j=j) -> None:
                caught[j] = hidden_states_of(output).detach()

            handles.append(layer.register_forward_hook(hook))
    try:
        yield caught
    finally:
        for h in handles:
            h.remove()


def _points(expanded_dir: str | os.PathLike[str], expanded_layers: int, base_layers: int) -> list[int | None]:
    """For each base layer, the last expanded layer whose output corresponds to its output."""
    manifest = read_manifest(expanded_dir)
    if not manifest or "layers" not in manifest:
        raise OtdusError(f"{expanded_dir} has no otdus layer map (otdus.json): not an otdus expansion")
    targets = correspondence(layer_entries(manifest["layers"], expanded_layers), base_layers)
    points: list[int | None] = [None] * base_layers
    for j, target in enumerate(targets):
        if target is not None and target >= 0:
            points[target] = j
    return points


@torch.no_grad()
def function_distance(
    base_dir: str | os.PathLike[str],
    expanded_dir: str | os.PathLike[str],
    windows: torch.Tensor,
    batch: int = 8,
    device: str | torch.device = "cpu",
) -> FunctionDistance:
    """The distance between ``base_dir``'s function and that of ``expanded_dir`` (an otdus expansion
    of it) on ``windows`` (token ids, windows x length), as the module docstring defines it."""
    if windows.ndim != 2 or windows.shape[1] < 2 or windows.shape[0] == 0:
        raise OtdusError("function_distance needs at least one window of two tokens or more")
    dev = torch.device(device)
    base, expd = load_model(str(base_dir), dev).eval(), load_model(str(expanded_dir), dev).eval()
    nb, ne = len(_layer_list(base)), len(_layer_list(expd))
    points = _points(expanded_dir, ne, nb)
    norms = _Norms(nb + 1)  # the base layers, then the final hidden state
    kl = base_nll = exp_nll = 0.0
    tokens = 0
    with (
        _layer_outputs(base, set(range(nb))) as got_b,
        _layer_outputs(expd, {p for p in points if p is not None}) as got_e,
    ):
        for s in range(0, windows.shape[0], batch):
            x = windows[s : s + batch].to(dev)
            out_b = base(input_ids=x, output_hidden_states=True)
            out_e = expd(input_ids=x, output_hidden_states=True)
            for i, j in enumerate(points):
                if j is not None:
                    norms.add(i, got_e[j], got_b[i])
            norms.add(nb, out_e.hidden_states[-1], out_b.hidden_states[-1])
            lp_b = torch.log_softmax(out_b.logits[:, :-1].double(), dim=-1)
            lp_e = torch.log_softmax(out_e.logits[:, :-1].double(), dim=-1)
            kl += float((lp_b.exp() * (lp_b - lp_e)).sum())
            target = x[:, 1:].unsqueeze(-1)
            base_nll -= float(lp_b.gather(-1, target).sum())
            exp_nll -= float(lp_e.gather(-1, target).sum())
            tokens += target.numel()
    layers = [None if j is None else norms.relative(i) for i, j in enumerate(points)]
    notes = []
    if any(j is None for j in points):
        notes.append(
            "the expanded stack leaves the base's layer order: later layers have no corresponding point"
        )
    return FunctionDistance(
        tokens=tokens,
        base_layers=nb,
        expanded_layers=ne,
        layer_relative_l2=layers,
        layer_points=points,
        final_relative_l2=norms.relative(nb),
        kl=kl / tokens,
        base_loss=base_nll / tokens,
        expanded_loss=exp_nll / tokens,
        notes=notes,
    )
