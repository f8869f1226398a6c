"""`otdus widen`: grow a mixture-of-experts model's width, E -> m E experts and top-k -> m k.

Every MoE layer gets m - 1 copies of each expert: expert e + j E (j = 1 .. m-1) is a copy of
expert e, its router row (and any per-expert router bias) is a copy of e's row, and the config's
expert count and top-k are multiplied by m (docs/widen.md). Originals keep
their index and their bytes; copies get Gaussian noise N(0, (alpha std(W))^2), W the tensor the
copy is made from (an expert's matrix, the router's weight), seeded per output tensor so a run is
reproducible whatever the order tensors are written in. With alpha = 0 the grown model computes
the base's function: the copies of e split e's routing probability in two halves that top-(m k)
both selects, and their outputs add up to e's (equal in exact arithmetic; the sums are taken in
another order, so logits agree to rounding, not bit for bit).

Streaming as in expand: tensors outside the MoE blocks and unperturbed copies move as bytes; a
noisy copy or an expert-indexed tensor (router weight: [E, hidden] -> [m E, hidden]) is built alone,
from its source read once for the original and all its copies. The output is staged, checked and
swapped into place as every otdus output is (output.py).
"""

from __future__ import annotations

import copy
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from otdus_cli.arch.config_rules import (
    finish_prefetch,
    prefetch_config_validation,
    validate_with_transformers,
)
from otdus_cli.arch.experts import UNGROWABLE_ROUTING_FIELDS, ExpertLayout, expert_layout
from otdus_cli.errors import OtdusError
from otdus_cli.io.writer import PlannedTensor, ShardedWriter
from otdus_cli.manifest import (
    Manifest,
    ManifestLayer,
    WidenRecord,
    created_now,
    seen_from_first_source,
)
from otdus_cli.output import ConfigCheck, Finished, RankWrite, write_output
from otdus_cli.source import SourceModel, earlier_steps, open_source, source_record

if TYPE_CHECKING:
    import torch

ProgressFn = Callable[[int], None]
StageFn = Callable[[str], None]  # what the run is doing now, for progress lines in a log


class WidenOptions(BaseModel):
    """Everything that decides what `otdus widen` writes (recorded in the manifest)."""

    model_config = ConfigDict(extra="forbid")

    factor: int = Field(2, ge=2, description="m: experts E -> m E, top-k k -> m k")
    noise: float = Field(0.01, ge=0, allow_inf_nan=False, description="alpha: copies get N(0, (alpha std)^2)")
    seed: int = 0
    max_shard_size: str = "5GB"
    revision: str | None = None


@dataclass(frozen=True)
class _Job:
    """How one output tensor is made from one source tensor."""

    out: str
    src: str
    kind: str  # "copy": the source's bytes; "noisy": a perturbed copy; "tiled": m copies along dim 0
    new: bool  # a tensor the base did not have in this form (what to train first)


@dataclass
class WidenPlan:
    source: SourceModel
    options: WidenOptions
    layout: ExpertLayout
    experts: int  # E of the source
    top_k: int
    moe_layers: list[int]
    config: dict  # the rewritten config.json
    jobs: list[_Job]
    tensors: list[PlannedTensor]

    @property
    def function_preserving(self) -> bool:
        return self.options.noise == 0

    @property
    def new_parameter_names(self) -> list[str]:
        return [j.out for j in self.jobs if j.new]


def check_routing(config: dict) -> None:
    """Refuse routers whose growth by duplication is not exact (arch/experts.py says why)."""
    groups = config.get("n_group")
    if isinstance(groups, int) and groups > 1:
        raise OtdusError(
            f"config n_group={groups}: group-limited routing ranks groups by their best experts, which "
            "duplicated experts change; widening it is not supported"
        )
    scoring = config.get("scoring_func")
    if scoring not in (None, "softmax"):
        raise OtdusError(f"config scoring_func={scoring!r}: only softmax routers can be widened exactly")
    for name in UNGROWABLE_ROUTING_FIELDS:
        if name in ("n_group", "scoring_func"):
            continue
        value = config.get(name)
        if value not in (None, 1, 1.0):
            raise OtdusError(f"config {name}={value}: this router cannot be widened exactly")


def check_widenable(source: SourceModel) -> ExpertLayout:
    """The family's expert layout, or one error line: dense models and unknown or ungrowable routers."""
    family = source.family
    layout = expert_layout(family.name)
    if not family.moe:
        raise OtdusError(
            f"widen grows the experts of mixture-of-experts models; {family.name} is a dense model "
            "(use `otdus expand` to grow depth)"
        )
    if layout is None:
        raise OtdusError(f"widen does not know the router of {family.name} yet; nothing was written")
    check_routing(source.config)
    return layout


def make_widen_plan(source: SourceModel, options: WidenOptions) -> WidenPlan:
    family = source.family
    layout = check_widenable(source)
    config = source.config
    experts = layout.expert_count(config)
    top_k = config.get(layout.topk_field)
    if not isinstance(top_k, int) or top_k < 1:
        raise OtdusError(f"config.json needs {layout.topk_field} (the router's top-k) to widen")
    m = options.factor
    per_expert = layout.expert_regex()
    jobs: list[_Job] = []
    moe_layers: list[int] = []
    noisy = "noisy" if options.noise > 0 else "copy"
    jobs += [_Job(n, n, "copy", False) for n in source.head]
    for layer in source.layers:
        copies: list[_Job] = []
        seen: set[int] = set()
        indexed = False
        for suffix in layer.suffixes():
            name = layer.name(suffix)
            hit = per_expert.fullmatch(suffix)
            if hit:
                e = int(hit.group(1))
                seen.add(e)
                jobs.append(_Job(name, name, "copy", False))
                for j in range(1, m):
                    out = layer.name(f"{layout.block}experts.{e + j * experts}.{hit.group(2)}")
                    copies.append(_Job(out, name, noisy, True))
            elif layout.is_expert_indexed(suffix):
                rows = layer.shape(suffix)[0] if layer.shape(suffix) else None
                if rows != experts:
                    raise OtdusError(
                        f"{name} indexes {rows} experts along its first dimension; the config says {experts}"
                    )
                indexed = True
                jobs.append(_Job(name, name, "tiled", True))
            else:
                jobs.append(_Job(name, name, "copy", False))
        if seen and seen != set(range(experts)):
            raise OtdusError(
                f"layer {layer.index} holds experts {min(seen)}..{max(seen)} ({len(seen)} of them); "
                f"the config says {experts}"
            )
        if seen or indexed:
            moe_layers.append(layer.index)
        jobs += sorted(copies, key=lambda job: job.out)
    jobs += [_Job(n, n, "copy", False) for n in source.tail]
    if not moe_layers:
        raise OtdusError(f"no layer of this {family.name} checkpoint holds experts; nothing to widen")
    new_config = copy.deepcopy(config)
    for name in layout.count_fields:
        if isinstance(config.get(name), int):
            new_config[name] = experts * m
    new_config[layout.topk_field] = top_k * m
    tensors = [_planned(source, job, m) for job in jobs]
    return WidenPlan(source, options, layout, experts, top_k, moe_layers, new_config, jobs, tensors)


def _planned(source: SourceModel, job: _Job, m: int) -> PlannedTensor:
    meta = source.reader.meta(job.src)
    shape = (meta.shape[0] * m, *meta.shape[1:]) if job.kind == "tiled" else meta.shape
    return PlannedTensor(job.out, meta.dtype, tuple(shape))


def _generator(seed: int, name: str) -> torch.Generator:
    """A generator of its own for each output tensor: the noise does not depend on write order."""
    import torch

    digest = hashlib.sha256(f"otdus-widen/{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _perturbed(t: torch.Tensor, alpha: float, gen: torch.Generator) -> torch.Tensor:
    """t + N(0, (alpha std(t))^2), computed in float32, returned in t's dtype."""
    import torch

    x = t.to(torch.float32, copy=True)  # never in place: t may be a block of a tiled tensor
    std = float(x.std()) if x.numel() > 1 else 0.0
    return x.add_(torch.randn(x.shape, generator=gen).mul_(alpha * std)).to(t.dtype)


def _tiled(t: torch.Tensor, m: int, alpha: float, gen: torch.Generator) -> torch.Tensor:
    """[E, ...] -> [m E, ...]: block 0 the original, blocks 1..m-1 copies (perturbed when alpha > 0).

    The noise scale is the std of the whole tensor for a router (one matrix), of each expert's slice
    for fused 3-D expert tensors (one matrix per expert, as in the per-expert layout)."""
    import torch

    blocks = [t]
    for _ in range(1, m):
        if alpha == 0:
            blocks.append(t)
        elif t.dim() >= 3:
            blocks.append(torch.stack([_perturbed(t[e], alpha, gen) for e in range(t.shape[0])]))
        else:
            blocks.append(_perturbed(t, alpha, gen))
    return torch.cat(blocks, dim=0)


@dataclass
class WidenResult:
    out: Path
    plan: WidenPlan
    manifest: dict
    bytes_written: int
    seconds: float
    warnings: list[str] = field(default_factory=list)
    replaced: bool = False  # --force replaced an earlier (unchanged) otdus output at ``out``


def _write(plan: WidenPlan, writer: ShardedWriter, progress: ProgressFn, on_stage: StageFn) -> None:
    """Each source tensor is read once for all the outputs made from it (the original and its m - 1
    copies): moved as bytes when none of them changes it, else decoded once and written m times."""
    reader = plan.source.reader
    by_source: dict[str, list[_Job]] = {}
    for job in plan.jobs:
        by_source.setdefault(job.src, []).append(job)
    for k, (src, jobs) in enumerate(by_source.items(), 1):
        on_stage(f"source tensor {k} of {len(by_source)}")
        raw = reader.raw(src)
        if raw is not None and all(job.kind == "copy" for job in jobs):
            for job in jobs:
                progress(writer.copy_raw(job.out, raw))
            continue
        t = reader.get(src)
        for job in jobs:
            if job.kind == "copy":  # the same bytes: the planned dtype is the source's
                n = writer.write_tensor(job.out, t)
            elif job.kind == "noisy":
                gen = _generator(plan.options.seed, job.out)
                n = writer.write_tensor(job.out, _perturbed(t, plan.options.noise, gen))
            else:
                gen = _generator(plan.options.seed, job.out)
                n = writer.write_tensor(job.out, _tiled(t, plan.options.factor, plan.options.noise, gen))
            progress(n)
        del t


def build_widen_manifest(plan: WidenPlan, finished: Finished[None]) -> Manifest:
    src = plan.source
    m = plan.options.factor
    widened = set(plan.moe_layers)
    noise = plan.options.noise
    history = earlier_steps(src) or []  # the source made by otdus (e.g. expand, then widen): its record
    skipped = finished.config_check.skipped
    return Manifest(
        **created_now(),
        source=source_record(src),
        method="widen",
        options=plan.options.model_dump(),
        num_hidden_layers=src.depth,
        # claimed: the same function up to rounding when no noise was added (verify checks it)
        function_preserving=plan.function_preserving,
        widen=WidenRecord(
            factor=m,
            experts=[plan.experts, plan.experts * m],
            top_k=[plan.top_k, plan.top_k * m],
            noise=noise,
            seed=plan.options.seed,
            layers=plan.moe_layers,
            copies=f"expert e + j*{plan.experts} (j = 1..{m - 1}) copies expert e; router rows likewise",
            routing=plan.layout.routing,
        ),
        layers=[
            ManifestLayer(
                index=i,
                source=i,
                new=False,
                parents=[],
                builder="widen" if i in widened else "base",
                zero_init=False,
                **({"widened": True, "noise": noise} if i in widened else {}),
            )
            for i in range(src.depth)
        ],
        new_parameters=plan.new_parameter_names,
        transport={},
        copied_files=finished.copied_files,
        config_checked_by_transformers=skipped is None,
        warnings=[skipped] if skipped else [],
        history=history,
    )


def _from_first_source(manifest: Manifest) -> Manifest:
    record = manifest.to_json()
    first = seen_from_first_source(record)
    if first is None:
        raise OtdusError("widen was asked to record an earlier otdus step, but its source has no manifest")
    earlier = record["history"][-1]
    return Manifest.model_validate(
        {
            **first,
            # the depth step's claim and the width step's together
            "function_preserving": bool(record["function_preserving"] and earlier.get("function_preserving")),
            "intermediate": "the expanded model was widened from a scratch folder, then removed",
        }
    )


def _check_config(plan: WidenPlan, folder: Path) -> ConfigCheck:
    """transformers loads the written config (its import was started while the tensors were written)."""
    return ConfigCheck("transformers", validate_with_transformers(folder, plan.source.depth))


def widen(
    model: str,
    out: str | Path,
    options: WidenOptions | None = None,
    force: bool = False,
    progress: ProgressFn | None = None,
    on_plan: Callable[[WidenPlan], None] | None = None,
    on_note: Callable[[str], None] | None = None,
    from_first_source: bool = False,
    protected: tuple[Path, ...] = (),
    on_stage: StageFn | None = None,
) -> WidenResult:
    """Widen the MoE layers of ``model`` (folder, hub id) into ``out`` atomically.

    ``from_first_source``: ``model`` is an otdus output about to be removed (grow.py); the manifest
    then describes ``out`` against the model that output was made from (its layer map composed).
    ``protected``: folders besides the source's that ``out`` may not touch (that first model's)."""
    options = options or WidenOptions()
    start = time.perf_counter()

    def plan() -> WidenPlan:
        the_plan = make_widen_plan(open_source(model, options.revision), options)
        if on_plan:
            on_plan(the_plan)
        return the_plan

    def write(the_plan: WidenPlan, writer: ShardedWriter) -> RankWrite[None]:
        prefetch_config_validation(the_plan.source.config.get("model_type"))
        try:
            _write(the_plan, writer, progress or (lambda n: None), on_stage or (lambda stage: None))
        finally:
            finish_prefetch()
        return RankWrite(None, None)

    def manifest(the_plan: WidenPlan, finished: Finished[None]) -> Manifest:
        record = build_widen_manifest(the_plan, finished)
        return _from_first_source(record) if from_first_source else record

    written = write_output(
        out,
        plan,
        write,
        _check_config,
        manifest,
        max_shard_size=options.max_shard_size,
        force=force,
        protected=protected,
        on_note=on_note,
    )
    the_plan = written.plan
    return WidenResult(
        written.out,
        the_plan,
        written.manifest,
        sum(t.nbytes for t in the_plan.tensors),
        time.perf_counter() - start,
        written.warnings,
        written.replaced,
    )
