"""Option groups declared once and shared by several commands (expand/plan, verify/ppl), and the
flags generated from the methods' options models.

A group is a dataclass whose fields are Typer-annotated options. A command takes one parameter
``flags: Group``; :func:`with_flags` shows Typer the group's fields in that parameter's place and
hands the command the values gathered in one ``Group`` instance. :func:`with_method_flags` does the
same for a parameter ``method_flags``, with one flag per options field marked ``Flag`` (methods/base.py).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from otdus_cli.methods.base import Flag

Command = TypeVar("Command", bound=Callable[..., Any])


def with_flags(group: type) -> Callable[[Command], Command]:
    hints = typing.get_type_hints(group, include_extras=True)
    fields = dataclasses.fields(group)
    names = {f.name for f in fields}

    def decorate(fn: Command) -> Command:
        params: list[inspect.Parameter] = []
        for p in inspect.signature(fn, eval_str=True).parameters.values():
            if p.name == "flags":
                params += [
                    inspect.Parameter(
                        f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name]
                    )
                    for f in fields
                ]
            else:
                # every parameter keyword-only: Typer calls commands with keywords only, and the group
                # may sit between parameters with and without defaults
                params.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY))

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            grouped = {name: kwargs.pop(name) for name in list(kwargs) if name in names}
            return fn(flags=group(**grouped), **kwargs)

        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return typing.cast(Command, command)

    return decorate


@dataclasses.dataclass(frozen=True)
class MethodFlag:
    """A flag made from a field of a method's options model marked with methods.base.Flag."""

    group: str  # the method (its option group)
    field: str
    flag: Flag
    annotation: Any  # what Typer is shown: Annotated[type | None, typer.Option(...)]

    @property
    def key(self) -> str:
        """The option as recipes and manifests name it: ``group.field``."""
        return f"{self.group}.{self.field}"

    @property
    def param(self) -> str:
        return f"{self.group}__{self.field}"


def method_flags(for_plan: bool = False) -> list[MethodFlag]:
    """The flags of every registered method's options, in registry and field order (``for_plan``:
    those of `otdus plan`, the options that change the layer map)."""
    import typer

    from otdus_cli.options import option_groups

    flags = []
    for group, model in option_groups().items():
        for name, info in model.model_fields.items():
            flag = next((m for m in info.metadata if isinstance(m, Flag)), None)
            if flag is None or (for_plan and not flag.plan):
                continue  # set in recipes only
            shown = flag.default if flag.default is not None else str(info.default)
            option = typer.Option(flag.name, help=f"{flag.help} [default: {shown}]")
            annotation = typing.Annotated[typing.Optional[info.annotation], option]  # noqa: UP045 - a runtime type
            flags.append(MethodFlag(group, name, flag, annotation))
    return flags


def with_method_flags(
    for_plan: bool = False, keep: Callable[[MethodFlag], bool] | None = None
) -> Callable[[Command], Command]:
    """Shows Typer the methods' flags (those ``keep`` keeps) in place of the parameter ``method_flags``
    and hands the command ``method_flags={"ot.variant": value or None, ...}``."""
    return functools.partial(
        _with_method_flags, [f for f in method_flags(for_plan) if keep is None or keep(f)]
    )


def _with_method_flags(generated: list[MethodFlag], fn: Command) -> Command:
    params: list[inspect.Parameter] = []
    for p in inspect.signature(fn, eval_str=True).parameters.values():
        if p.name == "method_flags":
            params += [
                inspect.Parameter(
                    f.param, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=f.annotation
                )
                for f in generated
            ]
        else:
            params.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY))

    @functools.wraps(fn)
    def command(**kwargs: Any) -> Any:
        given = {f.key: kwargs.pop(f.param, None) for f in generated}  # None: not given
        return fn(method_flags=given, **kwargs)

    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    return typing.cast(Command, command)
