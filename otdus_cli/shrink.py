"""`otdus shrink`: remove layers, or merge them, and write the shallower checkpoint.

A shrink is a layer map with fewer layers (plan/shrink_map.py): the layers to remove are chosen by
scores streamed over calibration text (plan/layer_scores.py) or named; ``drop`` leaves them out, a
merge method (methods/merge.py: average, laco, ot) builds one layer from each merge group. The map
is written by expand's own path (expand.py): kept layers are byte copies, merged layers are built
one at a time from their parents read lazily, the output is staged and swapped into place
atomically, with the same manifest, card, --json and torchrun/srun support.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from otdus_cli.distributed import World, current_world
from otdus_cli.errors import OtdusError, doing
from otdus_cli.expand import (
    ExpandResult,
    ExpansionPlan,
    ProgressFn,
    StageFn,
    expand,
    output_layout,
)
from otdus_cli.io.reader import CheckpointReader
from otdus_cli.methods.base import Method, variants_note
from otdus_cli.methods.ot.options import DEFAULT_CALIB, DEFAULT_CALIB_TOKENS, MIN_CALIB_TOKENS
from otdus_cli.methods.registry import SHRINK_METHODS
from otdus_cli.options import OutputDtype, invalid, merge_options, read_yaml
from otdus_cli.plan.shrink_map import (
    LacoTrace,
    LayerScores,
    Selection,
    merge_groups,
    removal_count,
    select_removed,
    shrink_layers,
)
from otdus_cli.source import SourceModel, open_source

if TYPE_CHECKING:
    import torch


ShrinkMethod = Literal[tuple(SHRINK_METHODS)]  # type: ignore[valid-type]


class ShrinkSettings(BaseModel):
    """What decides a shrink besides the merge methods' own options (ShrinkOptions adds one option
    group per shrink method that has options, from the registry: methods/registry.py)."""

    model_config = ConfigDict(extra="forbid")

    method: ShrinkMethod = "drop"  # type: ignore[valid-type]
    layers: int | None = Field(None, ge=1, description="number of layers removed (default 1)")
    ratio: float | None = Field(None, gt=0, lt=1, description="layers removed, as a fraction of the depth")
    select: Selection | None = None  # None: explicit when remove names layers, else bi
    remove: list[int] | None = Field(None, min_length=1)  # --select explicit: the source layers removed
    # the text the selection scores are measured on (and OT's activation variant's calibration text)
    calib: str = DEFAULT_CALIB
    calib_tokens: int = Field(DEFAULT_CALIB_TOKENS, ge=MIN_CALIB_TOKENS)
    dtype: OutputDtype = "auto"
    max_shard_size: str = "5GB"
    device: str = "auto"
    seed: int = 0
    revision: str | None = None
    allow_unknown_arch: bool = False
    # --select laco (laco_select.py): C layers merged per step, the similarity threshold T, the step I
    # after a kept merge, the top and bottom layers H and L (H None: the last); the released
    # notebook's settings for Llama-2-13B are the defaults (C 7, I 1, T 0.45, L 0, H the last layer)
    laco_merge: int = Field(7, ge=2, description="layers merged into one per step of LaCo's loop")
    laco_interval: int = Field(1, ge=1, description="how far LaCo's loop moves down after a kept merge")
    laco_threshold: float = Field(0.45, ge=-1, le=1, description="similarity a merge must exceed to be kept")
    laco_top: int | None = Field(None, ge=0, description="LaCo's H: the first merge ends below it")
    laco_bottom: int = Field(0, ge=0, description="LaCo's L: no merge starts below it")

    @field_validator("remove")
    @classmethod
    def _each_layer_once(cls, remove: list[int] | None) -> list[int] | None:
        if remove is not None and len(set(remove)) != len(remove):
            raise ValueError(f"names a layer twice ({remove}); name each layer once")
        return remove

    @property
    def selection(self) -> str:
        """The selection in force (``select``, or its default)."""
        return self.select or ("explicit" if self.remove else "bi")

    def method_options(self) -> BaseModel | None:
        """The chosen method's option group, with the shrink's own values for the options it shares
        (shrink_owned: OT's calibration text is the one the layers are scored on); None: it has none."""
        method = SHRINK_METHODS[self.method]
        if method.options is None:
            return None
        group: BaseModel = getattr(self, method.name)
        return group.model_copy(update={name: getattr(self, name) for name in shrink_owned(method)})

    def method_variant(self) -> str | None:
        """The variant of the chosen method (e.g. ``ot.variant`` for ot), if it has variants."""
        return getattr(self.method_options(), "variant", None)


def shrink_owned(method: Method) -> tuple[str, ...]:
    """The options of ``method``'s group that the shrink sets itself (its flags and recipe keys of
    the same name stand for them), e.g. OT's calib and calib_tokens."""
    if method.options is None:
        return ()
    return tuple(name for name in method.options.model_fields if name in ShrinkSettings.model_fields)


# Everything that decides what `otdus shrink` writes (recorded in the manifest).
ShrinkOptions = create_model(
    "ShrinkOptions",
    __base__=ShrinkSettings,
    __module__=__name__,
    **{m.name: (m.options, Field(default_factory=m.options)) for m in SHRINK_METHODS.values() if m.options},  # type: ignore[call-overload]
)


def shrink_spec_options(spec: str, overrides: dict[str, Any] | None = None) -> ShrinkOptions:
    """The shrink options of a study arm's spec ``METHOD[:VARIANT][@SELECTION]`` (what follows
    ``shrink:``), e.g. ``drop``, ``ot:structured``, ``laco@angular``. ``overrides`` (ShrinkOptions
    fields, e.g. ``{"layers": 2}``) apply first; the spec's own method, variant and selection win.
    A variant is the ``variant`` option of the method's group."""
    body, _, select = spec.strip().partition("@")
    method, _, variant = body.partition(":")
    data: dict[str, Any] = {"method": method}
    if select:
        data["select"] = select
    if variant:
        if method not in SHRINK_METHODS or not SHRINK_METHODS[method].has_variants():
            raise OtdusError(f"shrink arm {spec!r}: {variants_note(SHRINK_METHODS.values(), 'shrink:')}")
        data[method] = {"variant": variant}
    try:
        return ShrinkOptions.model_validate(merge_options(overrides or {}, data))
    except ValidationError as exc:
        raise OtdusError(f"shrink arm {spec!r}: {invalid(exc)}") from None


LACO_SELECTION = ("laco_merge", "laco_interval", "laco_threshold", "laco_top", "laco_bottom")


def ignored_options(options: ShrinkSettings) -> dict[str, str]:
    """Options without effect on this shrink -> why (recorded in the manifest): every other shrink
    method's option group; of the chosen method's, the ones the shrink sets itself and the ones its
    declaration says these values ignore (Method.ignored); the calibration text when nothing reads
    it (an explicit selection scores nothing; a method reads it unless its declaration ignores it)."""
    chosen = SHRINK_METHODS[options.method]
    ignored: dict[str, str] = {}
    for other in SHRINK_METHODS.values():
        if other.options is not None and other.name != chosen.name:
            label = other.label or other.name
            why = f"only --method {other.name} uses {label} options, not {chosen.name}"
            ignored |= dict.fromkeys((f"{other.name}.{f}" for f in other.options.model_fields), why)
    owned = shrink_owned(chosen)
    if owned:
        why = f"the shrink's {' and '.join(owned)} apply"
        ignored |= dict.fromkeys((f"{chosen.name}.{f}" for f in owned), why)
    own = chosen.ignored(options.method_options()) if chosen.ignored is not None else {}
    ignored |= {f"{chosen.name}.{f}": why for f, why in own.items() if f not in owned}
    if options.selection != "laco":
        ignored |= dict.fromkeys(LACO_SELECTION, "only --select laco reads it")
    reads_calib = "calib" in owned and "calib" not in own
    if options.selection == "explicit" and not reads_calib:
        ignored |= dict.fromkeys(("calib", "calib_tokens"), "--select explicit scores nothing")
    return ignored


@dataclass
class ShrinkPlan(ExpansionPlan):
    """A shrink's layer map, config and tensors, with what chose the removed layers."""

    removed: list[int] = field(default_factory=list)
    scores: LayerScores | None = None
    laco: LacoTrace | None = None  # --select laco: what its loop tried

    @property
    def function_preserving(self) -> bool:
        return False

    @property
    def zero_init(self) -> bool:
        return False

    def ignored_options(self) -> dict[str, str]:
        return ignored_options(self.options)

    def manifest_fields(self) -> dict[str, Any]:
        """What the manifest records beyond an expansion's: what was removed or merged, and why."""
        return {
            "operation": "shrink",
            "shrink": {
                "removed": self.removed,
                "merged": self.merged,
                "select": self.options.selection,
                "scores": None if self.scores is None else self.scores.to_json(),
                "laco": None if self.laco is None else self.laco.to_json(),
            },
        }

    @property
    def merged(self) -> list[list[int]]:
        """The source layers of each merged layer (none for drop)."""
        return [list(lay.parents) for lay in self.layer_map if lay.new]


def make_shrink_plan(
    source: SourceModel,
    options: ShrinkOptions,
    scores: LayerScores | None = None,
    laco: LacoTrace | None = None,
) -> ShrinkPlan:
    """The shrink of ``source`` that ``options`` ask for; every bad request fails here (OtdusError),
    before anything is written. Scored selections use ``scores`` (``laco``: LaCo's loop), or stream the
    source over the calibration text for them."""
    method = SHRINK_METHODS[options.method]
    family = source.family
    depth = source.depth
    if family.copy_only and method.make_builder is not None:
        raise OtdusError(
            f"{family.name} has no exact template (which tensors a layer holds): --method drop only, "
            f"not {method.name}"
        )
    refusal = method.refusal(family)
    if refusal:
        raise OtdusError(
            f"--method {method.name} cannot merge {family.name} layers ({refusal}); use drop, average or laco"
        )
    if method.refuses_options is not None:
        message = method.refuses_options(family, options.method_options())
        if message:
            raise OtdusError(message)
    if options.selection == "explicit" or options.remove:
        if options.ratio is not None:
            raise OtdusError("--remove names the layers itself; leave out --ratio")
        scores = None
        removed = select_removed(depth, options.layers, options.selection, options.remove)
    elif options.selection == "laco":
        scores = None
        check_laco_selection(source, options)
        if laco is None:
            laco = run_laco_selection(source, options)
        removed = select_removed(depth, None, "laco", laco=laco)
    else:
        laco = None
        count = removal_count(depth, options.layers, options.ratio)
        if scores is None:
            scores = measure_scores(source, options)
        removed = select_removed(depth, count, options.selection, scores=scores)
    layer_map = shrink_layers(depth, removed, method.builder)
    for group in merge_groups(depth, removed) if method.make_builder is not None else []:
        kinds = {family.layer_kind(source.text_config, i) for i in group}
        if len(kinds) > 1:
            raise OtdusError(
                f"--method {method.name}: layers {', '.join(map(str, sorted(group)))} would be merged into "
                f"one, but they are of different kinds in {family.name} ({', '.join(sorted(kinds))}); "
                "use --method drop or remove other layers"
            )
    config, tensors = output_layout(source, layer_map, options.dtype)
    return ShrinkPlan(source, method, options, layer_map, config, tensors, removed, scores, laco)


def check_laco_selection(source: SourceModel, options: ShrinkOptions) -> None:
    """Refuses a --select laco request that cannot run, before the loop's passes."""
    from otdus_cli.laco_select import laco_bounds

    if options.method == "ot":
        raise OtdusError(
            "--select laco tries each merge on the calibration text, which with --method ot is one OT build "
            "per try: choose with --method laco, average or drop, or select with --select bi or angular"
        )
    if options.layers is not None or options.ratio is not None:  # a cap on what the loop removes
        removal_count(source.depth, options.layers, options.ratio)
    laco_bounds(source.depth, options)


def run_laco_selection(source: SourceModel, options: ShrinkOptions, world: World | None = None) -> LacoTrace:
    """LaCo's selection loop over the calibration text (laco_select.py)."""
    from otdus_cli.device import resolve_device
    from otdus_cli.laco_select import laco_select  # torch

    check_laco_selection(source, options)
    device = resolve_device(options.device, world)
    with doing(_scoring(options), "fewer --calib-tokens"):
        return laco_select(source, options, device)


def _scoring(options: ShrinkOptions) -> str:
    """The stage that chooses the layers (what progress and a failure's message name)."""
    what = "LaCo's selection" if options.selection == "laco" else "scoring the layers"
    return f"{what} on up to {options.calib_tokens} tokens of {options.calib}"


def measure_scores(source: SourceModel, options: ShrinkOptions, world: World | None = None) -> LayerScores:
    """The selection scores of ``source`` on the calibration text (blocks of one layer and of the
    removal count)."""
    from otdus_cli.device import resolve_device

    count = removal_count(source.depth, options.layers, options.ratio)
    device = resolve_device(options.device, world)
    with doing(_scoring(options), "fewer --calib-tokens"):
        return scores_of(source.reader, options.calib, options.calib_tokens, count, device)


def scores_of(
    model: str | os.PathLike[str] | CheckpointReader,
    calib: str,
    calib_tokens: int,
    block: int,
    device: str | torch.device = "cpu",
) -> LayerScores:
    """The selection scores (plan/layer_scores.py) of ``model`` (a folder, or the reader a plan has
    open already), streamed by verify's evaluator over up to ``calib_tokens`` tokens of ``calib``."""
    import torch

    from otdus_cli.methods.ot.calibration import calibration_windows
    from otdus_cli.plan.layer_scores import layer_scores
    from otdus_cli.verify.metrics import model_max_positions
    from otdus_cli.verify.streaming import StreamedModel

    reader = model if isinstance(model, CheckpointReader) else CheckpointReader(model)
    max_positions = model_max_positions(reader.config)
    windows = calibration_windows(reader.folder, calib, calib_tokens, max_positions, "scoring the layers")
    run = StreamedModel(reader, device=device, dtype=torch.float32, batch_size=8)
    try:
        return layer_scores(run, windows, calib, block)
    finally:
        run.weights.free_shell()


def plan_shrink(model: str, options: ShrinkOptions) -> ShrinkPlan:
    """The plan `otdus plan --shrink` shows: nothing is written."""
    return make_shrink_plan(open_source(model, options.revision, options.allow_unknown_arch), options)


def shrink(
    model: str,
    out: str | Path,
    options: ShrinkOptions | None = None,
    force: bool = False,
    progress: ProgressFn | None = None,
    on_plan: Callable[[ExpansionPlan], None] | None = None,
    on_note: Callable[[str], None] | None = None,
    world: World | None = None,
    on_stage: StageFn | None = None,
) -> ExpandResult:
    """Shrink `model` (folder or hub id) into `out` atomically; returns what was written.

    Under torchrun/srun the scores are measured once, by rank 0, and every rank plans with them (a
    selection measured on each rank's own device could differ in the last bits and split the plan)."""
    options = options or ShrinkOptions()
    world = current_world() if world is None else world
    start = time.perf_counter()
    scores = laco = None
    if options.selection != "explicit" and not options.remove:

        def measure() -> LayerScores | LacoTrace | None:
            if not world.is_main:
                return None
            source = open_source(model, options.revision, options.allow_unknown_arch)
            if on_stage:
                on_stage(_scoring(options))
            if options.selection == "laco":
                return run_laco_selection(source, options, world)
            return measure_scores(source, options, world)

        measured = world.exchange(measure)[0]
        if isinstance(measured, LacoTrace):
            laco = measured
        else:
            scores = measured
    scored_s = time.perf_counter() - start
    result = expand(
        model,
        out,
        options,
        force=force,
        progress=progress,
        on_plan=on_plan,
        on_note=on_note,
        world=world,
        on_stage=on_stage,
        planner=functools.partial(make_shrink_plan, scores=scores, laco=laco),
    )
    result.seconds += scored_s  # the whole run, the scoring pass included
    result.timings["score_s"] = scored_s
    return result


class ShrinkRecipe(BaseModel):
    """A YAML recipe of a shrink: the source model, optionally the output, and the shrink options."""

    model_config = ConfigDict(extra="forbid")

    model: str
    out: str | None = None
    description: str | None = None
    shrink: ShrinkOptions = Field(default_factory=ShrinkOptions)


def load_shrink_recipe(path: Path) -> ShrinkRecipe:
    data = read_yaml(path)
    try:
        return ShrinkRecipe.model_validate(data)
    except ValidationError as exc:
        raise OtdusError(f"recipe {path}: {invalid(exc)}") from None
