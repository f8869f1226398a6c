"""Under which names transformers saves a model's tensors, and so finds them in a checkpoint it saved.

transformers 5 converts some checkpoints' tensors when loading (its conversion_mapping: renamings such as
EXAONE's ``attn.attention.out_proj`` -> ``self_attn.o_proj``, per-expert matrices merged into one fused
tensor, a fused q/k/v split ...) and reverts that when saving, so such a checkpoint stores a tensor under
another name than the module holds it. The names are asked of transformers' own reverse conversion
(``revert_weight_conversion``), never listed here; transformers 4 has none, and saves tensors as named.
"""

from __future__ import annotations

import re

_NUMBERED = re.compile(r"(.+?\.)(\d+)\.(.+)")


def _revert(model, tensors: dict) -> dict | None:
    """transformers' saved form of ``tensors`` (full module names); None where it has no conversion."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: tensors are saved under their module names
        return None
    return revert_weight_conversion(model, dict(tensors))


def saved_names(model, tensors: dict) -> dict[str, list[str]]:
    """For each of ``tensors`` (full module names of ``model``, meta tensors will do), the names
    transformers saves it under, each reverted alone; a tensor it saves only merged with others (a fused
    q/k/v split when loading) is left out, as is every tensor saved under its own name."""
    out: dict[str, list[str]] = {}
    for name, tensor in tensors.items():
        try:
            saved = _revert(model, {name: tensor})
        except Exception:  # a reverse op that needs its partners (a split fused tensor)
            continue
        if saved is not None and list(saved) != [name]:
            out[name] = sorted(saved)
    return out


def revert_names(model, tensors: dict) -> list[str]:
    """The names transformers saves ``tensors`` (full module names of ``model``) under, reverted together
    (a fused tensor's parts with each other); their own names where it converts none."""
    saved = _revert(model, dict(tensors))
    return sorted(tensors if saved is None else saved)


class SavedTogether(ValueError):
    """A tensor transformers saves inside a larger one, together with other tensors."""


def saved_targets(model, layer_tensors: dict, targets: list[str]) -> dict[str, list[str]]:
    """For each of ``targets`` (full names among ``layer_tensors``, one layer's tensors with their
    values), the saved names that hold exactly it: zeroing it in memory zeroes them whole when saved.
    SavedTogether when a target is saved inside a tensor that also holds others."""
    import torch

    # distinct nonzero values, so what a zeroed target becomes in the saved form shows
    values = {
        k: torch.rand_like(v, dtype=torch.float32).add_(1).to(v.dtype) if v.is_floating_point() else v
        for k, v in layer_tensors.items()
    }
    plain = _revert(model, values)
    if plain is None:
        return {t: [t] for t in targets}
    out: dict[str, list[str]] = {}
    for target in targets:
        zeroed = _revert(model, {**values, target: torch.zeros_like(values[target])})
        changed = sorted(k for k in zeroed if not torch.equal(zeroed[k], plain.get(k, zeroed[k])))
        partial = next((k for k in changed if zeroed[k].count_nonzero()), None)
        if partial is not None:
            raise SavedTogether(f"transformers saves {target} inside {partial}, together with other tensors")
        if not changed:
            raise SavedTogether(f"transformers saves no tensor of its own for {target}")
        out[target] = changed
    return out


def layer_suffix_patterns(names: list[str], index: int) -> list[str] | None:
    """Regexes for saved names of layer ``index`` (``transformer.h.3.attn.out_proj.weight``), relative to
    the layer's saved prefix: what follows its number. Names alike but for numbers (the experts of a
    fused tensor saved per expert: ``experts.0.w2.weight``, ``experts.1.w2.weight``) make one pattern with
    ``\\d+`` where the numbers differ. None when a name is not under a layer numbered ``index``."""
    groups: dict[tuple, list[list[str]]] = {}
    for name in names:
        m = _NUMBERED.match(name)
        if m is None or int(m.group(2)) != index:
            return None
        parts = m.group(3).split(".")
        groups.setdefault(tuple(None if p.isdigit() else p for p in parts), []).append(parts)
    patterns = []
    for members in groups.values():
        columns = zip(*members, strict=True)
        patterns.append(r"\.".join(re.escape(c[0]) if len(set(c)) == 1 else r"\d+" for c in columns))
    return patterns
