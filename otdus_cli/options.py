"""Validated options of an expansion: one model shared by the CLI flags and YAML recipes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from otdus_cli.errors import OtdusError

# The closed sets of values, shared with the CLI (which offers them as choices and completions).
OTVariant = Literal["paper", "official", "structured", "activation"]
OTSolver = Literal["sinkhorn", "emd"]
LesaVariant = Literal["pair", "published"]
Position = Literal["top", "bottom", "mid", "top-bottom", "uniform"]
OutputDtype = Literal["auto", "float32", "bfloat16", "float16"]


class OTOptions(BaseModel):
    """Options of `--method ot` (see docs/ot.md)."""

    model_config = ConfigDict(extra="forbid")

    variant: OTVariant = "paper"
    solver: OTSolver = "sinkhorn"
    reg: float = Field(0.06, gt=0)
    tol: float = Field(1e-6, gt=0)
    max_iter: int = Field(2000, gt=0)
    # activation variant: calibration text (a file or bundled:NAME) and at most this many tokens of it
    calib: str = "bundled:tinystories-sample"
    calib_tokens: int = Field(4096, ge=512)

    @model_validator(mode="after")
    def _official_has_one_solver(self) -> OTOptions:
        if self.variant == "official" and self.solver != "sinkhorn":
            raise ValueError(
                "--ot-variant official reproduces the released code's POT Sinkhorn and has no emd solver "
                "(use --ot-variant paper or structured with --solver emd)"
            )
        return self


class LesaOptions(BaseModel):
    """Options of `--method lesa` (methods/lesa.py). The predictor's defaults are the published ones
    (the LESA authors' notebook: MLP 2d -> 256 -> 256 -> d, AdamW lr 1e-3, 10 epochs, batch 64,
    norm-term weight 0.0005)."""

    model_config = ConfigDict(extra="forbid")

    variant: LesaVariant = "pair"
    hidden: int = Field(256, ge=1, description="hidden width of the predictor MLP")
    epochs: int = Field(10, ge=1)
    batch_size: int = Field(64, ge=1)
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.01, ge=0, description="AdamW's (torch's default)")
    norm_weight: float = Field(0.0005, ge=0, le=1, description="lambda of the norm term in the loss")
    rank: int | None = Field(None, ge=1, description="keep the top-k singular directions (default all)")
    loo: int = Field(1, ge=0, description="layers held out, one at a time, for the leave-one-out check")


class ExpandOptions(BaseModel):
    """Everything that decides what `otdus expand` writes (recorded in the manifest)."""

    model_config = ConfigDict(extra="forbid")

    method: str = "ot"
    position: Position = "top"
    layers: int | None = Field(None, ge=1, description="number of new layers (default: half the base depth)")
    ratio: float | None = Field(None, gt=0, description="new layers as a fraction of the base depth")
    after: list[int] | None = None
    zero_init: bool | None = None  # None: the method's default
    dtype: OutputDtype = "auto"
    max_shard_size: str = "5GB"
    device: str = "auto"
    seed: int = 0
    revision: str | None = None
    allow_unknown_arch: bool = False
    ot: OTOptions = Field(default_factory=OTOptions)
    lesa: LesaOptions = Field(default_factory=LesaOptions)

    @field_validator("method")
    @classmethod
    def _known_method(cls, value: str) -> str:
        from otdus_cli.methods.registry import get_method

        get_method(value)
        return value

    def method_variant(self) -> str | None:
        """The variant of the chosen method (``ot.variant`` for ot, ``lesa.variant`` for lesa)."""
        own = getattr(self, self.method, None)
        return getattr(own, "variant", None)


def ignored_options(options: ExpandOptions) -> dict[str, str]:
    """Options that have no effect on this expansion, each with the reason (recorded in the manifest)."""
    ignored: dict[str, str] = {}
    if options.method != "lesa":
        lesa_fields = [f"lesa.{name}" for name in LesaOptions.model_fields]
        ignored |= dict.fromkeys(lesa_fields, f"only --method lesa uses LESA options, not {options.method}")
    if options.method != "ot":
        ot_fields = [f"ot.{name}" for name in OTOptions.model_fields]
        return dict.fromkeys(ot_fields, f"only --method ot uses OT options, not {options.method}") | ignored
    if options.ot.variant != "activation":
        ignored |= dict.fromkeys(
            ("ot.calib", "ot.calib_tokens"), "only --ot-variant activation reads calibration text"
        )
    if options.ot.variant == "official":
        return {
            "ot.tol": "the official variant pins the released code's stopThr 1e-9",
            "ot.max_iter": "the official variant pins the released code's 10000 iterations",
        } | ignored
    if options.ot.solver == "emd":
        return (
            dict.fromkeys(("ot.reg", "ot.tol", "ot.max_iter"), "--solver emd is exact (no Sinkhorn)")
            | ignored
        )
    return ignored


def method_spec_options(spec: str, overrides: dict[str, Any] | None = None) -> ExpandOptions:
    """The expand options of a method spec ``method[:variant][+zero|+nozero]`` (study's arms).

    ``overrides`` are ExpandOptions fields applied first (e.g. ``{"layers": 2, "position": "top"}``;
    an ``ot`` mapping sets OT options); the spec's own variant and zero-init flags win over them.
    """
    text = spec.strip()
    zero: bool | None = None
    base, _, flag = text.partition("+")
    if flag:
        if flag not in ("zero", "nozero"):
            raise OtdusError(f"method spec {spec!r}: '+{flag}' is not '+zero' or '+nozero'")
        zero = flag == "zero"
    method, _, variant = base.partition(":")
    data: dict[str, Any] = json.loads(json.dumps(overrides or {}))
    data["method"] = method
    if zero is not None:
        data["zero_init"] = zero
    if variant:
        if method not in ("ot", "lesa"):
            raise OtdusError(
                f"method spec {spec!r}: only ot and lesa have variants (ot:paper, ot:structured, "
                "ot:official, lesa:pair, lesa:published)"
            )
        data.setdefault(method, {})["variant"] = variant
    try:
        return ExpandOptions.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise OtdusError(f"method spec {spec!r}: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None


class Recipe(BaseModel):
    """A YAML recipe: the source model, optionally the output, and the expand options."""

    model_config = ConfigDict(extra="forbid")

    model: str
    out: str | None = None
    description: str | None = None
    expand: ExpandOptions = Field(default_factory=ExpandOptions)


def load_recipe(path: Path) -> Recipe:
    import yaml  # noqa: PLC0415 - only recipes need it; every command imports this module

    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise OtdusError(f"recipe not found: {path}") from None
    except UnicodeDecodeError:
        raise OtdusError(f"recipe {path} is not a text file (YAML expected)") from None
    except OSError as exc:
        raise OtdusError(f"cannot read recipe {path} ({exc.strerror})") from None
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
