"""The arms of a study: method specs, their expand options, and the expansions they build.

Method specs (strings): ``method[:variant][+zero|+nozero]``: any registered method's name
(methods/registry.py), with a variant of its options and zero-init forced on or off, e.g. ``ot``
(OT-DUS, paper variant, zero-init), ``ot+nozero``, ``ot:structured``, ``average`` (Avg-DeUS, no
zero-init), ``average+zero``, ``copy``, ``interpose`` (every chosen layer duplicated in place),
``stack`` (the whole stack repeated). Full expand options can be given instead with
:class:`RunSpec` or in a YAML recipe (study.recipe).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otdus_cli.errors import OtdusError
from otdus_cli.options import ExpandOptions, method_spec_options
from otdus_cli.study_settings import DEFAULT_METHODS

__all__ = ["DEFAULT_METHODS", "ExpansionCache", "RunSpec", "parse_method", "resolve_runs"]


@dataclass(frozen=True)
class RunSpec:
    """One arm of the study: a label and the full expand options that build it."""

    label: str
    options: ExpandOptions


def parse_method(spec: str, overrides: dict[str, Any] | None = None) -> RunSpec:
    """``method[:variant][+zero|+nozero]`` (see the module docstring) as a :class:`RunSpec`;
    ``overrides`` as in :func:`otdus_cli.options.method_spec_options`."""
    return RunSpec(spec.strip(), method_spec_options(spec, overrides))


def resolve_runs(methods: Sequence[str | RunSpec], overrides: dict[str, Any] | None) -> list[RunSpec]:
    runs = [m if isinstance(m, RunSpec) else parse_method(m, overrides) for m in methods]
    labels = [r.label for r in runs]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise OtdusError(f"methods listed twice: {', '.join(dupes)}")
    if not runs:
        raise OtdusError("no methods to study")
    return runs


class ExpansionCache:
    """Expanded checkpoints in a temporary folder, one per distinct options (seed only for random)."""

    def __init__(self, base: str, root: Path):
        self.base = base
        self.root = root
        self._made: dict[str, tuple[Path, dict]] = {}

    def get(self, options: ExpandOptions, seed: int) -> tuple[Path, dict]:
        from otdus_cli.expand import expand
        from otdus_cli.methods.registry import get_method

        seeded = get_method(options.method).seeded_by_study
        opts = options.model_copy(update={"seed": seed if seeded else options.seed})
        key = opts.model_dump_json()
        if key not in self._made:
            out = self.root / f"m{len(self._made)}"
            result = expand(self.base, out, opts)
            self._made[key] = (out, result.manifest)
        return self._made[key]
