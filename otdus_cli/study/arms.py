"""The arms of a study: the expansions (or shrinks) they build, and the shipped lists of them.

What an arm is (its kinds, specs and options) is otdus_cli.study_arms, outside this package so
that the CLI reads it without importing torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from otdus_cli.options import ExpandOptions
from otdus_cli.study_arms import (
    ARM_KINDS,
    DEFAULT_KIND,
    ArmKind,
    RunSpec,
    arm_kind,
    parse_method,
    resolve_runs,
)
from otdus_cli.study_settings import DEFAULT_METHODS

if TYPE_CHECKING:
    from otdus_cli.shrink import ShrinkOptions

__all__ = [
    "ARM_KINDS",
    "DEFAULT_KIND",
    "DEFAULT_METHODS",
    "ArmKind",
    "ExpansionCache",
    "RunSpec",
    "arm_kind",
    "parse_method",
    "resolve_runs",
]


class ExpansionCache:
    """The arms' checkpoints (expanded or shrunk) in a temporary folder, one per distinct options
    (seed only where the seed changes what is written: random)."""

    def __init__(self, base: str, root: Path):
        self.base = base
        self.root = root
        self._made: dict[str, tuple[Path, dict]] = {}

    def get(self, options: ExpandOptions | ShrinkOptions, seed: int) -> tuple[Path, dict]:
        kind = arm_kind(options)
        opts = options.model_copy(update={"seed": seed if kind.seeded(options) else options.seed})
        key = f"{kind.name} {opts.model_dump_json()}"
        if key not in self._made:
            out = self.root / f"m{len(self._made)}"
            result = kind.write(self.base, out, opts)
            self._made[key] = (out, result.manifest)
        return self._made[key]
