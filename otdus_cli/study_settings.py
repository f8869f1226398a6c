"""The settings of a study: one validated model, the single source of their defaults.

`study()` takes them as keyword arguments or a :class:`StudySettings`, a recipe as its `settings:`
block (and per study), and `otdus study` as flags whose defaults are read from here.

Training runs either a fixed number of ``steps`` (linear warmup, cosine decay to 10%), or, with
``until_plateau``, until the validation loss stops falling (:class:`PlateauRule`; linear warmup then
a constant learning rate, so that the stop is not an artefact of a decaying schedule). With
``lr_sweep`` each method's learning rate is chosen among the listed ones by the validation loss its
first seed reaches. Both decide on a validation split: the last ``validation_fraction`` of the
training documents, held out of training and disjoint from the scored held-out text, which no
choice ever looks at.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from otdus_cli.errors import OtdusError
from otdus_cli.options import invalid

__all__ = ["DEFAULT_METHODS", "PlateauRule", "StudySettings", "plateau_reached", "study_settings"]

# the arms a study compares when none are named
DEFAULT_METHODS = ("ot", "average", "average+zero", "copy", "random")


class PlateauRule(BaseModel):
    """Train until the validation loss plateaus.

    The validation loss is evaluated every ``eval_every`` steps. Training stops at the first
    evaluation k >= ``window`` at which the last ``window`` evaluations together improved on
    evaluation k - ``window`` by less than the noise floor: max(``tolerance``, ``noise`` x the
    standard error of that change), the change measured window by window on the same validation
    windows (a paired standard error). ``max_steps`` caps a run that never plateaus (the result
    records that it did not)."""

    model_config = ConfigDict(extra="forbid")

    eval_every: int = Field(25, ge=1, description="Steps between validation evaluations.")
    window: int = Field(3, ge=1, description="Evaluations that must bring no real improvement.")
    tolerance: float = Field(0.002, ge=0, description="Smallest improvement that counts, in nats.")
    noise: float = Field(2.0, ge=0, description="Noise floor in paired standard errors of the change.")
    max_steps: int = Field(2000, ge=1, description="Steps at most.")


def plateau_reached(rule: PlateauRule, curve: Sequence[Sequence[float]]) -> bool:
    """Whether the validation curve (per-window losses at each evaluation, oldest first) has
    plateaued under ``rule`` at its last evaluation."""
    if len(curve) <= rule.window:
        return False
    before = curve[-1 - rule.window]
    best = min(curve[-rule.window :], key=math.fsum)
    change = [b - a for a, b in zip(best, before, strict=True)]  # > 0: the loss fell
    n = len(change)
    mean = math.fsum(change) / n
    se = math.sqrt(math.fsum((x - mean) ** 2 for x in change) / (n - 1) / n) if n > 1 else 0.0
    return mean < max(rule.tolerance, rule.noise * se)


class StudySettings(BaseModel):
    """Everything a study's numbers depend on besides its base, texts, methods and expand options."""

    model_config = ConfigDict(extra="forbid")

    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1, description="Seeds.")
    steps: int = Field(
        150, ge=1, description="Training steps per run (a recipe's until_plateau replaces them)."
    )
    lr: float = Field(2e-3, gt=0, description="AdamW learning rate (lr_sweep replaces it).")
    lr_sweep: list[float] | None = Field(
        None, min_length=1, description="Learning rates to choose from, per method, on the validation split."
    )
    until_plateau: PlateauRule | None = Field(None, description="Train until the validation loss plateaus.")
    batch: int = Field(8, ge=1, description="Windows per step.")
    seq_len: int = Field(128, ge=2, description="Tokens per window.")
    eval_every: int = Field(25, ge=1, description="Evaluate held-out loss every N steps.")
    eval_windows: int | Literal["all"] = Field(
        128, description="Held-out windows scored (evenly spaced), or all of them."
    )
    eval_fraction: float = Field(
        0.05, gt=0, lt=1, description="Held-out share of documents when no eval text is given."
    )
    validation_fraction: float = Field(
        0.05, gt=0, lt=1, description="Share of the training documents held out for validation."
    )
    validation_windows: int = Field(64, ge=1, description="Validation windows scored (evenly spaced).")
    max_train_windows: int | None = Field(None, ge=1, description="Training windows at most.")
    train_new_only: bool = Field(True, description="Train only the new layers.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    warmup: float = Field(0.1, ge=0, lt=1, description="Share of the steps with a linear warmup.")
    eval_attention: Literal["eager", "sdpa"] = Field(
        "eager", description="Attention kernel for scoring (training always uses eager)."
    )
    device: str = Field("auto", description="auto (a GPU when there is one), cpu, cuda or cuda:N.")
    threads: int | None = Field(None, ge=1, description="torch CPU threads.")

    @field_validator("seeds")
    @classmethod
    def _distinct(cls, seeds: list[int]) -> list[int]:
        if len(set(seeds)) != len(seeds):
            raise ValueError("seeds must be distinct")
        return seeds

    @field_validator("eval_windows", mode="before")
    @classmethod
    def _windows(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ValueError("eval_windows must be >= 1 or 'all'")
        return value

    @field_validator("lr_sweep")
    @classmethod
    def _sweep(cls, rates: list[float] | None) -> list[float] | None:
        if rates is not None and (any(x <= 0 for x in rates) or len(set(rates)) != len(rates)):
            raise ValueError("lr_sweep must list distinct positive learning rates")
        return rates

    @property
    def uses_validation(self) -> bool:
        """Whether training decisions (stop, learning rate) need a validation split."""
        return self.until_plateau is not None or self.lr_sweep is not None

    @property
    def max_steps(self) -> int:
        return self.until_plateau.max_steps if self.until_plateau else self.steps


def study_settings(
    settings: StudySettings | Mapping[str, Any] | None = None, /, where: str = "", **overrides: Any
) -> StudySettings:
    """``settings`` (a model or a mapping of its fields) with ``overrides`` on top, validated; a bad
    or unknown setting is one :class:`OtdusError` naming it (``where``: e.g. the recipe and block)."""
    base = settings.model_dump() if isinstance(settings, StudySettings) else dict(settings or {})
    data = {**base, **overrides}
    try:
        return StudySettings.model_validate(data)
    except ValidationError as exc:
        prefix = f"{where}: " if where else ""
        raise OtdusError(f"{prefix}{invalid(exc)}") from None
