"""Validated options of an expansion: one model shared by the CLI flags and YAML recipes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from otdus_cli.errors import OtdusError
from otdus_cli.methods.base import variants_note
from otdus_cli.methods.registry import METHODS, get_method
from otdus_cli.plan.layer_map import Position

# The closed sets of values, shared with the CLI (which offers them as choices and completions).
OutputDtype = Literal["auto", "float32", "bfloat16", "float16"]


class ExpandSettings(BaseModel):
    """What decides an expansion besides the methods' own options (ExpandOptions adds one option
    group per method that has options, from the registry)."""

    model_config = ConfigDict(extra="forbid")

    method: str = "ot"
    position: Position = "top"
    layers: int | None = Field(None, ge=1, description="number of new layers (default: half the base depth)")
    ratio: float | None = Field(None, gt=0, description="new layers as a fraction of the base depth")
    after: list[int] | None = Field(None, min_length=1)  # repeats allowed: several new layers after one
    zero_init: bool | None = None  # None: the method's default
    dtype: OutputDtype = "auto"
    max_shard_size: str = "5GB"
    device: str = "auto"
    seed: int = 0
    revision: str | None = None
    allow_unknown_arch: bool = False
    base_model: str | None = None  # the card's base_model (a hub id) when the source is a local folder

    @field_validator("base_model")
    @classmethod
    def _hub_id(cls, value: str | None) -> str | None:
        from otdus_cli.source import is_hub_id

        if value is not None and not is_hub_id(value):
            raise ValueError(f"{value!r} is not a Hugging Face hub id (owner/name)")
        return value

    @field_validator("method")
    @classmethod
    def _known_method(cls, value: str) -> str:
        get_method(value)
        return value

    def method_options(self) -> BaseModel | None:
        """The chosen method's option group (None: it has none)."""
        return getattr(self, self.method) if get_method(self.method).options is not None else None

    def method_variant(self) -> str | None:
        """The variant of the chosen method (e.g. ``ot.variant`` for ot), if it has variants."""
        return getattr(self.method_options(), "variant", None)


def option_groups() -> dict[str, type[BaseModel]]:
    """Method name -> its options model, for every registered method that has options."""
    return {m.name: m.options for m in METHODS.values() if m.options is not None}


# Everything that decides what `otdus expand` writes (recorded in the manifest).
ExpandOptions = create_model(
    "ExpandOptions",
    __base__=ExpandSettings,
    __module__=__name__,
    **{name: (model, Field(default_factory=model)) for name, model in option_groups().items()},  # type: ignore[call-overload]
)


def merge_options(base: dict[str, Any], *layers: dict[str, Any]) -> dict[str, Any]:
    """``base`` updated by each layer in turn; option groups (nested mappings) are merged key by
    key, so a layer that sets ``ot.reg`` keeps the ``ot`` options it does not name."""
    merged = json.loads(json.dumps(base))
    for layer in layers:
        for key, value in layer.items():
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = merge_options(merged[key], value)
            else:
                merged[key] = json.loads(json.dumps(value))
    return merged


def ignored_options(options: ExpandSettings) -> dict[str, str]:
    """Options that have no effect on this expansion, each with the reason (recorded in the manifest):
    every other method's option group, then the chosen method's own (Method.ignored)."""
    chosen = get_method(options.method)
    ignored: dict[str, str] = {}
    for other in METHODS.values():
        if other.options is not None and other.name != chosen.name:
            label = other.label or other.name
            why = f"only --method {other.name} uses {label} options, not {chosen.name}"
            ignored |= dict.fromkeys((f"{other.name}.{f}" for f in other.options.model_fields), why)
    if chosen.ignored is not None:
        own = chosen.ignored(options.method_options())
        ignored |= {f"{chosen.name}.{k}": why for k, why in own.items()}
    return ignored


def method_spec_options(spec: str, overrides: dict[str, Any] | None = None) -> ExpandOptions:
    """The expand options of a method spec ``method[:variant][+zero|+nozero]`` (study's arms).

    ``overrides`` are ExpandOptions fields applied first (e.g. ``{"layers": 2, "position": "top"}``;
    an ``ot`` mapping sets OT options); the spec's own variant and zero-init flags win over them.
    A variant is the ``variant`` option of the method's group.
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
        if method not in METHODS or not METHODS[method].has_variants():
            raise OtdusError(f"method spec {spec!r}: {variants_note(METHODS.values())}")
        data.setdefault(method, {})["variant"] = variant
    try:
        return ExpandOptions.model_validate(data)
    except ValidationError as exc:
        raise OtdusError(f"method spec {spec!r}: {invalid(exc)}") from None


class Recipe(BaseModel):
    """A YAML recipe: the source model, optionally the output, and the expand options."""

    model_config = ConfigDict(extra="forbid")

    model: str
    out: str | None = None
    description: str | None = None
    expand: ExpandOptions = Field(default_factory=ExpandOptions)  # type: ignore[valid-type]


def invalid(exc: ValidationError) -> str:
    """A validation error in one line: where (``expand.ot``), then pydantic's message without its
    "Value error, " prefix (a rule's own message names its options)."""
    err = exc.errors()[0]
    message = err["msg"].removeprefix("Value error, ")
    where = ".".join(map(str, err["loc"]))
    return f"{where}: {message}" if where else message


def read_yaml(path: str | Path) -> Any:
    """A recipe file's YAML (expand and study recipes alike); a missing or malformed file is an
    OtdusError naming it."""
    import yaml  # only recipes need it; every command imports this module

    try:
        return yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise OtdusError(f"recipe not found: {path}") from None
    except UnicodeDecodeError:
        raise OtdusError(f"recipe {path} is not a text file (YAML expected)") from None
    except OSError as exc:
        raise OtdusError(f"cannot read recipe {path} ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise OtdusError(f"recipe {path} is not valid YAML: {str(exc).splitlines()[0]}") from None


def load_recipe(path: Path) -> Recipe:
    data = read_yaml(path)
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise OtdusError(f"recipe {path}: {invalid(exc)}") from None
    except OtdusError as exc:
        raise OtdusError(f"recipe {path}: {exc}") from None
