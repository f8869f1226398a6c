"""Attention geometry as the methods read it from a config: query heads, KV heads, head size.

The role-wise methods (methods/layer_roles.py) split q/k/v/o by it, and the proof of a derived
template's roles (arch/derived_roles.py) checks the shapes against it: architecture data, read here.
"""

from __future__ import annotations

from dataclasses import dataclass

from otdus_cli.errors import OtdusError


def _field(config: dict, name: str):
    """``name`` of ``config``, or the field its config class's attribute_map gives it (XGLM's
    attention_heads and d_model), as config.json holds it."""
    if config.get(name):
        return config[name]
    from otdus_cli.arch.depth import config_class

    mapped = getattr(config_class(config.get("model_type")), "attribute_map", {}).get(name)
    return config.get(mapped) if isinstance(mapped, str) else None


@dataclass(frozen=True)
class Heads:
    """Attention geometry: query heads, KV heads (GQA groups) and the per-head dimension."""

    n_q: int
    n_kv: int
    head_dim: int

    @property
    def group(self) -> int:
        """Query heads per KV head (HF repeat_kv: query head h reads KV head h // group)."""
        return self.n_q // self.n_kv

    @classmethod
    def from_config(cls, config: dict, q_rows: int | None = None) -> Heads:
        n_q = _field(config, "num_attention_heads")
        if not n_q:
            raise OtdusError("--method ot needs num_attention_heads in config.json")
        n_q = int(n_q)
        n_kv = int(config.get("num_key_value_heads") or n_q)
        head_dim = config.get("head_dim") or (q_rows or _field(config, "hidden_size")) // n_q
        if n_q % n_kv:
            raise OtdusError(f"num_attention_heads={n_q} is not a multiple of num_key_value_heads={n_kv}")
        return cls(n_q, n_kv, int(head_dim))
