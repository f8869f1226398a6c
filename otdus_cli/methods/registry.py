"""The methods `otdus expand` offers, one line each; each method's module declares the rest.

Adding a method: write its module (a :class:`~otdus_cli.methods.base.Method`, see README, "Adding a
method") and register it here. Its options become ``ExpandOptions.<name>``, recipe keys and flags.
"""

from __future__ import annotations

from otdus_cli.errors import OtdusError
from otdus_cli.methods import lesa, ot, simple
from otdus_cli.methods.base import Method

METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Offer ``method``; one with options must be registered before otdus_cli.options is imported
    (ExpandOptions is made from the registry then)."""
    if method.name in METHODS:
        raise OtdusError(f"method {method.name!r} is registered already")
    if method.options is not None and not method.name.isidentifier():
        raise OtdusError(f"method {method.name!r} has options: its name must be a Python identifier")
    METHODS[method.name] = method
    return method


register(ot.OT)
register(lesa.LESA)
register(simple.AVERAGE)
register(simple.COPY)
register(simple.INTERPOSE)
register(simple.RANDOM)
register(simple.LLAMA_PRO)
register(simple.SOLAR)
register(simple.STACK)


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise OtdusError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}") from None
