"""Option groups declared once and shared by several commands (expand/plan, verify/ppl).

A group is a dataclass whose fields are Typer-annotated options. A command takes one parameter
``flags: Group``; :func:`with_flags` shows Typer the group's fields in that parameter's place and
hands the command the values gathered in one ``Group`` instance.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any, TypeVar

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
