"""Stand-ins for the decoder layers inside the family's own forward, and what flows between layers.

The streamed evaluator swaps a model's decoder layers for ``LayerStandIn`` s, so the family's
``forward`` still computes everything around the layers (embeddings, position ids, rotary tables,
masks, the final norm, the head). A shared ``LayerCalls`` tells the stand-ins what to do with each call:
record its keyword arguments (to replay them to the real layer later), inject final hidden states (the
head pass), or hand the call to the real layer (a forward in one call, each layer loaded on demand).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from otdus_cli.errors import OtdusError
from otdus_cli.verify import hf_compat


@dataclass(frozen=True)
class LayerOutputRef:
    """Item ``item`` (>= 1) of decoder layer ``layer``'s output, as a stand-in returns it while recording:
    what a forward hands from one layer to the next (GLM-MoE-DSA's top-k indices) is recorded as this
    and replaced by the real layer's value when the receiving layer runs (``resolve_refs``)."""

    layer: int
    item: int


def refs_in(kwargs: dict) -> bool:
    """Whether a layer's recorded arguments take an item of an earlier layer's output."""
    return any(isinstance(v, LayerOutputRef) for v in kwargs.values())


def resolve_refs(kwargs: dict, carried: tuple[int, tuple] | None) -> dict:
    """A layer's recorded arguments with each ``LayerOutputRef`` replaced by that item of the real output
    ``carried`` holds: (the index of the layer run last, its output's items after the hidden states)."""
    if not refs_in(kwargs):
        return kwargs
    out = dict(kwargs)
    for name, value in kwargs.items():
        if isinstance(value, LayerOutputRef):
            if carried is None or carried[0] != value.layer:
                raise OtdusError(
                    f"decoder layer {value.layer}'s output is passed on further than to the next layer "
                    "(not supported for streaming)"
                )
            out[name] = carried[1][value.item - 1]
    return out


@dataclass
class LayerCalls:
    """What the stand-ins do with a call ("record", "inject" or "delegate") and what they collect."""

    mode: str = "record"
    first_input: torch.Tensor | None = None
    kwargs: dict[int, dict] = field(default_factory=dict)
    last_index: int = -1
    final_hidden: torch.Tensor | None = None
    # (hidden_states, kwargs) -> real layer 0's output on them; None until learned
    learn_output: Callable[[torch.Tensor, dict], object] | None = None
    output_items: int | None = None  # see hf_compat.output_items; None until learned
    delegate: Callable[[int, torch.Tensor, dict], object] | None = None


class LayerReachedInto(OtdusError, AttributeError):
    """The family's forward asked a stand-in for a part of the real layer (a submodule, a parameter):
    an AttributeError still, so ``hasattr`` and ``getattr`` with a default see a plain absence."""


class LayerStandIn(nn.Module):
    """Takes a decoder layer's place inside the family's forward.

    mode "record": remember the call's keyword arguments (masks, rotary embeddings, ...) and, for the
    first layer, its input (the embeddings); pass the hidden states through.
    mode "inject": the last layer returns the given final hidden states instead of its input.
    mode "delegate": hand the call to the real layer (``LayerCalls.delegate``) and return what it returns.
    Outside "delegate", the hidden states are returned the way the real layers return them (a tensor or
    a tuple, with a ``LayerOutputRef`` for each other item), which the first recording learns from real
    layer 0 (``LayerCalls.learn_output``). A forward that does more with a layer than call it with the
    hidden states (reads its weights, gives its first parameter a second stream) is refused in words.
    """

    def __init__(self, index: int, real: nn.Module, calls: LayerCalls):
        super().__init__()
        self.index = index
        self._calls = calls
        self._real_class = type(real).__name__
        # the real layer's parameters after hidden_states, for forwards that pass them by position
        # (GPT-2's blocks: past_key_values, cache_position, attention_mask ...)
        self._first, *self._positional = [*inspect.signature(real.forward).parameters] or [None]
        # the real layer's submodules, parameters and buffers, which a stand-in does not hold
        self._real_parts = frozenset(real._modules) | frozenset(real._parameters) | frozenset(real._buffers)
        # attributes some forwards read from the layer object (attention_type, layer_idx, Nemotron-H's
        # block_type ...): every plain setting of the real layer, copied, not owned; its class's too
        # (Inkling 2's attention_type), but for those every module has
        settings = {
            name: value
            for cls in reversed(type(real).__mro__)
            if not issubclass(nn.Module, cls)
            for name, value in vars(cls).items()
        }
        for name, value in {**settings, **real.__dict__}.items():
            plain = isinstance(value, str | int | float | bool) or value is None
            if plain and not name.startswith("_") and name not in ("training", "index"):
                setattr(self, name, value)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name not in self.__dict__.get("_real_parts", ()):
                raise
        raise LayerReachedInto(
            f"the model's forward reads {name} of decoder layer {self.index} ({self._real_class}) itself, "
            "not only calling the layer (as a forward that rescales its layers' weights does): the "
            "layer-by-layer evaluator holds no layer outside its call, so it cannot evaluate this model",
            name=name,
            obj=self,
        )

    def forward(self, hidden_states, *args, **kwargs):
        calls = self._calls
        if args:
            if len(args) > len(self._positional) or set(self._positional[: len(args)]) & set(kwargs):
                raise OtdusError("decoder layer called with positional arguments its forward does not name")
            kwargs = {**dict(zip(self._positional, args, strict=False)), **kwargs}
        if self._first in kwargs:
            # the forward names the hidden states and gives the layer's first parameter something else
            raise OtdusError(
                f"decoder layer {self.index} ({self._real_class}) takes {self._first} before its hidden "
                f"states, and the model's forward passes both: two streams of states go through its layers "
                "(reversible layers), and the layer-by-layer evaluator carries one, so it cannot evaluate "
                "this model"
            )
        if calls.mode == "delegate":
            return calls.delegate(self.index, hidden_states, kwargs)
        if calls.mode == "record":
            if self.index == 0:
                calls.first_input = hidden_states
                if calls.output_items is None:
                    calls.output_items = hf_compat.output_items(calls.learn_output(hidden_states, kwargs))
            calls.kwargs[self.index] = kwargs
        elif calls.mode == "inject" and self.index == calls.last_index:
            hidden_states = calls.final_hidden
        return hf_compat.as_layer_output(
            hidden_states, calls.output_items or 0, lambda k: LayerOutputRef(self.index, k)
        )


@dataclass
class Activations:
    """Hidden states of every evaluation window, grouped in batches of equal length."""

    groups: list[list[int]]  # window indices per batch
    inputs: list[torch.Tensor]  # [B, T] token ids per batch (on the compute device)
    hidden: list[torch.Tensor]  # [B, T, H] per batch (on the activation device)
    layer_kwargs: list[dict[int, dict] | None]  # per batch: layer index -> forward kwargs (None: recompute)
    layers_done: int = 0
    check: CheckBatch | None = None  # the self-check's input, carried along beside the windows
    # per batch: (the layer run last, its output's items after the hidden states), where later layers
    # take some of them (see LayerOutputRef); None otherwise
    carried: list[tuple[int, tuple] | None] = field(default_factory=list)


@dataclass
class CheckBatch:
    """The self-check's input (not a window of the plan): run through every layer like the windows,
    then its logits are compared with ``reference`` (transformers' own, computed ``how``)."""

    ids: torch.Tensor  # [1, T]
    hidden: torch.Tensor  # [1, T, H]
    layer_kwargs: dict[int, dict]
    reference: torch.Tensor  # [T, V] on the CPU
    how: str
    carried: tuple[int, tuple] | None = None  # as Activations.carried


def tensor_bytes(obj, seen: set[int] | None = None) -> int:
    """Bytes held by the tensors inside nested dicts/lists/tuples, each tensor counted once."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        if id(obj) in seen:
            return 0
        seen.add(id(obj))
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in obj)
    return 0


def same_values(a, b) -> bool:
    """Whether two recorded arguments (nested dicts/lists/tuples of tensors and plain values) hold the same
    values: tensors of one dtype, shape and device, equal element for element; other objects equal, or
    the same object where they cannot say (a NaN, an object without ``==``: not the same)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device)
            and torch.equal(a, b)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_values(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_values, a, b))
    if a is b:
        return True
    try:
        return (a == b) is True
    except Exception:  # an object whose == raises: told apart
        return False
