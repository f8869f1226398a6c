"""Architecture knowledge of mixture-of-experts layers, as data: where the experts and the router live.

families.py says which families are MoE; this table says, per family, how one MoE block is laid
out on disk and which config fields count its experts, so width growth (widen.py) needs no
per-family code. A MoE family without an entry here is refused by widen with one clear line.

Tensor paths are inside a decoder layer. Two on-disk layouts exist for the experts: one matrix
per expert (``experts.{e}.w1.weight``, what the hub checkpoints of these families hold) and fused
3-D tensors whose first dimension is the expert (``experts.gate_up_proj``, newer saves). Both are
recognised; any tensor whose leading dimension indexes experts (router weight and bias, a
per-expert score-correction bias, a fused expert tensor) is an "expert-indexed" tensor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from otdus_cli.errors import OtdusError


@dataclass(frozen=True)
class ExpertLayout:
    """One family's MoE block."""

    block: str  # path of the MoE block inside a layer, with its dot: "block_sparse_moe."
    count_fields: tuple[str, ...]  # config fields holding the expert count (any that are present)
    topk_field: str = "num_experts_per_tok"
    router: str = "gate"  # the router's linear layer inside the block ([E, hidden] weight)
    gate: str = "gate_proj"  # names of an expert's projections (per-expert layout)
    up: str = "up_proj"
    down: str = "down_proj"
    # dense MLP beside the experts (Qwen2-MoE's shared expert) and its scalar gate: left as they are
    shared: tuple[str, ...] = ()
    # Why duplicating experts keeps the function (checked per family by tests/test_widen.py): the
    # router is a softmax over expert logits followed by top-k (with or without renormalising the
    # k weights). Two copies of expert e get equal logits, so each gets half of e's probability,
    # top-2k picks both copies of every expert top-k picked, and their outputs sum to e's.
    routing: str = "softmax-top-k"

    def expert_regex(self) -> re.Pattern[str]:
        """Per-expert tensors: group 1 the expert index, group 2 the rest of the name."""
        return re.compile(re.escape(self.block) + r"experts\.(\d+)\.(.+)")

    def is_expert_indexed(self, suffix: str) -> bool:
        """Router weight/bias, per-expert bias vectors and fused expert tensors: dim 0 = expert."""
        rest = suffix[len(self.block) :] if suffix.startswith(self.block) else None
        if rest is None:
            return False
        return bool(re.fullmatch(re.escape(self.router) + r"\.[A-Za-z_]+", rest)) or bool(
            re.fullmatch(r"experts\.[A-Za-z_]+", rest)
        )

    def expert_count(self, config: dict) -> int:
        counts = {config[f] for f in self.count_fields if isinstance(config.get(f), int)}
        if len(counts) != 1:
            fields = ", ".join(self.count_fields)
            raise OtdusError(
                f"config.json must give the expert count in one of {fields} (found {counts or 'none'})"
            )
        return counts.pop()


_MIXTRAL = ExpertLayout("block_sparse_moe.", ("num_local_experts",), gate="w1", up="w3", down="w2")
_QWEN_MOE = ExpertLayout("mlp.", ("num_experts", "num_local_experts"))

EXPERT_LAYOUTS: dict[str, ExpertLayout] = {
    "mixtral": _MIXTRAL,
    "qwen2_moe": ExpertLayout(
        "mlp.", ("num_experts",), shared=("mlp.shared_expert.", "mlp.shared_expert_gate.")
    ),
    # a Qwen3-MoE config saved by transformers 5 names its count num_local_experts (docs/architectures.md)
    "qwen3_moe": _QWEN_MOE,
    "olmoe": ExpertLayout("mlp.", ("num_experts",)),
}

# Config fields of routers whose exact growth by duplication is not established: group-limited
# routing (DeepSeek-V3 style: experts are picked within the top groups, ranked by the sum of their
# best two scores, which a duplicate pair changes) is refused rather than grown approximately.
UNGROWABLE_ROUTING_FIELDS = ("n_group", "topk_group", "routed_scaling_factor", "scoring_func")


def expert_layout(family_name: str) -> ExpertLayout | None:
    return EXPERT_LAYOUTS.get(family_name)
