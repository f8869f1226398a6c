"""OT-DUS on MoE layers: experts matched by their router rows, neurons aligned inside each pair.

Planted symmetry, as for dense layers (test_ot_builder.py): layer B is layer A with its experts
permuted (router rows with them), the neurons inside every expert permuted, and 1% noise. A correct
alignment recovers B: the new layer's router and expert gate/up are within 5% of B's. Zero-init:
the expanded model's logits equal the base's bit for bit, per family and variant.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from otdus_cli.arch.experts import expert_layout
from otdus_cli.arch.family_lookup import family_for
from otdus_cli.expand import expand
from otdus_cli.methods.base import BuildContext
from otdus_cli.methods.ot import OT, OTOptions
from otdus_cli.options import ExpandOptions
from tests.support.tiny_models import MOE_TYPES, load_causal_lm, logits

pytestmark = pytest.mark.usefixtures("single_thread")

RECOVERED = 0.05
NOISE = 0.01


class DictLayer:
    def __init__(self, index: int, tensors: dict[str, torch.Tensor]):
        self.index = index
        self.tensors = tensors

    def suffixes(self) -> list[str]:
        return list(self.tensors)

    def get(self, suffix: str) -> torch.Tensor:
        return self.tensors[suffix]


def _layer(folder, index: int) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{index}."
    weights = load_file(str(folder / "model.safetensors"))
    return {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}


def _planted(a: dict, block: str, names: tuple[str, str, str], experts: int, seed: int) -> tuple[dict, list]:
    """B = A with experts permuted (B's expert f is A's expert order[f]), neurons permuted in each."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(experts, generator=gen).tolist()
    gate, up, down = names
    b = dict(a)
    router = f"{block}gate.weight"
    b[router] = a[router][order]
    for f, e in enumerate(order):
        rows = a[f"{block}experts.{e}.{gate}.weight"].shape[0]
        pi = torch.randperm(rows, generator=gen)
        b[f"{block}experts.{f}.{gate}.weight"] = a[f"{block}experts.{e}.{gate}.weight"][pi]
        b[f"{block}experts.{f}.{up}.weight"] = a[f"{block}experts.{e}.{up}.weight"][pi]
        b[f"{block}experts.{f}.{down}.weight"] = a[f"{block}experts.{e}.{down}.weight"][:, pi]
    noisy = {
        k: v + NOISE * v.std() * torch.randn(v.shape, generator=gen) if v.numel() > 1 else v
        for k, v in b.items()
    }
    return noisy, order


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).norm() / y.norm())


@pytest.mark.parametrize(
    ("model_type", "variant", "solver"),
    [("mixtral", "paper", "sinkhorn"), ("qwen2_moe", "structured", "emd"), ("olmoe", "paper", "emd")],
)
def test_permuted_experts_and_neurons_are_recovered(tiny_models, model_type, variant, solver):
    folder = tiny_models[model_type]
    config = json.loads((folder / "config.json").read_text())
    family = family_for(config)
    lay = expert_layout(family.name)
    a = _layer(folder, 1)
    b, order = _planted(a, lay.block, (lay.gate, lay.up, lay.down), 4, seed=5)
    ctx = BuildContext(
        family=family, config=config, options=OTOptions(variant=variant, solver=solver, tol=1e-5)
    )
    out = dict(OT.make_builder().build([DictLayer(1, a), DictLayer(2, b)], ctx))
    assert sorted(out) == sorted(a)
    perm = ctx.stats["modules"]["experts"]["perm"]
    assert [perm[e] for e in order] == list(range(4))  # A's expert order[f] went to B's f
    router = f"{lay.block}gate.weight"
    assert _rel(out[router], b[router]) < RECOVERED
    for f in range(4):
        for proj in (lay.gate, lay.up):
            name = f"{lay.block}experts.{f}.{proj}.weight"
            assert _rel(out[name], b[name]) < RECOVERED, (name, _rel(out[name], b[name]))
            # the plain average of unaligned experts/neurons is far off
            assert _rel((a[name] + b[name]) / 2, b[name]) > 0.3
        assert not out[f"{lay.block}experts.{f}.{lay.down}.weight"].any()  # zero-init
    assert len(ctx.stats["experts"]) == 4 and all("a" in p and "b" in p for p in ctx.stats["experts"])


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_zero_init_ot_is_an_exact_identity(tiny_models, tmp_path, model_type):
    folder = tiny_models[model_type]
    base = logits(load_causal_lm(folder))
    for variant in ("paper", "structured"):
        out = tmp_path / variant
        result = expand(str(folder), out, ExpandOptions(method="ot", layers=2, ot={"variant": variant}))
        assert result.plan.function_preserving
        assert torch.equal(logits(load_causal_lm(out)), base), variant
        stats = result.manifest["transport"]
        layer = stats[next(iter(stats))]
        assert len(layer["experts"]) == 4 and "experts" in layer["modules"]
