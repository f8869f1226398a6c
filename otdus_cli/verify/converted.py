"""Decoder-layer tensors transformers computes from other checkpoint tensors when loading.

transformers 5 converts some checkpoints' tensors when loading (its conversion mapping): OLMo hybrid's
and Kimi Linear's ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d`` concatenated into one ``conv1d``, Sarvam's
fused ``query_key_value`` split into ``q_proj`` / ``k_proj`` / ``v_proj``, LARA's ``in_proj`` split four
ways ... and saves them back in the stored form, so a checkpoint holds no tensor under the module's name.
The streamed evaluator gets such tensors the way ``from_pretrained`` does: transformers' own converters
(matched by its own key renaming, run by its own ops) on the stored tensors, one layer at a time; nothing
is listed here. transformers 4 has no conversion: it stores and loads tensors as named.

The stored tensors of one conversion are read whole (a fused q/k/v matrix, a layer's convolutions).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Conversion:
    """One of transformers' converters as loading applies it: ``stored`` tensors (checkpoint names, in
    the order transformers collects them, each with the converter pattern it matched) in, module tensors
    out (``outputs``, by full module name)."""

    converter: object  # a transformers WeightConverter, not yet fed (a fresh copy runs each time)
    first_target: str  # the module name transformers files the conversion under
    stored: list[tuple[str, str]]
    outputs: dict[str, object]  # full module name -> its shape (or what the caller files it under)
    layer_name: str = ""  # the decoder layer's module name, where the conversion makes its tensors

    def run(
        self,
        model: nn.Module,
        read: Callable[[str], torch.Tensor],
        layer: tuple[str, nn.Module] | None = None,
    ) -> dict[str, torch.Tensor]:
        """The module tensors, from the stored tensors ``read`` returns (full module name -> tensor);
        ``layer``: (name, module) of the decoder layer they belong to, where ``model`` holds a stand-in
        in its place."""
        if layer is not None:
            model = _WithLayer(model, *layer)
        converter = copy.deepcopy(self.converter)
        for name, pattern in self.stored:
            converter.add_tensor(self.first_target, name, pattern, read(name))
        out = converter.convert(self.first_target, model=model, config=model.config)
        return {name: value[0] if isinstance(value, list) else value for name, value in out.items()}


class _WithLayer:
    """A model as a converter sees it, with decoder layer ``name`` reachable again (the streamed
    evaluator's model holds a stand-in there): some ops size their outputs by the module's parameters
    (``Split``)."""

    def __init__(self, model: nn.Module, name: str, layer: nn.Module):
        self._model, self._prefix, self._layer = model, name + ".", layer

    def get_parameter(self, target: str) -> nn.Parameter:
        if target.startswith(self._prefix):
            return self._layer.get_parameter(target.removeprefix(self._prefix))
        return self._model.get_parameter(target)

    def __getattr__(self, attr: str):
        return getattr(self._model, attr)


class LoadConversions:
    """transformers' conversion mapping for ``model`` (asked once, when first needed): which of a
    layer's leftover checkpoint tensors it converts into which module tensors."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._mapping: tuple | None = None

    def _load_mapping(self) -> tuple | None:
        if self._mapping is None:
            try:
                from transformers.conversion_mapping import get_model_conversion_mapping
                from transformers.core_model_loading import WeightConverter
            except ImportError:  # transformers 4: tensors are stored and loaded as named
                self._mapping = ()
                return None
            mapping = get_model_conversion_mapping(self.model)
            converters = [t for t in mapping if isinstance(t, WeightConverter)]
            renamings = [t for t in mapping if not isinstance(t, WeightConverter)]
            self._mapping = (renamings, converters, self.model.state_dict())  # meta: names and shapes
        return self._mapping or None

    def find(
        self, stored: Iterable[str], meta: Callable[[str], tuple[tuple[int, ...], torch.dtype]]
    ) -> list[Conversion]:
        """The conversions that make module tensors from checkpoint tensors ``stored`` (names left over
        once the tensors stored as named are placed; ``meta`` gives a name's shape and dtype), each tried
        on meta tensors to learn what it yields; empty where none applies."""
        mapping = self._load_mapping()
        if mapping is None:
            return []
        from transformers.core_model_loading import dot_natural_key, rename_source_key

        renamings, converters, in_model = mapping
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        prefix = self.model.base_model_prefix
        groups: dict[str, Conversion] = {}
        for name in sorted(stored, key=dot_natural_key):  # the order transformers collects them in
            target, pattern = rename_source_key(name, renamings, converters, prefix, in_model)
            if pattern is not None and target in in_model:
                group = groups.setdefault(target, Conversion(by_pattern[pattern], target, [], {}))
                group.stored.append((name, pattern))

        def on_meta(name: str) -> torch.Tensor:
            shape, dtype = meta(name)
            return torch.empty(shape, dtype=dtype, device="meta")

        found = []
        for group in groups.values():
            try:
                out = group.run(self.model, on_meta)
            except Exception:  # an op that cannot run on meta tensors, or a group missing its partners
                continue
            group.outputs = {name: tuple(value.shape) for name, value in out.items()}
            if all(name in in_model for name in group.outputs):
                found.append(group)
        return found
