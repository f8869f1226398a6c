"""Validated options of an expansion: one model shared by the CLI flags and YAML recipes."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from otdus_cli.errors import OtdusError


class OTOptions(BaseModel):
    """Options of `--method ot` (see docs/ot.md)."""

    model_config = ConfigDict(extra="forbid")

    variant: Literal["paper", "official", "structured"] = "paper"
    solver: Literal["sinkhorn", "emd"] = "sinkhorn"
    reg: float = Field(0.06, gt=0)
    tol: float = Field(1e-6, gt=0)
    max_iter: int = Field(2000, gt=0)


class ExpandOptions(BaseModel):
    """Everything that decides what `otdus expand` writes (recorded in the manifest)."""

    model_config = ConfigDict(extra="forbid")

    method: str = "ot"
    position: Literal["top", "bottom", "mid", "top-bottom", "uniform"] = "top"
    layers: int | None = Field(None, ge=1, description="number of new layers (default: half the base depth)")
    ratio: float | None = Field(None, gt=0, description="new layers as a fraction of the base depth")
    after: list[int] | None = None
    zero_init: bool | None = None  # None: the method's default
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_shard_size: str = "5GB"
    device: str = "auto"
    seed: int = 0
    revision: str | None = None
    allow_unknown_arch: bool = False
    ot: OTOptions = Field(default_factory=OTOptions)

    @field_validator("method")
    @classmethod
    def _known_method(cls, value: str) -> str:
        from otdus_cli.methods.registry import get_method

        get_method(value)
        return value


class Recipe(BaseModel):
    """A YAML recipe: the source model, optionally the output, and the expand options."""

    model_config = ConfigDict(extra="forbid")

    model: str
    out: str | None = None
    description: str | None = None
    expand: ExpandOptions = Field(default_factory=ExpandOptions)


def load_recipe(path: Path) -> Recipe:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise OtdusError(f"recipe not found: {path}") from None
    except yaml.YAMLError as exc:
        raise OtdusError(f"recipe {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise OtdusError(f"recipe {path}: {where}: {err['msg']}") from None
    except OtdusError as exc:
        raise OtdusError(f"recipe {path}: {exc}") from None
