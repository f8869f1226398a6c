"""Where each tensor of a meta-device transformers model lives in a checkpoint, and putting it on the device.

The streamed evaluator (``streaming.StreamedModel``) builds its model with parameters on the meta
device. This module fills it from the checkpoint one piece at a time: a decoder layer, or the "shell"
(everything outside the decoder layers: embeddings, final norm, head), whole or in the stage one step
needs. It maps module names to the checkpoint's (wrapper layouts, Mixtral's ``block_sparse_moe``,
per-expert matrices of transformers' fused expert tensors), checks every layer's tensors before
anything runs, and converts large matrices in row blocks so a second full copy is never held.

Loading is a fixed cost per layer and per run (a plain forward pays it once, in ``from_pretrained``), so
it is kept cheap: safetensors data is read into one reused buffer and converted from there, and a
freed layer's tensors are reused for the next layer of the same shapes: fresh memory costs a page
fault per 4 KiB on its first touch, more than reading and converting the data.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from otdus_cli.arch.experts import EXPERT_LAYOUTS
from otdus_cli.arch.saved_names import saved_names
from otdus_cli.arch.wrappers import text_model_prefix
from otdus_cli.errors import OtdusError
from otdus_cli.io.reader import CheckpointReader
from otdus_cli.io.safetensors_format import TensorInfo, itemsize, torch_dtype
from otdus_cli.verify import hf_compat
from otdus_cli.verify.converted import Conversion, LoadConversions

# Large tensors are copied from disk in blocks of this size (float32 destination bytes).
_COPY_BLOCK_BYTES = 64 * 2**20

# Per-expert on-disk names of transformers' fused expert tensors: (prefix, (gate, up, down)) of each
# MoE layout arch/experts.py knows (Mixtral's block_sparse_moe.experts.N.w1 ...), each once.
_EXPERT_LAYOUTS = tuple(
    dict.fromkeys((f"{lay.block}experts.", (lay.gate, lay.up, lay.down)) for lay in EXPERT_LAYOUTS.values())
)
# MoE blocks stored under another name than transformers builds them (``mlp.``): Mixtral's
_MOE_BLOCKS = tuple(dict.fromkeys(lay.block for lay in EXPERT_LAYOUTS.values() if lay.block != "mlp."))


def non_persistent_keys(module: nn.Module) -> set[str]:
    """Names of ``module``'s buffers that are not saved (computed by the constructors)."""
    keys = set()
    for name, sub in module.named_modules():
        for buf in sub._non_persistent_buffers_set:
            keys.add(f"{name}.{buf}" if name else buf)
    return keys


def _disk_sources(prefix: str, key: str, on_disk: set[str], n_experts: int | None) -> tuple[str, ...] | None:
    """Names on disk that make up module tensor ``key`` of the layer at ``prefix``: the same name, the
    Mixtral ``block_sparse_moe`` spelling, or per-expert matrices of a fused experts tensor."""
    if prefix + key in on_disk:
        return (prefix + key,)
    for block in _MOE_BLOCKS if key.startswith("mlp.") else ():
        alias = block + key.removeprefix("mlp.")
        if prefix + alias in on_disk:
            return (prefix + alias,)
    if not n_experts or key not in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
        return None
    for base, (gate, up, down) in _EXPERT_LAYOUTS:
        names = [gate, up] if key.endswith("gate_up_proj") else [down]
        sources = tuple(f"{prefix}{base}{e}.{w}.weight" for w in names for e in range(n_experts))
        if all(s in on_disk for s in sources):
            return sources
    return None


class _StagingBuffer:
    """One reusable host buffer that tensor bytes are read into before conversion: a fresh buffer per
    tensor costs a page fault per 4 KiB on first touch, more than the read itself. Inside
    ``shards_open``, each shard file read is opened once (a layer's tensors lie in one or two)."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.uint8)
        self._fds: dict[str, int] | None = None  # shard path -> open descriptor, inside shards_open

    @contextlib.contextmanager
    def shards_open(self) -> Iterator[None]:
        """Keep the shard files read in the block open until its end (one load: a layer, the shell)."""
        self._fds = {}
        try:
            yield
        finally:
            fds, self._fds = self._fds, None
            for fd in fds.values():
                os.close(fd)

    def read(self, info: TensorInfo, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Elements of ``shape`` of ``info``'s data from byte ``offset``, as a view of the buffer (valid
        until the next read)."""
        nbytes = math.prod(shape) * itemsize(info.dtype)
        if self._buf.numel() < nbytes:
            self._buf = torch.empty(nbytes, dtype=torch.uint8)
        view = memoryview(self._buf.numpy())[:nbytes]
        fd = self._fds.get(info.file) if self._fds is not None else None
        if fd is None:
            fd = os.open(info.file, os.O_RDONLY)
            if self._fds is not None:
                self._fds[info.file] = fd
        try:
            done = 0
            while done < nbytes:
                got = os.preadv(fd, [view[done:]], info.begin + offset + done)
                if got <= 0:
                    raise OtdusError(f"{os.path.basename(info.file)}: truncated while reading {info.name}")
                done += got
        finally:
            if self._fds is None:
                os.close(fd)
        return self._buf[:nbytes].view(torch_dtype(info.dtype)).view(shape)


class CheckpointWeights:
    """Fills the meta-device ``model`` (its real decoder ``layers``, taken out of their list ``layers_name``
    in ``layers_owner``) from ``reader``.

    Shell stages: "embed" (embedding the windows) needs no LM head, "head" (the logits, fed the final
    hidden states as ``inputs_embeds``) no input embeddings, "all" both; unless the two are tied (one
    matrix), which then serves both stages.
    """

    def __init__(
        self,
        reader: CheckpointReader,
        model: nn.Module,
        layers_owner: nn.Module,
        layers_name: str,
        layers: list[nn.Module],
        buffer_values: hf_compat.BufferValues,
        device: torch.device,
        text_config,
    ):
        self.reader = reader
        self.folder = Path(reader.folder)
        self.model = model
        self.layers = layers
        self.device = device
        self.text_config = text_config
        self._buffer_values = buffer_values
        self._on_disk = set(reader.names)
        self._disk_names = self._disk_name_rules(layers_owner, layers_name)
        self._saved: dict[str, str | None] = {}  # module tensor -> the name transformers saves it under
        untie = hf_compat.loads_stored_tied_copies()
        # tied name -> its source; a stored tied copy is its own tensor where transformers loads it so
        self._tied = {
            target: source
            for target, source in hf_compat.tied_parameters(model).items()
            if not (untie and self.disk_name(target) in self._on_disk)
        }
        names = {id(m): n for n, m in model.named_modules()}
        self._layer_names = [names[id(layer)] for layer in layers]  # each layer's module name
        self.layer_prefixes = [self.disk_name(name + ".") for name in self._layer_names]
        self._load_conversions = LoadConversions(model)
        self._conversions: list[list[Conversion]] = []  # per layer: tensors transformers converts
        self._sources = self._layer_sources()
        self._stage_skips = self._shell_stages()
        self._shell_loaded: str | None = None  # "embed", "head" or "all": what is on the device
        # tensors of freed layers, by (shape, dtype): the next layer's parameters are taken from here
        self._spare: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        self._staging = _StagingBuffer()

    # -- names -------------------------------------------------------------------------------------
    def _disk_name_rules(self, layers_owner: nn.Module, layers_name: str) -> list[tuple[str, str]]:
        """(module-name prefix, on-disk prefix) pairs for checkpoints that store the text model under
        another name than the class builds it: a wrapper saved as ``language_model.model.layers.N``
        (or ``model.layers.N``) and built as ``model.language_model.layers.N``, its head as
        ``language_model.lm_head``, its vision tower and projector at the top."""
        built = next(n for n, m in self.model.named_modules() if m is layers_owner) + "."
        stored = text_model_prefix(sorted(self._on_disk))
        if stored is None:
            # a class that renames its base model when loading (Nemotron-H: built as model.layers.N,
            # stored as backbone.layers.N): the one prefix its layer list is stored under
            first = f"{layers_name}.0."
            found = {n[: n.index(first)] for n in self._on_disk if first in n}
            found = {p for p in found if p == "" or p.endswith(".")}
            return [(built, found.pop())] if len(found) == 1 and built not in found else []
        if stored == built:
            return []
        text_root = stored.rsplit(".", 2)[0] + "." if stored.count(".") > 1 else ""
        return [(built, stored), ("lm_head.", text_root + "lm_head."), ("model.", "")]

    def disk_name(self, name: str) -> str:
        """The checkpoint's name for module tensor (or prefix) ``name``: itself when stored so, else as
        the wrapper layout rules give it (``_disk_name_rules``), else the one name transformers saves it
        under where it converts names when loading (EXAONE's ``transformer.h.N``, GPT-OSS's sinks ...)."""
        if name in self._on_disk:
            return name
        for built, stored in self._disk_names:
            if name.startswith(built):
                renamed = stored + name[len(built) :]
                if renamed in self._on_disk or name.endswith("."):
                    return renamed
        saved = None if name.endswith(".") else self._saved_name(name, self._module_tensor(name))
        return saved or name

    def _module_tensor(self, name: str) -> torch.Tensor | None:
        try:
            return self.model.get_parameter(name)
        except AttributeError:
            try:
                return self.model.get_buffer(name)
            except AttributeError:
                return None

    def _saved_name(self, name: str, tensor: torch.Tensor | None) -> str | None:
        """The one name transformers' own saving gives module tensor ``name`` (arch/saved_names.py), where
        the checkpoint holds it; None otherwise."""
        if name not in self._saved:
            found = saved_names(self.model, {name: tensor}).get(name, []) if tensor is not None else []
            # of the tensor's shape: one part of a tensor saved merged with others (q_proj of a fused
            # query_key_value) is not it
            same = (
                len(found) == 1
                and found[0] in self._on_disk
                and tuple(self.reader.meta(found[0]).shape) == tuple(tensor.shape)
            )
            self._saved[name] = found[0] if same else None
        return self._saved[name]

    def _layer_sources(self) -> list[dict[str, tuple[str, ...]]]:
        """For every layer, where each of its tensors comes from on disk (the same name, another
        spelling, per-expert matrices of a fused tensor); the tensors transformers makes from others when
        loading go to ``self._conversions`` instead. Refuses unknown layouts."""
        on_disk = self._on_disk
        out = []
        for prefix, layer, built in zip(self.layer_prefixes, self.layers, self._layer_names, strict=True):
            sources: dict[str, tuple[str, ...]] = {}
            missing = []
            skip = non_persistent_keys(layer)
            for key, value in layer.state_dict(keep_vars=True).items():
                if key in skip:
                    continue
                # a fused experts tensor holds its experts along the first axis (LongCat-Flash's gate_up_proj
                # also the zero-computation experts', its down_proj not: the config's count fits neither)
                experts = value.shape[0] if value.dim() == 3 else None
                found = _disk_sources(prefix, key, on_disk, experts)
                if found is None:
                    saved = self._saved_name(f"{built}.{key}", value)
                    found = (saved,) if saved else None
                if found is None:
                    missing.append(key)
                else:
                    sources[key] = found
            used = {n for names in sources.values() for n in names}
            left = sorted(n for n in on_disk if n.startswith(prefix) and n not in used)
            conversions = self._converted(prefix, built, layer, missing, left) if missing else []
            self._conversions.append(conversions)
            used = {n for c in conversions for n, _ in c.stored}
            extra = [n for n in left if n not in used]
            if extra:
                raise OtdusError(
                    f"{self.folder.name}: tensor {extra[0]} has no place in transformers' "
                    f"{type(self.model).__name__} (checkpoint layout not supported for streaming)"
                )
            out.append(sources)
        return out

    def _converted(
        self, prefix: str, built: str, layer: nn.Module, missing: list[str], left: list[str]
    ) -> list[Conversion]:
        """The conversions that make layer tensors ``missing`` (keys in ``layer``, built as ``built``)
        from checkpoint tensors ``left`` (see ``converted``); refuses where one stays missing."""

        def meta(name: str) -> tuple[tuple[int, ...], torch.dtype]:
            info = self.reader.meta(name)
            return tuple(info.shape), torch_dtype(info.dtype)

        found = self._load_conversions.find(left, meta)
        shapes = {f"{built}.{k}": tuple(v.shape) for k, v in layer.state_dict(keep_vars=True).items()}
        made = {name: shape for c in found for name, shape in c.outputs.items()}
        for key in missing:
            name = f"{built}.{key}"
            if name not in made:
                raise OtdusError(
                    f"{self.folder.name}: tensor {prefix + key} (as named in transformers' "
                    f"{type(self.model).__name__}) not found in the checkpoint"
                )
            if made[name] != shapes[name]:
                raise OtdusError(
                    f"{self.folder.name}: transformers makes {prefix + key} of shape {made[name]} from the "
                    f"checkpoint, config implies {shapes[name]}"
                )
        mine = [c for c in found if set(c.outputs) <= set(shapes)]
        for c in mine:  # module names -> keys in the layer, which is no child of the model when loaded
            c.outputs = {name: name.removeprefix(f"{built}.") for name in c.outputs}
            c.layer_name = built
        return mine

    # -- sizes ------------------------------------------------------------------------------------
    @functools.cached_property
    def layer_shapes(self) -> list[tuple[int, ...]]:
        """Shapes of the decoder layers' tensors on disk (all layers: a family may vary them); read once,
        as batching asks for every window length."""
        return [
            tuple(self.reader.meta(n).shape) for s in self._sources for names in s.values() for n in names
        ]

    @functools.cached_property
    def largest_layer_numel(self) -> int:
        """Elements of the largest decoder layer's tensors (all experts of a MoE layer)."""
        return max(
            sum(math.prod(self.reader.meta(n).shape) for names in s.values() for n in names)
            for s in self._sources
        )

    # -- copying ----------------------------------------------------------------------------------
    def _copy_from_disk(self, target: torch.Tensor, name: str) -> None:
        """target <- tensor ``name``, in row blocks, so converting a large matrix (an embedding in
        bfloat16 -> float32) never holds a second full copy of it."""
        shape = tuple(self.reader.meta(name).shape)
        if tuple(target.shape) != shape:
            raise OtdusError(
                f"{self.folder.name}: {name} has shape {shape}, config implies {tuple(target.shape)}"
            )
        info = self.reader.raw(name)  # None for a pickled checkpoint: read through the reader
        if target.numel() == 0:
            return
        row_bytes = target[0].numel() * target.element_size() if target.dim() else 0
        if target.dim() == 0 or row_bytes * len(target) <= _COPY_BLOCK_BYTES:
            if info is not None:
                target.copy_(self._staging.read(info, 0, tuple(target.shape)))
            else:
                target.copy_(self.reader.get(name))
            return
        step = max(1, _COPY_BLOCK_BYTES // row_bytes)
        stored_row_bytes = target[0].numel() * itemsize(info.dtype) if info is not None else 0
        for start in range(0, len(target), step):
            block = target[start : start + step]
            if info is not None:
                block.copy_(self._staging.read(info, start * stored_row_bytes, tuple(block.shape)))
            else:
                block.copy_(self.reader.get_rows(name, start, start + step))

    def _copy_fused_experts(
        self, target: torch.Tensor, sources: tuple[str, ...], key: str, name: str
    ) -> None:
        """target <- a fused experts tensor ``name``, one per-expert matrix from disk at a time (never a
        stacked copy beside it)."""
        n = target.shape[0] if target.dim() == 3 else 0
        gate_up = key.endswith("gate_up_proj")  # [E, 2I, H]: expert e = cat(gate_e, up_e) along rows
        if not n or len(sources) != n * (2 if gate_up else 1):
            raise OtdusError(
                f"{self.folder.name}: {name} is stored as {len(sources)} per-expert tensors, config implies "
                f"{tuple(target.shape)}"
            )
        half = target.shape[1] // 2
        for e in range(n):
            if gate_up:
                self._copy_from_disk(target[e, :half], sources[e])
                self._copy_from_disk(target[e, half:], sources[n + e])
            else:  # [E, H, I] down projections
                self._copy_from_disk(target[e], sources[e])

    def _allocate(self, module: nn.Module) -> None:
        """Parameters of ``module`` (on meta) on the device, taken from freed layers' tensors where one of
        the same shape and dtype is spare; buffers fresh."""
        for sub in module.modules():
            for name, param in list(sub.named_parameters(recurse=False)):
                spare = self._spare.get((tuple(param.shape), param.dtype))
                data = spare.pop() if spare else torch.empty_like(param, device=self.device)
                setattr(sub, name, nn.Parameter(data, requires_grad=param.requires_grad))
            for name, buf in list(sub.named_buffers(recurse=False)):
                setattr(sub, name, torch.empty_like(buf, device=self.device))

    def _materialise(
        self,
        module: nn.Module,
        prefix: str,
        sources: dict[str, tuple[str, ...]],
        conversions: list[Conversion] = (),
    ) -> None:
        """Allocate ``module`` on the device and fill it from the checkpoint (tensors under ``prefix``,
        and those ``conversions`` make), in inference mode: tensors reused from a layer loaded in it may
        only be updated in it."""
        with torch.inference_mode():
            self._allocate(module)
            hf_compat.restore_buffers(module, self._buffer_values)  # rotary inv_freq, embed_scale, ...
        skip = non_persistent_keys(module)
        targets = dict(module.named_parameters())
        targets.update(dict(module.named_buffers()))
        with torch.inference_mode(), self._staging.shards_open():
            for key, target in targets.items():
                if key in skip or key not in sources:  # not stored as such: converted below
                    continue
                names = sources[key]
                if len(names) == 1:
                    self._copy_from_disk(target, names[0])
                    continue
                self._copy_fused_experts(target, names, key, prefix + key)
            for conversion in conversions:
                made = conversion.run(self.model, self.reader.get, (conversion.layer_name, module))
                for name, value in made.items():
                    targets[conversion.outputs[name]].copy_(value)

    # -- decoder layers ---------------------------------------------------------------------------
    def load_layer(self, index: int) -> nn.Module:
        layer = self.layers[index]
        self._materialise(layer, self.layer_prefixes[index], self._sources[index], self._conversions[index])
        layer.eval()
        return layer

    def free_layer(self, index: int) -> None:
        """Layer ``index`` back on meta; its parameters' memory is kept for the next layer to load (only
        the last freed layer's: layers of other shapes, in stacks of mixed kinds, would pile up)."""
        layer = self.layers[index]
        self._spare = {}
        for param in layer.parameters():
            if not param.is_meta:
                self._spare.setdefault((tuple(param.shape), param.dtype), []).append(param.data)
        layer.to_empty(device="meta")

    # -- the shell ----------------------------------------------------------------------------------
    def _shell_stages(self) -> dict[str, nn.Module | None]:
        """Per shell stage, the module that stage can leave on the meta device (none if unlisted)."""
        inp, out = self.model.get_input_embeddings(), self.model.get_output_embeddings()
        weight_in, weight_out = getattr(inp, "weight", None), getattr(out, "weight", None)
        if not isinstance(weight_in, nn.Parameter) or not isinstance(weight_out, nn.Parameter):
            return {}
        names = {id(m): n for n, m in self.model.named_modules()}
        pair = {names[id(inp)] + ".weight", names[id(out)] + ".weight"}
        if any({target, source} == pair for target, source in self._tied.items()):
            return {}
        return {"embed": out, "head": inp}

    @property
    def stages_split(self) -> bool:
        """Whether the "embed" and "head" stages hold different matrices (an untied head)."""
        return bool(self._stage_skips)

    def load_shell(self, stage: str = "all") -> None:
        """The weights outside the decoder layers (embeddings, final norm, head, rotary buffers), all
        of them or those one ``stage`` needs."""
        if self._shell_loaded in (stage, "all"):
            return
        if self._shell_loaded:
            self.free_shell()
        self._spare.clear()  # the shell's memory instead of a spare layer's, never both
        skip = self._stage_skips.get(stage)
        # the skipped module stays on meta with everything inside it (Inkling's embedding norm), and
        # what stays on meta is not loaded: skipped parameters were once told apart by id(), which a
        # parameter replaced by to_empty hands on to the next one made (the final norm's went unloaded)
        skipped = set(skip.modules()) if skip is not None else set()
        tied = self._tied
        # stand-ins own nothing and real layers are not children
        for sub in self.model.modules():
            if sub not in skipped:
                sub.to_empty(device=self.device, recurse=False)
                hf_compat.restore_buffers(sub, self._buffer_values, recurse=False)
        with torch.no_grad(), self._staging.shards_open():
            for name, param in self.model.named_parameters(remove_duplicate=False):
                if param.is_meta or name in tied:
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
