"""The arms of a study: what kinds there are, their method specs and the options those stand for.

Method specs (strings): ``method[:variant][+zero|+nozero]``: any registered method's name
(methods/registry.py), with a variant of its options and zero-init forced on or off, e.g. ``ot``
(OT-DUS, paper variant, zero-init), ``ot+nozero``, ``ot:structured``, ``average`` (Avg-DeUS, no
zero-init), ``average+zero``, ``copy``, ``interpose`` (every chosen layer duplicated in place),
``stack`` (the whole stack repeated). Full expand options can be given instead with
:class:`RunSpec` or in a YAML recipe (study.recipe).

An arm may shrink the base instead (`otdus shrink`, then a healing run): ``shrink:METHOD[:VARIANT]
[@SELECTION]``, e.g. ``shrink:drop``, ``shrink:laco@angular``, ``shrink:ot:structured`` (full
options: a :class:`RunSpec` with :class:`~otdus_cli.shrink.ShrinkOptions`, or a recipe run's
``shrink:`` block). What each kind of arm is, is the table :data:`ARM_KINDS`.

Outside the study package (as study_settings), so that the CLI checks ``--methods`` without importing
torch; study.arms builds the arms' checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from otdus_cli.errors import OtdusError
from otdus_cli.options import ExpandOptions, method_spec_options

if TYPE_CHECKING:
    from pydantic import BaseModel

    from otdus_cli.expand import ExpandResult
    from otdus_cli.shrink import ShrinkOptions

__all__ = ["ARM_KINDS", "DEFAULT_KIND", "ArmKind", "RunSpec", "arm_kind", "parse_method", "resolve_runs"]


@dataclass(frozen=True)
class RunSpec:
    """One arm of the study: a label and the full options that build it (ExpandOptions: an expansion;
    ShrinkOptions: a shrink)."""

    label: str
    options: ExpandOptions | ShrinkOptions


def _expand(base: str, out: Path, options: Any) -> ExpandResult:
    from otdus_cli.expand import expand

    return expand(base, out, options)


def _shrink(base: str, out: Path, options: Any) -> ExpandResult:
    from otdus_cli.shrink import shrink

    return shrink(base, out, options)


def _expand_seeded(options: Any) -> bool:
    from otdus_cli.methods.registry import get_method

    return get_method(options.method).seeded_by_study


def _shrink_spec(spec: str, overrides: dict[str, Any] | None) -> ShrinkOptions:
    from otdus_cli.shrink import shrink_spec_options

    return shrink_spec_options(spec, overrides)


def _scored_on_training_text(options: Any, train_text: str) -> Any:
    """A shrink's selection scores (and OT's calibration) on the study's training text unless the arm
    names its own: the default text could be the held-out one."""
    if "calib" in options.model_fields_set:
        return options
    return options.model_copy(update={"calib": train_text})


def _shrink_options_model() -> type[BaseModel]:
    from otdus_cli.shrink import ShrinkOptions

    return ShrinkOptions


@dataclass(frozen=True)
class ArmKind:
    """What an arm does to the base before it is trained."""

    name: str  # the spec prefix (``shrink:drop``) and the recipe run's key (``shrink: {...}``)
    options: Callable[[], type[BaseModel]]  # its options model (imported when asked: torch)
    parse: Callable[[str, dict[str, Any] | None], Any]  # spec without the prefix, overrides -> options
    write: Callable[[str, Path, Any], ExpandResult]  # base, out, options -> what was written
    seeded: Callable[[Any], bool]  # whether the study's seed changes what it writes
    # False: the arm adds no layer of its own (a shrink), so "train the new layers only" means nothing
    adds_layers: bool
    doing: str  # what a run of it does, for the progress lines
    # the options as a study with this training text runs them
    in_study: Callable[[Any, str], Any] = lambda options, train_text: options


ARM_KINDS: dict[str, ArmKind] = {
    kind.name: kind
    for kind in (
        ArmKind(
            name="expand",
            options=lambda: ExpandOptions,
            parse=method_spec_options,
            write=_expand,
            seeded=_expand_seeded,
            adds_layers=True,
            doing="expanding, then training",
        ),
        ArmKind(
            name="shrink",
            options=_shrink_options_model,
            parse=_shrink_spec,
            write=_shrink,
            seeded=lambda options: False,  # every shrink method is deterministic
            adds_layers=False,
            doing="shrinking, then healing",
            in_study=_scored_on_training_text,
        ),
    )
}
DEFAULT_KIND = "expand"  # a spec without a kind's prefix


def arm_kind(options: Any) -> ArmKind:
    """The kind of arm ``options`` build (by their model)."""
    for kind in ARM_KINDS.values():
        if isinstance(options, kind.options()):
            return kind
    raise TypeError(f"no kind of study arm takes {type(options).__name__}")


def parse_method(
    spec: str, overrides: dict[str, Any] | None = None, shrink_overrides: dict[str, Any] | None = None
) -> RunSpec:
    """``method[:variant][+zero|+nozero]`` or ``shrink:METHOD[:VARIANT][@SELECTION]`` (see the module
    docstring) as a :class:`RunSpec`; ``overrides`` as in :func:`otdus_cli.options.method_spec_options`
    for expansions, ``shrink_overrides`` (ShrinkOptions fields) for shrinks."""
    text = spec.strip()
    prefix, sep, rest = text.partition(":")
    name = prefix if sep and prefix in ARM_KINDS and prefix != DEFAULT_KIND else DEFAULT_KIND
    given = {"expand": overrides, "shrink": shrink_overrides}
    return RunSpec(text, ARM_KINDS[name].parse(rest if name != DEFAULT_KIND else text, given[name]))


def resolve_runs(
    methods: Sequence[str | RunSpec],
    overrides: dict[str, Any] | None,
    shrink_overrides: dict[str, Any] | None = None,
) -> list[RunSpec]:
    runs = [m if isinstance(m, RunSpec) else parse_method(m, overrides, shrink_overrides) for m in methods]
    labels = [r.label for r in runs]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise OtdusError(f"methods listed twice: {', '.join(dupes)}")
    if not runs:
        raise OtdusError("no methods to study")
    return runs
