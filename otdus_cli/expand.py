"""`otdus expand`: plan the new stack, then stream every output tensor to its final place.

Base layers and copies move bytes (no decode); built layers are made one at a time from their
parents, read lazily; only the current tensor (and what a builder's formulas need) is in memory.

The output is written as every otdus output is (output.py: claim, stage, shards, config, side
files, manifest, swap); this module provides the plan, the tensors and the manifest.

Under torchrun or srun (see distributed.py) the ranks share the work: the built layers are split
across them (each on its own device), every other tensor is copied by the rank that owns its shard
file; rank 0 claims the output and creates the temporary folder and the shard files, every rank
writes its tensors into them, and once all have, rank 0 writes the index, config and manifest and
swaps the folder into place. The bytes are those of a single process (every builder is seeded per
output layer). A world of one goes through the same steps.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from otdus_cli.arch.config_rules import (
    check_depth_rules,
    family_config,
    validate_with_transformers,
)
from otdus_cli.arch.derived import WITHOUT_ZERO_INIT, check_derived_plan
from otdus_cli.arch.derived_roles import check_role_kinds
from otdus_cli.arch.layer_slices import DepthSliced, LayerSlices, planned_slices, write_slices
from otdus_cli.device import resolve_device
from otdus_cli.distributed import World, current_world, shard
from otdus_cli.errors import OtdusError, doing
from otdus_cli.io.safetensors_format import CODE_OF_NAME, FLOAT_CODES
from otdus_cli.io.writer import PlannedTensor, ShardedWriter
from otdus_cli.manifest import Manifest, ManifestLayer, created_now
from otdus_cli.methods.base import BuildContext, Method
from otdus_cli.methods.registry import METHODS, get_method
from otdus_cli.options import ExpandOptions, ignored_options
from otdus_cli.output import ConfigCheck, Finished, RankWrite, write_output
from otdus_cli.plan.layer_map import OutputLayer, check_parent_kinds, is_function_preserving, plan_layers
from otdus_cli.source import SourceModel, earlier_steps, open_source, source_record

SCRATCH = ".otdus-scratch"  # inside the staging folder; never part of an output

ProgressFn = Callable[[int], None]
# what a long run is doing now, for progress lines in a log: "layer 5 of 7 (output layer 4: new, ot of ...)"
StageFn = Callable[[str], None]


@dataclass
class ExpansionPlan:
    """What an expansion will write: the layer map, the rewritten config and every output tensor."""

    source: SourceModel
    method: Method
    options: ExpandOptions
    layer_map: list[OutputLayer]
    config: dict  # the rewritten config.json
    tensors: list[PlannedTensor]

    @property
    def function_preserving(self) -> bool:
        return is_function_preserving(self.layer_map, self.source.depth)

    @property
    def zero_init(self) -> bool:
        """Zero-init as asked, or the method's default for its variant."""
        if self.options.zero_init is not None:
            return self.options.zero_init
        return self.method.zero_init_for(self.options.method_variant())

    def ignored_options(self) -> dict[str, str]:
        """Options without effect on this plan -> why (recorded in the manifest)."""
        return ignored_options(self.options)

    def manifest_fields(self) -> dict[str, Any]:
        """Manifest fields beyond an expansion's (a shrink's: its operation and what it removed)."""
        return {}

    @property
    def new_parameter_names(self) -> list[str]:
        return [
            self.source.output_name(lay.source, lay.index, s)
            for lay in self.layer_map
            if lay.new
            for s in self.source.layers[lay.source].suffixes()
        ]


def _either(names: list[str]) -> str:
    """["a", "b", "c"] -> "a, b or c" (the methods a message offers, from the registry)."""
    return " or ".join(filter(None, [", ".join(names[:-1]), names[-1]]))


def make_plan(source: SourceModel, options: ExpandOptions) -> ExpansionPlan:
    method = get_method(options.method)
    family = source.family
    if family.copy_only and method.builder != "copy":
        if family.name == "generic":
            raise OtdusError(f"--allow-unknown-arch supports only copy-type methods, not {method.name}")
        copy_type = _either([m.name for m in METHODS.values() if m.builder == "copy"])
        if not method.needs_roles:
            role_wise = _either([m.name for m in METHODS.values() if m.needs_roles])
            also = f", {role_wise}" if family.roles else ""
            raise OtdusError(
                f"--method {method.name} needs an exact template; {family.name} was read off transformers' "
                f"class: use {copy_type}{also}"
            )
        if not family.roles:
            why = "; ".join(f"{k}: {v}" for k, v in (family.roles_proof or {}).get("unmatched", {}).items())
            raise OtdusError(
                f"--method {method.name} computes new tensors from the layer roles (q/k/v/o, gate/up/down); "
                f"{family.name} was read off transformers' class, and no kind of its layers has an exact "
                f"template's roles ({why or 'none'}): use {copy_type}"
            )
    refusal = method.refusal(source.family)
    if refusal:
        raise OtdusError(
            f"--method {method.name} cannot build {source.family.name} layers ({refusal}); "
            "use copy, interpose, average or random"
        )
    if method.refuses_options is not None:
        message = method.refuses_options(source.family, options.method_options())
        if message:
            raise OtdusError(message)
    layer_map = plan_layers(
        source.depth,
        method,
        options.position,
        options.layers,
        options.ratio,
        options.after,
        method.zero_init_for(options.method_variant()) if options.zero_init is None else options.zero_init,
    )
    check_parent_kinds(source.family, source.text_config, source.depth, layer_map, method.name)
    if method.needs_roles:
        check_role_kinds(source, layer_map, method.name, method.roles_of_every_layer)
    if not source.family.zero_init and any(lay.zero_init for lay in layer_map):
        why = source.family.zero_init_note or "it needs an exact template (which tensors to zero)"
        raise OtdusError(f"zero-init for {source.family.name}: {why}; {WITHOUT_ZERO_INIT}")
    config, tensors = output_layout(source, layer_map, options.dtype)
    return ExpansionPlan(source, method, options, layer_map, config, tensors)


def output_layout(
    source: SourceModel, layer_map: list[OutputLayer], dtype: str
) -> tuple[dict, list[PlannedTensor]]:
    """The config.json and the tensors of an output with ``layer_map`` (an expansion's or a shrink's):
    the family's per-layer and index fields rewritten (a derived template's checked against
    transformers' own build), in ``dtype`` unless "auto"."""
    family = source.family
    config = family_config(family, source.config, layer_map)
    sliced = check_derived_plan(source, config, layer_map) if family.derived else {}
    if dtype != "auto":
        config["torch_dtype" if "torch_dtype" in config else "dtype"] = dtype
    return config, _planned_tensors(source, layer_map, dtype, sliced)


if TYPE_CHECKING:
    import torch

    from otdus_cli.arch.identity_values import IdentityValue
    from otdus_cli.io.stack import SourceLayer


def _out_dtype(code: str, dtype: str) -> str:
    if dtype == "auto" or code not in FLOAT_CODES:
        return code
    return CODE_OF_NAME[dtype]


def _planned_tensors(
    source: SourceModel, layer_map: list[OutputLayer], dtype: str, sliced: dict[str, DepthSliced]
) -> list[PlannedTensor]:
    """Every output tensor; those of ``sliced`` (a slice per layer) with one slice per output layer."""
    sources = [lay.source for lay in layer_map]

    def planned(src_name: str, out_name: str) -> PlannedTensor:
        meta = source.reader.meta(src_name)
        out_dtype = _out_dtype(meta.dtype, dtype)
        if src_name in sliced:
            return planned_slices(src_name, out_dtype, meta.shape, sliced[src_name], sources)
        return PlannedTensor(out_name, out_dtype, meta.shape)

    out = [planned(n, n) for n in source.head]
    for lay in layer_map:
        src = source.layers[lay.source]
        out += [planned(src.name(s), source.output_name(lay.source, lay.index, s)) for s in src.suffixes()]
    out += [planned(n, source.after_stack_name(n, len(layer_map))) for n in source.after_stack]
    out += [planned(n, n) for n in source.tail]
    return out


@dataclass
class ExpandResult:
    out: Path
    plan: ExpansionPlan
    manifest: dict
    bytes_written: int
    seconds: float
    stats: dict = field(default_factory=dict)
    # what the user should know: the manifest's warnings, stale temporary folders removed or found
    warnings: list[str] = field(default_factory=list)
    # where the time went (seconds; "first_byte_at" is a time.time() stamp): see expand()
    timings: dict = field(default_factory=dict)
    replaced: bool = False  # --force replaced an earlier (unchanged) otdus output at ``out``


def _layer_names(source: SourceModel, lay: OutputLayer) -> set[str]:
    """The names output layer ``lay`` stores its tensors under."""
    return {source.output_name(lay.source, lay.index, s) for s in source.layers[lay.source].suffixes()}


def _built(lay: OutputLayer) -> bool:
    return lay.builder not in ("base", "copy")


def rank_tensors(plan: ExpansionPlan, writer: ShardedWriter, world: World) -> tuple[set[str], set[int]]:
    """The output tensors this rank writes and the output layers it builds: a contiguous block of
    the built layers (balanced by their tensors' bytes), and every other tensor of the shard files
    it owns (file k: rank k mod world size)."""
    source = plan.source
    built = [lay for lay in plan.layer_map if _built(lay)]
    sizes = {t.name: t.nbytes for t in plan.tensors}
    names = {lay.index: _layer_names(source, lay) for lay in built}
    block = shard([sum(sizes[n] for n in names[lay.index]) for lay in built], world)
    mine = {built[k].index for k in block}
    of_built = {n: i for i, group in names.items() for n in group}
    owner = {f: k % world.size for k, f in enumerate(writer.files)}
    tensors = {
        name
        for name, slot in writer.slots.items()
        if (of_built[name] in mine if name in of_built else owner[slot.file] == world.rank)
    }
    return tensors, mine


def _layer_stage(lay: OutputLayer, depth: int) -> str:
    """Output layer ``lay`` of ``depth`` in words, counted from 1, then by its index as layer maps
    give it: "layer 5 of 7 (output layer 4: new, ot of base layers 3 and 4)", "layer 2 of 7 (output
    layer 1: base layer 1)"."""
    where = f"layer {lay.index + 1} of {depth} (output layer {lay.index}"
    if not lay.new:
        return f"{where}: base layer {lay.source})"
    parents = list(lay.parents) or [lay.source]
    of = f"base layer{'s' * (len(parents) > 1)} {' and '.join(map(str, parents))}"
    return f"{where}: new, {lay.builder} of {of})"


class _Engine:
    """Writes this rank's part of one planned expansion into a folder (all of it in a world of one)."""

    def __init__(
        self,
        plan: ExpansionPlan,
        writer: ShardedWriter,
        progress: ProgressFn | None,
        world: World,
        on_stage: StageFn | None = None,
    ):
        self.plan = plan
        self.src = plan.source
        self.world = world
        self.writer = writer  # the shard files, open (output.py)
        self.mine, self.my_layers = rank_tensors(plan, writer, world)
        self.progress = progress or (lambda n: None)
        self.on_stage = on_stage or (lambda stage: None)
        self.stats: dict[int, dict] = {}
        # builders that need the whole source first (LESA) predict into this folder, removed after
        self.scratch = writer.folder / (SCRATCH if world.is_main else f"{SCRATCH}-rank{world.rank}")
        self.reports: dict[str, dict] = {}  # builder name -> what its pre-pass reports (manifest)
        self.first_byte_at: float | None = None  # time.time() when the work proper started
        self.first_byte_cpu_s: float | None = None  # this process's CPU seconds (all threads) by then

    def _copy(self, src_name: str, out_name: str) -> None:
        if out_name not in self.mine:
            return
        raw = self.src.reader.raw(src_name)
        planned = self.writer.slots[out_name].tensor
        if isinstance(planned, LayerSlices):  # a slice per layer: each output layer's from its source's
            n = write_slices(self.src.reader, self.writer, planned)
        elif raw is not None and raw.dtype == planned.dtype:
            n = self.writer.copy_raw(out_name, raw)
        else:
            n = self.writer.write_tensor(out_name, self.src.reader.get(src_name))
        self.progress(n)

    def run(self) -> None:
        method = self.plan.method
        self.on_stage(f"setting up {method.name}")  # a computing method's builder imports torch: seconds
        built = method.make_builder is not None and any(_built(lay) for lay in self.plan.layer_map)
        builders = {method.builder: method.make_builder()} if built else {}
        # copy-type plans move bytes only: no torch (seconds of import) unless a device was named
        named = self.plan.options.device
        # several ranks: "auto"/"cuda" is this rank's GPU (otdus_cli.device)
        device = resolve_device(named, self.world) if builders or named != "auto" else None
        # start-up ends here: for copy-type methods the next thing is the first tensor byte moving
        self.first_byte_at = time.time()
        self.first_byte_cpu_s = time.process_time()
        try:
            self._prepare(builders, device)
            self._write(builders, device)
        finally:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def _prepare(self, builders: dict, device: torch.device | None) -> None:
        """Run the pre-pass of every builder that has one (over all source layers)."""
        for name, builder in builders.items():
            prepare = getattr(builder, "prepare", None)
            if prepare is None:
                continue
            new = [lay for lay in self.plan.layer_map if lay.builder == name]
            ctx = self._context(new[0].zero_init, device)
            what = f"preparing {name} (its pass over the source layers)"
            self.on_stage(what)
            with doing(what):
                report = prepare(self.src.layers, new, ctx, self.scratch)
            if report is not None:  # None: this variant of the builder has nothing to report
                self.reports[name] = report

    def _context(self, zero_init: bool, device, output_index: int = 0) -> BuildContext:
        return BuildContext(
            family=self.src.family,
            config=self.src.text_config,
            device=device,
            options=self.plan.options.method_options(),
            seed=self.plan.options.seed,
            output_index=output_index,
            source_folder=Path(self.src.reader.folder),
            zero_init=zero_init,
            dtype=self.plan.options.dtype,
        )

    def _write(self, builders: dict, device: torch.device | None) -> None:
        self.on_stage("copying the embeddings")
        for name in self.src.head:
            self._copy(name, name)
        depth = len(self.plan.layer_map)
        for lay in self.plan.layer_map:
            self.on_stage(_layer_stage(lay, depth))
            if not _built(lay):
                self._copy_layer(lay)
            elif lay.index in self.my_layers:
                with doing(f"building output layer {lay.index} with {lay.builder}"):
                    self._build_layer(lay, builders[lay.builder], device)
        self.on_stage("copying the final norm and head")
        for name in self.src.after_stack:
            self._copy(name, self.src.after_stack_name(name, len(self.plan.layer_map)))
        for name in self.src.tail:
            self._copy(name, name)

    def _out_name(self, lay: OutputLayer, suffix: str) -> str:
        return self.src.output_name(lay.source, lay.index, suffix)

    def _copy_layer(self, lay: OutputLayer) -> None:
        src = self.src.layers[lay.source]
        for suffix in src.suffixes():
            out = self._out_name(lay, suffix)
            value = self.src.family.zero_init_value(suffix) if lay.zero_init else None
            if value is None:
                self._copy(src.name(suffix), out)
            elif out in self.mine:
                self._write_value(out, value, src)

    def _write_value(self, out: str, value: IdentityValue, source: SourceLayer) -> None:
        """A tensor of a zero-init layer that holds ``value`` (Family.zero_init_value): zeros without
        torch; another value (a derived template's residual scale at 1, an expert-choice bias that counts
        the ``source`` layer's experts: arch/identity_values.py)."""
        if value == 0.0:
            self.progress(self.writer.write_zeros(out))
            return
        from otdus_cli.arch.identity_values import ExpertChoiceBias, value_tensor

        # only an expert-choice bias counts the layer's experts: one header lookup per tensor of the layer
        counted = isinstance(value, ExpertChoiceBias)
        shapes = {suffix: source.shape(suffix) for suffix in source.suffixes()} if counted else {}
        held = value_tensor(value, tuple(self.writer.slots[out].tensor.shape), shapes)
        self.progress(self.writer.write_tensor(out, held))

    def _build_layer(self, lay: OutputLayer, builder, device: torch.device) -> None:
        parents = [self.src.layers[i] for i in lay.parents]
        if builder.parents_needed is not None and len(parents) != builder.parents_needed:  # None: any
            raise OtdusError(f"layer {lay.index}: {lay.builder} needs {builder.parents_needed} parent layers")
        ctx = self._context(lay.zero_init, device, lay.index)
        expected = set(parents[0].suffixes())
        for suffix, tensor in builder.build(parents, ctx):
            if suffix not in expected:
                raise RuntimeError(f"builder {lay.builder} produced unknown tensor {suffix}")
            expected.discard(suffix)
            out = self._out_name(lay, suffix)
            value = self.src.family.zero_init_value(suffix) if lay.zero_init else None
            if value is None:
                self.progress(self.writer.write_tensor(out, tensor))
            else:
                self._write_value(out, value, parents[0])
            del tensor
        if expected:
            raise RuntimeError(f"builder {lay.builder} did not produce {sorted(expected)[0]}")
        if ctx.stats:
            self.stats[lay.index] = ctx.stats


def build_manifest(
    plan: ExpansionPlan, stats: dict[int, dict], finished: Finished[dict[int, dict]], reports: dict[str, dict]
) -> Manifest:
    """The manifest of an expansion; ``reports``: each pre-pass's report, under its builder's name."""
    check = finished.config_check
    history = earlier_steps(plan.source)  # a source made by otdus: every earlier step, for the chain
    return Manifest(
        **created_now(),
        source=source_record(plan.source),
        method=plan.method.name,
        options=plan.options.model_dump(),
        ignored_options=plan.ignored_options(),  # option -> why it had no effect
        num_hidden_layers=len(plan.layer_map),
        function_preserving=plan.function_preserving,
        layers=[ManifestLayer(**lay.to_json()) for lay in plan.layer_map],
        new_parameters=plan.new_parameter_names,
        layer_slices={
            t.name: {"axis": t.axis, "width": t.width} for t in plan.tensors if isinstance(t, LayerSlices)
        }
        or None,
        transport={str(k): v for k, v in sorted(stats.items())},
        method_sections={**_method_extras(plan), **reports},  # LESA: its leave-one-out check
        copied_files=finished.copied_files,
        config_checked_by_transformers=check.by == "transformers" and check.skipped is None,
        config_check=check.by,
        warnings=[check.skipped] if check.skipped else [],
        **plan.manifest_fields(),
        **({"history": history} if history else {}),
    )


def _method_extras(plan: ExpansionPlan) -> dict:
    """What the method adds to the manifest (Method.manifest_extras; OT: the conventions in force)."""
    if plan.method.manifest_extras is None:
        return {}
    return plan.method.manifest_extras(plan, plan.zero_init)


def _merged(stats: list[dict[int, dict]]) -> dict[int, dict]:
    """Every rank's transport statistics, by output layer."""
    return {k: v for part in stats for k, v in part.items()}


def check_config(plan: ExpansionPlan, folder: Path) -> ConfigCheck:
    """transformers loads the written config when it derives fields of this family from the depth
    (or knows nothing of an unknown one), when the config lists per-layer types (values transformers
    validates), or when it is imported already; otherwise otdus's depth rules (checked when the plan
    was made) are the whole check, and copies never pay transformers' import (seconds)."""
    family, text = plan.source.family, plan.source.text_config
    if family.derives_layer_types or "layer_types" in text or "transformers" in sys.modules:
        return ConfigCheck("transformers", validate_with_transformers(folder, len(plan.layer_map)))
    return ConfigCheck("otdus depth rules")


def expand(
    model: str,
    out: str | Path,
    options: ExpandOptions | None = None,
    force: bool = False,
    progress: ProgressFn | None = None,
    on_plan: Callable[[ExpansionPlan], None] | None = None,
    on_note: Callable[[str], None] | None = None,
    world: World | None = None,
    on_stage: StageFn | None = None,
    planner: Callable[[SourceModel, Any], ExpansionPlan] = make_plan,
) -> ExpandResult:
    """Expand `model` (folder or hub id) into `out` atomically; returns what was written.

    ``planner`` makes the layer map from the source and ``options``; `otdus shrink` (shrink.py) writes
    through this same path with its own.
    ``world`` (default: this process's, see distributed.py): its ranks share the work (module
    docstring); every rank returns the result, and a failure on any rank fails every rank with
    nothing left behind."""
    options = options or ExpandOptions()
    world = current_world() if world is None else world
    start = time.perf_counter()
    timings: dict = {}
    engines: list[_Engine] = []

    def plan() -> ExpansionPlan:
        # a GPU that is not there fails before the model is read (every rank hears of it)
        if options.device not in ("auto", "cpu"):
            resolve_device(options.device, world)
        source = open_source(model, options.revision, options.allow_unknown_arch)
        the_plan = planner(source, options)
        if on_plan:
            on_plan(the_plan)
        timings["plan_s"] = time.perf_counter() - start
        # otdus's own depth rules first (pure Python): a wrong rewrite fails before any output exists
        check_depth_rules(
            the_plan.config,
            source.config,
            len(the_plan.layer_map),
            source.family.per_layer_fields,
            source.family.index_fields,
            source.family.numbered_from_one,
        )
        return the_plan

    def write(the_plan: ExpansionPlan, writer: ShardedWriter) -> RankWrite[dict[int, dict]]:
        """This rank's tensors; the transport statistics of its built layers."""
        engine = _Engine(the_plan, writer, progress, world, on_stage)
        engines.append(engine)
        engine.run()
        return RankWrite(engine.mine, engine.stats)

    def manifest(the_plan: ExpansionPlan, finished: Finished[dict[int, dict]]) -> Manifest:
        return build_manifest(the_plan, _merged(finished.reports), finished, engines[0].reports)

    written = write_output(
        out,
        plan,
        write,
        check_config,
        manifest,
        max_shard_size=options.max_shard_size,
        force=force,
        world=world,
        on_note=on_note,
    )
    engine = engines[0]
    timings |= written.timings
    timings.update(
        first_byte_at=engine.first_byte_at,
        startup_cpu_s=engine.first_byte_cpu_s,
        sync_s=engine.writer.sync_s,
    )
    the_plan = written.plan
    return ExpandResult(
        written.out,
        the_plan,
        written.manifest,
        sum(t.nbytes for t in the_plan.tensors),
        time.perf_counter() - start,
        _merged(written.reports),
        written.warnings,
        timings,
        written.replaced,
    )
