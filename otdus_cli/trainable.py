"""Which parameters of an otdus output to train first (LLaMA PRO's recipe: the new ones), in the
forms trainers read: axolotl's ``unfrozen_parameters``, LLaMA-Factory's freeze settings, a list of
names, and :func:`apply` for plain PyTorch / transformers.Trainer.

The set: every tensor of a new layer (the manifest's layer map) and every tensor the manifest lists
as new (widen's expert copies and router weights); ``zero_init_only`` keeps, of the new layers, only
the tensors expand initialised instead of copying (zeroed, or a residual scale set to 1); ``also``
adds the embeddings, the norms (every layer's and the final one) or the output head.

Each trainer's selection rule is applied here exactly as its source code applies it, and a setting
is printed only when it selects this set and nothing else:

* axolotl (``utils/freeze.py``): every period not followed by ``+`` is escaped (so a pattern's
  periods are literal, and must not be escaped again), and a pattern selects a name when
  ``re.match`` does (anchored at the start; ``$`` anchors the end).
* LLaMA-Factory (``model/adapter.py``, ``finetuning_type: freeze``): the trainable layer ids are the
  last ``freeze_trainable_layers`` (the first, if negative), or with ``use_llama_pro`` every
  ``stride``-th layer, ``stride = num_layers // freeze_trainable_layers``, ids ``stride - 1,
  2 stride - 1, ...``; a parameter is trainable when its name contains ``.{id}.{module}`` for a
  trainable id and module (``all``: any), or one of ``freeze_extra_modules`` as a substring.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from otdus_cli.errors import OtdusError
from otdus_cli.fused_experts import FUSED_NOTE, PER_EXPERT
from otdus_cli.manifest import MANIFEST, read_manifest

if TYPE_CHECKING:
    import torch

FORMATS = ("axolotl", "llama-factory", "json", "names")
ALSO = ("embeddings", "norms", "head")
_GENERIC_LAYER = re.compile(r"^(.*?\.layers\.)(\d+)\.(.+)$")
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.]+")
# the formats that express any set of names (what a refusal points to)
ANY_SET = "--format axolotl, json or names"


@dataclass
class TrainableSet:
    """The parameters to train, among all the model's, and what a trainer's setting needs to know."""

    names: list[str]  # every parameter (tensor) name of the model, in order
    trainable: list[str]  # the ones to train, in the same order
    num_layers: int
    layer_of: dict[str, tuple[int, str]]  # name -> (output layer, suffix) for the decoder stack's tensors
    notes: list[str] = field(default_factory=list)  # what the user should know (e.g. a router trained whole)

    def whole_layers(self) -> list[int]:
        """Layers every tensor of which is trainable."""
        chosen = set(self.trainable)
        by_layer: dict[int, list[str]] = {}
        for name, (layer, _) in self.layer_of.items():
            by_layer.setdefault(layer, []).append(name)
        return sorted(i for i, names in by_layer.items() if all(n in chosen for n in names))


def _layer_parser(config: dict):
    """name -> (layer, suffix) or None: the family's layer prefix, else the usual ``*.layers.N.``."""
    from otdus_cli.arch.family_lookup import family_for

    try:
        family = family_for(config)
    except OtdusError:
        family = None
    regex = family.layer_regex() if family is not None else None

    def parse(name: str) -> tuple[int, str] | None:
        hit = regex.fullmatch(name) if regex is not None else None
        if hit is not None:
            return int(hit.group(1)), hit.group(2)
        # a layer's tensor stored outside it under a name numbered by it (Inkling 2's attn_res.*_queries.N)
        outside = family.numbered_tensor(name) if family is not None else None
        if outside is not None:
            return outside
        generic = _GENERIC_LAYER.match(name)
        return (int(generic.group(2)), generic.group(3)) if generic else None

    return parse, family


def select(
    manifest: dict,
    names: Iterable[str],
    config: dict,
    also: Iterable[str] = (),
    zero_init_only: bool = False,
) -> TrainableSet:
    """The trainable set of a model with these parameter ``names`` (an otdus output's tensors, or
    a loaded model's parameters) made as ``manifest`` records."""
    names = list(names)
    parse, family = _layer_parser(config)
    layer_of = {n: where for n in names if (where := parse(n)) is not None}
    new_layers = {lay["index"]: lay for lay in manifest["layers"] if lay["new"]}
    notes: list[str] = []
    if zero_init_only:
        zero_layers = {i for i, lay in new_layers.items() if lay.get("zero_init")}
        if not zero_layers or family is None:
            raise OtdusError("--zero-init-only: this output has no zero-initialised parameters")
        # the residual scales a new layer holds at 1 (Doge's) are initialised as the zeroed tensors are
        chosen = {
            n
            for n, (i, sfx) in layer_of.items()
            if i in zero_layers and family.zero_init_value(sfx) is not None
        }
    else:
        chosen = {n for n, (i, _) in layer_of.items() if i in new_layers}
        listed = set(manifest.get("new_parameters", []))
        missing = sorted(listed - set(names))
        if missing:
            raise OtdusError(
                f"the manifest lists {missing[0]} as new, but the model has no parameter of that name "
                "(a different checkpoint, or a transformers version that fuses those tensors on load)"
            )
        chosen |= listed
        partial = sorted(n for n in listed if n in layer_of and layer_of[n][0] not in new_layers)
        routers = [n for n in partial if "experts." not in n]
        if routers:
            notes.append(
                f"{len(routers)} router weight(s) (e.g. {routers[0]}) hold the base's rows and the new "
                "experts' rows in one tensor: training them changes the base rows too"
            )
        if any(PER_EXPERT.match(n) for n in listed):
            notes.append(FUSED_NOTE)
    for extra in also:
        chosen |= _extra(extra, names, layer_of, config)
    trainable = [n for n in names if n in chosen]
    if not trainable:
        # an empty list reads as "train everything" to axolotl (it freezes only if the list is set)
        raise OtdusError(
            "this output has no new parameters (a shrink removes or merges layers, adding none): "
            "nothing to train first; --also embeddings, norms or head names parameters to train"
        )
    return TrainableSet(names, trainable, int(manifest["num_hidden_layers"]), layer_of, notes)


def _extra(kind: str, names: list[str], layer_of: dict, config: dict) -> set[str]:
    if kind not in ALSO:
        raise OtdusError(f"--also {kind}: choose embeddings, norms or head")
    outside = [n for n in names if n not in layer_of]
    if kind == "embeddings":
        found = {n for n in outside if "embed" in n}
    elif kind == "norms":
        found = {n for n in names if "." in n and "norm" in n.rsplit(".", 2)[-2]}
    else:
        found = {n for n in outside if n.split(".")[0] == "lm_head"}
        if not found and (config.get("tie_word_embeddings") or _text(config).get("tie_word_embeddings")):
            raise OtdusError(
                "--also head: this model's output head is its input embedding (tie_word_embeddings); "
                "use --also embeddings"
            )
    if not found:
        raise OtdusError(f"--also {kind}: this model has no such parameters")
    return found


def _text(config: dict) -> dict:
    text = config.get("text_config")
    return text if isinstance(text, dict) else {}


def output_set(folder: str | os.PathLike[str], also: Iterable[str] = (), zero_init_only: bool = False):
    """The trainable set of an otdus output folder (one error line if it is not one)."""
    from otdus_cli.io.reader import CheckpointReader

    folder = Path(folder)
    if not folder.is_dir():
        raise OtdusError(f"{folder} is not a folder")
    manifest = read_manifest(folder)
    if manifest is None:
        raise OtdusError(
            f"{folder} is not an otdus output (no {MANIFEST}); nothing records which layers are new"
        )
    reader = CheckpointReader(folder)
    return select(manifest, reader.names, reader.config, also, zero_init_only)


# -- formats -------------------------------------------------------------------------------------
def axolotl_patterns(chosen: TrainableSet) -> list[str]:
    """``unfrozen_parameters``: ``^PREFIX`` for a whole layer, ``^NAME$`` for any other tensor.
    Periods stay unescaped: axolotl escapes them itself (escaping them here would double it)."""
    whole = set(chosen.whole_layers())
    patterns: list[str] = []
    prefixes: set[int] = set()
    for name in chosen.trainable:
        if not _PLAIN_NAME.fullmatch(name):
            raise OtdusError(f"{name}: not a plain tensor name; use --format json or names")
        where = chosen.layer_of.get(name)
        # a whole layer's tensors under its prefix by one pattern; one stored outside it (a name numbered
        # by the layer: Inkling 2's queries) by its own
        if where is not None and where[0] in whole and name.endswith("." + where[1]):
            if where[0] not in prefixes:
                prefixes.add(where[0])
                patterns.append("^" + name[: len(name) - len(where[1])])
            continue
        patterns.append(f"^{name}$")
    return patterns


def llama_factory_selects(names: list[str], num_layers: int, settings: dict[str, Any]) -> set[str]:
    """What LLaMA-Factory's freeze tuning trains, by its rule (module docstring)."""
    k = settings["freeze_trainable_layers"]
    if settings.get("use_llama_pro"):
        if num_layers % k:
            return set()
        stride = num_layers // k
        ids = list(range(stride - 1, num_layers + stride - 1, stride))
    elif k > 0:
        ids = list(range(max(0, num_layers - k), num_layers))
    else:
        ids = list(range(min(-k, num_layers)))
    modules = settings["freeze_trainable_modules"].split(",")
    marks = [f".{i}.{m if m != 'all' else ''}" for m in modules for i in ids]
    extras = [m for m in settings.get("freeze_extra_modules", "").split(",") if m]
    return {n for n in names if any(mark in n for mark in marks + extras)}


def llama_factory_settings(chosen: TrainableSet) -> dict[str, Any]:
    """``finetuning_type: freeze`` settings that select exactly this set, or one error saying why
    none can and which format can."""
    outside = [n for n in chosen.trainable if n not in chosen.layer_of]
    extras = sorted({n.rsplit(".", 2)[-2] for n in outside})
    # what freeze_extra_modules takes by substring (e.g. "norm": every layer's norms too) is not
    # asked of the layer ids
    in_layers = [n for n in chosen.trainable if n in chosen.layer_of and not any(e in n for e in extras)]
    layers = sorted({chosen.layer_of[n][0] for n in in_layers})
    if not layers:
        raise OtdusError(f"LLaMA-Factory's freeze settings need trainable layers; use {ANY_SET}")
    n, k = chosen.num_layers, len(layers)
    candidates: list[dict[str, Any]] = []
    if layers == list(range(n - k, n)):
        candidates.append({"freeze_trainable_layers": k})
    if layers == list(range(k)):
        candidates.append({"freeze_trainable_layers": -k})
    if n % k == 0 and layers == list(range(n // k - 1, n, n // k)):
        candidates.append({"freeze_trainable_layers": k, "use_llama_pro": True})
    if not candidates:
        raise OtdusError(
            f"LLaMA-Factory's freeze settings cannot express trainable layers {_ranges(layers)} of {n} "
            f"(only the last or first k, or every (num_layers/k)-th with use_llama_pro); use {ANY_SET}"
        )
    whole = set(chosen.whole_layers())
    if all(i in whole for i in layers):
        modules = "all"
    else:
        modules = ",".join(sorted({chosen.layer_of[n][1].split(".")[0] for n in in_layers}))
    target = set(chosen.trainable)
    for candidate in candidates:
        settings = {"finetuning_type": "freeze", **candidate, "freeze_trainable_modules": modules}
        if extras:
            settings["freeze_extra_modules"] = ",".join(extras)
        if llama_factory_selects(chosen.names, n, settings) == target:
            return settings
    raise OtdusError(
        f"LLaMA-Factory's freeze settings select whole modules of the trainable layers ({modules}) by "
        f"substring, which also takes parameters outside this set; use {ANY_SET}"
    )


def _ranges(ids: list[int]) -> str:
    return ",".join(map(str, ids)) if len(ids) <= 12 else f"{ids[0]},{ids[1]},...,{ids[-1]}"


def to_yaml(settings: dict[str, Any]) -> str:
    """YAML by the serializer, never by formatting: a checkpoint's tensor names are quoted, so none
    can add a key (a name holding "\\nfinetuning_type: full")."""
    import yaml  # only the YAML formats need it

    class Indented(yaml.SafeDumper):  # list items indented under their key, as trainers' docs show them
        def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
            super().increase_indent(flow, False)

    text = yaml.dump(settings, Dumper=Indented, sort_keys=False, allow_unicode=True, width=1 << 16)
    return text.rstrip("\n")


def render(chosen: TrainableSet, fmt: str) -> str:
    """The text `otdus trainable --format FMT` prints."""
    if fmt not in FORMATS:
        raise OtdusError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == "axolotl":
        return to_yaml({"unfrozen_parameters": axolotl_patterns(chosen)})
    if fmt == "llama-factory":
        return to_yaml(llama_factory_settings(chosen))
    if fmt == "json":
        return json.dumps(chosen.trainable, indent=2)
    broken = next((n for n in chosen.trainable if not n.isprintable() or n != n.strip()), None)
    if broken is not None:  # one name a line cannot hold it
        raise OtdusError(f"{ascii(broken)}: a parameter name that is not one plain line; use --format json")
    return "\n".join(chosen.trainable)


# -- PyTorch -------------------------------------------------------------------------------------
def apply(
    model: torch.nn.Module,
    manifest: dict | str | os.PathLike[str],
    also: Iterable[str] = (),
    zero_init_only: bool = False,
) -> list[str]:
    """Set ``requires_grad`` on ``model``'s parameters: True for the trainable set, False for every
    other. ``manifest``: an otdus output folder, its ``otdus.json``, or the manifest as read. Returns
    the names made trainable. A name the manifest lists that the model lacks is an error, never skipped,
    but for experts the model loads fused (transformers 5): the fused tensors are trained with a
    gradient mask on the new experts' rows (fused_experts.py). A peft-wrapped model's names are read
    as the checkpoint's (checkpoint_name); the names returned are the model's own.
    """
    if not isinstance(manifest, dict):
        path = Path(manifest)
        folder = path.parent if path.name == MANIFEST else path
        found = read_manifest(folder)
        if found is None:
            raise OtdusError(f"{folder} is not an otdus output (no {MANIFEST})")
        manifest = found
    from otdus_cli.fused_experts import map_listed, mask_rows

    # a peft-wrapped model: its parameters under the names the checkpoint gives them
    loaded = {checkpoint_name(n): (n, p) for n, p in model.named_parameters()}
    params = {n: p for n, (_, p) in loaded.items()}
    config = model.config.to_dict() if hasattr(model, "config") else {}
    listed = manifest.get("new_parameters") or []
    widened = manifest.get("widen") if isinstance(manifest.get("widen"), dict) else {}
    fused = map_listed([n for n in listed if n not in params], params, (widened.get("experts") or [0, 0])[1])
    if (fused.rows or fused.renamed) and not fused.unmatched and not zero_init_only:
        # experts loaded fused (transformers 5): their tensors behind a gradient mask, routers renamed
        manifest = {**manifest, "new_parameters": [n for n in listed if n in params] + fused.renamed}
    else:
        fused.rows = {}
    chosen = select(manifest, params, config, also, zero_init_only)
    train = set(chosen.trainable) | set(fused.rows)
    for name, param in params.items():
        param.requires_grad_(name in train)
    for name, rows in fused.rows.items():
        mask_rows(params[name], rows)
    return [loaded[n][0] for n in params if n in train]


def checkpoint_name(name: str) -> str:
    """A loaded parameter's name as the checkpoint has it: peft's wrapper prefix (``base_model.model.``)
    and its ``base_layer`` module around a wrapped linear layer dropped. An adapter's own parameters
    (``lora_A`` ...) keep their names, so they follow the layer they sit in."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")
