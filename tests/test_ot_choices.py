"""The manifest records, per OT variant, the conventions in force and where each comes from
(otdus_cli/methods/ot/choices.py), and what it records is what the builder computed."""

from __future__ import annotations

import pytest
import torch

from otdus_cli.expand import expand
from otdus_cli.io.reader import CheckpointReader
from otdus_cli.methods.ot import OTOptions
from otdus_cli.methods.ot.choices import MOE_CHOICES, SOURCES, ot_choices
from otdus_cli.options import ExpandOptions
from otdus_cli.transport.solve import match_rows

UNIT_COST = "rows scaled to unit L2 norm, Euclidean (not squared) distance, divided by its maximum"
RAW_COST = "Euclidean distance between raw rows (torch.cdist, p=2)"

# The choices that tell the variants apart, written out by hand from docs/ot.md's source table:
# choice -> (value, source).
PINNED = {
    "paper": {
        "plan_scale": ("n", "imfeld"),
        "cost": (UNIT_COST, "imfeld"),
        "reg": ("0.06, relative to the largest cost (cost in [0, 1])", "imfeld"),
        "stopping": ("relative L-inf row/column marginal error <= 1e-06, at most 2000 iterations", "otdus"),
        "mlp_norm": ("1/2 (g_A T_in + g_B), T_in = 1/2 (n T_O + I)", "paper"),
        "mlp": ("gate, up: inputs W_A n T_O, then an own plan each", "paper"),
        "hidden_axis": ("moved by T_O (pre-MLP norm, gate/up inputs)", "paper"),
        "o_down": ("zero (their plans are still solved)", "paper"),
        "biases": (
            "with their weight's plan: 1/2 ((n T)^T b_A + b_B); o/down biases on the hidden axis",
            "imfeld",
        ),
        "sandwich_norms": ("through T_O / T_D (the rows they scale)", "otdus"),
    },
    "official": {
        "plan_scale": ("1", "released"),
        "cost": (RAW_COST, "released"),
        "reg": ("0.06, absolute (on the raw cost)", "released"),
        "stopping": (
            "POT: L2 column-marginal error < 1e-09 (checked every 10 iterations), at most 10000 iterations",
            "released",
        ),
        "mlp_norm": ("1/2 (g_A T_in + g_B), T_in = 1/2 (1 T_O + I)", "released"),
        "mlp": ("gate, up: inputs W_A 1 T_O, then an own plan each", "released"),
        "hidden_axis": ("moved by T_O (pre-MLP norm, gate/up inputs)", "released"),
        "o_down": ("zero (their plans are still solved)", "released"),
        "biases": (
            "with their weight's plan: 1/2 ((1 T)^T b_A + b_B); o/down biases on the hidden axis",
            "otdus",
        ),
        "sandwich_norms": ("1/2 (A + B)", "otdus"),
    },
    "structured": {
        "plan_scale": ("n", "imfeld"),
        "cost": (UNIT_COST + "; MLP: [gate | up | down column] parts each unit-normalised", "imfeld"),
        "reg": ("0.06, relative to the largest cost (cost in [0, 1])", "imfeld"),
        "stopping": ("relative L-inf row/column marginal error <= 1e-06, at most 2000 iterations", "otdus"),
        "mlp_norm": ("1/2 (g_A + g_B) (hidden axis not permuted)", "otdus"),
        "mlp": ("one plan per neuron: gate row, up row and down column together", "otdus"),
        "hidden_axis": ("never permuted (A and B share the residual stream's basis)", "otdus"),
        "o_down": ("zero (their plans are still solved)", "paper"),
        "biases": (
            "with their weight's plan: 1/2 ((n T)^T b_A + b_B); o/down biases on the hidden axis",
            "otdus",
        ),
        "sandwich_norms": ("1/2 (A + B)", "otdus"),
    },
}


@pytest.fixture(scope="module")
def expanded(tmp_path_factory):
    """stories260K + one new OT layer (top: from layers 3 and 4) per variant: (folder, manifest)."""
    from otdus_cli.bundled import STORIES260K

    cache: dict = {}

    def get(variant: str):
        if variant not in cache:
            out = tmp_path_factory.mktemp("choices") / variant
            result = expand(
                str(STORIES260K), out, ExpandOptions(method="ot", layers=1, ot=OTOptions(variant=variant))
            )
            cache[variant] = (out, result.manifest)
        return cache[variant]

    return get


@pytest.mark.parametrize("variant", ["paper", "official", "structured"])
def test_manifest_records_each_variants_choices(expanded, variant):
    _, manifest = expanded(variant)
    choices = manifest["ot_choices"]
    got = {name: (choices[name]["value"], choices[name]["source"]) for name in PINNED[variant]}
    assert got == PINNED[variant]
    assert all(c["source"] in SOURCES for c in choices.values())
    # the same choices are named for every variant, so two manifests compare key by key
    assert set(choices) == set(ot_choices(OTOptions(variant="paper"), True))


@pytest.mark.parametrize("variant", ["paper", "official"])
def test_recorded_scale_and_cost_are_what_was_built(expanded, variant):
    """Recompute q and the pre-MLP norm of the new layer from the recorded cost and plan scale:
    the written tensors are bit-identical, and the other scale would not give them."""
    out, manifest = expanded(variant)
    choices = manifest["ot_choices"]
    new = next(layer for layer in manifest["layers"] if layer["new"])
    i, j = new["parents"]
    base, built = CheckpointReader(manifest["source"]["path"]), CheckpointReader(out)
    cost = {UNIT_COST: "paper", RAW_COST: "raw"}[choices["cost"]["value"]]
    solver = "official" if choices["solver"]["source"] == "released" else "sinkhorn"

    def parent(k: int, name: str) -> torch.Tensor:
        return base.get(f"model.layers.{k}.{name}").float()

    def written(name: str) -> torch.Tensor:
        return built.get(f"model.layers.{new['index']}.{name}")

    q = "self_attn.q_proj.weight"
    plan_q = match_rows(parent(i, q), parent(j, q), cost=cost, solver=solver)
    o = "self_attn.o_proj.weight"
    plan_o = match_rows(parent(i, o), parent(j, o), cost=cost, solver=solver)
    g = "post_attention_layernorm.weight"
    g_a, g_b = parent(i, g), parent(j, g)

    def expected(scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        q_new = (plan_q.rows_to_b(parent(i, q), scale) + parent(j, q)) * 0.5
        g_new = ((plan_o.cols_to_b(g_a, scale) + g_a) * 0.5 + g_b) * 0.5
        return q_new, g_new

    recorded = {"n": float(plan_q.n), "1": 1.0}[choices["plan_scale"]["value"]]
    other = 1.0 if recorded != 1.0 else float(plan_q.n)
    q_new, g_new = expected(recorded)
    assert torch.equal(written(q), q_new) and torch.equal(written(g), g_new)
    q_other, g_other = expected(other)
    assert (written(q) - q_other).norm() > 0.1 * q_other.norm()
    assert (written(g) - g_other).norm() > 0.1 * g_other.norm()


def test_options_away_from_the_defaults_show_in_the_choices():
    user_reg = ot_choices(OTOptions(reg=0.1, tol=1e-4, max_iter=50), True)
    reg = {"value": "0.1, relative to the largest cost (cost in [0, 1])", "source": "user"}
    assert user_reg["reg"] == reg
    assert user_reg["stopping"]["value"].endswith("<= 0.0001, at most 50 iterations")
    exact = ot_choices(OTOptions(solver="emd"), True)
    assert exact["stopping"] == {"value": "none (exact plan)", "source": "otdus"}
    assert exact["reg"]["value"] == "unused (exact plan)"
    kept = ot_choices(OTOptions(), zero_init=False)["o_down"]
    assert kept == {"value": "aligned average with their own plans, T_in = I", "source": "paper"}


def test_methods_other_than_ot_record_no_choices(tmp_path):
    from otdus_cli.bundled import STORIES260K

    result = expand(str(STORIES260K), tmp_path / "avg", ExpandOptions(method="average", layers=1))
    assert "ot_choices" not in result.manifest


# MoE layers (methods/ot/moe.py) add the choices of MOE_CHOICES; written out by hand per variant.
MOE_PINNED = {
    "paper": {
        "experts_matching": (
            "on the router rows of A moved through T_O (W_A n T_O): rows scaled to unit L2 norm, Euclidean "
            "distance, divided by its maximum (in every variant); expert weights are not compared (their "
            "neurons are unordered)",
            "otdus",
        ),
        "expert_plan": (
            "exact assignment (linear_sum_assignment, float64): a permutation, never a blend of experts",
            "otdus",
        ),
        "expert_mlp": (
            "each matched pair aligned as the dense `mlp` above; down: zero (no plan is solved for it)",
            "otdus",
        ),
        "shared_experts": (
            "a dense SwiGLU MLP aligned as `mlp` says (down as experts' down); its scalar gate row averaged "
            "through T_O, 1/2 (g_A n T_O + g_B)",
            "otdus",
        ),
    },
    "structured": {
        "experts_matching": (
            "on the raw router rows: rows scaled to unit L2 norm, Euclidean distance, divided by its maximum "
            "(in every variant); expert weights are not compared (their neurons are unordered)",
            "otdus",
        ),
        "expert_mlp": (
            "each matched pair aligned as the dense `mlp` above; down: zero (its columns still shape the "
            "joint plan)",
            "otdus",
        ),
        "shared_experts": ("none in this family", "otdus"),
    },
}


@pytest.fixture(scope="module")
def moe_expanded(tiny_models, tmp_path_factory):
    """One new OT layer (from the top pair) of a tiny MoE model: (folder, manifest) per (family, variant)."""
    cache: dict = {}

    def get(model_type: str, variant: str):
        if (model_type, variant) not in cache:
            out = tmp_path_factory.mktemp("moe-choices") / f"{model_type}-{variant}"
            options = ExpandOptions(method="ot", layers=1, ot=OTOptions(variant=variant))
            cache[model_type, variant] = (out, expand(str(tiny_models[model_type]), out, options).manifest)
        return cache[model_type, variant]

    return get


@pytest.mark.parametrize(("model_type", "variant"), [("qwen2_moe", "paper"), ("mixtral", "structured")])
def test_moe_manifest_records_how_experts_were_matched(moe_expanded, model_type, variant):
    _, manifest = moe_expanded(model_type, variant)
    choices = manifest["ot_choices"]
    got = {name: (choices[name]["value"], choices[name]["source"]) for name in MOE_PINNED[variant]}
    assert got == MOE_PINNED[variant]
    # the dense choices plus every MoE one, whatever the family: two MoE manifests compare key by key
    assert set(choices) == set(ot_choices(OTOptions(variant="paper"), True)) | set(MOE_CHOICES)
    assert "experts_matching" not in ot_choices(OTOptions(), True)  # dense manifests do not name them


def test_moe_recorded_choices_are_what_was_built(moe_expanded):
    """Qwen2-MoE, paper: recompute the expert permutation from the router rows moved through T_O (as
    recorded), then the new router and the shared expert's gate: bit-identical to what was written.
    The raw router rows (structured's recorded input) would not give the same router."""
    from otdus_cli.transport.assignment import assignment
    from otdus_cli.transport.cost import paper_cost

    def average(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x + y) * 0.5

    out, manifest = moe_expanded("qwen2_moe", "paper")
    assert "T_O" in manifest["ot_choices"]["experts_matching"]["value"]
    new = next(layer for layer in manifest["layers"] if layer["new"])
    i, j = new["parents"]
    base, built = CheckpointReader(manifest["source"]["path"]), CheckpointReader(out)

    def parent(k: int, name: str) -> torch.Tensor:
        return base.get(f"model.layers.{k}.{name}").float()

    def written(name: str) -> torch.Tensor:
        return built.get(f"model.layers.{new['index']}.{name}")

    o = "self_attn.o_proj.weight"
    plan_o = match_rows(parent(i, o), parent(j, o))
    router, shared_gate = "mlp.gate.weight", "mlp.shared_expert_gate.weight"
    ra, rb = plan_o.cols_to_b(parent(i, router)), parent(j, router)
    plan = assignment(paper_cost(ra, rb))
    perm = [int(p) for p in plan.perm]
    record = manifest["transport"][str(new["index"])]["modules"]["experts"]
    assert perm == record["perm"] and perm != list(range(len(perm)))  # a real permutation was applied
    assert torch.equal(written(router), average(plan.rows_to_b(ra), rb))
    ga, gb = plan_o.cols_to_b(parent(i, shared_gate)), parent(j, shared_gate)
    assert torch.equal(written(shared_gate), average(ga, gb))
    raw = assignment(paper_cost(parent(i, router), rb))
    assert not torch.equal(written(router), average(raw.rows_to_b(parent(i, router)), rb))
