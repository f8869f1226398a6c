"""Rewriting config.json for a new depth, driven by the DEPTH_FIELDS table."""

from __future__ import annotations

import contextlib
import copy
import math
import sys
import threading
import warnings
from pathlib import Path

from otdus_cli.arch.depth import DEPTH, depth_field, stated_depth
from otdus_cli.arch.families import DEPTH_FIELDS
from otdus_cli.arch.rope_base import legacy_rope_fields
from otdus_cli.arch.wrappers import LEADING_LAYER_FIELDS, depth_parts, text_config
from otdus_cli.errors import OtdusError
from otdus_cli.io.reader import read_json_object
from otdus_cli.plan.layer_map import OutputLayer


def derived_layer_types(config: dict) -> list[str] | None:
    """The per-layer attention types transformers derives for this config, if the family has them.

    Families such as Qwen2 (max_window_layers), Gemma 2/3 (alternating / sliding_window_pattern)
    compute layer_types when it is absent; we write it explicitly so each new layer keeps its
    source layer's type whatever the derivation rule would say at the new depth.
    """
    if isinstance(config.get("layer_types"), list):
        return list(config["layer_types"])
    return transformers_derived(config, ("layer_types",)).get("layer_types")


def transformers_derived(config: dict, names: tuple[str, ...]) -> dict[str, list]:
    """The list values transformers' config class derives for ``names`` absent from ``config`` (e.g.
    Llama 4's moe_layers from interleave_moe_layer_step, no_rope_layers from no_rope_layer_interval);
    {} for a config transformers cannot read."""
    missing = [name for name in names if config.get(name) is None]
    if not missing:
        return {}
    try:
        from transformers import AutoConfig

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = AutoConfig.for_model(**config)
    except Exception:
        return {}
    values = {name: getattr(loaded, name, None) for name in missing}
    return {name: list(value) for name, value in values.items() if isinstance(value, list | tuple)}


def family_config(family, config: dict, layer_map: list[OutputLayer]) -> dict:
    """rewrite_config with the fields ``family`` (arch/families.Family) says follow the layers."""
    return rewrite_config(
        config,
        layer_map,
        family.derives_layer_types,
        family.per_layer_fields,
        family.derived_fields,
        family.index_fields,
        family.numbered_from_one,
    )


def rewrite_config(
    config: dict,
    layer_map: list[OutputLayer],
    derives_layer_types: bool = True,
    per_layer_fields: tuple[str, ...] = (),
    derived_fields: tuple[str, ...] = (),
    index_fields: tuple[str, ...] = (),
    numbered_from_one: tuple[str, ...] = (),
) -> dict:
    """A copy of `config` describing the expanded stack: where it states the depth (a multimodal
    wrapper's text_config, the top level, or both), the depth fields are rewritten.

    ``derives_layer_types``: whether transformers may derive layer_types for this family (see
    Family.derives_layer_types); if not, only an explicit layer_types list is carried over.
    ``per_layer_fields``: more fields with one entry per layer (Family.per_layer_fields).
    ``derived_fields``: depth fields transformers derives when absent (Family.derived_fields); written
    explicitly, each new layer taking its source layer's entry.
    ``index_fields``: more fields listing layer indices (Family.index_fields); ``numbered_from_one``: those
    of them that count the layers from 1 (Family.numbered_from_one).
    """
    fields = _field_kinds(per_layer_fields, index_fields, numbered_from_one)
    check_leading_layers(config, layer_map)
    out = copy.deepcopy(config)
    for key in depth_parts(config):
        if key is None:
            stack = {**config, **transformers_derived(config, derived_fields)}
            out = {**out, **_rewrite_stack_config(stack, layer_map, derives_layer_types, fields)}
        else:
            stack = {**config[key], **transformers_derived(config[key], derived_fields)}
            out[key] = _rewrite_stack_config(stack, layer_map, derives_layer_types, fields)
    return out


def _field_kinds(
    per_layer_fields: tuple[str, ...], index_fields: tuple[str, ...], numbered_from_one: tuple[str, ...]
) -> dict[str, str]:
    """A family's own depth fields (beside DEPTH_FIELDS) by how they follow the layers."""
    return {
        **dict.fromkeys(per_layer_fields, "per_layer"),
        **{name: "layer_numbers" if name in numbered_from_one else "index_list" for name in index_fields},
    }


def check_leading_layers(config: dict, layer_map: list[OutputLayer]) -> None:
    """Refuse a layer map that moves or replaces a text layer the wrapper addresses by position
    (LEADING_LAYER_FIELDS: Qwen3-VL's deepstack injections after text layers 0 .. K-1)."""
    for (part, name), what in LEADING_LAYER_FIELDS.items():
        value = (config.get(part) or {}).get(name) if isinstance(config.get(part), dict) else None
        if not isinstance(value, list) or not value:
            continue
        leading = len(value)
        moved = next((lay for lay in layer_map[:leading] if lay.new or lay.source != lay.index), None)
        if moved is not None:
            where = f"0-{leading - 1}" if leading > 1 else "0"
            found = f"new layer {moved.index}" if moved.new else f"base layer {moved.source} at {moved.index}"
            raise OtdusError(
                f"{part}.{name} has {leading} entries: {what} {where} by position, and this layer map puts "
                f"{found} there; place the new layers after layer {leading - 1} (e.g. --position top)"
            )


def _rewrite_stack_config(
    config: dict, layer_map: list[OutputLayer], derives_layer_types: bool, fields: dict[str, str]
) -> dict:
    base_layers = stated_depth(config)
    if base_layers is None:
        raise OtdusError("config.json states no depth otdus can rewrite (num_hidden_layers or its alias)")
    sources = [lay.source for lay in layer_map]
    out = copy.deepcopy(config)
    out |= legacy_rope_fields(config)  # read alike by transformers 4.57, 5 and llama.cpp
    field = depth_field(config)
    if field is not None:  # else the depth is the length of a per-layer list, rewritten below
        out[field] = len(layer_map)
    if derives_layer_types:
        types = derived_layer_types(config)
    else:
        types = list(config["layer_types"]) if isinstance(config.get("layer_types"), list) else None
    if types is not None:
        if len(types) != base_layers:
            raise OtdusError(f"config layer_types has {len(types)} entries for {base_layers} layers")
        out["layer_types"] = [types[i] for i in sources]
    for name, kind in {**DEPTH_FIELDS, **fields}.items():
        value = config.get(name)
        if value is None or name == "layer_types":
            continue
        if kind == "per_layer" and isinstance(value, list) and len(value) != base_layers and name in fields:
            # a derived template's pattern of kinds transformers repeats to the depth (RecurrentGemma's
            # block_types): written whole, one entry per layer
            value = (value * (base_layers // max(len(value), 1) + 1))[:base_layers]
        if kind == "per_layer" and isinstance(value, list | str):
            if len(value) != base_layers:
                raise OtdusError(f"config {name} has {len(value)} entries for {base_layers} layers")
            picked = [value[i] for i in sources]
            out[name] = "".join(picked) if isinstance(value, str) else picked  # a pattern: a letter a layer
        elif kind == "per_layer" and isinstance(value, dict):
            out[name] = _rewrite_layer_keyed(name, value, sources, base_layers)
        elif kind == "index_list" and isinstance(value, list):
            listed = set(value)
            out[name] = [j for j, i in enumerate(sources) if i in listed]
        elif kind == "layer_numbers" and isinstance(value, list):
            listed = set(value)
            out[name] = [j + 1 for j, i in enumerate(sources) if i + 1 in listed]
        elif kind == "index_list" and isinstance(value, int) and not isinstance(value, bool):
            out[name] = _rewrite_layer_index(name, value, sources, base_layers)
        elif kind == "threshold" and isinstance(value, int):
            below = [j for j, i in enumerate(sources) if i < value]
            prefix = next((j for j, i in enumerate(sources) if i >= value), len(sources))
            if below != list(range(len(below))) and "layer_types" not in out:
                raise OtdusError(
                    f"config {name}={value} marks the first layers; this layer map interleaves them with "
                    "later ones, which the field cannot express"
                )
            # with explicit layer_types (what transformers reads) the threshold is kept as the
            # longest prefix it still describes, for loaders that read only the threshold
            out[name] = prefix
        elif kind == "last_count" and isinstance(value, int) and not isinstance(value, bool):
            out[name] = _rewrite_last_count(name, value, sources, base_layers)
        elif kind == "inverse_sqrt_depth" and isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = same_quotient(value, base_layers, len(sources))
        elif kind == "group_size" and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out[name] = same_groups(value, layer_map, base_layers)
        elif kind == "refuse" and value:
            raise OtdusError(
                f"config {name}={value}: layers stored after the decoder stack are not supported yet"
            )
    _rewrite_sparse_step(config, out, sources)
    return out


def layer_keyed(value: object, depth: int) -> bool:
    """A dict keyed by layer index (Gemma 4's per_layer_config: ``{"3": {"head_dim": 512}}``), each key
    a layer of the ``depth``."""
    if not isinstance(value, dict) or not value:
        return False
    keys = [int(k) if isinstance(k, str) and k.isdigit() else k for k in value]
    return all(isinstance(k, int) and not isinstance(k, bool) and 0 <= k < depth for k in keys)


def _rewrite_layer_keyed(name: str, value: dict, sources: list[int], base_layers: int) -> dict:
    """Each output layer gets its source layer's entry, keyed by its own index (as a string: JSON)."""
    if not layer_keyed(value, base_layers):
        raise OtdusError(
            f"config {name} is keyed by other things than the indices of its {base_layers} layers"
        )
    by_layer = {int(k): v for k, v in value.items()}
    return {str(j): copy.deepcopy(by_layer[i]) for j, i in enumerate(sources) if i in by_layer}


def _rewrite_layer_index(name: str, value: int, sources: list[int], base_layers: int) -> int:
    """A field naming one layer (ERNIE 4.5 MoE's moe_layer_start_index <= i <= moe_layer_end_index): a
    range's last layer (a name with "end" or "last") becomes the last output layer whose source is at or
    before it, any other the first output layer whose source is at or after it. A negative index counts
    from the end and stays; one past the stack stays as far past it. What transformers then builds at
    each index is checked against the plan (arch/derived.py: check_planned_kinds)."""
    if value < 0:
        return value
    if value >= base_layers:
        return value - base_layers + len(sources)
    if "end" in name or "last" in name:
        return max((j for j, i in enumerate(sources) if i <= value), default=-1)
    return next((j for j, i in enumerate(sources) if i >= value), len(sources))


def _rewrite_last_count(name: str, value: int, sources: list[int], base_layers: int) -> int:
    """A count of the last layers (num_kv_shared_layers): the output layers whose source is among them,
    which must be the last ones (OtdusError otherwise)."""
    last = [j for j, i in enumerate(sources) if i >= base_layers - value]
    if last != list(range(len(sources) - len(last), len(sources))):
        wrong = next(j for j in range(last[0], len(sources)) if j not in last)
        raise OtdusError(
            f"config {name}={value} marks the last {value} layers; this layer map puts output layer {wrong}, "
            f"a copy of base layer {sources[wrong]}, among them, which the field cannot express: place new "
            "layers before them, or copy only layers among them there"
        )
    return len(last)


def same_quotient(value: float, depth: int, new_depth: int) -> float:
    """The value v' with v' / sqrt(new_depth) == value / sqrt(depth) in floating point, exactly (a few
    rounding steps from value * sqrt(new_depth / depth) at most)."""
    target = value / math.sqrt(depth)
    up = down = value * math.sqrt(new_depth) / math.sqrt(depth)
    for _ in range(8):
        for candidate in (up, down):
            if candidate / math.sqrt(new_depth) == target:
                return candidate
        up, down = math.nextafter(up, math.inf), math.nextafter(down, -math.inf)
    raise OtdusError(
        f"config: no value of a depth-scaled field keeps {value} / sqrt({depth}) exactly at "
        f"{new_depth} layers"
    )


def same_groups(size: int, layer_map: list[OutputLayer], base_layers: int) -> int:
    """The smallest group size from ``size`` up with which every base layer of the layer map lies in the
    group it was in (index // size) and the stack holds as many whole groups; ``size`` where none does."""
    kept = [(j, lay.source) for j, lay in enumerate(layer_map) if not lay.new]
    depth = len(layer_map)
    return next(
        (
            s
            for s in range(size, depth + 2)
            if all(j // s == i // size for j, i in kept) and depth // s == base_layers // size
        ),
        size,
    )


def _rewrite_sparse_step(config: dict, out: dict, sources: list[int]) -> None:
    """Qwen MoE puts experts on layers with (i + 1) % decoder_sparse_step == 0; depth changes move them.

    Dense source layers that land on an expert slot are listed in mlp_only_layers; an expert layer
    that lands on a dense slot cannot be expressed, so that placement is refused.
    """
    step = config.get("decoder_sparse_step")
    if not step or step == 1 or not config.get("num_experts"):
        return
    only = set(config.get("mlp_only_layers") or [])

    def sparse(i: int) -> bool:
        return i not in only and (i + 1) % step == 0

    for j, i in enumerate(sources):
        if sparse(i) and (j + 1) % step:
            raise OtdusError(
                f"decoder_sparse_step={step}: MoE base layer {i} would land on dense slot {j}; "
                "choose placements that keep the MoE pattern"
            )
    out["mlp_only_layers"] = [j for j, i in enumerate(sources) if not sparse(i) and (j + 1) % step == 0]


_prefetch: threading.Thread | None = None


def _import_autoconfig(model_type: str | None) -> None:
    # any failure is left to validate_with_transformers, which imports again and reports it
    with contextlib.suppress(BaseException):
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        if model_type:
            CONFIG_MAPPING[model_type]  # imports that family's configuration module


def prefetch_config_validation(model_type: str | None = None) -> None:
    """Import transformers' config machinery (seconds of CPU) on a thread while the caller does I/O,
    so ``validate_with_transformers`` at the end does not add it to the wall time (widen uses it; a
    copy-type expand of a family otdus's depth rules cover never imports transformers at all).
    Call it after the caller's own imports are done (two threads importing at once can deadlock on
    module locks when their imports are circular)."""
    global _prefetch
    if _prefetch is None and "transformers.models.auto" not in sys.modules:
        _prefetch = threading.Thread(
            target=_import_autoconfig, args=(model_type,), name="otdus-prefetch", daemon=True
        )
        _prefetch.start()


def finish_prefetch() -> None:
    """Wait for the import thread: a caller that imports transformers next (a test, a study's next
    arm) must not meet a half-imported package."""
    if _prefetch is not None:
        _prefetch.join()


def validate_with_transformers(folder: Path, expected_layers: int) -> str | None:
    """Load the written config the way users will, so a bad config fails here and not in their job.

    Returns None when transformers loaded it, else why the load check was skipped: a model_type
    transformers does not know (--allow-unknown-arch) cannot be loaded by it, so only the depth
    fields are checked in the JSON itself.
    """
    finish_prefetch()
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    written = read_json_object(folder / "config.json")
    model_type = written.get("model_type")
    if model_type not in CONFIG_MAPPING:
        _check_depth(text_config(written), expected_layers)
        return (
            f"transformers {transformers.__version__} does not know model_type={model_type!r}: "
            "the rewritten config.json was not load-checked"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    except Exception as exc:
        raise OtdusError(f"transformers rejects the rewritten config: {exc}") from None
    text = loaded.get_text_config()  # a multimodal wrapper's text config; the config itself otherwise
    field = depth_field(text_config(written)) or DEPTH  # BART's decoder_layers, not its num_hidden_layers
    _check_depth(
        {"num_hidden_layers": getattr(text, field), "layer_types": getattr(text, "layer_types", None)},
        expected_layers,
    )
    return None


def _check_depth(config: dict, expected_layers: int) -> None:
    depth = stated_depth(config)
    if depth != expected_layers:
        raise OtdusError(f"rewritten config loads with {depth} layers, expected {expected_layers}")
    types = config.get("layer_types")
    if isinstance(types, list) and len(types) != expected_layers:
        raise OtdusError(f"rewritten config has {len(types)} layer_types for {expected_layers} layers")


# Fields rewrite_config may change in a stack's settings; anything else must stay the source's.
_REWRITTEN = {DEPTH, "torch_dtype", "dtype", *DEPTH_FIELDS}


def check_depth_rules(
    written: dict,
    source: dict,
    expected_layers: int,
    per_layer_fields: tuple[str, ...] = (),
    index_fields: tuple[str, ...] = (),
    numbered_from_one: tuple[str, ...] = (),
) -> None:
    """The written config describes ``expected_layers`` layers by otdus's own depth rules: wherever
    the source states the depth (the top level, a wrapper's text config, or both), every depth field
    (DEPTH_FIELDS, ``per_layer_fields``) agrees with the new depth; nothing else differs from the
    source (the output dtype aside).

    This is the whole check for families whose config transformers derives nothing from the depth
    (Family.derives_layer_types false: llama, mistral, phi3, mixtral ...): it needs
    no transformers import (seconds of CPU, torch included). The tests load every family's outputs
    with transformers, and validate_with_transformers adds transformers' own check whenever it is
    imported anyway.
    """
    parts = depth_parts(source)
    fields = _field_kinds(per_layer_fields, index_fields, numbered_from_one)
    for key in parts:
        stack = written if key is None else written.get(key)
        if not isinstance(stack, dict):
            raise OtdusError(f"rewritten config lost its {key}")
        _check_stack_rules(stack, expected_layers, fields)
        if key is not None:
            expected = source[key] | legacy_rope_fields(source[key])
            _check_unchanged(stack, expected, _REWRITTEN | set(fields), f"{key}.")
    top_may_change = {"torch_dtype", "dtype", *(k for k in parts if k)}
    if None in parts:
        top_may_change |= _REWRITTEN | set(fields) | {depth_field(source)}
        source = source | legacy_rope_fields(source)
    _check_unchanged(written, source, top_may_change, "")


def _check_stack_rules(config: dict, expected_layers: int, fields: dict[str, str]) -> None:
    _check_depth(config, expected_layers)
    for name, kind in {**DEPTH_FIELDS, **fields}.items():
        value = config.get(name)
        if kind == "per_layer" and isinstance(value, list | str) and len(value) != expected_layers:
            raise OtdusError(f"rewritten config has {len(value)} {name} for {expected_layers} layers")
        keyed = isinstance(value, dict) and value
        if kind == "per_layer" and keyed and not layer_keyed(value, expected_layers):
            raise OtdusError(
                f"rewritten config {name} is keyed by other things than its {expected_layers} layers"
            )
        if kind in ("index_list", "layer_numbers") and isinstance(value, list):
            first = int(kind == "layer_numbers")
            bad = [i for i in value if not isinstance(i, int) or not first <= i < expected_layers + first]
            if bad:
                raise OtdusError(f"rewritten config {name} lists layer {bad[0]} of {expected_layers}")
        if (
            kind in ("threshold", "last_count")
            and isinstance(value, int)
            and not 0 <= value <= expected_layers
        ):
            raise OtdusError(f"rewritten config {name}={value} exceeds the {expected_layers} layers")


def _check_unchanged(written: dict, source: dict, may_change: set, where: str) -> None:
    changed = sorted(
        k for k in set(written) | set(source) if k not in may_change and written.get(k) != source.get(k)
    )
    if changed:
        raise OtdusError(f"rewritten config changed {where}{changed[0]}, which does not depend on depth")
