"""Rewriting config.json for a new depth, driven by the DEPTH_FIELDS table."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

from otdus_cli.arch.families import DEPTH_FIELDS
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
    try:
        from transformers import AutoConfig

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = AutoConfig.for_model(**config)
    except Exception:
        return None
    types = getattr(loaded, "layer_types", None)
    return list(types) if isinstance(types, list) else None


def rewrite_config(config: dict, layer_map: list[OutputLayer], derives_layer_types: bool = True) -> dict:
    """A copy of `config` describing the expanded stack.

    ``derives_layer_types``: whether transformers may derive layer_types for this family (see
    Family.derives_layer_types); if not, only an explicit layer_types list is carried over.
    """
    base_layers = int(config["num_hidden_layers"])
    sources = [lay.source for lay in layer_map]
    out = copy.deepcopy(config)
    out["num_hidden_layers"] = len(layer_map)
    if derives_layer_types:
        types = derived_layer_types(config)
    else:
        types = list(config["layer_types"]) if isinstance(config.get("layer_types"), list) else None
    if types is not None:
        if len(types) != base_layers:
            raise OtdusError(f"config layer_types has {len(types)} entries for {base_layers} layers")
        out["layer_types"] = [types[i] for i in sources]
    for name, kind in DEPTH_FIELDS.items():
        value = config.get(name)
        if value is None or name == "layer_types":
            continue
        if kind == "per_layer" and isinstance(value, list):
            if len(value) != base_layers:
                raise OtdusError(f"config {name} has {len(value)} entries for {base_layers} layers")
            out[name] = [value[i] for i in sources]
        elif kind == "index_list" and isinstance(value, list):
            listed = set(value)
            out[name] = [j for j, i in enumerate(sources) if i in listed]
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
        elif kind == "refuse" and value:
            raise OtdusError(
                f"config {name}={value}: layers stored after the decoder stack are not supported yet"
            )
    _rewrite_sparse_step(config, out, sources)
    return out


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


def validate_with_transformers(folder: Path, expected_layers: int) -> str | None:
    """Load the written config the way users will, so a bad config fails here and not in their job.

    Returns None when transformers loaded it, else why the load check was skipped: a model_type
    transformers does not know (--allow-unknown-arch) cannot be loaded by it, so only the depth
    fields are checked in the JSON itself.
    """
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    written = read_json_object(folder / "config.json")
    model_type = written.get("model_type")
    if model_type not in CONFIG_MAPPING:
        _check_depth(written, expected_layers)
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
    _check_depth(
        {"num_hidden_layers": loaded.num_hidden_layers, "layer_types": getattr(loaded, "layer_types", None)},
        expected_layers,
    )
    return None


def _check_depth(config: dict, expected_layers: int) -> None:
    depth = config.get("num_hidden_layers")
    if depth != expected_layers:
        raise OtdusError(f"rewritten config loads with {depth} layers, expected {expected_layers}")
    types = config.get("layer_types")
    if isinstance(types, list) and len(types) != expected_layers:
        raise OtdusError(f"rewritten config has {len(types)} layer_types for {expected_layers} layers")


# Fields rewrite_config may change; anything else in the written config must be the source's.
_REWRITTEN = {"num_hidden_layers", "torch_dtype", "dtype", *DEPTH_FIELDS}


def check_depth_rules(written: dict, source: dict, expected_layers: int) -> None:
    """The written config describes ``expected_layers`` layers by otdus's own depth rules: every
    depth field (DEPTH_FIELDS) agrees with the new depth, and nothing else differs from the source.

    This is the whole check for families whose config transformers derives nothing from the depth
    (Family.derives_layer_types false: llama, mistral, phi3, mixtral, qwen3_moe, olmoe): it needs
    no transformers import (seconds of CPU, torch included). The tests load every family's outputs
    with transformers, and validate_with_transformers adds transformers' own check whenever it is
    imported anyway.
    """
    _check_depth(written, expected_layers)
    for name, kind in DEPTH_FIELDS.items():
        value = written.get(name)
        if kind == "per_layer" and isinstance(value, list) and len(value) != expected_layers:
            raise OtdusError(f"rewritten config has {len(value)} {name} for {expected_layers} layers")
        if kind == "index_list" and isinstance(value, list):
            bad = [i for i in value if not isinstance(i, int) or not 0 <= i < expected_layers]
            if bad:
                raise OtdusError(f"rewritten config {name} lists layer {bad[0]} of {expected_layers}")
        if kind == "threshold" and isinstance(value, int) and not 0 <= value <= expected_layers:
            raise OtdusError(f"rewritten config {name}={value} exceeds the {expected_layers} layers")
    changed = sorted(
        k for k in set(written) | set(source) if k not in _REWRITTEN and written.get(k) != source.get(k)
    )
    if changed:
        raise OtdusError(f"rewritten config changed {changed[0]}, which does not depend on depth")
