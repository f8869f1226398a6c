"""What the factor n does: `paper`, `official` and the paper's table read literally, side by side.

The paper's transport-matrix-flow table writes the plans T_O and 1/2 (T_O + I) with no scaling;
`--ot-variant paper` applies every plan as n T (Imfeld et al.'s convention), `official` applies
T unscaled on a raw cost (the released script). This script adds the third combination, the
table read literally on `paper`'s normalised cost (plans unscaled), and measures, on the real
adjacent layers of stories260K, how far each new tensor is from what "A's contribution shrinks
by ~n" predicts (1/2 W_B for q/k/v/gate/up, 1/4 g_A + 1/2 g_B for the pre-MLP norm) and how far
the literal reading is from `paper` and from `official`. docs/ot.md quotes its output.

    python -m scripts.ot_plan_scale                 # all 4 pairs (about a minute on 2 CPU cores)
    python -m scripts.ot_plan_scale --pairs 2
"""

from __future__ import annotations

import argparse
import json

import torch
from safetensors.torch import load_file

from otdus_cli.arch.family_lookup import family_for
from otdus_cli.bundled import STORIES260K
from otdus_cli.methods.base import BuildContext
from otdus_cli.methods.ot import OTOptions
from otdus_cli.methods.ot.builder import OTBuilder
from otdus_cli.transport.solve import match_rows

ROLES = {
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
}
O_PROJ, MLP_NORM = "self_attn.o_proj.weight", "post_attention_layernorm.weight"


class _Layer:
    def __init__(self, index: int, tensors: dict[str, torch.Tensor]):
        self.index, self.tensors = index, tensors

    def suffixes(self) -> list[str]:
        return list(self.tensors)

    def get(self, suffix: str) -> torch.Tensor:
        return self.tensors[suffix]


def _built(a: dict, b: dict, config: dict, variant: str) -> dict[str, torch.Tensor]:
    ctx = BuildContext(family=family_for(config), config=config, options=OTOptions(variant=variant))
    return dict(OTBuilder().build([_Layer(0, a), _Layer(1, b)], ctx))


def _literal(a: dict, b: dict) -> dict[str, torch.Tensor]:
    """The table with unscaled plans on the normalised cost (scale=1.0 everywhere)."""
    out = {}
    for role in ("q", "k", "v"):
        plan = match_rows(a[ROLES[role]], b[ROLES[role]])
        out[ROLES[role]] = 0.5 * (plan.rows_to_b(a[ROLES[role]].float(), 1.0) + b[ROLES[role]])
    plan_o = match_rows(a[O_PROJ], b[O_PROJ])
    g_a = a[MLP_NORM].float()
    out[MLP_NORM] = 0.5 * (0.5 * (plan_o.cols_to_b(g_a, 1.0) + g_a) + b[MLP_NORM])
    for role in ("gate", "up"):
        inputs = plan_o.cols_to_b(a[ROLES[role]].float(), 1.0)  # W_A T_O
        plan = match_rows(inputs, b[ROLES[role]])
        out[ROLES[role]] = 0.5 * (plan.rows_to_b(inputs, 1.0) + b[ROLES[role]])
    return out


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.float() - y.float()).norm() / y.float().norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4, help="first N adjacent pairs (0,1), (1,2), ...")
    args = parser.parse_args()
    weights = load_file(str(STORIES260K / "model.safetensors"))
    config = json.loads((STORIES260K / "config.json").read_text())

    def layer(i: int) -> dict[str, torch.Tensor]:
        prefix = f"model.layers.{i}."
        return {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}

    rows: dict[str, dict[str, list[float]]] = {}
    for i in range(min(args.pairs, config["num_hidden_layers"] - 1)):
        a, b = layer(i), layer(i + 1)
        results = {v: _built(a, b, config, v) for v in ("paper", "official")}
        results["literal"] = _literal(a, b)
        for role, name in [*ROLES.items(), ("mlp_norm", MLP_NORM)]:
            shrunk = 0.5 * b[name] if role != "mlp_norm" else 0.25 * a[name] + 0.5 * b[name]
            row = rows.setdefault(role, {})
            for variant, out in results.items():
                row.setdefault(f"{variant} vs shrunk", []).append(_rel(out[name], shrunk))
            for other in ("official", "paper"):
                distance = _rel(results["literal"][name], results[other][name])
                row.setdefault(f"literal vs {other}", []).append(distance)
        print(f"pair ({i}, {i + 1}) done", flush=True)

    columns = list(next(iter(rows.values())))
    print("relative distances, min-max over pairs; shrunk = 1/2 W_B (norm: 1/4 g_A + 1/2 g_B)")
    print("| tensor | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for role, row in rows.items():
        cells = [f"{min(v):.3f}-{max(v):.3f}" for v in row.values()]
        print(f"| {role} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
