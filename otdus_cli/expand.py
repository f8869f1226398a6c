"""`otdus expand`: plan the new stack, then stream every output tensor to its final place.

Base layers and copies move bytes (no decode); built layers are made one at a time from their
parents, read lazily; only the current tensor (and what a builder's formulas need) is in memory.

Under torchrun or srun (see distributed.py) the ranks share the work: the built layers are split
across them (each on its own device), every other tensor is copied by the rank that owns its shard
file; rank 0 claims the output and creates the temporary folder and the shard files, every rank
writes its tensors into them, and once all have, rank 0 writes the index, config and manifest and
swaps the folder into place. The bytes are those of a single process (every builder is seeded per
output layer). A world of one goes through the same steps.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from otdus_cli import __version__
from otdus_cli.arch.config_rules import (
    check_depth_rules,
    rewrite_config,
    validate_with_transformers,
)
from otdus_cli.arch.families import family_for
from otdus_cli.card import write_output_card
from otdus_cli.device import resolve_device
from otdus_cli.distributed import World, current_world, shard
from otdus_cli.errors import OtdusError
from otdus_cli.io.fingerprint import stack_fingerprints
from otdus_cli.io.output_dir import OutputReport, staged_output
from otdus_cli.io.reader import CheckpointReader
from otdus_cli.io.safetensors_format import CODE_OF_NAME, FLOAT_CODES
from otdus_cli.io.stack import LayerStack, read_stack
from otdus_cli.io.writer import PlannedTensor, ShardedWriter, parse_size
from otdus_cli.manifest import MANIFEST, write_manifest
from otdus_cli.methods.base import BuildContext, Method
from otdus_cli.methods.registry import get_method
from otdus_cli.options import ExpandOptions, ignored_options
from otdus_cli.plan.layer_map import OutputLayer, is_function_preserving, plan_layers
from otdus_cli.source import SIDE_FILE_PATTERNS, ResolvedSource, resolve_source

SCRATCH = ".otdus-scratch"  # inside the staging folder; never part of an output
_NOT_SIDE_FILES = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json", MANIFEST}

ProgressFn = Callable[[int], None]


@dataclass
class SourceModel(LayerStack):
    """The source checkpoint of an expansion: its layer stack and where it came from."""

    resolved: ResolvedSource


def open_source(model: str, revision: str | None = None, allow_unknown_arch: bool = False) -> SourceModel:
    resolved = resolve_source(model, revision)
    reader = CheckpointReader(resolved.folder)
    stack = read_stack(reader, family_for(reader.config, allow_unknown_arch))
    return SourceModel(**vars(stack), resolved=resolved)


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

    @property
    def new_parameter_names(self) -> list[str]:
        prefix = self.source.family.layer_prefix
        return [
            prefix.format(i=lay.index) + s
            for lay in self.layer_map
            if lay.new
            for s in self.source.layers[lay.source].suffixes()
        ]


def make_plan(source: SourceModel, options: ExpandOptions) -> ExpansionPlan:
    method = get_method(options.method)
    if source.family.copy_only and method.builder != "copy":
        if source.family.name == "generic":
            raise OtdusError(f"--allow-unknown-arch supports only copy-type methods, not {method.name}")
        raise OtdusError(
            f"{source.family.name} has no exact template (its layers were read off transformers' class): "
            f"copy-type methods only, not {method.name}"
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
    # a layer built from several parents (average) needs them of one kind: the same tensors
    for lay in layer_map:
        kinds = {source.family.layer_kind(source.text_config, i) for i in lay.parents}
        if len(kinds) > 1:
            parents, kinds_named = ", ".join(map(str, lay.parents)), ", ".join(sorted(kinds))
            raise OtdusError(
                f"--method {method.name}: new layer {lay.index} would be built from layers {parents}, of "
                f"different kinds in {source.family.name} ({kinds_named}); use a copy-type method or place "
                "the new layers between layers of one kind"
            )
    if not source.family.zero_init and any(lay.zero_init for lay in layer_map):
        raise OtdusError(
            f"zero-init needs an exact template (which tensors to zero), which {source.family.name} is not; "
            "add --no-zero-init"
        )
    config = rewrite_config(
        source.config,
        layer_map,
        source.family.derives_layer_types,
        source.family.per_layer_fields,
        source.family.derived_fields,
    )
    if options.dtype != "auto":
        config["torch_dtype" if "torch_dtype" in config else "dtype"] = options.dtype
    return ExpansionPlan(
        source, method, options, layer_map, config, _planned_tensors(source, layer_map, options.dtype)
    )


if TYPE_CHECKING:
    import torch


def _out_dtype(code: str, dtype: str) -> str:
    if dtype == "auto" or code not in FLOAT_CODES:
        return code
    return CODE_OF_NAME[dtype]


def _planned_tensors(source: SourceModel, layer_map: list[OutputLayer], dtype: str) -> list[PlannedTensor]:
    def planned(src_name: str, out_name: str) -> PlannedTensor:
        meta = source.reader.meta(src_name)
        return PlannedTensor(out_name, _out_dtype(meta.dtype, dtype), meta.shape)

    out = [planned(n, n) for n in source.head]
    for lay in layer_map:
        src = source.layers[lay.source]
        prefix = source.family.layer_prefix.format(i=lay.index)
        out += [planned(src.name(s), prefix + s) for s in src.suffixes()]
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


def _built(lay: OutputLayer) -> bool:
    return lay.builder not in ("base", "copy")


def rank_tensors(plan: ExpansionPlan, writer: ShardedWriter, world: World) -> tuple[set[str], set[int]]:
    """The output tensors this rank writes and the output layers it builds: a contiguous block of
    the built layers (balanced by their tensors' bytes), and every other tensor of the shard files
    it owns (file k: rank k mod world size)."""
    prefix = plan.source.family.layer_prefix
    built = [lay for lay in plan.layer_map if _built(lay)]
    sizes = {t.name: t.nbytes for t in plan.tensors}
    suffixes = {lay.index: plan.source.layers[lay.source].suffixes() for lay in built}
    names = {i: {prefix.format(i=i) + s for s in sfx} for i, sfx in suffixes.items()}
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


class _Engine:
    """Writes this rank's part of one planned expansion into a folder (all of it in a world of one)."""

    def __init__(
        self, plan: ExpansionPlan, folder: Path, progress: ProgressFn | None, world: World | None = None
    ):
        self.plan = plan
        self.src = plan.source
        self.world = world = world if world is not None else World()
        # rank 0 creates the shard files (headers included) before any other rank opens them
        self.writer = ShardedWriter(
            folder, plan.tensors, parse_size(plan.options.max_shard_size), create=world.is_main
        )
        self.mine, self.my_layers = rank_tensors(plan, self.writer, world)
        self.progress = progress or (lambda n: None)
        self.stats: dict[int, dict] = {}
        # builders that need the whole source first (LESA) predict into this folder, removed after
        self.scratch = folder / (SCRATCH if world.is_main else f"{SCRATCH}-rank{world.rank}")
        self.reports: dict[str, dict] = {}  # builder name -> what its pre-pass reports (manifest)
        self.first_byte_at: float | None = None  # time.time() when the work proper started
        self.first_byte_cpu_s: float | None = None  # this process's CPU seconds (all threads) by then

    def _copy(self, src_name: str, out_name: str) -> None:
        if out_name not in self.mine:
            return
        raw = self.src.reader.raw(src_name)
        planned = self.writer.slots[out_name].tensor
        if raw is not None and raw.dtype == planned.dtype:
            n = self.writer.copy_raw(out_name, raw)
        else:
            n = self.writer.write_tensor(out_name, self.src.reader.get(src_name))
        self.progress(n)

    def run(self) -> None:
        method = self.plan.method
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
        for name in self.src.head:
            self._copy(name, name)
        for lay in self.plan.layer_map:
            if not _built(lay):
                self._copy_layer(lay)
            elif lay.index in self.my_layers:
                self._build_layer(lay, builders[lay.builder], device)
        for name in self.src.after_stack:
            self._copy(name, self.src.after_stack_name(name, len(self.plan.layer_map)))
        for name in self.src.tail:
            self._copy(name, name)

    def _out_name(self, lay: OutputLayer, suffix: str) -> str:
        return self.src.family.layer_prefix.format(i=lay.index) + suffix

    def _copy_layer(self, lay: OutputLayer) -> None:
        src = self.src.layers[lay.source]
        for suffix in src.suffixes():
            out = self._out_name(lay, suffix)
            if lay.zero_init and self.src.family.is_zero_target(suffix):
                if out in self.mine:
                    self.progress(self.writer.write_zeros(out))
            else:
                self._copy(src.name(suffix), out)

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
            if lay.zero_init and self.src.family.is_zero_target(suffix):
                self.progress(self.writer.write_zeros(out))
            else:
                self.progress(self.writer.write_tensor(out, tensor))
            del tensor
        if expected:
            raise RuntimeError(f"builder {lay.builder} did not produce {sorted(expected)[0]}")
        if ctx.stats:
            self.stats[lay.index] = ctx.stats


def readable_side_files(source_folder: Path) -> list[Path]:
    """The source's files an output carries (tokenizer, generation config, licence ...), each checked
    readable now: one that is not must stop the run before any tensor is written, not after."""
    try:
        listed = sorted(source_folder.iterdir())
    except OSError as exc:
        raise OtdusError(f"cannot list the model folder {source_folder} ({exc.strerror})") from None
    found = []
    for path in listed:
        if not path.is_file() or path.name in _NOT_SIDE_FILES:
            continue
        if any(fnmatch.fnmatch(path.name, p) for p in SIDE_FILE_PATTERNS):
            try:
                with open(path, "rb") as f:
                    f.read(1)
            except OSError as exc:
                raise OtdusError(f"cannot read {path} ({exc.strerror}); nothing was written") from None
            found.append(path)
    return found


def copy_side_files(source_folder: Path, folder: Path) -> list[str]:
    copied = []
    for path in readable_side_files(source_folder):
        shutil.copyfile(path, folder / path.name)  # follows hub-cache symlinks
        copied.append(path.name)
    return copied


def source_record(src: SourceModel) -> dict:
    """What a manifest records of its source, so verify can tell whether a base is that model."""
    return {
        "id": src.resolved.id,
        "revision": src.resolved.revision,
        "path": str(src.resolved.folder.absolute()),
        "model_type": src.config.get("model_type"),
        "family": src.family.name,
        "num_hidden_layers": src.depth,
        "kind": src.resolved.kind,
        **src.reader.fingerprint(),
        "fingerprints": stack_fingerprints(src),
        "config": src.config,
    }


def build_manifest(
    plan: ExpansionPlan,
    stats: dict[int, dict],
    side_files: list[str],
    config_check_skipped: str | None = None,
    reports: dict[str, dict] | None = None,
    config_check: str = "transformers",
) -> dict:
    return {
        "otdus_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": source_record(plan.source),
        "method": plan.method.name,
        "options": plan.options.model_dump(),
        "ignored_options": ignored_options(plan.options),  # option -> why it had no effect
        "num_hidden_layers": len(plan.layer_map),
        "function_preserving": plan.function_preserving,
        "layers": [lay.to_json() for lay in plan.layer_map],
        "new_parameters": plan.new_parameter_names,
        "transport": {str(k): v for k, v in sorted(stats.items())},
        **_method_extras(plan),
        **(reports or {}),  # a pre-pass's report, under its builder's name (LESA: its leave-one-out check)
        "copied_files": side_files,
        "config_checked_by_transformers": config_check == "transformers" and config_check_skipped is None,
        "config_check": config_check,  # "transformers" or "otdus depth rules" (see expand())
        "warnings": [config_check_skipped] if config_check_skipped else [],
    }


def _method_extras(plan: ExpansionPlan) -> dict:
    """What the method adds to the manifest (Method.manifest_extras; OT: the conventions in force)."""
    if plan.method.manifest_extras is None:
        return {}
    return plan.method.manifest_extras(plan, plan.zero_init)


def expand(
    model: str,
    out: str | Path,
    options: ExpandOptions | None = None,
    force: bool = False,
    progress: ProgressFn | None = None,
    on_plan: Callable[[ExpansionPlan], None] | None = None,
    on_note: Callable[[str], None] | None = None,
    world: World | None = None,
    planner: Callable[[SourceModel, Any], ExpansionPlan] = make_plan,
    manifest_of: Callable[..., dict] = build_manifest,
) -> ExpandResult:
    """Expand `model` (folder or hub id) into `out` atomically; returns what was written.

    ``planner`` and ``manifest_of`` make the layer map and the manifest; `otdus shrink` (shrink.py)
    writes through this same path with its own.
    ``world`` (default: this process's, see distributed.py): its ranks share the work (module
    docstring); every rank returns the result, and a failure on any rank fails every rank with
    nothing left behind."""
    options = options or ExpandOptions()
    world = current_world() if world is None else world
    start = time.perf_counter()
    out = Path(out)
    report = OutputReport(notify=on_note)
    timings: dict = {}
    engines: list[_Engine] = []
    planned: list[ExpansionPlan] = []
    with contextlib.ExitStack() as claimed:

        def claim() -> Path | None:
            """Every rank: the plan. Rank 0: the claim and the temporary folder (io/output_dir.py),
            held open until the swap, and the shard files."""
            # a GPU that is not there fails before the model is read (inside the exchange: every rank
            # hears of it)
            if options.device not in ("auto", "cpu"):
                resolve_device(options.device, world)
            source = open_source(model, options.revision, options.allow_unknown_arch)
            plan = planner(source, options)
            planned.append(plan)
            if on_plan:
                on_plan(plan)
            timings["plan_s"] = time.perf_counter() - start
            # otdus's own depth rules first (pure Python): a wrong rewrite fails before any output exists
            check_depth_rules(plan.config, source.config, len(plan.layer_map), source.family.per_layer_fields)
            if not world.is_main:
                return None
            readable_side_files(source.resolved.folder)
            staged = staged_output(out, protected=[source.resolved.folder], force=force, report=report)
            tmp = claimed.enter_context(staged)
            engines.append(_Engine(plan, tmp, progress, world))  # creates the shard files
            return tmp

        tmp = world.exchange(claim)[0]
        plan = planned[0]
        source = plan.source

        def write_mine() -> dict[int, dict]:
            """This rank's tensors, flushed to disk; the transport statistics of its built layers."""
            engine = engines[0] if engines else _Engine(plan, tmp, progress, world)
            engines[:] = [engine]
            try:
                t = time.perf_counter()
                engine.run()
                engine.writer.finish(engine.mine, index=world.is_main)
                timings["copy_s"] = time.perf_counter() - t
            finally:
                engine.writer.close()
            return engine.stats

        stats = {k: v for part in world.exchange(write_mine) for k, v in part.items()}

        def finish() -> dict | None:
            """Rank 0, once every rank's tensors are on disk: config, side files, manifest, swap."""
            if not world.is_main:
                return None
            engine = engines[0]
            (tmp / "config.json").write_text(json.dumps(plan.config, indent=2) + "\n")
            side_files = copy_side_files(source.resolved.folder, tmp)
            t = time.perf_counter()
            config_check, skipped = "otdus depth rules", None
            # transformers loads the written config when it derives fields of this family from the
            # depth (or knows nothing of an unknown one), or is imported already; otherwise otdus's
            # depth rules are the whole check, and copies never pay transformers' import (seconds)
            if source.family.derives_layer_types or "transformers" in sys.modules:
                config_check, skipped = "transformers", validate_with_transformers(tmp, len(plan.layer_map))
            timings["config_check_s"] = time.perf_counter() - t
            timings["config_check"] = config_check
            t = time.perf_counter()
            manifest = manifest_of(plan, stats, side_files, skipped, engine.reports, config_check)
            timings["manifest_s"] = time.perf_counter() - t  # mostly the source's tensor fingerprints
            manifest["card"] = write_output_card(tmp, manifest, source.resolved.folder)  # before the manifest
            manifest = write_manifest(tmp, manifest)  # with the size and hash of every file written
            claimed.close()  # the swap into place (or, on any failure before, the clean-up)
            return manifest

        manifest = world.exchange(finish)[0]
    engine = engines[0]
    timings.update(
        first_byte_at=engine.first_byte_at,
        startup_cpu_s=engine.first_byte_cpu_s,
        sync_s=engine.writer.sync_s,
    )
    written = sum(t.nbytes for t in plan.tensors)
    seconds = time.perf_counter() - start
    notes = list(manifest["warnings"]) + report.notes
    return ExpandResult(out, plan, manifest, written, seconds, stats, notes, timings, report.replaced)
