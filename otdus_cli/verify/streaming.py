"""Layer-by-layer evaluation of a checkpoint with the model's own transformers classes.

The model is instantiated with its parameters on the meta device (no memory, no trust_remote_code) and
its buffers as its constructors compute them (rotary frequencies, embedding scales: see ``hf_compat``,
which holds every transformers-version detail the evaluator relies on). Its decoder layers are
swapped for light stand-ins (``layer_calls``), so the family's own ``forward`` still computes everything
around the layers: embeddings (Gemma's scaling included), position ids, rotary embeddings (per layer
type for Gemma 3), causal / sliding-window masks from transformers' masking utilities, the final norm,
the LM head and logit soft-capping (``head_pass``). The stand-ins record the arguments each layer
receives; the real layers are then materialised one at a time from the checkpoint
(``checkpoint_weights``), run over every window's hidden states with exactly those arguments, and freed.

Peak memory: one decoder layer (or the embeddings, or the head: the shell is loaded in two stages,
the input embeddings for the first step and the final norm + head for the logits, so an untied head
and embedding matrix are never held together), the per-window hidden states, and one chunk of
logits (positions are scored in chunks of at most ``head_pass.DEFAULT_MAX_LOGITS_BYTES``), plus
the buffer tensors are read into (the largest tensor read whole, at most 64 MiB in the compute dtype).
Departures: stored tensors that transformers converts when loading (``converted``) are read whole; a
forward that takes token ids only (CPM-Ant) is scored a batch at a time, embeddings and head loaded.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from otdus_cli.arch.derived import layer_lists
from otdus_cli.arch.hf_config import transformers_config
from otdus_cli.arch.rope_base import with_legacy_rope
from otdus_cli.device import resolve_device
from otdus_cli.errors import OtdusError
from otdus_cli.io.reader import CheckpointReader, read_json_object
from otdus_cli.verify import hf_compat
from otdus_cli.verify.batching import auto_windows_per_batch, group_windows, layer_call_flop
from otdus_cli.verify.checkpoint_weights import CheckpointWeights
from otdus_cli.verify.head_pass import iter_logits
from otdus_cli.verify.layer_calls import (
    Activations,
    CheckBatch,
    LayerCalls,
    LayerStandIn,
    refs_in,
    resolve_refs,
    same_values,
    tensor_bytes,
)
from otdus_cli.verify.progress import LayerTicks, Progress

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype.lower()]
    except KeyError:
        raise OtdusError(f"unknown dtype {dtype!r}; use one of {', '.join(sorted(DTYPES))}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for torch.float32: how reports name a dtype."""
    return str(dtype).replace("torch.", "")


class StreamedModel:
    """A causal LM evaluated one decoder layer at a time, straight from a checkpoint folder.

    ``weights`` (a :class:`CheckpointWeights`) puts layers and the shell on the device and frees them;
    ``calls`` (a :class:`LayerCalls`) steers the stand-ins inside the family's forward.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | CheckpointReader,
        *,
        device: str | torch.device | None = "cpu",
        dtype: str | torch.dtype = torch.float32,
        attn_implementation: str | None = None,
        batch_size: int | None = 1,
        activation_device: str | torch.device | None = None,
        kwargs_budget: int = 512 * 2**20,
        self_check: str = "off",
    ):
        from transformers import AutoConfig  # heavy import

        self.reader = model if isinstance(model, CheckpointReader) else CheckpointReader(model)
        self.folder = Path(self.reader.folder)
        self.device = resolve_device(device)
        self.dtype = parse_dtype(dtype)
        self.activation_device = resolve_device(activation_device) if activation_device else self.device
        # windows per forward pass; None: as many as batching.AUTO_BATCH_TOKENS / _TEMP_BYTES allow
        self.batch_size = None if batch_size is None else max(1, int(batch_size))
        self.kwargs_budget = kwargs_budget  # bytes of recorded masks/rotary tables kept between layers
        # "on": the next start() adds the self-check (see verify.self_check); "whole-model": only if the
        # model is small enough for the whole-model reference
        if self_check not in ("off", "on", "whole-model"):
            raise ValueError(f"self_check must be off, on or whole-model, not {self_check!r}")
        self.self_check = self_check
        # whether the head pass can give the forward placeholder embeddings (head_pass.takes_embeddings)
        self.head_takes_embeddings: bool | None = None
        # the config object transformers must be given (None: config.json read as it is)
        self.stated_config = None
        self._check_pending = self_check != "off"
        try:
            # a config saved by transformers 5 states its RoPE only in rope_parameters, which 4.57
            # ignores: read with the fields otdus writes beside it, base and output mean the same
            stated = read_json_object(self.folder / "config.json")
            if with_legacy_rope(stated) != stated:
                config = transformers_config(with_legacy_rope(stated))
                self.stated_config = copy.deepcopy(config)
            else:
                config = AutoConfig.from_pretrained(self.folder, trust_remote_code=False)
        except Exception as exc:  # unknown model_type, invalid fields, ...
            raise OtdusError(f"transformers cannot read {self.folder}/config.json: {exc}") from None
        self.attn_implementation = attn_implementation
        self.model, buffer_values = hf_compat.build_skeleton(config, self.dtype, attn_implementation)
        self.model.eval()
        self.config = self.model.config
        # a multimodal wrapper's sizes (hidden, heads, experts, vocabulary) are its text model's
        self.text_config = self.config.get_text_config()
        self.decoder, holder, layers_name = self._find_decoder()
        layers = list(getattr(holder, layers_name))
        self.num_layers = len(layers)
        if self.num_layers == 0:
            raise OtdusError(f"{self.folder} has no decoder layers")
        self.weights = CheckpointWeights(
            self.reader,
            self.model,
            holder,
            layers_name,
            layers,
            buffer_values,
            self.device,
            self.text_config,
        )
        self.calls = LayerCalls(last_index=self.num_layers - 1, learn_output=self._layer0_output)
        setattr(
            holder,
            layers_name,
            nn.ModuleList(LayerStandIn(i, layer, self.calls) for i, layer in enumerate(layers)),
        )
        # decoder layers the family's forward skips on text-only input (Mllama's cross-attention layers
        # without an image): learned at the first recording, passed through by apply_layer
        self.skipped_layers: frozenset[int] | None = None
        # whether the forward hands items of a layer's output to the next layer (see LayerOutputRef):
        # learned at the first recording too
        self.passes_outputs = False

    def _find_decoder(self) -> tuple[nn.Module, nn.Module, str]:
        """The module whose forward runs the decoder layers from token ids, the module holding their
        list, and the list's name in it: ``.model`` and its ``layers`` for most (a wrapper's language
        model, an encoder-decoder's decoder); else the base model and its one module list of that depth
        outside vision and audio towers (GPT-2's ``transformer.h``, RoBERTa's ``roberta.encoder.layer``)."""
        inner = getattr(self.model, "model", None)
        candidates = [inner, getattr(inner, "language_model", None)]  # a causal LM's; a wrapper's
        with contextlib.suppress(Exception):  # best effort: some wrappers raise
            candidates.append(self.model.get_decoder())
        for cand in candidates:
            if isinstance(cand, nn.Module) and isinstance(getattr(cand, "layers", None), nn.ModuleList):
                return cand, cand, "layers"
        base = getattr(self.model, "base_model", None)
        depth = getattr(self.model.config.get_text_config(), "num_hidden_layers", None)
        if isinstance(base, nn.Module) and base is not self.model:
            lists = layer_lists(base, depth)
            if len(lists) == 1:
                holder, _, name = lists[0].rpartition(".")
                return base, base.get_submodule(holder), name
        raise OtdusError(
            f"{type(self.model).__name__}: cannot find its decoder layers (.model.layers, or one list of "
            f"{depth} modules in its base model)"
        )

    def _layer0_output(self, hidden_states: torch.Tensor, kwargs: dict):
        """Real layer 0's output on its first recorded call: how the stand-ins must return."""
        layer = self.weights.load_layer(0)
        try:
            return layer(hidden_states, **kwargs)
        finally:
            self.weights.free_layer(0)

    # -- sizes --------------------------------------------------------------------------------------
    def windows_per_batch(self, length: int) -> int:
        """The explicit batch size, else the automatic one for windows of ``length`` tokens."""
        if self.batch_size is not None:
            return self.batch_size
        shapes = self.weights.layer_shapes
        return auto_windows_per_batch(length, shapes, self.dtype, self.config, self.text_config)

    def layer_call_flop(self, windows: int, length: int) -> float:
        """Floating-point operations of one decoder-layer call (see ``batching.layer_call_flop``)."""
        hidden = int(getattr(self.text_config, "hidden_size", 0) or 0)
        return layer_call_flop(windows, length, self.weights.largest_layer_numel, hidden)

    # -- the layer-by-layer forward -------------------------------------------------------------
    @torch.inference_mode()
    def start(self, inputs: Sequence[Sequence[int]]) -> Activations:
        """Embed every window (token id lists) and record each layer's forward arguments."""
        if not inputs:
            raise OtdusError("nothing to evaluate (no windows)")
        groups = group_windows([len(x) for x in inputs], self.windows_per_batch)
        reference = None
        if self._check_pending:  # once per model: the first window's start, as a batch of its own
            from otdus_cli.verify.self_check import SELF_CHECK_TOKENS, reference_logits

            self._check_pending = False
            check_ids = list(inputs[0])[:SELF_CHECK_TOKENS]
            reference = reference_logits(self, check_ids, whole_model_only=self.self_check == "whole-model")
        self.weights.load_shell("embed")
        acts = Activations(groups=groups, inputs=[], hidden=[], layer_kwargs=[])
        if reference is not None:
            ids = torch.tensor([check_ids], dtype=torch.long, device=self.device)
            embedded, kwargs = self._record(ids)
            acts.check = CheckBatch(ids, embedded.to(self.activation_device), kwargs, *reference)
        by_shape: dict[tuple[int, int], dict[int, dict]] = {}
        kept_bytes = 0
        for group in groups:
            ids = torch.tensor([list(inputs[i]) for i in group], dtype=torch.long, device=self.device)
            embedded, kwargs = self._record(ids)
            acts.inputs.append(ids)
            acts.hidden.append(embedded.to(self.activation_device))
            acts.carried.append(None)
            # masks and rotary tables depend only on the batch shape here (no padding, no cache): one
            # batch's serve every batch of its shape where equal to its own (not per-layer inputs made
            # from the tokens: Gemma 4's); kwargs beyond the budget (explicit masks of eager attention,
            # of many shapes) are recomputed when needed instead of kept
            shape = tuple(ids.shape)
            if shape in by_shape and same_values(by_shape[shape], kwargs):
                acts.layer_kwargs.append(by_shape[shape])
            elif kept_bytes + tensor_bytes(kwargs) <= self.kwargs_budget:
                by_shape.setdefault(shape, kwargs)
                kept_bytes += tensor_bytes(kwargs)
                acts.layer_kwargs.append(kwargs)
            else:
                acts.layer_kwargs.append(None)
        if all(k is not None for k in acts.layer_kwargs):
            # the embeddings (GBs for large vocabularies) are not needed again: the layer loop holds
            # one layer and the activations; iter_logits loads the final norm and the head
            self.weights.free_shell()
        return acts

    def _record(self, ids: torch.Tensor) -> tuple[torch.Tensor, dict[int, dict]]:
        """Run the family's forward with the stand-ins: (embeddings, per-layer forward kwargs)."""
        calls = self.calls
        calls.mode, calls.first_input, calls.kwargs = "record", None, {}
        try:
            self.decoder(input_ids=ids, use_cache=False, **hf_compat.logits_only(self.decoder))
            if calls.first_input is None:
                raise OtdusError(f"{type(self.model).__name__}: its forward did not call decoder layer 0")
            skipped = frozenset(range(self.num_layers)) - set(calls.kwargs)
            if self.skipped_layers is None:
                self.skipped_layers = skipped
                self.passes_outputs = any(refs_in(kwargs) for kwargs in calls.kwargs.values())
                calls.last_index = max(calls.kwargs)  # the final hidden states are injected there
            elif skipped != self.skipped_layers:
                raise OtdusError(
                    f"{type(self.model).__name__}: its forward called other decoder layers for other inputs"
                )
            return calls.first_input, calls.kwargs
        finally:
            calls.first_input, calls.kwargs = None, {}

    @torch.inference_mode()
    def apply_layer(
        self,
        index: int,
        acts: Activations,
        layer: nn.Module | None = None,
        on_batch: Callable[[int, int], None] | None = None,
    ) -> None:
        """Run decoder layer ``index`` (already loaded, or loaded and freed here) over every window;
        ``on_batch`` is told the windows and tokens done after each batch."""
        if self.skipped_layers and index in self.skipped_layers:  # the forward passes it by: so do we
            acts.layers_done = max(acts.layers_done, index + 1)
            return
        own = layer is None
        if own:
            layer = self.weights.load_layer(index)
        try:
            done = tokens = 0
            for g, hidden in enumerate(acts.hidden):
                kwargs = acts.layer_kwargs[g]
                if kwargs is None:
                    self.weights.load_shell("embed")  # recording runs the embeddings again
                    kwargs = self._record(acts.inputs[g])[1]
                out, acts.carried[g] = self._call_layer(index, layer, hidden, kwargs[index], acts.carried[g])
                acts.hidden[g] = out.to(self.activation_device)
                done += len(acts.groups[g])
                tokens += acts.inputs[g].numel()
                if on_batch is not None:
                    on_batch(done, tokens)
            if (check := acts.check) is not None:
                out, check.carried = self._call_layer(
                    index, layer, check.hidden, check.layer_kwargs[index], check.carried
                )
                check.hidden = out.to(self.activation_device)
        finally:
            if own:
                self.weights.free_layer(index)
        acts.layers_done = max(acts.layers_done, index + 1)

    def _call_layer(
        self,
        index: int,
        layer: nn.Module,
        hidden: torch.Tensor,
        kwargs: dict,
        carried: tuple[int, tuple] | None,
    ) -> tuple[torch.Tensor, tuple[int, tuple] | None]:
        """Real layer ``index`` on one batch: (its hidden states, what of its output the next layer takes:
        see ``LayerOutputRef``; None when the forward passes none on)."""
        out = layer(hidden.to(self.device), **resolve_refs(kwargs, carried))
        passed_on = isinstance(out, tuple) and len(out) > 1 and self.passes_outputs
        return hf_compat.hidden_states_of(out), (index, out[1:]) if passed_on else None

    def run(self, inputs: Sequence[Sequence[int]], progress: Progress | None = None) -> Activations:
        """Every layer, in order, over every window."""
        acts = self.start(inputs)
        ticks = LayerTicks(progress, len(inputs), sum(len(x) for x in inputs), self.num_layers)
        for i in range(self.num_layers):
            self.apply_layer(i, acts, on_batch=ticks.layer(i))
        return acts

    def logits(self, inputs: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Full logits [T, V] for each window (for checks on small models)."""
        acts = self.run(inputs)
        pieces: list[list[torch.Tensor]] = [[] for _ in inputs]
        for group, _, logits in iter_logits(self, acts):
            for row, i in enumerate(group):
                pieces[i].append(logits[row])
        return [p[0] if len(p) == 1 else torch.cat(p) for p in pieces]
