"""Why an expanded tiny model's logits differ from the base's although every new layer is an identity.

arch/identity.py's prove_plan runs the base and the expanded tiny instance on the same ids, with torch's
global random generator in the same state; where their logits differ, this names the mechanism, found
on the two models, and the placements that keep the logits:

- layers that draw from torch's global random generator as they run (Reformer's LSH hashing draws its
  random rotations there unless config.json sets hash_seed): a copy of such a layer placed before a base
  layer that draws shifts what that layer draws. Found by watching the generator's state across each
  base layer's call.
- the stack rescaled by groups of layers in eval mode (RWKV's rescale_every: transformers divides layer
  i's output weights by 2 ** (i // rescale_every) and halves the hidden states after every
  rescale_every-th layer). Exact in floating point but for LayerNorm's eps, which a scaled input sees
  larger: a base layer that moves to another group, or a depth that changes how often the stream is
  halved before the final norm, changes the logits. config_rules rewrites the group size where one
  keeps both (same_groups); where none does, this says which placements do. Known from the config field
  (STACK_RESCALING).
- else: a layer's index enters its computation (a factor, a rotation or a window by index), or a later
  layer reuses what the layer before it hands on (POSITION_DIFFERS).
"""

from __future__ import annotations

from otdus_cli.arch.families import DEPTH_FIELDS

POSITION_DIFFERS = (
    "on a tiny instance the expanded model's logits differ from the base's although each new layer is an "
    "identity: its layers compute differently at their new positions (their index enters their "
    "computation, or a later layer reuses what the layer before it hands on)"
)
# config fields by which transformers rescales a stack in groups of that many layers when it runs the
# model in eval mode (stream halved after each group, weights of group g divided by 2 ** g); 0: never
STACK_RESCALING = tuple(name for name, kind in DEPTH_FIELDS.items() if kind == "group_size")


def why_logits_differ(config: dict, written: dict, base, layers: list, ids, sources: list[int | None]) -> str:
    """The reason the expanded model's logits differ from ``base``'s (a tiny instance of ``config``, the
    base's text settings; ``written``: the expanded model's; ``layers``: the base's decoder layers; run on
    ``ids``; ``sources``: for each expanded layer, the base layer it is, None for a new one), with the
    placements that keep them."""
    depth = len(layers)
    drawing = _layers_drawing(base, layers, ids)
    if drawing is not None:
        return _draws_message(drawing, depth)
    for name in STACK_RESCALING:
        every, size = config.get(name), written.get(name)
        if isinstance(every, int) and not isinstance(every, bool) and every > 0 and isinstance(size, int):
            moved = any(i is not None and i // every != j // size for j, i in enumerate(sources))
            if size <= 0 or moved or len(sources) // size != depth // every:
                return _rescaling_message(name, every, depth)
    return POSITION_DIFFERS


def _layers_drawing(model, layers: list, ids) -> list[int] | None:
    """The indices of the decoder layers that draw from torch's global random generator as they run, if
    the model's logits depend on that generator's state; else None."""
    import torch

    from otdus_cli.arch.tiny import seeded_logits

    if torch.equal(seeded_logits(model, ids, 0), seeded_logits(model, ids, 1)):
        return None
    states: dict[int, torch.Tensor] = {}
    drawing: set[int] = set()

    def before(index: int):
        def hook(_module, _args) -> None:
            states[index] = torch.get_rng_state()

        return hook

    def after(index: int):
        def hook(_module, _args, _output) -> None:
            if not torch.equal(states[index], torch.get_rng_state()):
                drawing.add(index)

        return hook

    hooks = [m.register_forward_pre_hook(before(i)) for i, m in enumerate(layers)]
    hooks += [m.register_forward_hook(after(i)) for i, m in enumerate(layers)]
    try:
        seeded_logits(model, ids, 0)
    finally:
        for hook in hooks:
            hook.remove()
    return sorted(drawing)


def _draws_message(drawing: list[int], depth: int) -> str:
    from otdus_cli.plan.layer_map import index_ranges

    if not drawing:
        return (
            "the base's logits depend on the state of torch's global random generator, which its forward "
            "draws from outside its decoder layers, and the expanded model's differ from them with the "
            "generator in the same state"
        )
    others = [i for i in range(depth) if i not in drawing]
    keep = f"copy only layers that draw none (base layers {index_ranges(others)}), or " if others else ""
    return (
        f"base layers {index_ranges(drawing)} draw random numbers from torch's global random generator as "
        "they run (unseeded random projections: Reformer's LSH hashing without hash_seed in config.json), "
        "so even the base's logits change from run to run, and a copy of one placed before another shifts "
        "what that one draws: the expanded model's logits differ from the base's with the generator in the "
        f"same state; {keep}place copies of layers that draw after base layer {drawing[-1]} (the last that "
        "draws)"
    )


def _rescaling_message(name: str, every: int, depth: int) -> str:
    groups = depth // every
    ends = ",".join(str(every * g + every - 1) for g in range(groups))
    room = every - 1 - depth % every
    tail = f", as {'do' if room > 1 else 'does'} at most {room} new layer{'s' * (room > 1)}" if room else ""
    tail += f" after base layer {every * groups - 1}" if room else ""
    return (
        f"in eval mode transformers rescales the stack in groups of {name}={every} layers (layer i's "
        f"output weights divided by 2 ** (i // {every}), the hidden states halved after each group), which "
        "keeps the function only up to LayerNorm's eps (a stream scaled by 1/2 ** g meets an eps 4 ** g "
        f"times larger), so every base layer must stay in its group and the stream be halved {groups} times "
        f"before the final norm, which no {name} gives for this placement; the same number of new layers "
        f"in every group keeps both ({name} rewritten; e.g. --after {ends}: one after each group's last "
        f"layer){tail}"
    )
