"""Layer-by-layer evaluation of a checkpoint with the model's own transformers classes.

The model is instantiated with its parameters on the meta device (no memory, no trust_remote_code) and
its buffers as its constructors compute them (rotary frequencies, embedding scales: see ``hf_compat``,
which holds every transformers-version detail the evaluator relies on). Its decoder layers are
swapped for light stand-ins, so the family's own ``forward`` still computes everything around the
layers: embeddings (Gemma's scaling included), position ids, rotary embeddings (per layer type for
Gemma 3), causal / sliding-window masks from transformers' masking utilities, the final norm, the
LM head and logit soft-capping. The stand-ins record the arguments each layer receives; the real
layers are then materialised one at a time from the checkpoint, run over every window's hidden
states with exactly those arguments, and freed.

Peak memory: one decoder layer (or the embeddings, or the head: the shell is loaded in two stages,
the input embeddings for the first step and the final norm + head for the logits, so an untied head
and embedding matrix are never held together), the per-window hidden states, and one chunk of
logits (positions are scored in chunks of at most ``max_logits_bytes``).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from otdus_cli.arch.wrappers import text_model_prefix
from otdus_cli.device import resolve_device
from otdus_cli.errors import OtdusError
from otdus_cli.io.reader import CheckpointReader
from otdus_cli.verify import hf_compat
from otdus_cli.verify.progress import LayerTicks, Progress

# Large tensors are copied from disk in blocks of this size (float32 destination bytes).
_COPY_BLOCK_BYTES = 64 * 2**20
# Logits of one scoring step: 64 MiB is ~128 positions of a 128k vocabulary in float32.
DEFAULT_MAX_LOGITS_BYTES = 64 * 2**20
# Automatic batches (batch_size=None): windows of one length are stacked until a batch holds this many
# tokens (a layer call then lasts long enough that its Python and thread start-up costs vanish: 32
# windows of 512 tokens, as a plain forward would be batched) ...
AUTO_BATCH_TOKENS = 16384
# ... or until the layer's largest intermediate results would take this many bytes.
AUTO_BATCH_TEMP_BYTES = 256 * 2**20

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


class _LayerStandIn(nn.Module):
    """Takes a decoder layer's place inside the family's forward.

    mode "record": remember the call's keyword arguments (masks, rotary embeddings, ...) and, for the
    first layer, its input (the embeddings); pass the hidden states through.
    mode "inject": the last layer returns the given final hidden states instead of its input.
    mode "delegate": hand the call to the real layer (``_Hub.delegate``) and return what it returns.
    Outside "delegate", the hidden states are returned the way the real layers return them (a tensor or
    a 1-tuple), which the first recording learns from real layer 0 (``_Hub.learn_output``).
    """

    def __init__(self, index: int, real: nn.Module, hub: _Hub):
        super().__init__()
        self.index = index
        self._hub = hub
        # the real layer's parameters after hidden_states, for forwards that pass them by position
        # (GPT-2's blocks: past_key_values, cache_position, attention_mask ...)
        self._positional = list(inspect.signature(real.forward).parameters)[1:]
        # attributes some forwards read from the layer object (attention_type, layer_idx, Nemotron-H's
        # block_type ...): every plain setting of the real layer, copied, not owned
        for name, value in real.__dict__.items():
            plain = isinstance(value, str | int | float | bool) or value is None
            if plain and not name.startswith("_") and name not in ("training", "index"):
                setattr(self, name, value)

    def forward(self, hidden_states, *args, **kwargs):
        hub = self._hub
        if args:
            if len(args) > len(self._positional) or set(self._positional[: len(args)]) & set(kwargs):
                raise OtdusError("decoder layer called with positional arguments its forward does not name")
            kwargs = {**dict(zip(self._positional, args, strict=False)), **kwargs}
        if hub.mode == "delegate":
            return hub.delegate(self.index, hidden_states, kwargs)
        if hub.mode == "record":
            if self.index == 0:
                hub.first_input = hidden_states
                if hub.output_is_tuple is None:
                    hub.output_is_tuple = hf_compat.returns_tuple(hub.learn_output(hidden_states, kwargs))
            hub.kwargs[self.index] = kwargs
        elif hub.mode == "inject" and self.index == hub.last_index:
            hidden_states = hub.final_hidden
        return hf_compat.as_layer_output(hidden_states, bool(hub.output_is_tuple))


@dataclass
class _Hub:
    mode: str = "record"
    first_input: torch.Tensor | None = None
    kwargs: dict[int, dict] = field(default_factory=dict)
    last_index: int = -1
    final_hidden: torch.Tensor | None = None
    # (hidden_states, kwargs) -> real layer 0's output on them; None until learned
    learn_output: Callable[[torch.Tensor, dict], object] | None = None
    output_is_tuple: bool | None = None
    delegate: Callable[[int, torch.Tensor, dict], object] | None = None


@dataclass
class Activations:
    """Hidden states of every evaluation window, grouped in batches of equal length."""

    groups: list[list[int]]  # window indices per batch
    inputs: list[torch.Tensor]  # [B, T] token ids per batch (on the compute device)
    hidden: list[torch.Tensor]  # [B, T, H] per batch (on the activation device)
    layer_kwargs: list[dict[int, dict] | None]  # per batch: layer index -> forward kwargs (None: recompute)
    layers_done: int = 0
    check: CheckBatch | None = None  # the self-check's input, carried along beside the windows


@dataclass
class CheckBatch:
    """The self-check's input (not a window of the plan): run through every layer like the windows,
    then its logits are compared with ``reference`` (transformers' own, computed ``how``)."""

    ids: torch.Tensor  # [1, T]
    hidden: torch.Tensor  # [1, T, H]
    layer_kwargs: dict[int, dict]
    reference: torch.Tensor  # [T, V] on the CPU
    how: str


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


def _tensor_bytes(obj, seen: set[int] | None = None) -> int:
    """Bytes held by the tensors inside nested dicts/lists/tuples, each tensor counted once."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        if id(obj) in seen:
            return 0
        seen.add(id(obj))
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, seen) for v in obj)
    return 0


def _non_persistent_keys(module: nn.Module) -> set[str]:
    keys = set()
    for name, sub in module.named_modules():
        for buf in sub._non_persistent_buffers_set:
            keys.add(f"{name}.{buf}" if name else buf)
    return keys


# Per-expert on-disk names of transformers' fused expert tensors (gate, up, down), per layout.
_EXPERT_LAYOUTS = (
    ("mlp.experts.", ("gate_proj", "up_proj", "down_proj")),
    ("block_sparse_moe.experts.", ("w1", "w3", "w2")),  # Mixtral
)


def _disk_sources(prefix: str, key: str, on_disk: set[str], n_experts: int | None) -> tuple[str, ...] | None:
    """Names on disk that make up module tensor ``key`` of the layer at ``prefix``: the same name, the
    Mixtral ``block_sparse_moe`` spelling, or per-expert matrices of a fused experts tensor."""
    if prefix + key in on_disk:
        return (prefix + key,)
    alias = key.replace("mlp.", "block_sparse_moe.", 1) if key.startswith("mlp.") else None
    if alias and prefix + alias in on_disk:
        return (prefix + alias,)
    if not n_experts or key not in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
        return None
    for base, (gate, up, down) in _EXPERT_LAYOUTS:
        names = [gate, up] if key.endswith("gate_up_proj") else [down]
        sources = tuple(f"{prefix}{base}{e}.{w}.weight" for w in names for e in range(n_experts))
        if all(s in on_disk for s in sources):
            return sources
    return None


class StreamedModel:
    """A causal LM evaluated one decoder layer at a time, straight from a checkpoint folder."""

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
        from transformers import AutoConfig  # noqa: PLC0415 - heavy import

        self.reader = model if isinstance(model, CheckpointReader) else CheckpointReader(model)
        self.folder = Path(self.reader.folder)
        self.device = resolve_device(device)
        self.dtype = parse_dtype(dtype)
        self.activation_device = resolve_device(activation_device) if activation_device else self.device
        # windows per forward pass; None: as many as AUTO_BATCH_TOKENS / AUTO_BATCH_TEMP_BYTES allow
        self.batch_size = None if batch_size is None else max(1, int(batch_size))
        self.kwargs_budget = kwargs_budget  # bytes of recorded masks/rotary tables kept between layers
        # "on": the next start() adds the self-check (see verify.self_check); "whole-model": only if the
        # model is small enough for the whole-model reference
        if self_check not in ("off", "on", "whole-model"):
            raise ValueError(f"self_check must be off, on or whole-model, not {self_check!r}")
        self.self_check = self_check
        self._check_pending = self_check != "off"
        try:
            config = AutoConfig.from_pretrained(self.folder, trust_remote_code=False)
        except Exception as exc:  # unknown model_type, invalid fields, ...
            raise OtdusError(f"transformers cannot read {self.folder}/config.json: {exc}") from None
        self.attn_implementation = attn_implementation
        self.model, self._buffer_values = hf_compat.build_skeleton(config, self.dtype, attn_implementation)
        # tied name -> its source; a stored tied copy is its own tensor where transformers loads it so
        self.model.eval()
        self.config = self.model.config
        # a multimodal wrapper's sizes (hidden, heads, experts, vocabulary) are its text model's
        self.text_config = self.config.get_text_config()
        self.decoder, self._layers_name = self._find_decoder()
        self._on_disk = set(self.reader.names)
        self._disk_names = self._disk_name_rules()
        untie = hf_compat.loads_stored_tied_copies()
        self._tied = {
            target: source
            for target, source in hf_compat.tied_parameters(self.model).items()
            if not (untie and self.disk_name(target) in self._on_disk)
        }
        self.layers = list(getattr(self.decoder, self._layers_name))
        self.num_layers = len(self.layers)
        if self.num_layers == 0:
            raise OtdusError(f"{self.folder} has no decoder layers")
        self.layer_prefixes = self._layer_prefixes()
        self._check_layer_tensors()
        self._hub = _Hub(last_index=self.num_layers - 1, learn_output=self._layer0_output)
        setattr(
            self.decoder,
            self._layers_name,
            nn.ModuleList(_LayerStandIn(i, layer, self._hub) for i, layer in enumerate(self.layers)),
        )
        self._stage_skips = self._shell_stages()
        # decoder layers the family's forward skips on text-only input (Mllama's cross-attention layers
        # without an image): learned at the first recording, passed through by apply_layer
        self.skipped_layers: frozenset[int] | None = None
        self._shell_loaded: str | None = None  # "embed", "head" or "all": what is on the device

    # -- structure ------------------------------------------------------------------------------
    def _find_decoder(self) -> tuple[nn.Module, str]:
        """The module whose forward runs the decoder layers, and the name of their list in it:
        ``.model.layers`` for most; the base model's one list of that depth for others (GPT-2's
        ``transformer.h``, Bloom's ``transformer.h``)."""
        inner = getattr(self.model, "model", None)
        candidates = [inner, getattr(inner, "language_model", None)]  # a causal LM's; a wrapper's
        with contextlib.suppress(Exception):  # best effort: some wrappers raise
            candidates.append(self.model.get_decoder())
        for cand in candidates:
            if isinstance(cand, nn.Module) and isinstance(getattr(cand, "layers", None), nn.ModuleList):
                return cand, "layers"
        base = getattr(self.model, "base_model", None)
        depth = getattr(self.model.config.get_text_config(), "num_hidden_layers", None)
        if isinstance(base, nn.Module) and base is not self.model:
            lists = [n for n, m in base.named_children() if isinstance(m, nn.ModuleList) and len(m) == depth]
            if len(lists) == 1:
                return base, lists[0]
        raise OtdusError(f"{type(self.model).__name__}: cannot find its decoder layers (.model.layers)")

    def _layer_prefixes(self) -> list[str]:
        """Where each decoder layer's tensors are stored (on disk, see ``disk_name``)."""
        names = {id(m): n for n, m in self.model.named_modules()}
        return [self.disk_name(names[id(layer)] + ".") for layer in self.layers]

    def _disk_name_rules(self) -> list[tuple[str, str]]:
        """(module-name prefix, on-disk prefix) pairs for checkpoints that store the text model under
        another name than the class builds it: a wrapper saved as ``language_model.model.layers.N``
        (or ``model.layers.N``) and built as ``model.language_model.layers.N``, its head as
        ``language_model.lm_head``, its vision tower and projector at the top."""
        decoder = next(n for n, m in self.model.named_modules() if m is self.decoder) + "."
        stored = text_model_prefix(sorted(self._on_disk))
        if stored is None:
            # a class that renames its base model when loading (Nemotron-H: built as model.layers.N,
            # stored as backbone.layers.N): the one prefix its layer list is stored under
            first = f"{self._layers_name}.0."
            found = {n[: n.index(first)] for n in self._on_disk if first in n}
            found = {p for p in found if p == "" or p.endswith(".")}
            return [(decoder, found.pop())] if len(found) == 1 and decoder not in found else []
        if stored == decoder:
            return []
        text_root = stored.rsplit(".", 2)[0] + "." if stored.count(".") > 1 else ""
        return [(decoder, stored), ("lm_head.", text_root + "lm_head."), ("model.", "")]

    def disk_name(self, name: str) -> str:
        """The checkpoint's name for module tensor (or prefix) ``name``: itself when stored so, else as
        the wrapper layout rules give it (``_disk_name_rules``)."""
        if name in self._on_disk:
            return name
        for built, stored in self._disk_names:
            if name.startswith(built):
                renamed = stored + name[len(built) :]
                if renamed in self._on_disk or name.endswith("."):
                    return renamed
        return name

    def _check_layer_tensors(self) -> None:
        """Plan, for every layer, where each of its tensors comes from on disk; refuse unknown layouts."""
        on_disk = self._on_disk
        self._recipes = []
        for prefix, layer in zip(self.layer_prefixes, self.layers, strict=True):
            recipe: dict[str, tuple[str, ...]] = {}
            for key in layer.state_dict():
                if key in _non_persistent_keys(layer):
                    continue
                sources = _disk_sources(prefix, key, on_disk, self._num_experts())
                if sources is None:
                    raise OtdusError(
                        f"{self.folder.name}: tensor {prefix + key} (as named in transformers' "
                        f"{type(self.model).__name__}) not found in the checkpoint"
                    )
                recipe[key] = sources
            used = {n for names in recipe.values() for n in names}
            extra = sorted(n for n in on_disk if n.startswith(prefix) and n not in used)
            if extra:
                raise OtdusError(
                    f"{self.folder.name}: tensor {extra[0]} has no place in transformers' "
                    f"{type(self.model).__name__} (checkpoint layout not supported for streaming)"
                )
            self._recipes.append(recipe)

    def _layer_shapes(self) -> list[tuple[int, ...]]:
        """Shapes of the decoder layers' tensors on disk (all layers: a family may vary them)."""
        return [
            tuple(self.reader.meta(n).shape) for r in self._recipes for names in r.values() for n in names
        ]

    def layer_call_flop(self, windows: int, length: int) -> float:
        """Floating-point operations of one decoder-layer call on ``windows`` windows of ``length``
        tokens: two per weight and token (the largest layer's weights; all experts of a MoE layer, an
        upper bound), and causal attention's two products."""
        largest = max(
            sum(math.prod(self.reader.meta(n).shape) for names in r.values() for n in names)
            for r in self._recipes
        )
        hidden = int(getattr(self.text_config, "hidden_size", 0) or 0)
        return 2.0 * windows * length * (largest + length * hidden)

    def windows_per_batch(self, length: int) -> int:
        """The explicit batch size, else the automatic one for windows of ``length`` tokens."""
        if self.batch_size is not None:
            return self.batch_size
        element = torch.empty((), dtype=self.dtype).element_size()
        widest = max((max(shape[-2:]) for shape in self._layer_shapes() if len(shape) >= 2), default=1)
        per_token = 4 * widest * element  # a few intermediate results of the widest projection
        if hf_compat.attention_materialises_scores(self.config):  # eager attention: heads x T scores
            per_token += 2 * int(getattr(self.text_config, "num_attention_heads", 1) or 1) * length * element
        by_tokens = AUTO_BATCH_TOKENS // max(1, length)
        by_memory = AUTO_BATCH_TEMP_BYTES // max(1, per_token * length)
        return max(1, min(by_tokens, by_memory))

    def _num_experts(self) -> int | None:
        for attr in ("num_local_experts", "num_experts", "n_routed_experts"):
            value = getattr(self.text_config, attr, None)
            if isinstance(value, int) and value > 0:
                return value
        return None

    def _copy_from_disk(self, target: torch.Tensor, name: str) -> None:
        """target <- tensor ``name``, in row blocks, so converting a large matrix (an embedding in
        bfloat16 -> float32) never holds a second full copy of it."""
        shape = tuple(self.reader.meta(name).shape)
        if tuple(target.shape) != shape:
            raise OtdusError(
                f"{self.folder.name}: {name} has shape {shape}, config implies {tuple(target.shape)}"
            )
        row_bytes = target[0].numel() * target.element_size() if target.dim() and len(target) else 0
        if target.dim() == 0 or row_bytes * len(target) <= _COPY_BLOCK_BYTES:
            target.copy_(self.reader.get(name))
            return
        step = max(1, _COPY_BLOCK_BYTES // row_bytes)
        for start in range(0, len(target), step):
            target[start : start + step].copy_(self.reader.get_rows(name, start, start + step))

    def _fetch(self, sources: tuple[str, ...], key: str) -> torch.Tensor:
        if len(sources) == 1:
            return self.reader.get(sources[0])
        n = self._num_experts() or 0
        tensors = [self.reader.get(name) for name in sources]
        if key.endswith("gate_up_proj"):  # [E, 2I, H]: expert e = cat(gate_e, up_e) along rows
            return torch.stack([torch.cat([tensors[e], tensors[n + e]], dim=0) for e in range(n)])
        return torch.stack(tensors)  # [E, H, I] down projections

    def _materialise(
        self, module: nn.Module, prefix: str, recipe: dict[str, tuple[str, ...]] | None = None
    ) -> None:
        """Allocate ``module`` on the device and fill it from the checkpoint (tensors under ``prefix``)."""
        module.to_empty(device=self.device)
        hf_compat.restore_buffers(module, self._buffer_values)  # rotary inv_freq, Gemma's embed_scale, ...
        skip = _non_persistent_keys(module)
        targets = dict(module.named_parameters())
        targets.update(dict(module.named_buffers()))
        with torch.no_grad():
            for key, target in targets.items():
                if key in skip:
                    continue
                sources = recipe[key] if recipe is not None else (prefix + key,)
                if len(sources) == 1:
                    self._copy_from_disk(target, sources[0])
                    continue
                value = self._fetch(sources, key)
                if tuple(target.shape) != tuple(value.shape):
                    raise OtdusError(
                        f"{self.folder.name}: {prefix + key} has shape {tuple(value.shape)}, "
                        f"config implies {tuple(target.shape)}"
                    )
                target.copy_(value)

    def _shell_stages(self) -> dict[str, nn.Module | None]:
        """Per shell stage, the module that stage can leave on the meta device (none if unlisted).

        "embed" (embedding the windows) needs no LM head, "head" (the logits, fed the final hidden
        states as ``inputs_embeds``) no input embeddings; unless the two are tied (one matrix), which
        then serves both stages.
        """
        inp, out = self.model.get_input_embeddings(), self.model.get_output_embeddings()
        weight_in, weight_out = getattr(inp, "weight", None), getattr(out, "weight", None)
        if not isinstance(weight_in, nn.Parameter) or not isinstance(weight_out, nn.Parameter):
            return {}
        names = {id(m): n for n, m in self.model.named_modules()}
        pair = {names[id(inp)] + ".weight", names[id(out)] + ".weight"}
        if any({target, source} == pair for target, source in self._tied.items()):
            return {}
        return {"embed": out, "head": inp}

    def _load_shell(self, stage: str = "all") -> None:
        """The weights outside the decoder layers (embeddings, final norm, head, rotary buffers), all
        of them or those one ``stage`` needs (see ``_shell_stages``)."""
        if self._shell_loaded in (stage, "all"):
            return
        if self._shell_loaded:
            self.free_shell()
        skip = self._stage_skips.get(stage)
        skipped = {id(p) for p in skip.parameters()} if skip is not None else set()
        tied = self._tied
        # stand-ins own nothing and real layers are not children; the skipped module stays on meta
        for sub in self.model.modules():
            if sub is not skip:
                sub.to_empty(device=self.device, recurse=False)
                hf_compat.restore_buffers(sub, self._buffer_values, recurse=False)
        with torch.no_grad():
            for name, param in self.model.named_parameters(remove_duplicate=False):
                if id(param) in skipped or param.is_meta or name in tied:
                    continue
                # a tied group is read from its first name on disk (the head, if only it is stored)
                group = [self.disk_name(n) for n in [name, *(t for t, s in tied.items() if s == name)]]
                stored = next((n for n in group if n in self._on_disk), None)
                if stored is None:
                    raise OtdusError(f"{self.folder.name}: tensor {name} not found")
                self._copy_from_disk(param, stored)
            for name, buf in self.model.named_buffers():
                if self.disk_name(name) in self._on_disk:
                    buf.copy_(self.reader.get(self.disk_name(name)))
        for target, source in tied.items():  # to_empty gave each module its own copy: tie them again
            owner_name, _, attr = target.rpartition(".")
            setattr(self.model.get_submodule(owner_name), attr, self.model.get_parameter(source))
        self._shell_loaded = stage

    def free_shell(self) -> None:
        if self._shell_loaded:
            self.model.to_empty(device="meta")
            self._shell_loaded = None

    def _layer0_output(self, hidden_states: torch.Tensor, kwargs: dict):
        """Real layer 0's output on its first recorded call: how the stand-ins must return."""
        layer = self.load_layer(0)
        try:
            return layer(hidden_states, **kwargs)
        finally:
            self.free_layer(0)

    def load_layer(self, index: int) -> nn.Module:
        layer = self.layers[index]
        self._materialise(layer, self.layer_prefixes[index], self._recipes[index])
        layer.eval()
        return layer

    def free_layer(self, index: int) -> None:
        self.layers[index].to_empty(device="meta")

    # -- evaluation -------------------------------------------------------------------------------
    @torch.inference_mode()
    def start(self, inputs: Sequence[Sequence[int]]) -> Activations:
        """Embed every window (token id lists) and record each layer's forward arguments."""
        if not inputs:
            raise OtdusError("nothing to evaluate (no windows)")
        groups = group_windows([len(x) for x in inputs], self.windows_per_batch)
        reference = None
        if self._check_pending:  # once per model: the first window's start, as a batch of its own
            from otdus_cli.verify.self_check import SELF_CHECK_TOKENS, reference_logits  # noqa: PLC0415

            self._check_pending = False
            check_ids = list(inputs[0])[:SELF_CHECK_TOKENS]
            reference = reference_logits(self, check_ids, whole_model_only=self.self_check == "whole-model")
        self._load_shell("embed")
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
            # masks and rotary tables depend only on the batch shape here (no padding, no cache);
            # explicit masks (eager attention) of many shapes are recomputed when needed instead of kept
            shape = tuple(ids.shape)
            if shape not in by_shape and kept_bytes + _tensor_bytes(kwargs) <= self.kwargs_budget:
                by_shape[shape] = kwargs
                kept_bytes += _tensor_bytes(kwargs)
            acts.layer_kwargs.append(by_shape.get(shape))
        if all(k is not None for k in acts.layer_kwargs):
            # the embeddings (GBs for large vocabularies) are not needed again: the layer loop holds
            # one layer and the activations; iter_logits loads the final norm and the head
            self.free_shell()
        return acts

    def _record(self, ids: torch.Tensor) -> tuple[torch.Tensor, dict[int, dict]]:
        """Run the family's forward with the stand-ins: (embeddings, per-layer forward kwargs)."""
        hub = self._hub
        hub.mode, hub.first_input, hub.kwargs = "record", None, {}
        try:
            self.decoder(input_ids=ids, use_cache=False)
            if hub.first_input is None:
                raise OtdusError(f"{type(self.model).__name__}: its forward did not call decoder layer 0")
            skipped = frozenset(range(self.num_layers)) - set(hub.kwargs)
            if self.skipped_layers is None:
                self.skipped_layers = skipped
                hub.last_index = max(hub.kwargs)  # the final hidden states are injected there
            elif skipped != self.skipped_layers:
                raise OtdusError(
                    f"{type(self.model).__name__}: its forward called other decoder layers for other inputs"
                )
            return hub.first_input, hub.kwargs
        finally:
            hub.first_input, hub.kwargs = None, {}

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
            layer = self.load_layer(index)
        try:
            done = tokens = 0
            for g, hidden in enumerate(acts.hidden):
                kwargs = acts.layer_kwargs[g]
                if kwargs is None:
                    self._load_shell("embed")  # recording runs the embeddings again
                    kwargs = self._record(acts.inputs[g])[1]
                h = hidden.to(self.device)
                out = hf_compat.hidden_states_of(layer(h, **kwargs[index]))
                acts.hidden[g] = out.to(self.activation_device)
                done += len(acts.groups[g])
                tokens += acts.inputs[g].numel()
                if on_batch is not None:
                    on_batch(done, tokens)
            if acts.check is not None:
                out = layer(acts.check.hidden.to(self.device), **acts.check.layer_kwargs[index])
                acts.check.hidden = hf_compat.hidden_states_of(out).to(self.activation_device)
        finally:
            if own:
                self.free_layer(index)
        acts.layers_done = max(acts.layers_done, index + 1)

    @torch.inference_mode()
    def iter_logits(
        self,
        acts: Activations,
        keep: Sequence[int] | None = None,
        max_logits_bytes: int | None = None,
    ) -> Iterator[tuple[list[int], int, torch.Tensor]]:
        """Final norm + head (+ soft-capping) by the family's own forward, in position chunks.

        Yields (window indices, first position p0, logits [B, c, V]) for positions p0 .. p0 + c - 1
        of a batch, chunk after chunk, covering the last ``keep[window]`` positions (all when not
        given); a chunk's logits take at most ``max_logits_bytes`` (default DEFAULT_MAX_LOGITS_BYTES;
        at least one position). The final hidden states go in as ``inputs_embeds``, so the input
        embeddings are not needed.
        """
        self._load_shell("head")
        budget = DEFAULT_MAX_LOGITS_BYTES if max_logits_bytes is None else max_logits_bytes
        hub = self._hub
        head = self.model.get_output_embeddings()
        vocab = int(head.weight.shape[0]) if head is not None else int(self.text_config.vocab_size)
        try:
            if acts.check is not None:  # before any figure comes out
                self._self_check(acts.check)
                acts.check = None
            for g, group in enumerate(acts.groups):
                length = acts.inputs[g].shape[1]
                k = length if keep is None else max(keep[i] for i in group)
                per_position = len(group) * vocab * torch.empty((), dtype=self.dtype).element_size()
                step = max(1, budget // max(1, per_position))
                for p0 in range(length - k, length, step):
                    chunk = acts.hidden[g][:, p0 : p0 + step].to(self.device)
                    hub.mode, hub.final_hidden = "inject", chunk
                    out = self.model(
                        inputs_embeds=chunk, use_cache=False, logits_to_keep=0, **self._head_args(chunk)
                    )
                    hub.final_hidden = None
                    del chunk
                    yield group, p0, out.logits
        finally:
            hub.mode, hub.final_hidden = "record", None

    def _head_args(self, states: torch.Tensor) -> dict:
        """More arguments of the head pass (the final hidden states injected, the layers' inputs unused):
        a wrapper gets plain position ids, which Qwen2.5-VL's forward in transformers 4.57 cannot compute
        from embeddings alone (its multimodal rope index reads input_ids)."""
        if self.text_config is self.config:
            return {}
        positions = torch.arange(states.shape[1], device=states.device)
        return {"position_ids": positions.expand(states.shape[0], -1)}

    def _self_check(self, check: CheckBatch) -> None:
        """The check batch's logits, in one piece as the reference computed them, against the reference
        (refuses with OtdusError when they differ)."""
        from otdus_cli.verify.self_check import check_logits  # noqa: PLC0415

        hub = self._hub
        hub.mode, hub.final_hidden = "inject", check.hidden.to(self.device)
        head_args = self._head_args(hub.final_hidden)
        logits = self.model(
            inputs_embeds=hub.final_hidden, use_cache=False, logits_to_keep=0, **head_args
        ).logits
        hub.mode, hub.final_hidden = "record", None
        check_logits(self, logits[0], check.reference, check.how)

    @torch.inference_mode()
    def forward_logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Logits [T, V] of one input by the family's own forward in one call, each decoder layer loaded
        when the forward reaches it (the stand-ins hand the call to the real layer): no recorded
        arguments, no injected states. The self-check's reference for models too large to load whole."""
        hub = self._hub

        def delegate(index: int, hidden_states: torch.Tensor, kwargs: dict):
            if index == 0 and self._stage_skips:
                self._load_shell("head")  # the input embeddings are done with: never hold both
            layer = self.load_layer(index)
            try:
                return layer(hidden_states, **kwargs)
            finally:
                self.free_layer(index)

        self._load_shell("embed")
        hub.mode, hub.delegate = "delegate", delegate
        try:
            ids_t = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
            return self.model(input_ids=ids_t, use_cache=False).logits[0]
        finally:
            hub.mode, hub.delegate = "record", None
            self.free_shell()

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
        for group, _, logits in self.iter_logits(acts):
            for row, i in enumerate(group):
                pieces[i].append(logits[row])
        return [p[0] if len(p) == 1 else torch.cat(p) for p in pieces]
