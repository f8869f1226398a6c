"""Checks of an expansion against its source, as users load it: every layer's bytes from the layer the
manifest names, the config transformers reloads, the logits where the function is preserved."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from otdus_cli.expand import expand
from otdus_cli.io.reader import CheckpointReader
from otdus_cli.options import ExpandOptions
from tests.support.tiny_models import load_causal_lm, logits

COPY_METHODS = ["copy", "interpose", "llama-pro", "solar", "stack"]
BUILT_METHODS = ["average", "random"]


def method_options(method: str, depth: int, **extra) -> ExpandOptions:
    layers = {"solar": depth - 2, "stack": depth, "llama-pro": depth // 2 if depth % 2 == 0 else depth}.get(
        method
    )
    return ExpandOptions(method=method, layers=layers, **extra)


def expected_sources(method: str, depth: int) -> list[int]:
    """The source layer of every output layer, written out by hand from the README's method table
    for the defaults method_options uses (not computed by the planner under test)."""
    k = depth // 2
    if method in ("copy", "interpose", "average", "random", "ot"):  # top: new after L-k-1 .. L-2
        after = list(range(depth - k - 1, depth - 1))
        return [j for i in range(depth) for j in [i] * (1 + after.count(i))]
    if method == "llama-pro":  # after every L/k base layers, a copy of the group's last one
        group = depth // (depth // 2 if depth % 2 == 0 else depth)
        return [j for i in range(depth) for j in [i] * (2 if (i + 1) % group == 0 else 1)]
    if method == "solar":  # m = 1: layers 0..L-2 then 1..L-1
        return list(range(depth - 1)) + list(range(1, depth))
    if method == "stack":
        return list(range(depth)) * 2
    raise AssertionError(method)


# the manifest's flag is checked against this, not trusted: with zero-init every method preserves
EXPECTED_PRESERVING = {"ot": True, "llama-pro": True}


def assert_layers_match_sources(src: Path, out: Path, manifest: dict) -> None:
    """Every tensor of every base and copy-built layer holds exactly its source layer's bytes, every
    zero-init target of a new layer is all zeros, and the tensors outside the stack are the source's."""
    from otdus_cli.arch.family_lookup import family_for

    family = family_for(json.loads((src / "config.json").read_text()), allow_unknown=True)
    a, b = CheckpointReader(src), CheckpointReader(out)
    prefix = "model.layers.{i}."
    expected_names = {n for n in a.names if not n.startswith("model.layers.")}
    for lay in manifest["layers"]:
        src_prefix, out_prefix = prefix.format(i=lay["source"]), prefix.format(i=lay["index"])
        suffixes = [n[len(src_prefix) :] for n in a.names if n.startswith(src_prefix)]
        assert suffixes
        zeroed = [s for s in suffixes if lay["zero_init"] and family.is_zero_target(s)]
        assert not lay["zero_init"] or len(zeroed) >= 2, lay  # at least o_proj and a down projection
        for suffix in suffixes:
            name = out_prefix + suffix
            expected_names.add(name)
            got = b.get(name)
            if suffix in zeroed:
                assert not got.view(torch.uint8).any(), name
            elif lay["builder"] in ("base", "copy"):
                want = a.get(src_prefix + suffix)
                assert torch.equal(want.view(torch.uint8), got.view(torch.uint8)), name
    assert set(b.names) == expected_names
    for n in a.names:
        if not n.startswith("model.layers."):
            assert torch.equal(a.get(n).view(torch.uint8), b.get(n).view(torch.uint8)), n


def assert_random_layers(out: Path, manifest: dict, config: dict) -> None:
    """New random layers as the README says: matrices ~ N(0, initializer_range^2), norm scales at their
    neutral value (1, or 0 for (1 + w) norms), biases zero; zero-init targets zero."""
    from otdus_cli.arch.family_lookup import family_for

    family = family_for(config)
    std = config.get("initializer_range", 0.02)
    r = CheckpointReader(out)
    for lay in manifest["layers"]:
        if not lay["new"]:
            continue
        prefix = f"model.layers.{lay['index']}."
        for name in (n for n in r.names if n.startswith(prefix)):
            t = r.get(name).float()
            if lay["zero_init"] and family.is_zero_target(name[len(prefix) :]):
                assert not t.any(), name
            elif t.dim() >= 2:  # within 4 standard errors of a sample of t.numel() normal draws
                n = t.numel()
                assert abs(float(t.std()) / std - 1) < 4 / (2 * n) ** 0.5, name
                assert abs(float(t.mean())) < 4 * std / n**0.5, name
            elif "norm" in name:
                assert torch.equal(t, torch.full_like(t, 1.0 - family.norm_offset)), name
            else:
                assert not t.any(), name


_BASE_CACHE: dict[str, tuple[list | None, torch.Tensor]] = {}


def base_reference(src: Path) -> tuple[list | None, torch.Tensor]:
    """The base model's layer_types and reference logits, computed once per source folder."""
    key = str(src)
    if key not in _BASE_CACHE:
        model = load_causal_lm(src)
        _BASE_CACHE[key] = (getattr(model.config, "layer_types", None), logits(model))
    return _BASE_CACHE[key]


def check_expansion(src: Path, out: Path, method: str, zero_init: bool | None = None) -> dict:
    base_cfg = json.loads((src / "config.json").read_text())
    depth = base_cfg["num_hidden_layers"]
    result = expand(str(src), out, method_options(method, depth, zero_init=zero_init))
    manifest = json.loads((out / "otdus.json").read_text())
    assert manifest == json.loads(json.dumps(result.manifest))
    new_depth = len(manifest["layers"])
    model = load_causal_lm(out)
    assert model.config.num_hidden_layers == new_depth
    types = getattr(model.config, "layer_types", None)
    base_types, base_logits = base_reference(src)
    if base_types is not None:
        assert types == [base_types[lay["source"]] for lay in manifest["layers"]]
    if base_cfg.get("tie_word_embeddings", True):
        assert "lm_head.weight" not in CheckpointReader(out).names
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert [lay["source"] for lay in manifest["layers"]] == expected_sources(method, depth)
    assert_layers_match_sources(src, out, manifest)
    if method == "random":
        assert_random_layers(out, manifest, base_cfg)
    preserving = bool(zero_init) or EXPECTED_PRESERVING.get(method, False)
    assert manifest["function_preserving"] == preserving
    assert torch.equal(base_logits, logits(model)) == preserving
    return manifest
