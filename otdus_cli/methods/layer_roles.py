"""A decoder layer seen as roles (q, k, v, o, gate, up, down, norms), shared by the builders that
work role by role (the OT and LESA builders).

* where each role's weight and bias live in a layer, fused tensors (Phi-3's qkv, gate_up) split
  into their parts and re-fused on the way out (RoleLayout, RoleOutputs);
* a parent layer's roles read when first asked for, and the two parents of a new layer side by side
  (ParentRoles, ParentPair);
* the role-wise arithmetic the builders share: the average, the all-zero role, and the aligned
  average 1/2 ((s T)^T X_A + X_B) of a role through a transport plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from otdus_cli.arch.families import UNGATED_MLP
from otdus_cli.arch.heads import Heads
from otdus_cli.errors import OtdusError
from otdus_cli.methods.base import ParentLayer
from otdus_cli.transport.plan import TransportPlan

# The roles of a dense decoder layer that the OT formulas need; every dense family template provides
# them (Phi-3 through its fused qkv / gate_up tensors), all but gate where its MLP has none (UNGATED_MLP).
DENSE_ROLES = ("q", "k", "v", "o", "gate", "up", "down")


def dense_roles(family) -> tuple[str, ...]:
    """The projections a ``family`` layer holds: DENSE_ROLES, without gate for an ungated MLP."""
    return tuple(r for r in DENSE_ROLES if r != "gate" or not family.has(UNGATED_MLP))


NORM_ROLES = ("attn_norm", "mlp_norm", "attn_out_norm", "mlp_out_norm", "q_norm", "k_norm")

# role -> {"weight": tensor, "bias": tensor} (a role without bias has no "bias" key)
Tensors = dict[str, dict[str, torch.Tensor]]


# --------------------------------------------------------------------------------------------
# Tensor layout: roles <-> suffixes, fused tensors split and re-fused.


class RoleLayout:
    """Where each role's weight/bias lives in a layer, and how fused tensors split."""

    def __init__(
        self,
        family,
        config: dict,
        suffixes: list[str],
        required: tuple[str, ...] | None = None,  # None: dense_roles(family)
        roles: dict[str, str] | None = None,
        method: str = "ot",
    ):
        self.family = family
        self.config = config
        present = set(suffixes)
        self.where: dict[str, dict[str, str]] = {}
        for role, path in (family.roles if roles is None else roles).items():
            found = {kind: f"{path}.{kind}" for kind in ("weight", "bias") if f"{path}.{kind}" in present}
            if "weight" in found:
                self.where[role] = found
        # part role -> the fused role that stores it (Phi-3: q -> qkv, gate -> gate_up)
        self.fused_in: dict[str, str] = {
            part: fused for fused, parts in family.fused.items() if fused in self.where for part in parts
        }
        self.roles = set(self.where) | set(self.fused_in)
        lacking = [r for r in (dense_roles(family) if required is None else required) if r not in self.roles]
        if lacking:
            raise OtdusError(
                f"--method {method} needs the {'/'.join(lacking)} tensors, which this {family.name} layer "
                "lacks (is the family template right?)"
            )

    def sizes(self, fused: str, rows: int) -> list[int]:
        parts = self.family.fused[fused]
        if parts == ("q", "k", "v"):
            heads = Heads.from_config(self.config)
            sizes = [heads.n_q * heads.head_dim, heads.n_kv * heads.head_dim, heads.n_kv * heads.head_dim]
        elif len(parts) == 2:
            sizes = [rows // 2, rows - rows // 2]
        else:
            raise OtdusError(f"cannot split fused tensor {fused} into {parts}")
        if sum(sizes) != rows:
            raise OtdusError(f"fused {fused} has {rows} rows, the config implies {sum(sizes)} ({sizes})")
        return sizes


class ParentRoles:
    """One parent layer's roles, each read when first asked for (storage dtype, compute device).

    A fused tensor is read once; its parts not asked for yet wait here until they are.
    """

    def __init__(self, layer: ParentLayer, layout: RoleLayout, device: torch.device):
        self.layer = layer
        self.layout = layout
        self.device = device
        self._waiting: Tensors = {}

    def _read(self, role: str) -> dict[str, torch.Tensor]:
        return {kind: self.layer.get(name).to(self.device) for kind, name in self.layout.where[role].items()}

    def take(self, role: str) -> dict[str, torch.Tensor]:
        if role in self._waiting:
            return self._waiting.pop(role)
        fused = self.layout.fused_in.get(role)
        if fused is None:
            return self._read(role)
        parts = self.layout.family.fused[fused]
        for kind, t in self._read(fused).items():
            sizes = self.layout.sizes(fused, t.shape[0])
            for part, piece in zip(parts, torch.split(t, sizes, dim=0), strict=True):
                self._waiting.setdefault(part, {})[kind] = piece
        return self._waiting.pop(role)


@dataclass
class ParentPair:
    a: ParentRoles
    b: ParentRoles

    def has(self, role: str) -> bool:
        return role in self.a.layout.roles

    def take(self, role: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(A's, B's) tensors of ``role``; their shapes must agree."""
        ta, tb = self.a.take(role), self.b.take(role)
        for kind, t in ta.items():
            if tb[kind].shape != t.shape:
                raise OtdusError(
                    f"{role}.{kind}: shapes differ between the layers ({t.shape} vs {tb[kind].shape})"
                )
        return ta, tb


class RoleOutputs:
    """Finished roles -> (suffix, tensor); the parts of a fused tensor wait for each other."""

    def __init__(self, layout: RoleLayout):
        self.layout = layout
        self._parts: dict[str, Tensors] = {}

    def put(self, role: str, tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        fused = self.layout.fused_in.get(role)
        if fused is None:
            where = self.layout.where.get(role, {})
            return [(where[kind], t) for kind, t in tensors.items() if kind in where]
        group = self._parts.setdefault(fused, {})
        group[role] = tensors
        parts = self.layout.family.fused[fused]
        if not all(p in group for p in parts):
            return []
        del self._parts[fused]
        return [
            (name, torch.cat([group[p][kind] for p in parts], dim=0))
            for kind, name in self.layout.where[fused].items()
        ]


# --------------------------------------------------------------------------------------------
# Small helpers. Inputs taken from a parent are never modified in place (a parent may hand out
# tensors it keeps); results of products are fresh and updated in place to save a buffer.


def f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32)


def average(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x + y) * 0.5


def average_role(ta: dict[str, torch.Tensor], tb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {kind: average(f32(t), tb[kind]) for kind, t in ta.items()}


def zeros_like_role(ta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """All-zero tensors of ``ta``'s shapes as broadcast views (no memory; written as zeros)."""
    return {
        kind: torch.zeros((), dtype=torch.float32, device=t.device).expand(t.shape) for kind, t in ta.items()
    }


def aligned_role(
    plan: TransportPlan, ta: dict[str, torch.Tensor], tb: dict[str, torch.Tensor], scale: float | None
) -> dict[str, torch.Tensor]:
    """1/2 ((s T)^T X_A + X_B) for the weight (already input-aligned) and the bias of one role.

    The bias moves with its weight's output plan, as in Imfeld et al.'s fusion code; the paper and
    the released script have no biases (Llama), so for them this is our extension.
    """
    out = {}
    for kind, t in ta.items():
        moved = plan.rows_to_b(f32(t), scale)  # fresh: safe to update in place
        out[kind] = add_into(moved, tb[kind]).mul_(0.5)
    return out


_ADD_BLOCK_ELEMENTS = 1 << 22


def add_into(out: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """out += other, in row blocks when ``other`` needs converting (no full float32 copy of it)."""
    if other.dtype == out.dtype or other.dim() < 2:
        return out.add_(other)
    step = max(1, _ADD_BLOCK_ELEMENTS // max(1, other[0].numel()))
    for s in range(0, other.shape[0], step):
        out[s : s + step].add_(other[s : s + step])
    return out
