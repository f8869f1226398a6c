"""Tensors outside the decoder layers that hold one slice per layer, for a derived template.

Gemma 3n and Gemma 4 feed each layer an input of its own: a token embedding ``embed_tokens_per_layer``
of ``[vocab, layers * width]`` and a projection ``per_layer_model_projection`` of ``[layers * width,
hidden]``, reshaped to ``(layers, width)``: layer i reads ``width`` entries at ``i * width``. Such a
tensor is found from its shapes on the meta device, at the base depth and at the new one (one axis grows
by ``width`` a layer), and proved on the tiny instance: changing slice i leaves the outputs of layers
0 .. i-1 bit for bit as they were and changes layer i's. The output then holds, for each output layer,
its source layer's slice (a copy, a copy with zero-init, a base layer moved: the slice moves with it),
written in chunks so that memory holds a few tens of MB of it at a time, never the whole table (Gemma 4
E2B's embed_tokens_per_layer: 262144 x 35 x 256, 4.7 GB in bfloat16). A layer built from other layers
by a formula (average, OT-DUS, LESA, a merge) has no rule for its slice, and is refused.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from otdus_cli.errors import OtdusError
from otdus_cli.io.writer import PlannedTensor, ShardedWriter
from otdus_cli.quiet import quiet_transformers

if TYPE_CHECKING:
    import torch

CHUNK_BYTES = 64 * 1024 * 1024  # of the source tensor, read and rearranged at a time


@dataclass(frozen=True)
class DepthSliced:
    """Layer i's slice of a tensor: ``width`` entries along ``axis``, starting at ``i * width``."""

    axis: int
    width: int


@dataclass(frozen=True)
class LayerSlices(PlannedTensor):
    """An output tensor made of slices of the source tensor ``source``: output layer j's slice is source
    layer ``sources[j]``'s."""

    source: str = ""
    axis: int = 0
    width: int = 0
    sources: tuple[int, ...] = ()


def depth_sliced_tensors(source, base_model, written_model, layer_list: str, config: dict) -> dict:
    """The tensors of ``source``'s checkpoint outside the decoder layers that change shape with the depth
    (``base_model`` and ``written_model``: transformers' classes at the base depth and the new one, on
    the meta device), each with its slices (checkpoint name -> DepthSliced), proved on the tiny instance
    of ``config``; OtdusError naming the first that has no slice per layer, or is not read so."""
    base_depth, new_depth = source.depth, len(_layers(written_model, layer_list))
    before = _outside(base_model, layer_list)
    found: dict[str, tuple[str, DepthSliced]] = {}
    for name, shape in _outside(written_model, layer_list).items():
        if name not in before or before[name] == shape:
            continue
        sliced = slices_of(before[name], shape, base_depth, new_depth)
        if sliced is None:
            raise OtdusError(
                f"{source.family.name}: {name} is {list(before[name])} in the base and {list(shape)} at "
                "the new depth, which is no slice of one size per layer along one axis; otdus cannot tell "
                "which part a new layer reads"
            )
        found[name] = (_checkpoint_name(source, base_model, name), sliced)
    if not found:
        return {}
    axes = tuple((n, s.axis) for n, (_, s) in found.items())
    why = _prove(json.dumps(config, sort_keys=True), layer_list, axes)
    if why is not None:
        raise OtdusError(f"{source.family.name}: {why}")
    return dict(found.values())


def check_sliced_sources(family, layer_map: list, sliced: dict) -> None:
    """Each output layer takes one layer's slice: its source's. A layer built by a formula from other
    layers (average, OT-DUS, LESA, a merge) is refused in one line, naming the tensor."""
    built = next((lay for lay in layer_map if lay.builder not in ("base", "copy")), None)
    if sliced and built is not None:
        parents = ", ".join(map(str, built.parents))
        raise OtdusError(
            f"{family.name}: {next(iter(sliced))} holds a slice per layer outside the layers' tensors, "
            f"and output layer {built.index} is built by {built.builder} from base layers {parents}, which "
            "has no rule for its slice; use a method that copies layers (copy, interpose, llama-pro, solar, "
            "stack)"
        )


def planned_slices(
    name: str, dtype: str, shape: tuple, sliced: DepthSliced, sources: list[int]
) -> LayerSlices:
    """The output tensor of ``name`` (of ``shape`` in the source) with one slice per output layer."""
    out = list(shape)
    out[sliced.axis] = sliced.width * len(sources)
    return LayerSlices(name, dtype, tuple(out), name, sliced.axis, sliced.width, tuple(sources))


def write_slices(reader, writer: ShardedWriter, planned: LayerSlices) -> int:
    """Write ``planned`` from the source tensor, a chunk of rows at a time; the bytes written."""
    shape = reader.meta(planned.source).shape
    axis, width, sources = planned.axis, planned.width, planned.sources

    def pieces():
        if axis == 0:  # a layer's slice is ``width`` whole rows
            for j, i in enumerate(sources):
                yield j * width, reader.get_rows(planned.source, i * width, (i + 1) * width)
            return
        step = max(1, CHUNK_BYTES // max(1, reader.nbytes(planned.source) // shape[0]))
        for start in range(0, shape[0], step):
            chunk = reader.get_rows(planned.source, start, min(start + step, shape[0]))
            yield start, select_slices(chunk, DepthSliced(axis, width), sources)

    return writer.write_rows(planned.name, pieces())


def select_slices(tensor, sliced: DepthSliced, sources) -> torch.Tensor:
    """``tensor`` (a slice per layer along ``sliced.axis``) with output layer j's slice source layer
    ``sources[j]``'s."""
    import torch

    axis, width = sliced.axis, sliced.width
    shape = tuple(tensor.shape)
    split = tensor.reshape(*shape[:axis], shape[axis] // width, width, *shape[axis + 1 :])
    picked = split.index_select(axis, torch.tensor(list(sources), device=tensor.device))
    return picked.reshape(*shape[:axis], len(sources) * width, *shape[axis + 1 :])


def slices_of(before: tuple, after: tuple, depth: int, new_depth: int) -> DepthSliced | None:
    """The one axis along which ``before`` (at ``depth`` layers) holds a slice per layer and ``after`` (at
    ``new_depth``) as many of the same width; None when the shapes say otherwise."""
    if len(before) != len(after):
        return None
    axes = [a for a, (x, y) in enumerate(zip(before, after, strict=True)) if x != y]
    if len(axes) != 1:
        return None
    axis = axes[0]
    width, rest = divmod(before[axis], depth)
    if rest or width == 0 or after[axis] != width * new_depth:
        return None
    return DepthSliced(axis, width)


def _outside(model, layer_list: str) -> dict[str, tuple]:
    prefix = layer_list + "."
    return {n: tuple(p.shape) for n, p in model.named_parameters() if not n.startswith(prefix)}


def _layers(model, layer_list: str) -> list:
    from otdus_cli.arch.modules import modules_of

    return modules_of(model, layer_list)


def _checkpoint_name(source, model, name: str) -> str:
    """The name ``source``'s checkpoint holds the module tensor ``name`` under (its own, or the one
    transformers saves it under); OtdusError when it holds none of them."""
    from otdus_cli.arch.saved_names import saved_names

    stored = set(source.head) | set(source.tail)
    names = [name, *saved_names(model, {name: model.get_parameter(name)}).get(name, [])]
    found = next((n for n in names if n in stored), None)
    if found is None:
        raise OtdusError(
            f"{source.family.name}: {name} holds a slice per layer, and the checkpoint holds it under none "
            f"of the names transformers loads it from ({', '.join(names)}); save the model again with this "
            "transformers"
        )
    return found


@functools.lru_cache(maxsize=8)
@quiet_transformers
def _prove(config_json: str, layer_list: str, tensors: tuple[tuple[str, int], ...]) -> str | None:
    """On the tiny instance of the config: for each of ``tensors`` (module name, axis) and each layer i,
    changing the tensor's slice i (its ``size / depth`` entries at i along the axis) leaves the outputs
    of layers 0 .. i-1 as they were, bit for bit, and changes layer i's. None when it does; else why not."""
    import torch

    from otdus_cli.arch.tiny import tiny_ids, tiny_instance

    instance = tiny_instance(json.loads(config_json))
    if isinstance(instance, Exception):
        return f"no tiny instance to prove which layer reads which slice on ({type(instance).__name__})"
    model = instance[0]
    layers = _layers(model, layer_list)
    ids = tiny_ids(model, seed=2)
    outputs: list = []

    def keep(_module, _args, output) -> None:
        outputs.append((output[0] if isinstance(output, tuple | list) else output).detach().clone())

    def run() -> list:
        outputs.clear()
        hooks = [layer.register_forward_hook(keep) for layer in layers]
        try:
            with torch.no_grad():
                model(input_ids=ids, use_cache=False)
        finally:
            for hook in hooks:
                hook.remove()
        return list(outputs)

    base = run()
    depth = len(layers)
    for name, axis in tensors:
        param = model.get_parameter(name)
        width = param.shape[axis] // depth if axis < param.dim() else 0
        if width == 0 or param.shape[axis] != width * depth:
            return f"{name} of the tiny instance holds no slice per layer along axis {axis}"
        for i in range(depth):
            part = param.detach().narrow(axis, i * width, width)
            saved = part.clone()
            with torch.no_grad():
                part.add_(1.0)
            try:
                changed = run()
            finally:
                with torch.no_grad():
                    part.copy_(saved)
            below = all(torch.equal(a, b) for a, b in zip(base[:i], changed[:i], strict=True))
            if not below or torch.equal(base[i], changed[i]):
                what = "changes an earlier layer" if not below else f"leaves layer {i} as it was"
                return (
                    f"{name} changes shape with the depth, but on the tiny instance its part {i} of {depth} "
                    f"along axis {axis} is not read by layer {i} (a change to it {what}), so otdus cannot "
                    "tell which part a new layer reads"
                )
    return None
