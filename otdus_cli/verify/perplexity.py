"""Single-model perplexity (``otdus ppl``), streamed layer by layer."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

import torch

from otdus_cli.device import device_kind
from otdus_cli.distributed import World, current_world
from otdus_cli.errors import OtdusError
from otdus_cli.quiet import quiet_transformers
from otdus_cli.verify.compute import (
    ComputeSettings,
    PhaseClock,
    compute_settings,
    in_window_order,
    rank_windows,
)
from otdus_cli.verify.eval_set import model_folder
from otdus_cli.verify.metrics import EvalSet, PerplexityMetrics, metrics_from_logprobs, score_activations
from otdus_cli.verify.progress import LayerTicks, Progress
from otdus_cli.verify.streaming import StreamedModel, dtype_name
from otdus_cli.verify.threads import CpuSample, intra_op_threads

# "float32": log-softmax in float32, sums in float64; "model": both in the compute dtype, as lm-eval
SOFTMAX_DTYPES = ("float32", "model")


@dataclass
class PerplexityReport:
    model: str
    device: str
    dtype: str
    metrics: PerplexityMetrics
    compute: ComputeSettings | None = None
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase: varies run to run

    def to_dict(self) -> dict:
        d = asdict(self)
        d["metrics"] = self.metrics.to_dict()
        d["compute"] = self.compute.to_dict() if self.compute else None
        return d


@quiet_transformers
def perplexity(
    model_dir: str | os.PathLike[str],
    eval_set: EvalSet,
    *,
    device: str | torch.device | None = "cpu",
    dtype: str | torch.dtype = "float32",
    attn_implementation: str | None = None,
    batch_size: int | None = None,
    threads: int | None = None,
    cpu_sample: CpuSample | None = None,
    progress: Progress | None = None,
    world: World | None = None,
    softmax_dtype: str = "float32",
) -> PerplexityReport:
    """Single-model perplexity (``otdus ppl``), streamed layer by layer.

    ``batch_size``: windows per forward pass (None: automatic); ``threads``: intra-op threads (None:
    the policy of verify/threads.py, with other processes' CPU use measured since ``cpu_sample``).
    ``softmax_dtype``: "float32" (log-softmax in float32, log-probs summed in float64), or "model" (as
    lm-eval's hf model without its ``softmax_dtype`` argument: log-softmax in ``dtype`` and each
    window's log-likelihood summed in ``dtype``; its figures for a bfloat16 run, see
    docs/perplexity.md).
    ``world`` (default: this process's, see distributed.py): its ranks split the windows and every
    rank returns the same figures, those of a single process."""
    if softmax_dtype not in SOFTMAX_DTYPES:
        raise OtdusError(f"softmax dtype must be one of {', '.join(SOFTMAX_DTYPES)}, not {softmax_dtype!r}")
    model_dir = model_folder(model_dir)
    clock = PhaseClock()
    world = current_world() if world is None else world
    local: dict = {}  # this rank's model and compute settings, for the report

    def work() -> list[tuple[int, torch.Tensor]]:
        """This rank's windows' log-probs (by window index); everything that can fail, the model's
        loading included, runs here, so a failure on any rank is every rank's (World.exchange)."""
        local["model"] = model = StreamedModel(
            model_dir,
            device=device,
            dtype=dtype,
            attn_implementation=attn_implementation,
            batch_size=batch_size,
            self_check="on",
        )
        local["compute"] = compute = compute_settings(model, eval_set, threads, cpu_sample)
        compute.ranks = world.size
        mine = rank_windows(model, eval_set, world)
        if not mine and eval_set.windows:  # more ranks than batches
            return []
        windows = [eval_set.windows[i] for i in mine]
        with intra_op_threads(compute.threads.threads):
            acts = model.start([w.input_ids for w in windows])
            clock.lap("start")
            ticks = LayerTicks(progress, len(windows), sum(len(w.targets) for w in windows), model.num_layers)
            for i in range(model.num_layers):
                model.apply_layer(i, acts, on_batch=ticks.layer(i))
            clock.lap("layers")
            scored_in = model.dtype if softmax_dtype == "model" else torch.float32
            logprobs = score_activations(model, acts, windows, progress=progress, softmax_dtype=scored_in)
            clock.lap("scoring")
        return list(zip(mine, logprobs, strict=True))

    logprobs = in_window_order(world.exchange(work), len(eval_set.windows))
    model = local["model"]
    metrics = metrics_from_logprobs(eval_set, logprobs, model.dtype if softmax_dtype == "model" else None)
    return PerplexityReport(
        str(model_dir),
        device_kind(model.device),
        dtype_name(model.dtype),
        metrics,
        local["compute"],
        clock.total(),
    )
