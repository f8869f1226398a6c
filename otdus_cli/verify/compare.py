"""Base vs expanded (``otdus verify``): perplexity parity and the first layer where the two stacks part.

``verify_expansion`` runs the static check (verify/proof.py), streams both checkpoints in lockstep
over the same windows (verify/lockstep.py, with the layer correspondence of verify/layer_map.py),
combines what every rank computed, and judges the figures by the parity rule (verify/parity.py).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from otdus_cli.device import device_kind
from otdus_cli.distributed import World, current_world
from otdus_cli.io.reader import CheckpointReader
from otdus_cli.manifest import changed_since_written, read_manifest
from otdus_cli.quiet import quiet_transformers
from otdus_cli.verify.compute import (
    ComputeSettings,
    PhaseClock,
    compute_settings,
    in_window_order,
    rank_windows,
)
from otdus_cli.verify.eval_set import model_folder
from otdus_cli.verify.layer_map import (
    LayerEntry,
    LayerMap,
    correspondence,
    default_function_preserving,
    layer_entries,
)
from otdus_cli.verify.lockstep import LayerCheck, RankPart, combine_checks, run_layers, score_with_digests
from otdus_cli.verify.metrics import EvalSet, PerplexityMetrics, metrics_from_logprobs
from otdus_cli.verify.parity import parity_rule, verdict
from otdus_cli.verify.progress import Progress
from otdus_cli.verify.proof import StaticProof, static_check
from otdus_cli.verify.streaming import StreamedModel, dtype_name, parse_dtype
from otdus_cli.verify.threads import CpuSample, intra_op_threads


@dataclass
class VerifyReport:
    base_model: str
    expanded_model: str
    device: str
    dtype: str
    base: PerplexityMetrics
    expanded: PerplexityMetrics
    deltas: dict[str, float]
    expect_parity: bool
    parity: bool
    verdict: str
    exit_code: int
    tolerance: str
    logits_equal: bool  # every logit bitwise equal (chunk digests)
    logprob_max_abs_diff: float  # largest |difference| of a scored token's log-probability
    first_divergence: LayerCheck | None
    checks: list[LayerCheck] = field(default_factory=list)
    proof: StaticProof | None = None
    compute: ComputeSettings | None = None
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase: varies run to run

    def to_dict(self) -> dict:
        d = asdict(self)
        d["base"] = self.base.to_dict()
        d["expanded"] = self.expanded.to_dict()
        d["compute"] = self.compute.to_dict() if self.compute else None
        return d


@dataclass(frozen=True)
class _RunOptions:
    layer_map: LayerMap | None
    expect_parity: bool | None
    device: str | torch.device | None
    dtype: torch.dtype
    attn_implementation: str | None
    batch_size: int | None
    threads: int | None
    cpu_sample: CpuSample | None


@dataclass
class _RunSetup:
    """What a rank learned before the lockstep run, for the report."""

    proof: StaticProof
    entries: list[LayerEntry]
    base: StreamedModel
    expect_parity: bool
    compute: ComputeSettings


def _lockstep_on_rank(
    base_dir: os.PathLike[str],
    expanded_dir: os.PathLike[str],
    eval_set: EvalSet,
    options: _RunOptions,
    world: World,
    clock: PhaseClock,
    progress: Progress | None,
    setup: list[_RunSetup],
) -> RankPart | None:
    """The static check, both models and this rank's windows in lockstep (appends the setup to
    ``setup``); everything that can fail runs here, so a failure on any rank is every rank's
    (World.exchange)."""
    base_reader, expd_reader = CheckpointReader(base_dir), CheckpointReader(expanded_dir)
    layer_map = options.layer_map
    claimed = list(layer_map) if layer_map is not None and not callable(layer_map) else None
    proof = static_check(base_reader, expd_reader, claimed)
    layers = layer_map
    if layers is None:  # the manifest's map as the static check read it (through expand + widen)
        layers = proof.claimed if read_manifest(expanded_dir) else proof.layer_map()
    common = {
        "device": options.device,
        "dtype": options.dtype,
        "attn_implementation": options.attn_implementation,
        "batch_size": options.batch_size,
    }
    base = StreamedModel(base_reader, **common, self_check="whole-model")
    expd = StreamedModel(expd_reader, **common, self_check="on")
    entries = layer_entries(layers, expd.num_layers)
    points = correspondence(entries, base.num_layers)
    # the map's claim or the proof, unless the caller says; never a boolean a hand edit could flip
    expected = options.expect_parity
    if expected is None:
        expected = default_function_preserving(entries, base.num_layers) or proof.preserving

    compute = compute_settings(expd, eval_set, options.threads, options.cpu_sample)
    compute.ranks = world.size
    base.batch_size = expd.batch_size = (
        compute.batch_size if options.batch_size is None else options.batch_size
    )
    mine = rank_windows(expd, eval_set, world)
    setup.append(_RunSetup(proof, entries, base, bool(expected), compute))
    if not mine and eval_set.windows:  # more ranks than batches
        return None
    windows = [eval_set.windows[i] for i in mine]
    with intra_op_threads(compute.threads.threads):
        acts_b, acts_e, checks = run_layers(base, expd, entries, points, windows, clock, progress)
        # Logits one model at a time (its head, one chunk of positions): the chunks are compared by
        # digest, so neither model's head or logits need to be held next to the other's.
        lp_b, digests_b = score_with_digests(base, acts_b, windows, progress, "base")
        del acts_b
        lp_e, digests_e = score_with_digests(expd, acts_e, windows, progress, "expanded")
        del acts_e
        clock.lap("scoring")
    return RankPart(mine, lp_b, lp_e, digests_b == digests_e, checks)


def _largest_logprob_diff(lp_b: Sequence[torch.Tensor], lp_e: Sequence[torch.Tensor]) -> float:
    """The largest |difference| of a scored token's log-probability (inf for NaN)."""
    diff = max(
        (float((x - y).abs().max()) for x, y in zip(lp_b, lp_e, strict=True) if x.numel()), default=0.0
    )
    return math.inf if math.isnan(diff) else diff


@quiet_transformers
def verify_expansion(
    base_dir: str | os.PathLike[str],
    expanded_dir: str | os.PathLike[str],
    eval_set: EvalSet,
    *,
    layer_map: LayerMap | None = None,
    expect_parity: bool | None = None,
    device: str | torch.device | None = "cpu",
    dtype: str | torch.dtype = "float32",
    attn_implementation: str | None = None,
    batch_size: int | None = None,
    threads: int | None = None,
    cpu_sample: CpuSample | None = None,
    rtol: float | None = None,
    progress: Progress | None = None,
    world: World | None = None,
) -> VerifyReport:
    """Stream base and expanded side by side over ``eval_set``'s windows and judge function preservation.

    First the static check (verify/proof.py): the base must be the one the manifest recorded (else
    WrongBase, exit 2), and the expanded layers are matched to the base's by fingerprints.
    ``layer_map`` (list of manifest-style entries, or a function) defaults to the manifest's, else to
    the map the fingerprints show. Parity is expected (unless ``expect_parity`` says) when the layer
    map claims a function-preserving expansion or the static proof shows one. ``batch_size``,
    ``threads`` and ``cpu_sample`` as for :func:`perplexity` (chosen for the expanded model, the
    larger work; both models run with them). ``world`` as for :func:`perplexity`: its ranks split the
    windows; per-layer differences, logits equality and log-probs are combined into the figures
    a single process reports.
    """
    base_dir, expanded_dir = model_folder(base_dir), model_folder(expanded_dir)
    clock = PhaseClock()
    world = current_world() if world is None else world
    torch_dtype = parse_dtype(dtype)
    options = _RunOptions(
        layer_map, expect_parity, device, torch_dtype, attn_implementation, batch_size, threads, cpu_sample
    )
    setups: list[_RunSetup] = []

    def work() -> RankPart | None:
        return _lockstep_on_rank(base_dir, expanded_dir, eval_set, options, world, clock, progress, setups)

    parts = [p for p in world.exchange(work) if p is not None]
    setup = setups[0]
    # what one process finds over all windows at once
    checks = combine_checks([p.checks for p in parts])
    logits_equal = all(p.logits_equal for p in parts)
    n_windows = len(eval_set.windows)
    lp_b = in_window_order([list(zip(p.windows, p.base, strict=True)) for p in parts], n_windows)
    lp_e = in_window_order([list(zip(p.windows, p.expanded, strict=True)) for p in parts], n_windows)
    m_b, m_e = metrics_from_logprobs(eval_set, lp_b), metrics_from_logprobs(eval_set, lp_e)

    vb, ve = m_b.values(), m_e.values()
    widened = any(e.widened_noise is not None for e in setup.entries)
    rule = parity_rule(torch_dtype, widened, rtol)
    parity = rule.holds(vb, ve, logits_equal)
    first = next((c for c in checks if not c.equal), None)
    headline, value_b = m_b.headline()
    line, exit_code = verdict(
        expect_parity=setup.expect_parity,
        parity=parity,
        # a widened model's parity is a tolerance: "unchanged" only when nothing moved at all
        unchanged=logits_equal if widened else parity,
        headline=headline,
        base_value=value_b,
        expanded_value=ve[headline],
        tolerance=rule.tolerance,
        first_divergence=first,
        static_reason=setup.proof.reason,
        reproduces=eval_set.reproduces,
    )
    if exit_code:  # the claim was made of the files as written: say when they are not that any more
        changed = changed_since_written(expanded_dir)
        if changed:
            more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
            line += f"; changed since otdus wrote it: {', '.join(changed[:3])}{more}"
    return VerifyReport(
        base_model=str(base_dir),
        expanded_model=str(expanded_dir),
        device=device_kind(setup.base.device),
        dtype=dtype_name(torch_dtype),
        base=m_b,
        expanded=m_e,
        deltas={k: ve[k] - vb[k] for k in vb if k in ve},
        expect_parity=setup.expect_parity,
        parity=parity,
        verdict=line,
        exit_code=exit_code,
        tolerance=rule.tolerance,
        logits_equal=logits_equal,
        logprob_max_abs_diff=_largest_logprob_diff(lp_b, lp_e),
        first_divergence=first,
        checks=checks,
        proof=setup.proof,
        compute=setup.compute,
        timings=clock.total(),
    )
