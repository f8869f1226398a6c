"""Walking a model transformers built: the module list at a dotted path, and the towers that are not
the text stack. Shared by the modules that read templates off transformers' classes (derived.py,
depth.py) and those that prove them on tiny instances (identity.py, layer_slices.py ...)."""

from __future__ import annotations

# module-name parts of towers that are not the text stack
NOT_TEXT = ("vision", "visual", "audio", "image", "speech")


def modules_of(model, path: str) -> list:
    module = model
    for part in path.split("."):
        module = getattr(module, part)
    return list(module)
