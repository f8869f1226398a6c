"""`--method ot` (OT-DUS): the declaration of the method; builder.py computes, choices.py records.

A new layer is built from the adjacent pair (f_i, f_{i+1}): the neurons of f_i aligned to f_{i+1} by
optimal transport, then averaged (builder.py; moe.py for mixture-of-experts layers; calibration.py
for the activation variant's pre-pass).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from otdus_cli.arch.experts import expert_layout
from otdus_cli.arch.families import (
    CROSS_ATTENTION,
    EXPERT_BIASES,
    LATENT_ATTENTION,
    PARALLEL_BLOCKS,
    POST_NORM,
    SHARED_FUSED_EXPERTS,
)
from otdus_cli.methods.base import Method
from otdus_cli.methods.ot.choices import ot_choices
from otdus_cli.methods.ot.options import OTOptions

if TYPE_CHECKING:
    from otdus_cli.arch.families import Family
    from otdus_cli.methods.base import LayerBuilder

__all__ = ["OT", "OTOptions", "transport_warnings"]


def _builder() -> LayerBuilder:
    from otdus_cli.methods.ot.builder import OTBuilder  # torch only when building
    from otdus_cli.methods.ot.moe import build_moe_layer

    return OTBuilder(moe_layer=build_moe_layer)


def _ignored(ot: OTOptions) -> dict[str, str]:
    """OT options without effect for these values of the others."""
    ignored: dict[str, str] = {}
    if ot.variant != "activation":
        ignored |= dict.fromkeys(
            ("calib", "calib_tokens"), "only --ot-variant activation reads calibration text"
        )
    if ot.variant == "official":
        return {
            "tol": "the official variant pins the released code's stopThr 1e-9",
            "max_iter": "the official variant pins the released code's 10000 iterations",
        } | ignored
    if ot.solver == "emd":
        return dict.fromkeys(("reg", "tol", "max_iter"), "--solver emd is exact (no Sinkhorn)") | ignored
    return ignored


def _refuses_options(family: Family, ot: OTOptions) -> str | None:
    if ot.variant == "activation" and family.moe:
        return (
            f"--ot-variant activation aligns dense MLP neurons; {family.name} is a mixture of experts "
            "(use --ot-variant paper, official or structured)"
        )
    return None


def _manifest_extras(plan: Any, zero_init: bool) -> dict:
    """The OT conventions in force, each with its source (choices.py)."""
    family = plan.source.family
    moe = expert_layout(family.name) if family.moe else None
    return {"ot_choices": ot_choices(plan.options.ot, zero_init, moe)}


def transport_warnings(manifest: dict) -> list[str]:
    """Transport solves that stopped at the iteration cap or hit numerical trouble, each with the
    options that would change it (the official variant pins its iterations: only --reg applies)."""
    lines = []
    official_capped: list[tuple[float, int]] = []
    solves = 0
    for layer, stats in manifest.get("transport", {}).items():
        official = stats.get("variant") == "official"
        for module, info in (stats.get("modules") or {}).items():
            if not isinstance(info, dict):
                continue
            solves += 1
            status = info.get("status", "ok")
            error = info.get("marginal_error", float("nan"))
            if status == "ok":
                continue
            if official and status == "max_iter":
                official_capped.append((error, info.get("iterations")))
                continue
            remedy = "raise --reg" if official or status == "numerical_error" else "raise --max-iter or --reg"
            lines.append(
                f"layer {layer} {module}: Sinkhorn {status} after {info.get('iterations')} "
                f"iterations (marginal error {error:.2g}); {remedy}"
            )
    if official_capped:
        lines.insert(
            0,
            f"--ot-variant official: {len(official_capped)} of {solves} Sinkhorn solves ran the released "
            f"code's fixed {max(i for _, i in official_capped)} iterations without reaching its stopThr "
            f"1e-9 (largest marginal error {max(e for e, _ in official_capped):.2g}), as the released code "
            "does; --max-iter and --tol do not apply to it, --reg does",
        )
    return lines


OT = Method(
    "ot",
    "OT-DUS: neurons of f_i aligned to f_{i+1} by optimal transport, then averaged (docs/ot.md)",
    "placed",
    builder="ot",
    zero_init_default=True,
    pair=True,
    needs_roles=True,
    label="OT",
    options=OTOptions,
    make_builder=_builder,
    refuses={
        POST_NORM: "post-norm layers (no norm before attention or the MLP): the OT-DUS flow is defined for "
        "pre-norm ones",
        PARALLEL_BLOCKS: "attention and MLP run in parallel from one norm: the OT-DUS flow is defined for "
        "sequential blocks",
        EXPERT_BIASES: "fused experts with biases: OT knows no expert layout for them (arch/experts.py)",
        SHARED_FUSED_EXPERTS: "fused experts beside a shared expert: OT knows no expert layout for them "
        "(arch/experts.py)",
        CROSS_ATTENTION: "cross-attention layers between the self-attention ones: the OT-DUS flow knows no "
        "cross-attention roles",
        LATENT_ATTENTION: "multi-head latent attention has no q/k/v projections for the OT-DUS flow",
    },
    refuses_options=_refuses_options,
    ignored=_ignored,
    manifest_extras=_manifest_extras,
    report_warnings=transport_warnings,
)
