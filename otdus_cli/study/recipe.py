"""Study recipes: a YAML file with a base, shared settings, expand options, the runs (arms), the
studies (domains: a training and a held-out text each) and, optionally, the primary family of
comparisons declared before the data. A run is an expansion (``expand:``, the default) or a shrink
(``shrink:``, ShrinkOptions fields over the recipe's own ``shrink:`` block)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from otdus_cli.errors import OtdusError
from otdus_cli.options import invalid, merge_options, read_yaml
from otdus_cli.study.arms import ARM_KINDS, DEFAULT_KIND, RunSpec
from otdus_cli.study.results import StudyResult
from otdus_cli.study.runner import StudyEvent, study
from otdus_cli.study_settings import StudySettings, study_settings

__all__ = ["PrimaryFamily", "StudyRecipe", "load_study_recipe", "run_recipe"]


class _RecipeRun(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    expand: dict[str, Any] | None = None  # an expansion's options (the default kind of run)
    shrink: dict[str, Any] | None = None  # a shrink's options (then the model is healed, not grown)

    def kind(self) -> tuple[str, dict[str, Any]]:
        """The kind of arm (study.arms.ARM_KINDS) and its options block."""
        given = {name: block for name in ARM_KINDS if (block := getattr(self, name, None)) is not None}
        if len(given) > 1:
            raise OtdusError(f"run {self.name!r}: give one of {', '.join(given)}, not several")
        return next(iter(given.items()), (DEFAULT_KIND, {}))


class _RecipeStudy(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    train_text: str
    eval_text: str | None = None
    description: str | None = None
    settings: dict[str, Any] = Field(default_factory=dict)  # StudySettings fields over the recipe's


class PrimaryFamily(BaseModel):
    """The comparisons a recipe declares, before its data, as the primary (confirmatory) family:
    ``reference`` minus each of ``against`` in every study, Holm-adjusted within the study; with
    TOST at ``equivalence_margin`` (nats) behind any "no difference" reading. Everything else a
    study reports is exploratory. ``declared`` says when (and whether before the data)."""

    model_config = ConfigDict(extra="forbid")

    reference: str
    against: list[str] = Field(min_length=1)
    alpha: float = Field(0.05, gt=0, lt=1)
    equivalence_margin: float = Field(gt=0)
    declared: str


class StudyRecipe(BaseModel):
    """A YAML study recipe: a base, shared settings, expand options, runs (arms), studies (domains)."""

    model_config = ConfigDict(extra="forbid")

    base: str
    description: str | None = None
    reference: str | None = "ot"
    settings: dict[str, Any] = Field(default_factory=dict)  # StudySettings fields for every study
    expand: dict[str, Any] = Field(default_factory=dict)  # ExpandOptions fields for every expand run
    shrink: dict[str, Any] = Field(default_factory=dict)  # ShrinkOptions fields for every shrink run
    runs: list[_RecipeRun]
    studies: list[_RecipeStudy]
    primary: PrimaryFamily | None = None

    def run_specs(
        self, overrides: dict[str, Any] | None = None, shrink_overrides: dict[str, Any] | None = None
    ) -> list[RunSpec]:
        """Each run's full options; ``overrides`` (ExpandOptions fields) win over the recipe's for its
        expansions, ``shrink_overrides`` (ShrinkOptions fields) for its shrinks."""
        given = {"expand": overrides, "shrink": shrink_overrides}
        specs = []
        for r in self.runs:
            name, block = r.kind()
            # option groups (ot, ...) merge key by key: a run's ot.reg keeps the recipe's ot.variant
            data = merge_options(getattr(self, name), block, given[name] or {})
            try:
                specs.append(RunSpec(r.name, ARM_KINDS[name].options().model_validate(data)))
            except ValidationError as exc:
                raise OtdusError(f"run {r.name!r}: {invalid(exc)}") from None
        return specs

    def study_settings(self, name: str, overrides: dict[str, Any] | None = None) -> StudySettings:
        """The settings of study ``name``: the defaults, then the recipe's, the study's and
        ``overrides`` (StudySettings fields), validated."""
        (s,) = [s for s in self.studies if s.name == name]
        return study_settings({**self.settings, **s.settings}, where=f"studies.{name}", **(overrides or {}))


def load_study_recipe(path: str | os.PathLike[str]) -> StudyRecipe:
    path = Path(path)
    data = read_yaml(path)
    try:
        recipe = StudyRecipe.model_validate(data)
    except ValidationError as exc:
        raise OtdusError(f"recipe {path}: {invalid(exc)}") from None
    try:
        for s in recipe.studies:  # every study's settings, merged, are StudySettings
            recipe.study_settings(s.name)
    except OtdusError as exc:
        raise OtdusError(f"recipe {path}: {exc}") from None
    recipe.run_specs()  # validates every run's expand options
    return recipe


def _resolve_text(spec: str | None, folder: Path) -> str | None:
    if spec is None or spec.startswith("bundled:") or os.path.isabs(spec):
        return spec
    return os.path.normpath(folder / spec)  # "recipes/../data/x" is reported as "data/x"


def run_recipe(
    path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str] | None = None,
    only: Sequence[str] | None = None,
    overrides: dict[str, Any] | None = None,
    progress: Callable[[StudyEvent], None] | None = None,
    runs: Sequence[str] | None = None,
    reference: str | None = None,
    expand_overrides: dict[str, Any] | None = None,
    shrink_overrides: dict[str, Any] | None = None,
    force: bool = False,
    on_note: Callable[[str], None] | None = None,
) -> dict[str, StudyResult]:
    """Run every study of a recipe (or those named in ``only``); results under ``out_dir/<study>/``,
    each an otdus study output (``force``: see study()), every one of them checked before the first
    study runs; ``out_dir`` itself is made if absent (never through a link).

    Relative text paths are resolved against the recipe's folder. ``overrides``: study() settings
    that win over the recipe's (e.g. ``{"steps": 10, "seeds": [0]}`` for a smoke run);
    ``reference``: instead of the recipe's; ``expand_overrides``: ExpandOptions fields that win over
    every expand run's (e.g. ``{"layers": 1}``), ``shrink_overrides`` ShrinkOptions fields over every
    shrink run's; ``runs``: only these of the recipe's runs (by name), plus
    the reference, e.g. to add arms to a study already run (seeds fix the batches, so the reference
    reproduces its earlier numbers; :meth:`StudyResult.with_arms` merges the two).
    """
    path = Path(path)
    recipe = load_study_recipe(path)
    study_settings(overrides or {})  # a bad override is refused before anything runs
    specs = recipe.run_specs(expand_overrides, shrink_overrides)
    ref = recipe.reference if reference is None else reference
    if runs is not None:
        unknown = sorted(set(runs) - {s.label for s in specs})
        if unknown:
            known = ", ".join(s.label for s in specs)
            raise OtdusError(f"recipe {path}: unknown run(s) {', '.join(unknown)} (runs: {known})")
        specs = [s for s in specs if s.label in runs or s.label == ref]
    chosen = [s for s in recipe.studies if only is None or s.name in only]
    if only is not None and len(chosen) != len(set(only)):
        known = ", ".join(s.name for s in recipe.studies)
        raise OtdusError(f"recipe {path}: unknown study in {list(only)} (studies: {known})")
    if out_dir is not None:
        _studies_folder(Path(out_dir), [s.name for s in chosen], recipe.base, force)
    results = {}
    for s in chosen:
        results[s.name] = study(
            recipe.base,
            _resolve_text(s.train_text, path.parent),
            _resolve_text(s.eval_text, path.parent),
            methods=specs,
            reference=ref,
            out_dir=None if out_dir is None else Path(out_dir) / s.name,
            progress=progress,
            settings=recipe.study_settings(s.name, overrides),
            force=force,
            on_note=on_note,
        )
    return results


def _studies_folder(out_dir: Path, names: list[str], base: str, force: bool) -> None:
    """Check ``out_dir/<name>`` of every study as study() will, then make ``out_dir`` if absent:
    a refused folder fails the recipe before its first study, not after hours of the others."""
    from otdus_cli.io.output_dir import check_target
    from otdus_cli.output_files import STUDY
    from otdus_cli.source import resolve_source

    protected = [resolve_source(base).folder]
    if not os.path.lexists(out_dir):  # where it will be made: not in the base, its parent there
        check_target(out_dir, protected, False, STUDY)
    elif out_dir.is_symlink():
        raise OtdusError(f"--out {out_dir} is a symbolic link; give the real folder it should be")
    elif not out_dir.is_dir():
        raise OtdusError(f"--out {out_dir} is an existing file; a recipe writes a folder of studies")
    else:
        for name in names:
            check_target(out_dir / name, protected, force, STUDY)
    try:
        out_dir.mkdir(exist_ok=True)
    except OSError as exc:
        raise OtdusError(f"cannot create --out {out_dir} ({exc.strerror})") from None
