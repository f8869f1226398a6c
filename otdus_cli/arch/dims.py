"""The config's dimensions against the tensors' shapes: a config that disagrees describes another model.

transformers builds the model from config.json and then refuses (or, with mismatched sizes allowed,
re-initialises) tensors of other shapes; otdus copies tensors and rewrites the config, so a config
whose hidden_size, intermediate_size, heads or vocabulary disagree with the weights would pass on to
the output unnoticed. Only what the template's roles pin down is checked, from headers alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from otdus_cli.errors import OtdusError

if TYPE_CHECKING:
    from otdus_cli.arch.families import Family


class Stack(Protocol):
    """What the check reads of a checkpoint's layer stack (io/stack.py: LayerStack, which calls it)."""

    reader: Any  # io/reader.py: CheckpointReader
    family: Family
    layers: list[Any]  # io/stack.py: SourceLayer
    head: list[str]
    tail: list[str]


_HIDDEN_NORMS = ("attn_norm", "mlp_norm", "attn_out_norm", "mlp_out_norm")


def _int(config: dict, key: str) -> int | None:
    value = config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


Dim = tuple[int | None, str]  # a size the config gives (None: not given) and the fields it comes from


def expected_shapes(config: dict, roles: dict[str, str]) -> dict[str, tuple[Dim, ...]]:
    """Layer tensor suffix -> the shape the config gives it, dimension by dimension."""
    hidden = _int(config, "hidden_size")
    heads = _int(config, "num_attention_heads")
    kv_heads = _int(config, "num_key_value_heads") or heads
    head_dim = _int(config, "head_dim")
    if head_dim is None and hidden and heads and hidden % heads == 0:
        head_dim = hidden // heads
    inter = _int(config, "intermediate_size")
    h: Dim = (hidden, "hidden_size")
    q: Dim = (heads * head_dim if heads and head_dim else None, "num_attention_heads x head_dim")
    kv: Dim = (kv_heads * head_dim if kv_heads and head_dim else None, "num_key_value_heads x head_dim")
    i: Dim = (inter, "intermediate_size")
    wanted = {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q)}
    wanted |= {"gate": (i, h), "up": (i, h), "down": (h, i)}
    wanted |= {norm: (h,) for norm in _HIDDEN_NORMS}
    return {roles[role] + ".weight": shape for role, shape in wanted.items() if role in roles}


def check_dimensions(stack: Stack, config: dict) -> None:
    """Refuse (OtdusError) a config whose dimensions disagree with the tensors' shapes (families
    otdus has a template for; an unknown architecture's fields may mean other things)."""
    if stack.family.copy_only:
        return
    hidden = _int(config, "hidden_size")
    vocab = _int(config, "vocab_size")
    reader = stack.reader
    for name in stack.head + stack.tail:
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            shape = reader.meta(name).shape
            # rows past vocab_size are allowed: Mllama's embedding holds its image tokens there
            for axis, (want, field) in enumerate(((vocab, "vocab_size"), (hidden, "hidden_size"))):
                if (
                    want is not None
                    and len(shape) == 2
                    and (shape[axis] < want if axis == 0 else shape[axis] != want)
                ):
                    raise OtdusError(
                        f"config.json says {field}={want} but {name} has shape {list(shape)}; "
                        "the config does not describe these weights"
                    )
    if stack.family.fused:
        return
    expected = expected_shapes(config, stack.family.roles)
    for layer in stack.layers:
        for suffix, want in expected.items():
            if suffix not in layer.suffixes():
                continue
            shape = layer.shape(suffix)
            if len(shape) != len(want):
                continue
            for got, (need, field) in zip(shape, want, strict=True):
                if need is not None and got != need:
                    raise OtdusError(
                        f"config.json's {field} gives {need} but {layer.name(suffix)} has shape "
                        f"{list(shape)}; the config does not describe these weights"
                    )
