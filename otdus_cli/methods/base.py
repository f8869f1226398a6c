"""The seam between the engine and the methods: what a method declares, and the builder interface.

A method is one module that declares a :class:`Method` (its name, placement, options, the family
traits it cannot build, its builder, and what it adds to the manifest and the CLI's report);
methods/registry.py lists each declaration on one line. The options model, if any, becomes the
option group ``ExpandOptions.<name>`` (``expand.<name>.<field>`` in recipes and study arms), and
its fields marked with :class:`Flag` become flags of ``otdus expand``.

A builder makes the tensors of one new layer from its parent layers (one parent for copy-type
builders, the adjacent pair (f_i, f_{i+1}) for pair builders). Parents are read lazily, one
tensor at a time, so a builder holds only what its formulas need.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, get_args

from otdus_cli.arch.families import Family

if TYPE_CHECKING:
    from pathlib import Path

    import torch
    from pydantic import BaseModel


def _cpu() -> torch.device:
    import torch  # planning and copying never need torch

    return torch.device("cpu")


class ParentLayer(Protocol):
    """One base layer, read lazily from the source checkpoint."""

    index: int

    def suffixes(self) -> list[str]:
        """Tensor names inside the layer, e.g. "self_attn.q_proj.weight"."""
        ...

    def get(self, suffix: str) -> torch.Tensor:
        """Load one tensor (source dtype, CPU)."""
        ...


@dataclass
class BuildContext:
    """What a builder may consult besides its parents."""

    family: Family
    config: dict  # the source config.json
    device: torch.device = field(default_factory=_cpu)
    options: Any = None  # the method's validated options model (None: it has none)
    seed: int = 0
    output_index: int = 0  # index of the new layer in the output stack
    stats: dict[str, Any] = field(default_factory=dict)  # builders record per-layer statistics here
    source_folder: Path | None = None  # the source checkpoint (pre-passes that run it: OT activation)
    zero_init: bool = True  # whether the engine zeroes the family's zero-init targets of this layer
    dtype: str = "auto"  # the output dtype (a builder that spills tensors may keep them in it)


class LayerBuilder(Protocol):
    """Builds one new layer. Yields (suffix, tensor) for every suffix of parents[0].

    Tensors may be any float dtype and device; the writer casts to the output dtype. Zeroing of
    the family's zero-init targets is applied by the engine afterwards when --zero-init is on,
    so builders need not know about it unless their formulas depend on it. A builder that needs
    every source layer first (LESA: one SVD per projection type across the stack) also has
    ``prepare(layers, new_layers, ctx, scratch)``: the engine calls it once, before writing; it may
    keep intermediate results in ``scratch`` (inside the staging folder, removed afterwards) and
    returns a report recorded in the manifest under the builder's name (None: nothing to report).
    """

    parents_needed: int | None  # 1 (copy-type), 2 (pair), None: any number (a shrink's merge)

    def build(
        self, parents: Sequence[ParentLayer], ctx: BuildContext
    ) -> Iterator[tuple[str, torch.Tensor]]: ...


@dataclass(frozen=True)
class Flag:
    """Marks an options field as a flag of ``otdus expand`` (``Annotated[type, Flag(...)]``); fields
    without one are set in recipes only. ``default`` is the default as --help shows it (the field's
    own default when None); ``plan``: also a flag of ``otdus plan`` (the option changes the layer
    map, as a variant's zero-init default does)."""

    name: str  # e.g. "--ot-variant"
    help: str
    default: str | None = None
    plan: bool = False


Report = Callable[[dict], Any]  # a function of the written manifest


@dataclass(frozen=True)
class Method:
    """One expansion method, declared by its own module and listed once in methods/registry.py."""

    name: str
    summary: str
    # "placed": new layers go after insertion points (position / --after); "uniform": fixed LLaMA PRO
    # placement; "solar" / "stack": the whole output stack is a list of base layers.
    layout: str
    label: str | None = None  # how messages name it ("OT options"); default: its name
    builder: str = "copy"  # the name of the layers it builds; "copy": byte copies of the parent
    zero_init_default: bool = False
    pair: bool = False  # built from (f_i, f_{i+1})
    # computes new tensors role by role (methods/layer_roles.py): on a derived template, only from the
    # layer kinds whose roles were matched and proved (arch/derived_roles.py)
    needs_roles: bool = False
    # learns from the roles of every base layer, not only the new layers' parents (LESA's SVD)
    roles_of_every_layer: bool = False
    # variants whose published recipe zeroes nothing: zero-init is off by default for them
    zero_init_off_for: tuple[str, ...] = ()
    options: type[BaseModel] | None = None  # the option group ExpandOptions.<name>
    make_builder: Callable[[], LayerBuilder] | None = None  # None: copy-type (the engine moves bytes)
    # family trait (arch/families.py) -> why this method cannot build such layers (refused at plan time)
    refuses: Mapping[str, str] = field(default_factory=dict)
    # a refusal that depends on the options too: (family, options) -> the error message, or None
    refuses_options: Callable[[Family, Any], str | None] | None = None
    # each study seed draws its own layers (otherwise a study expands once, with the recipe's seed)
    seeded_by_study: bool = False
    # options of its own group that have no effect with these values -> why (recorded in the manifest)
    ignored: Callable[[Any], dict[str, str]] | None = None
    # what it adds to the manifest, from the expansion plan (expand.ExpansionPlan) and zero-init
    manifest_extras: Callable[[Any, bool], dict] | None = None
    # what it adds to `expand`'s report: --json entries, lines printed, warnings, `inspect` rows
    report_json: Report | None = None
    report_lines: Report | None = None
    report_warnings: Report | None = None
    inspect_rows: Report | None = None

    def zero_init_for(self, variant: str | None) -> bool:
        """The zero-init default of this method in ``variant``."""
        return self.zero_init_default and variant not in self.zero_init_off_for

    def refusal(self, family: Family) -> str | None:
        """Why this method cannot build ``family``'s layers, or None."""
        return next((why for trait, why in self.refuses.items() if family.has(trait)), None)

    def has_variants(self) -> bool:
        return self.options is not None and "variant" in self.options.model_fields

    def variants(self) -> tuple[str, ...]:
        """The values of its ``variant`` option (none: it has no variants)."""
        if self.options is None or not self.has_variants():
            return ()
        return tuple(get_args(self.options.model_fields["variant"].annotation))


def variants_note(methods: Iterable[Method], prefix: str = "") -> str:
    """Which of ``methods`` have variants, with each spec that names one (``prefix``: what a spec
    starts with, e.g. "shrink:"), e.g. "only ot and lesa have variants (ot:paper, ...)"."""
    with_variants = [m for m in methods if m.has_variants()]
    names = " and ".join(m.name for m in with_variants)
    specs = ", ".join(f"{prefix}{m.name}:{v}" for m in with_variants for v in m.variants())
    return f"only {names} {'has' if len(with_variants) == 1 else 'have'} variants ({specs})"
