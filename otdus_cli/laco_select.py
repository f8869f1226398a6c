"""`otdus shrink --select laco`: LaCo's layer selection (Yang, Cao & Zhao 2024, Algorithm 1).

From the top of the stack down, merge C consecutive layers into the lowest of them, keep the merge
while the model's representations stay similar to the source's, and move on:

    l = H - C
    while l >= L:
        M' = M* with layers l .. l+C-1 merged into one
        s  = mean over the calibration windows of cos(last hidden states of the source, of M')
        if s > T:  M* = M';  l = min(l - I, depth(M*) - C)
        else:      l = l - 1

The last hidden states are what transformers calls ``hidden_states[-1]``: after the final norm (the
input of the LM head), flattened over the window's positions. The released settings (Llama-2-13B,
40 layers) are C = 7, I = 1, H = 39, L = 0, T = 0.45, with five short English sentences as the
calibration text; otdus scores whole windows of ``--calib`` text instead. H defaults to the last
layer, L to 0.

The merge tried is the shrink's own ``--method`` (LaCo's RDSC with ``--method laco``; ``average``;
``drop``: the layers above l left out), built by its builder and run in place of layer l, so the
similarity is measured on what the shrink then writes. A merge that takes in a layer merged before is
one merge of all their source layers (a merge group of plan/shrink_map.py), where the released code
would merge the merged layer again; the two differ only when merges chain. One streamed pass of the
model over the calibration windows per tried merge (verify's evaluator, one decoder layer in memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from otdus_cli.errors import OtdusError
from otdus_cli.plan.shrink_map import LacoTrace

if TYPE_CHECKING:
    from pydantic import BaseModel

    from otdus_cli.source import SourceModel
    from otdus_cli.verify.streaming import StreamedModel


class ShrinkSettings(Protocol):
    """What the loop reads of a shrink's settings (otdus_cli/shrink.py's ShrinkSettings, which calls
    this module: named here by its shape, not imported)."""

    method: str
    seed: int
    layers: int | None
    ratio: float | None
    calib: str
    calib_tokens: int
    laco_merge: int
    laco_interval: int
    laco_threshold: float
    laco_top: int | None
    laco_bottom: int

    def method_options(self) -> BaseModel | None: ...


def laco_bounds(depth: int, options: ShrinkSettings) -> tuple[int, int, int]:
    """(C, H, L) of a selection on a stack of ``depth`` layers; refuses settings that merge nothing."""
    c, low = options.laco_merge, options.laco_bottom
    high = depth - 1 if options.laco_top is None else options.laco_top
    if not 0 <= low <= high < depth:
        raise OtdusError(
            f"--laco-bottom {low} and --laco-top {high} must name layers 0 <= bottom <= top <= {depth - 1}"
        )
    if high - c < low:
        raise OtdusError(
            f"--laco-merge {c}: LaCo's first merge takes the {c} layers below --laco-top {high}, which "
            f"start below --laco-bottom {low}; with these bounds --laco-merge is at most {high - low}"
        )
    return c, high, low


def _final_states(model: StreamedModel, acts) -> list[torch.Tensor]:
    """Each window's last hidden states after the final norm (the LM head's input), [T, H] float64."""
    from otdus_cli.verify.head_pass import iter_logits

    head = model.model.get_output_embeddings()
    seen: list[torch.Tensor] = []
    hook = head.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().double().cpu()))
    pieces: dict[int, list[torch.Tensor]] = {}
    try:
        for group, _, _ in iter_logits(model, acts):
            states = seen.pop()
            for row, i in enumerate(group):
                pieces.setdefault(i, []).append(states[row])
    finally:
        hook.remove()
    return [torch.cat(pieces[i]) for i in sorted(pieces)]


class _Trial:
    """Runs the source with some layers merged: the shrink's builder in place of each group's kept layer."""

    def __init__(self, source: SourceModel, options: ShrinkSettings, model: StreamedModel, windows) -> None:
        from otdus_cli.methods.base import BuildContext
        from otdus_cli.methods.registry import SHRINK_METHODS

        self.source, self.model, self.windows = source, model, windows
        method = SHRINK_METHODS[options.method]
        self.builder = None if method.make_builder is None else method.make_builder()
        self.ctx = BuildContext(
            family=source.family,
            config=source.text_config,
            options=options.method_options(),
            seed=options.seed,
            source_folder=source.reader.folder,
            zero_init=False,
        )

    @torch.inference_mode()  # the layers' memory is the evaluator's, made in inference mode
    def states(self, groups: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
        """Final states of the stack ``groups`` (each a run of source layers, kept layer first)."""
        acts = self.model.start(self.windows)
        for group in groups:
            kept = group[0]
            if len(group) == 1 or self.builder is None:  # a kept layer, or drop: the kept layer alone
                self.model.apply_layer(kept, acts)
                continue
            layer = self.model.weights.load_layer(kept)
            try:
                parents = [self.source.layers[i] for i in group]
                for suffix, tensor in self.builder.build(parents, self.ctx):
                    try:
                        target = layer.get_parameter(suffix)
                    except AttributeError:
                        raise OtdusError(
                            f"--select laco: the merged tensor {suffix} has no place in "
                            f"{type(layer).__name__}; choose with --select bi or angular"
                        ) from None
                    target.copy_(tensor.to(target.dtype))
                self.model.apply_layer(kept, acts, layer=layer)
            finally:
                self.model.weights.free_layer(kept)
        return _final_states(self.model, acts)


def _similarity(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """Mean over windows of the cosine between two windows' flattened final states."""
    cos = [
        torch.nn.functional.cosine_similarity(x.flatten(), y.flatten(), dim=0)
        for x, y in zip(a, b, strict=True)
    ]
    return float(torch.stack(cos).mean())


def laco_select(
    source: SourceModel, options: ShrinkSettings, device: str | torch.device = "cpu"
) -> LacoTrace:
    """The layers LaCo's loop removes from ``source`` (module docstring), with every merge it tried.
    ``options.layers`` (when given) caps how many layers it removes."""
    from otdus_cli.methods.ot.calibration import calibration_windows
    from otdus_cli.verify.metrics import model_max_positions
    from otdus_cli.verify.streaming import StreamedModel

    depth = source.depth
    c, high, low = laco_bounds(depth, options)
    cap = options.layers
    if options.ratio is not None:
        cap = round(depth * options.ratio)
    reader = source.reader
    windows = calibration_windows(
        reader.folder,
        options.calib,
        options.calib_tokens,
        model_max_positions(reader.config),
        "--select laco",
    )
    inputs = [w.tolist() for w in windows]
    model = StreamedModel(reader, device=device, dtype=torch.float32, batch_size=8)
    trial = _Trial(source, options, model, inputs)
    try:
        reference = trial.states([(i,) for i in range(depth)])
        groups: list[tuple[int, ...]] = [(i,) for i in range(depth)]
        tried: list[dict] = []
        removed = 0
        l = high - c  # noqa: E741 - the paper's name
        while l >= low and (cap is None or removed < cap):
            merged = tuple(i for g in groups[l : l + c] for i in g)
            candidate = [*groups[:l], merged, *groups[l + c :]]
            over = cap is not None and removed + c - 1 > cap  # C entries become one: C - 1 layers fewer
            similarity = None if over else _similarity(reference, trial.states(candidate))
            accepted = similarity is not None and similarity > options.laco_threshold
            tried.append({"at": l, "layers": list(merged), "similarity": similarity, "accepted": accepted})
            if accepted:
                groups, removed = candidate, removed + c - 1
                l = min(l - options.laco_interval, len(groups) - c)  # noqa: E741
            else:
                l -= 1  # noqa: E741
    finally:
        model.weights.free_shell()
    kept = {g[0] for g in groups}
    return LacoTrace(
        removed=[i for i in range(depth) if i not in kept],
        tried=tried,
        settings={
            "merge": c,
            "interval": options.laco_interval,
            "threshold": options.laco_threshold,
            "top": high,
            "bottom": low,
            "cap": cap,
        },
        tokens=int(windows.numel()),
        text=options.calib,
    )
