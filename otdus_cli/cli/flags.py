"""Options declared once and shared by several commands (expand/plan/shrink, verify/ppl), the flags
generated from the methods' options models, and the one path from recipe and flags to validated
options (expand's and shrink's).

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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from otdus_cli.cli.values import model_name
from otdus_cli.errors import OtdusError
from otdus_cli.methods.base import Flag, Method
from otdus_cli.methods.registry import METHODS, SHRINK_METHODS
from otdus_cli.options import OutputDtype

if TYPE_CHECKING:
    from pydantic import BaseModel

Command = TypeVar("Command", bound=Callable[..., Any])
Options = TypeVar("Options", bound="BaseModel")
Recipe = TypeVar("Recipe")

# the options that expand and shrink (and plan) share
Model = Annotated[
    str | None,
    typer.Argument(
        metavar="MODEL",  # shown bare in the usage line: required, but a recipe may name it instead
        help="Source model: a local folder, a Hugging Face hub id or bundled:stories260k. "
        "[required unless --recipe names it]",
        parser=model_name,
    ),
]
Out = Annotated[
    Path | None,
    typer.Option("--out", "-o", help="Output folder (must not exist). [required unless --recipe names it]"),
]
Dtype = Annotated[
    OutputDtype | None, typer.Option(help="Output dtype; auto keeps the source's. [default: auto]")
]
ShardSize = Annotated[str | None, typer.Option(help="Largest output shard, e.g. 5GB, 500MB. [default: 5GB]")]
Revision = Annotated[str | None, typer.Option(help="Hub revision (branch, tag or commit) of the source.")]
BaseModelId = Annotated[
    str | None,
    typer.Option(
        "--base-model",
        help="The hub id the card names as base_model (the Hub's model tree), for a local source folder "
        "(a hub id or a hub cache snapshot is named by itself).",
    ),
]
# expand's, shrink's, widen's and study's (one output life cycle: io/output_dir.py)
Force = Annotated[
    bool,
    typer.Option(
        help="Replace an existing --out, only if it is an empty folder or an earlier otdus output of the "
        "same kind (a model, a study) whose files are all still as its otdus.json records them (sizes, "
        "hashes), and only once the new output is complete."
    ),
]


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


def flag_name(loc: Sequence[Any]) -> str:
    """The command-line flag of an options field: ('ot', 'variant') -> --ot-variant, ('ot', 'reg') ->
    --reg (the flags a method's options model declares; options without a flag are named as in
    recipes, 'group.field'), ('layers',) -> --layers."""
    names = tuple(map(str, loc))
    if names[0] in flag_groups():
        flags = {(f.group, f.field): f.flag.name for f in method_flags(methods=None)}
        return flags.get(names[:2], ".".join(names[:2]))
    return "--" + names[-1].replace("_", "-")


def model_and_recipe(
    model: str | None, recipe: Path | None, load: Callable[[Path], Recipe]
) -> tuple[str, Recipe | None]:
    """The source model (the argument, else the recipe's) and the recipe ``load`` reads (None: no
    --recipe)."""
    base = load(recipe) if recipe else None
    model = model or (getattr(base, "model", None) if base else None)
    if not model:
        raise OtdusError("give a model (folder or hub id) or --recipe")
    return model, base


def validated_options(
    model: type[Options], base: Options, updates: dict[str, Any], method_flags: dict[str, Any] | None
) -> Options:
    """``base`` (a recipe's options, or the defaults) with the flags given: ``updates`` (fields, None
    left out by the caller) and ``method_flags`` (``{"ot.reg": 0.02}``, None where not given); a value
    a rule refuses is one OtdusError that names its flag."""
    from pydantic import ValidationError

    from otdus_cli.options import merge_options

    groups: dict[str, dict[str, Any]] = {}
    for key, value in (method_flags or {}).items():
        if value is not None:
            group, field = key.split(".")
            groups.setdefault(group, {})[field] = value
    try:
        return model.model_validate(merge_options(base.model_dump(), updates, groups))
    except ValidationError as exc:
        err = exc.errors()[0]
        message = err["msg"].removeprefix("Value error, ")
        loc = err["loc"]
        if not loc or (len(loc) == 1 and loc[0] in flag_groups()):  # a rule across options names its flags
            raise OtdusError(message) from None
        raise OtdusError(f"{flag_name(loc)} {err['input']!r}: {message}") from None


def flag_groups(methods: Mapping[str, Method] | None = None) -> dict[str, type[BaseModel]]:
    """Method name -> its options model, for the ``methods`` that have options (None: those of
    `otdus expand` and of `otdus shrink`; a method of both, such as ot, has one group)."""
    tables = [METHODS, SHRINK_METHODS] if methods is None else [methods]
    return {m.name: m.options for table in tables for m in table.values() if m.options is not None}


def method_flags(for_plan: bool = False, methods: Mapping[str, Method] | None = METHODS) -> list[MethodFlag]:
    """The flags of the options of ``methods`` (default: `otdus expand`'s; None: every registered
    method's), in registry and field order (``for_plan``: those of `otdus plan`, the options that
    change the layer map)."""
    import typer

    flags = []
    for group, model in flag_groups(methods).items():
        for name, info in model.model_fields.items():
            flag = next((m for m in info.metadata if isinstance(m, Flag)), None)
            if flag is None or (for_plan and not flag.plan):
                continue  # set in recipes only
            shown = _shown_default(flag, info)
            if for_plan and methods is METHODS:
                shown += _shrink_default(group, name, shown)
            option = typer.Option(flag.name, help=f"{flag.help} [default: {shown}]")
            annotation = typing.Annotated[typing.Optional[info.annotation], option]  # noqa: UP045 - a runtime type
            flags.append(MethodFlag(group, name, flag, annotation))
    return flags


def _shown_default(flag: Flag, info: Any) -> str:
    return flag.default if flag.default is not None else str(info.default)


def _shrink_default(group: str, name: str, shown: str) -> str:
    """`otdus plan`'s help for a flag expand and shrink share: shrink's default where it differs
    (``--ot-variant``: paper for an expansion, structured for a merge)."""
    method = SHRINK_METHODS.get(group)
    info = method.options.model_fields.get(name) if method and method.options else None
    flag = next((m for m in info.metadata if isinstance(m, Flag)), None) if info else None
    other = _shown_default(flag, info) if flag else shown
    return "" if other == shown else f"; with --shrink: {other}"


def with_method_flags(
    for_plan: bool = False,
    keep: Callable[[MethodFlag], bool] | None = None,
    methods: Mapping[str, Method] = METHODS,
) -> Callable[[Command], Command]:
    """Shows Typer the flags of ``methods`` (those ``keep`` keeps) in place of the parameter
    ``method_flags`` and hands the command ``method_flags={"ot.variant": value or None, ...}``."""
    return functools.partial(
        _with_method_flags, [f for f in method_flags(for_plan, methods) if keep is None or keep(f)]
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
