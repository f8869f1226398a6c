"""`--method lesa` (LESA, Yang et al.): the declaration of the method; builder.py computes.

Per projection type, an MLP trained on the base layers' SVD coefficients predicts a new layer's
from its neighbours f_i and f_{i+1} (builder.py has the method, its variants and our choices).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from otdus_cli.arch.families import CROSS_ATTENTION, MOE
from otdus_cli.methods.base import Method
from otdus_cli.methods.lesa.options import LesaOptions

if TYPE_CHECKING:
    from otdus_cli.methods.base import LayerBuilder

__all__ = ["LESA", "LesaOptions", "lesa_check_lines", "lesa_summary"]


def _builder() -> LayerBuilder:
    from otdus_cli.methods.lesa.builder import LesaBuilder  # torch only when building

    return LesaBuilder()


def lesa_check_lines(manifest: dict) -> list[str]:
    """LESA's leave-one-out check in words: per projection type, the held-out error next to the
    plain average's (the predictor is worth its training where it is lower)."""
    report = manifest.get("lesa")
    if report is None:
        return []
    if "loo_skipped" in report:
        return [f"LESA leave-one-out check skipped: {report['loo_skipped']}"]
    lines = []
    for role, info in report["projections"].items():
        loo = info["loo"]
        better = "better" if loo["error"] < loo["average_error"] else "NOT better"
        lines.append(
            f"LESA {role}: held-out relative error {loo['error']:.3f} on layer(s) "
            f"{','.join(map(str, loo['held_out']))} ({better} than the plain neighbour average's "
            f"{loo['average_error']:.3f}; {loo['fit_error']:.3f} when trained on it)"
        )
    return lines


def lesa_summary(report: dict) -> str:
    """One line: the variant and, per projection type, held-out error (plain average's)."""
    errors = [
        f"{role} {info['loo']['error']:.3f} ({info['loo']['average_error']:.3f})"
        for role, info in report["projections"].items()
        if "loo" in info
    ]
    check = "held-out error (plain average's): " + ", ".join(errors) if errors else "no leave-one-out check"
    return f"variant {report['variant']}; {check}"


LESA = Method(
    "lesa",
    "LESA: per projection, an MLP trained on every layer's SVD coefficients predicts f_i+1/2's from f_i "
    "and f_{i+1} (docs/methods.md, LESA)",
    "placed",
    builder="lesa",
    zero_init_default=True,
    pair=True,
    needs_roles=True,
    roles_of_every_layer=True,
    zero_init_off_for=("published",),
    label="LESA",
    options=LesaOptions,
    make_builder=_builder,
    refuses={
        MOE: "MoE layers: expert matrices have no single per-layer projection to decompose",
        CROSS_ATTENTION: "cross-attention layers between the self-attention ones: LESA predicts "
        "self-attention layers' projections only",
    },
    report_json=lambda manifest: {"lesa": manifest["lesa"]} if "lesa" in manifest else {},
    report_lines=lesa_check_lines,
    inspect_rows=lambda manifest: [("LESA", lesa_summary(manifest["lesa"]))] if "lesa" in manifest else [],
)
