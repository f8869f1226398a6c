"""The methods `otdus expand` and `otdus shrink` offer, one line each; each method's module declares
the rest.

Adding a method: write its module (a :class:`~otdus_cli.methods.base.Method`, see CONTRIBUTING.md, "Adding a
method") and register it here. An expansion method's options become ``ExpandOptions.<name>``, recipe
keys ``expand.<name>.<field>`` and flags of `otdus expand`; a shrink method's (layout "shrink")
``ShrinkOptions.<name>``, ``shrink.<name>.<field>`` and flags of `otdus shrink`. Every choice list,
help text and recipe key is made from these two tables.
"""

from __future__ import annotations

from otdus_cli.errors import OtdusError
from otdus_cli.methods import laco, lesa, merge, ot, simple
from otdus_cli.methods.base import Method

METHODS: dict[str, Method] = {}  # `otdus expand --method`
SHRINK_METHODS: dict[str, Method] = {}  # `otdus shrink --method`: those whose layout is "shrink"


def register(method: Method) -> Method:
    """Offer ``method`` (to `otdus shrink` if its layout is "shrink", else to `otdus expand`); one with
    options must be registered before otdus_cli.options (otdus_cli.shrink) is imported: ExpandOptions
    (ShrinkOptions) is made from the registry then."""
    table = SHRINK_METHODS if method.layout == "shrink" else METHODS
    if method.name in table:
        raise OtdusError(f"method {method.name!r} is registered already")
    if method.options is not None and not method.name.isidentifier():
        raise OtdusError(f"method {method.name!r} has options: its name must be a Python identifier")
    table[method.name] = method
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
register(merge.DROP)
register(merge.AVERAGE)
register(laco.LACO)
register(merge.OT_MERGE)


def method_help(methods: dict[str, Method], lead: str, default: str) -> str:
    """The --help text of a --method option: ``lead``, then each method's name and summary."""
    listed = "; ".join(f"{m.name}: {m.summary}" for m in methods.values())
    return f"{lead} {listed}. [default: {default}]"


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise OtdusError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}") from None
