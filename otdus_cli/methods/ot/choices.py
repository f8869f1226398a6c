"""The conventions each OT-DUS variant uses, and where each comes from (recorded in the manifest).

Two checkpoints built with different variants, or by different otdus versions, can then be
compared choice by choice. Each choice has a ``value`` (what is computed) and a ``source``:

* ``paper``: stated by the OT-DUS paper (Cao, Wang & Aletras, arXiv 2508.08011): its
  transport-matrix-flow table and Algorithm 1 (docs/ot.md, "Where each choice comes from");
* ``imfeld``: the convention of Imfeld et al. 2024's released transformer-fusion code
  (graldij/transformer-fusion), which the paper builds on;
* ``released``: the OT-DUS authors' released script (voalmciaf/OpT-DeUS, ``Model/OT-DUS.py``);
* ``otdus``: our own choice (the paper and the released script cover Llama tensors only);
* ``user``: an option the user set away from the variant's default.

The builder (methods/ot/builder.py, methods/ot/moe.py) is what computes; this table says what it computes.
tests/test_ot_choices.py checks the two against each other.
"""

from __future__ import annotations

from typing import Any

from otdus_cli.arch.experts import ExpertLayout
from otdus_cli.methods.ot.options import OTOptions

__all__ = ["MOE_CHOICES", "SOURCES", "ot_choices"]

SOURCES = ("paper", "imfeld", "released", "otdus", "user")

_DEFAULT_REG = 0.06
_RELEASED_ITERATIONS, _RELEASED_STOP = 10000, 1e-9
_DEFAULT_CALIB = (OTOptions().calib, OTOptions().calib_tokens)


def _choice(value: Any, source: str) -> dict[str, Any]:
    assert source in SOURCES, source
    return {"value": value, "source": source}


# The choices only a mixture-of-experts layer has (methods/ot/moe.py): every MoE manifest names them all.
MOE_CHOICES = ("experts_matching", "expert_plan", "expert_mlp", "router", "router_biases", "shared_experts")


def ot_choices(ot: OTOptions, zero_init: bool, moe: ExpertLayout | None = None) -> dict[str, dict[str, Any]]:
    """choice -> {"value", "source"} for ``--method ot`` with these options; ``moe``: the family's
    expert layout when the new layers are MoE layers (adds MOE_CHOICES)."""
    variant, exact = ot.variant, ot.solver == "emd"
    official, activation = variant == "official", variant == "activation"
    structured = variant in ("structured", "activation")  # activation: structured's flow
    # Where this variant's conventions come from when they are not the paper's own.
    fusion = "released" if official else "imfeld"
    ours = "otdus"
    # 0.06 is Imfeld et al.'s value for weight costs; on activation costs it is ours
    reg_source = "user" if ot.reg != _DEFAULT_REG else (ours if activation else fusion)
    scale = "1" if official else "n"

    if official:
        cost = _choice("Euclidean distance between raw rows (torch.cdist, p=2)", "released")
        reg = _choice(f"{ot.reg}, absolute (on the raw cost)", reg_source)
        solver = _choice("POT ot.sinkhorn, standard domain, float32", "released")
        stopping = _choice(
            f"POT: L2 column-marginal error < {_RELEASED_STOP:g} (checked every 10 iterations), "
            f"at most {_RELEASED_ITERATIONS} iterations",
            "released",
        )
    else:
        cost = (
            _choice(
                "1 - Pearson correlation of activations on the calibration text, divided by its maximum; "
                "MLP neurons: down_proj inputs; heads: residual-stream contributions; V dims: head outputs",
                ours,
            )
            if activation
            else _choice(
                "rows scaled to unit L2 norm, Euclidean (not squared) distance, divided by its maximum"
                + ("; MLP: [gate | up | down column] parts each unit-normalised" if structured else ""),
                "imfeld",
            )
        )
        if exact:
            reg = _choice("unused (exact plan)", ours)
            solver = _choice("exact assignment (linear_sum_assignment): the plan is P / n", ours)
            stopping = _choice("none (exact plan)", ours)
        else:
            reg = _choice(f"{ot.reg}, relative to the largest cost (cost in [0, 1])", reg_source)
            solver = _choice("Sinkhorn, log-stabilised (absorption, over-relaxation), float32", ours)
            stopping = _choice(
                f"relative L-inf row/column marginal error <= {ot.tol:g}, at most {ot.max_iter} iterations",
                ours,
            )

    choices = {
        "marginals": _choice("uniform, 1/n on both sides", "released" if official else "paper"),
        "cost": cost,
        "reg": reg,
        "solver": solver,
        "stopping": stopping,
        "plan_scale": _choice(scale, "released" if official else "imfeld"),
        "average": _choice(f"1/2 (({scale} T)^T W_A T_in + W_B)", "released" if official else "paper"),
    }
    if structured:
        choices |= {
            "hidden_axis": _choice("never permuted (A and B share the residual stream's basis)", ours),
            "attention": _choice(
                "whole heads by exact assignment (a KV head with its query heads), q/k dims never "
                "permuted (RoPE), V dims by a plan per head with o's columns following"
                + ("; matched on activation correlations" if activation else ""),
                ours,
            ),
            "mlp": _choice("one plan per neuron: gate row, up row and down column together", ours),
            "input_norm": _choice("1/2 (g_A + g_B)", ours),
            "mlp_norm": _choice("1/2 (g_A + g_B) (hidden axis not permuted)", ours),
        }
    else:
        flow = "released" if official else "paper"
        choices |= {
            "hidden_axis": _choice("moved by T_O (pre-MLP norm, gate/up inputs)", flow),
            "attention": _choice("q, k, v rows: an own plan each, T_in = I", flow),
            "mlp": _choice(f"gate, up: inputs W_A {scale} T_O, then an own plan each", flow),
            "input_norm": _choice("1/2 (g_A + g_B) (T_in = I)", flow),
            "mlp_norm": _choice(f"1/2 (g_A T_in + g_B), T_in = 1/2 ({scale} T_O + I)", flow),
        }
    choices["o_down"] = (
        _choice("zero (their plans are still solved)", "released" if official else "paper")
        if zero_init
        else _choice(
            "aligned average with their own plans" + ("" if structured else ", T_in = I"),
            ours if structured else ("released" if official else "paper"),
        )
    )
    if activation:
        calib_source = "user" if (ot.calib, ot.calib_tokens) != _DEFAULT_CALIB else ours
        choices["calibration"] = _choice(
            f"{ot.calib}, at most {ot.calib_tokens} tokens (whole windows of 256), streamed through the "
            "source layer by layer",
            calib_source,
        )
    else:
        weights_only = "none (plans from weights only)"
        choices["calibration"] = _choice(weights_only, "released" if official else "paper")
    choices |= {
        "biases": _choice(
            f"with their weight's plan: 1/2 (({scale} T)^T b_A + b_B); o/down biases on the hidden axis",
            ours if official or structured else "imfeld",
        ),
        "q_k_norms": _choice("1/2 (A + B): per head_dim, shared by all heads", ours),
        "sandwich_norms": _choice(
            "through T_O / T_D (the rows they scale)" if variant == "paper" else "1/2 (A + B)", ours
        ),
        "norm_offset": _choice("plans act on the gain 1 + w of (1 + w) norms", ours),
        "fused_tensors": _choice("split (qkv; gate_up), aligned as separate roles, re-fused", ours),
        "other_tensors": _choice("1/2 (A + B)", ours),
    }
    if moe is not None:
        choices |= _moe_choices(scale, structured, zero_init, moe)
    return choices


def _moe_choices(
    scale: str, structured: bool, zero_init: bool, moe: ExpertLayout
) -> dict[str, dict[str, Any]]:
    """How moe.py matches experts and treats the router and shared experts (none of it is in the
    paper or the released script, which cover dense Llama layers only: all ours)."""
    ours = "otdus"
    router_input = (
        "raw router rows" if structured else f"router rows of A moved through T_O (W_A {scale} T_O)"
    )
    if zero_init:
        down = (
            "zero (its columns still shape the joint plan)"
            if structured
            else "zero (no plan is solved for it)"
        )
    else:
        down = "aligned with the joint plan" if structured else "aligned average with its own plan"
    shared = (
        "none in this family"
        if not moe.shared
        else "a dense SwiGLU MLP aligned as `mlp` says (down as experts' down); its scalar gate row "
        + (
            "averaged, 1/2 (g_A + g_B)"
            if structured
            else f"averaged through T_O, 1/2 (g_A {scale} T_O + g_B)"
        )
    )
    return {
        "experts_matching": _choice(
            f"on the {router_input}: rows scaled to unit L2 norm, Euclidean distance, divided by its "
            "maximum (in every variant); expert weights are not compared (their neurons are unordered)",
            ours,
        ),
        "expert_plan": _choice(
            "exact assignment (linear_sum_assignment, float64): a permutation, never a blend of experts",
            ours,
        ),
        "expert_mlp": _choice(f"each matched pair aligned as the dense `mlp` above; down: {down}", ours),
        "router": _choice(
            "rows follow the expert permutation: 1/2 (P R_A' + R_B), R_A' the matched rows", ours
        ),
        "router_biases": _choice("router bias and score-correction bias follow P: 1/2 (P b_A + b_B)", ours),
        "shared_experts": _choice(shared, ours),
    }
