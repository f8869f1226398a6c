"""Base vs expanded: perplexity parity and, in lockstep, the first layer where the two stacks part.

Both checkpoints are streamed side by side over the same evaluation windows. After every expanded
layer that corresponds to a point of the base stack, the hidden states of all windows are compared:

* a base layer copied in order (``new`` false, ``source`` = the next base layer) is compared with the
  base's state after that base layer;
* a new layer is compared with the base's state after the base layers consumed so far (a zero-init
  layer is an exact identity, so nothing may change);
* once base layers appear out of order (SOLAR-style repeats), there is no corresponding base state and
  the rest of the stack is not compared layer by layer.

The layer map is the manifest's ``layers`` list (``otdus.json`` in the expanded folder), or a function
``expanded index -> base index it copies (None for a new layer)``.

Verdict: when the expansion is declared function-preserving, float32/float64 runs must give bitwise
identical logits (hence identical perplexities); bfloat16/float16 runs must agree within ``rtol`` on
every perplexity figure (default 1e-3). Exit code 0 when parity holds or is not expected, 1 when it
is expected and broken.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from otdus_cli.arch.wrappers import text_config
from otdus_cli.device import device_kind
from otdus_cli.distributed import World, current_world, shard
from otdus_cli.errors import OtdusError
from otdus_cli.io.reader import CheckpointReader
from otdus_cli.manifest import read_manifest
from otdus_cli.verify.lm_eval_presets import LM_EVAL_NEWEST, wikitext_tokenization
from otdus_cli.verify.metrics import (
    DEFAULT_SEQ_LEN,
    EvalPlan,
    PerplexityMetrics,
    Window,
    load_tokenizer,
    metrics_from_logprobs,
    model_max_positions,
    plan_rolling,
    plan_token,
    score_activations,
)
from otdus_cli.verify.progress import LayerTicks, Progress
from otdus_cli.verify.proof import StaticProof, static_check
from otdus_cli.verify.quiet import quiet_transformers
from otdus_cli.verify.streaming import Activations, StreamedModel, parse_dtype
from otdus_cli.verify.text import Corpus, wikitext_corpus
from otdus_cli.verify.threads import CpuSample, ThreadChoice, choose_threads, intra_op_threads

LOW_PRECISION_RTOL = 1e-3
# float32 runs of a model widened without noise: the same function up to the order of its routing sums
WIDENED_RTOL = 1e-5
EXACT_DTYPES = (torch.float32, torch.float64)

LayerMap = Sequence[dict] | Callable[[int], "int | None"]


# -- evaluation setup -------------------------------------------------------------------------------
def _model_folder(model: str | os.PathLike[str]) -> Path:
    """A model argument as the CLI takes it: a folder, ``bundled:stories260k`` or a cached hub id."""
    from otdus_cli.source import resolve_source

    return Path(resolve_source(str(model)).folder)


@quiet_transformers
def make_plan(
    model_dir: str | os.PathLike[str] | CheckpointReader,
    *,
    corpus: Corpus | None = None,
    protocol: str = "wikitext",
    max_length: int | None = None,
    seq_len: int = DEFAULT_SEQ_LEN,
    token_mode: str = "joined",
    max_docs: int | None = None,
    max_tokens: int | None = None,
    lm_eval: str = LM_EVAL_NEWEST,
    tokenizer=None,
) -> EvalPlan:
    """Tokenise ``corpus`` (default: bundled WikiText-2 test) for ``protocol`` with the model's tokenizer.

    protocol "wikitext": lm-eval's rolling windows as release ``lm_eval`` computes them (any version
    string; see verify/lm_eval_presets.py), of ``max_length`` tokens (lm-eval's model argument;
    default: as that release resolves it); protocol "token": GPTQ windows of ``seq_len`` (capped by
    the model's max positions).
    """
    if not isinstance(model_dir, CheckpointReader):
        model_dir = CheckpointReader(_model_folder(model_dir))
    reader = model_dir
    reader_config = reader.config
    tok = tokenizer if tokenizer is not None else load_tokenizer(reader.folder)
    corpus = corpus if corpus is not None else wikitext_corpus()
    if protocol == "wikitext":
        tokenization = wikitext_tokenization(lm_eval, reader_config, tok, max_length)
        plan = plan_rolling(corpus, tok, tokenization, max_docs=max_docs, max_tokens=max_tokens)
    elif protocol == "token":
        cap = model_max_positions(reader_config)
        length = min(seq_len, cap) if cap else seq_len
        plan = plan_token(corpus, tok, length, mode=token_mode, max_docs=max_docs, max_tokens=max_tokens)
    else:
        raise OtdusError(f"unknown protocol {protocol!r} (wikitext, token)")
    _check_ids_fit(plan, reader)
    return plan


def _check_ids_fit(plan: EvalPlan, reader: CheckpointReader) -> None:
    """A token id past the embedding's rows cannot be looked up: the tokenizer is not this model's."""
    embeddings = [n for n in reader.names if n.endswith(("embed_tokens.weight", "wte.weight"))]
    rows = reader.meta(embeddings[0]).shape[0] if embeddings else text_config(reader.config).get("vocab_size")
    if not isinstance(rows, int):
        return
    largest = max((max(w.input_ids, default=-1) for w in plan.windows), default=-1)
    if largest >= rows:
        raise OtdusError(
            f"the tokenizer of {reader.folder} gives token id {largest}, but the model's embedding has "
            f"{rows} rows: the tokenizer does not belong to this model"
        )


# -- how a run computes -----------------------------------------------------------------------------
@dataclass
class ComputeSettings:
    """What a run chose for speed (reported in --json as ``compute``): intra-op threads, windows per
    forward pass (those of the plan's longest windows) and the number of forward passes per layer."""

    threads: ThreadChoice
    batch_size: int
    batches: int
    ranks: int = 1  # processes the windows were split across (torchrun / srun; see distributed.py)

    def to_dict(self) -> dict:
        return {
            "threads": self.threads.to_dict(),
            "batch_size": self.batch_size,
            "batches": self.batches,
            "ranks": self.ranks,
        }


def compute_settings(
    model: StreamedModel, plan: EvalPlan, threads: int | None = None, since: CpuSample | None = None
) -> ComputeSettings:
    """Threads (see verify/threads.py) and batches for running ``model`` over ``plan``'s windows."""
    from otdus_cli.verify.streaming import group_windows

    lengths = [len(w.input_ids) for w in plan.windows]
    longest = max(lengths, default=1)
    batch = min(model.windows_per_batch(longest), max(1, lengths.count(longest)))
    batches = len(group_windows(lengths, model.windows_per_batch))
    if model.device.type == "cpu":
        choice = choose_threads(threads, model.layer_call_flop(batch, longest), since)
    else:  # the work is on the accelerator; CPU threads only feed it
        choice = ThreadChoice(
            torch.get_num_threads(), 0, None, f"device {model.device.type}: left as they are"
        )
    return ComputeSettings(choice, batch, batches)


def rank_windows(model: StreamedModel, plan: EvalPlan, world: World) -> list[int]:
    """The windows this rank evaluates: whole batches of the single-process grouping (a contiguous
    block of them, balanced by tokens), so every window is computed in the very batch a single
    process computes it in and its logits are the same bits."""
    from otdus_cli.verify.streaming import group_windows

    lengths = [len(w.input_ids) for w in plan.windows]
    groups = group_windows(lengths, model.windows_per_batch)
    mine = shard([sum(lengths[i] for i in g) for g in groups], world)
    return sorted(i for g in groups[mine.start : mine.stop] for i in g)


def _in_window_order(parts: Sequence[list[tuple[int, torch.Tensor]]], n_windows: int) -> list[torch.Tensor]:
    """Every rank's (window index, log-probs) pairs as one list in window order."""
    out: list[torch.Tensor | None] = [None] * n_windows
    for part in parts:
        for i, lp in part:
            out[i] = lp
    if any(lp is None for lp in out):
        raise OtdusError("internal: a window was scored by no rank")
    return out  # type: ignore[return-value]


class _Clock:
    """Seconds spent in each phase of a run (reported in --json as ``timings``)."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[f"{phase}_s"] = round(self.seconds.get(f"{phase}_s", 0.0) + now - self.last, 3)
        self.last = now

    def total(self) -> dict[str, float]:
        return {**self.seconds, "total_s": round(time.perf_counter() - self.start, 3)}


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
    plan: EvalPlan,
    *,
    device: str | torch.device | None = "cpu",
    dtype: str | torch.dtype = "float32",
    attn_implementation: str | None = None,
    batch_size: int | None = None,
    threads: int | None = None,
    cpu_sample: CpuSample | None = None,
    progress: Progress | None = None,
    world: World | None = None,
) -> PerplexityReport:
    """Single-model perplexity (``otdus ppl``), streamed layer by layer.

    ``batch_size``: windows per forward pass (None: automatic); ``threads``: intra-op threads (None:
    the policy of verify/threads.py, with other processes' CPU use measured since ``cpu_sample``).
    ``world`` (default: this process's, see distributed.py): its ranks split the windows and every
    rank returns the same figures, those of a single process."""
    model_dir = _model_folder(model_dir)
    clock = _Clock()
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
        local["compute"] = compute = compute_settings(model, plan, threads, cpu_sample)
        compute.ranks = world.size
        mine = rank_windows(model, plan, world)
        if not mine and plan.windows:  # more ranks than batches
            return []
        windows = [plan.windows[i] for i in mine]
        with intra_op_threads(compute.threads.threads):
            acts = model.start([w.input_ids for w in windows])
            clock.lap("start")
            ticks = LayerTicks(progress, len(windows), sum(len(w.targets) for w in windows), model.num_layers)
            for i in range(model.num_layers):
                model.apply_layer(i, acts, on_batch=ticks.layer(i))
            clock.lap("layers")
            logprobs = score_activations(model, acts, windows, progress=progress)
            clock.lap("scoring")
        return list(zip(mine, logprobs, strict=True))

    logprobs = _in_window_order(world.exchange(work), len(plan.windows))
    metrics = metrics_from_logprobs(plan, logprobs)
    model = local["model"]
    return PerplexityReport(
        str(model_dir),
        device_kind(model.device),
        _dtype_name(model.dtype),
        metrics,
        local["compute"],
        clock.total(),
    )


# -- layer correspondence -------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerEntry:
    index: int
    source: int | None
    new: bool
    zero_init: bool = False
    parents: tuple[int, ...] = ()
    builder: str | None = None
    widened_noise: float | None = None  # otdus widen: the noise alpha of its expert copies


def manifest_base_path(folder: str | os.PathLike[str]) -> str | None:
    """The base model folder recorded in an expanded checkpoint's manifest, if any."""
    manifest = read_manifest(folder) or {}
    source = manifest.get("source")
    return source.get("path") if isinstance(source, dict) else None


def layer_entries(layer_map: LayerMap, num_layers: int) -> list[LayerEntry]:
    if callable(layer_map):
        out = []
        for j in range(num_layers):
            src = layer_map(j)
            out.append(LayerEntry(j, src, src is None, zero_init=src is None))
        return out
    out = []
    for j, raw in enumerate(layer_map):
        if not isinstance(raw, dict) or "new" not in raw:
            raise OtdusError(f"manifest layer entry {j} is malformed (needs at least 'new')")
        index = int(raw.get("index", j))
        if index != j:
            raise OtdusError(f"manifest layer entries are out of order at {j} (index {index})")
        src = raw.get("source")
        out.append(
            LayerEntry(
                j,
                None if src is None else int(src),
                bool(raw["new"]),
                bool(raw.get("zero_init", False)),
                tuple(int(p) for p in raw.get("parents") or ()),
                raw.get("builder"),
                float(raw.get("noise") or 0.0) if raw.get("widened") else None,
            )
        )
    if len(out) != num_layers:
        raise OtdusError(f"the layer map lists {len(out)} layers, the expanded checkpoint has {num_layers}")
    return out


def correspondence(entries: Sequence[LayerEntry], base_layers: int) -> list[int | None]:
    """For each expanded layer j, the base layer whose output its output should equal (-1 = the
    embeddings), or None when there is no such point."""
    consumed = -1
    broken = False
    out: list[int | None] = []
    for e in entries:
        if broken:
            out.append(None)
        elif not e.new:
            if e.source == consumed + 1 and e.source < base_layers:
                consumed += 1
                out.append(consumed)
            else:
                broken = True
                out.append(None)
        else:
            out.append(consumed)
    return out


def default_function_preserving(entries: Sequence[LayerEntry], base_layers: int) -> bool:
    base_order = [e.source for e in entries if not e.new]
    noisy = any(e.widened_noise for e in entries)  # widened with noise: a different function
    return base_order == list(range(base_layers)) and all(e.zero_init for e in entries if e.new) and not noisy


def describe(entry: LayerEntry | None, index: int) -> str:
    if entry is None:
        return f"layer {index}"
    if entry.new:
        parts = [f"new layer {index}"]
        detail = []
        if entry.builder:
            detail.append(entry.builder)
        if entry.parents:
            detail.append("from " + "+".join(str(p) for p in entry.parents))
        if entry.zero_init:
            detail.append("zero-init")
        if detail:
            parts.append("(" + ", ".join(detail) + ")")
        return " ".join(parts)
    return f"layer {index} (copy of base layer {entry.source})"


# -- lockstep comparison ---------------------------------------------------------------------------------
@dataclass
class LayerCheck:
    expanded_layer: int  # -1: embeddings
    base_layer: int  # -1: embeddings
    name: str
    max_abs_diff: float
    equal: bool


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


def _max_abs_diff(a: Activations, b: Activations) -> tuple[float, bool]:
    worst, equal = 0.0, True
    for x, y in zip(a.hidden, b.hidden, strict=True):
        if x.shape != y.shape:
            return math.inf, False
        if not torch.equal(x, y):
            equal = False
            diff = (x.float() - y.float()).abs()
            d = float(diff.max()) if diff.numel() else 0.0
            worst = max(worst, d if not math.isnan(d) else math.inf)
    return worst, equal


def _digest(logits: torch.Tensor) -> str:
    data = logits.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    return f"{tuple(logits.shape)}:{hashlib.sha256(data).hexdigest()}"


def _score(
    model: StreamedModel, acts: Activations, windows: Sequence[Window], progress: Progress | None, label: str
) -> tuple[list, list[str]]:
    """Log-probs per window and a digest per logits chunk."""
    digests: list[str] = []
    logprobs = score_activations(
        model, acts, windows, lambda chunk: digests.append(_digest(chunk)), progress, label
    )
    return logprobs, digests


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _run_layers(
    base: StreamedModel,
    expd: StreamedModel,
    entries: Sequence[LayerEntry],
    points: Sequence[int | None],
    windows: Sequence[Window],
    clock: _Clock,
    progress: Progress | None,
) -> tuple[Activations, Activations, list[LayerCheck]]:
    """Both stacks over ``windows`` in lockstep, comparing hidden states at each corresponding point."""
    inputs = [w.input_ids for w in windows]
    acts_b = base.start(inputs)
    acts_e = expd.start(inputs)
    clock.lap("start")
    checks: list[LayerCheck] = []
    diff, eq = _max_abs_diff(acts_e, acts_b)
    checks.append(LayerCheck(-1, -1, "embeddings", diff, eq))
    n_tokens = sum(len(w.targets) for w in windows)
    ticks = LayerTicks(progress, len(inputs), n_tokens, base.num_layers + expd.num_layers)
    passes = 0

    def apply(model: StreamedModel, index: int, acts: Activations, name: str) -> None:
        nonlocal passes
        model.apply_layer(index, acts, on_batch=ticks.layer(passes, f"{name} {index}"))
        passes += 1

    base_done = 0  # base layers applied so far
    for j, target in enumerate(points):
        if target is not None:
            while base_done <= target:
                apply(base, base_done, acts_b, "base")
                base_done += 1
        apply(expd, j, acts_e, "expanded")
        if target is not None:
            diff, eq = _max_abs_diff(acts_e, acts_b)
            checks.append(LayerCheck(j, target, describe(entries[j], j), diff, eq))
    while base_done < base.num_layers:
        apply(base, base_done, acts_b, "base")
        base_done += 1
    clock.lap("layers")
    return acts_b, acts_e, checks


@dataclass
class _RankPart:
    """What one rank computed of a verify run: its windows' log-probs, the lockstep checks on them."""

    windows: list[int]
    base: list[torch.Tensor]
    expanded: list[torch.Tensor]
    logits_equal: bool
    checks: list[LayerCheck]


def _combine_checks(per_rank: Sequence[list[LayerCheck]]) -> list[LayerCheck]:
    """Each comparison point over all ranks' windows: the largest difference, equal only if equal on
    every rank (what one process finds over all windows at once)."""
    first, *others = per_rank
    out = []
    for k, check in enumerate(first):
        same_point = [c[k] for c in others]
        out.append(
            LayerCheck(
                check.expanded_layer,
                check.base_layer,
                check.name,
                max([check.max_abs_diff, *(c.max_abs_diff for c in same_point)]),
                check.equal and all(c.equal for c in same_point),
            )
        )
    return out


@quiet_transformers
def verify_expansion(
    base_dir: str | os.PathLike[str],
    expanded_dir: str | os.PathLike[str],
    plan: EvalPlan,
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
    """Stream base and expanded side by side over ``plan``'s windows and judge function preservation.

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
    base_dir, expanded_dir = _model_folder(base_dir), _model_folder(expanded_dir)
    clock = _Clock()
    world = current_world() if world is None else world
    local: dict = {}  # what this rank learned on the way, for the report

    def work() -> _RankPart | None:
        """The static check, both models and this rank's windows in lockstep; everything that can fail
        runs here, so a failure on any rank is every rank's (World.exchange)."""
        torch_dtype = parse_dtype(dtype)
        base_reader, expd_reader = CheckpointReader(base_dir), CheckpointReader(expanded_dir)
        claimed = list(layer_map) if layer_map is not None and not callable(layer_map) else None
        proof = static_check(base_reader, expd_reader, claimed)
        manifest = read_manifest(expanded_dir)
        layers = layer_map
        if layers is None:  # the manifest's map as the static check read it (through expand + widen)
            layers = proof.claimed if manifest else proof.layer_map()
        base = StreamedModel(
            base_reader,
            device=device,
            dtype=torch_dtype,
            attn_implementation=attn_implementation,
            batch_size=batch_size,
            self_check="whole-model",
        )
        expd = StreamedModel(
            expd_reader,
            device=device,
            dtype=torch_dtype,
            attn_implementation=attn_implementation,
            batch_size=batch_size,
            self_check="on",
        )
        entries = layer_entries(layers, expd.num_layers)
        points = correspondence(entries, base.num_layers)
        # the map's claim or the proof, unless the caller says; never a boolean a hand edit could flip
        expected = expect_parity
        if expected is None:
            expected = default_function_preserving(entries, base.num_layers) or proof.preserving

        compute = compute_settings(expd, plan, threads, cpu_sample)
        compute.ranks = world.size
        base.batch_size = expd.batch_size = compute.batch_size if batch_size is None else batch_size
        mine = rank_windows(expd, plan, world)
        local.update(proof=proof, entries=entries, base=base, expect_parity=expected, compute=compute)
        if not mine and plan.windows:  # more ranks than batches
            return None
        windows = [plan.windows[i] for i in mine]
        with intra_op_threads(compute.threads.threads):
            acts_b, acts_e, checks = _run_layers(base, expd, entries, points, windows, clock, progress)
            # Logits one model at a time (its head, one chunk of positions): the chunks are compared by
            # digest, so neither model's head or logits need to be held next to the other's.
            lp_b, digests_b = _score(base, acts_b, windows, progress, "base")
            del acts_b
            lp_e, digests_e = _score(expd, acts_e, windows, progress, "expanded")
            del acts_e
            clock.lap("scoring")
        return _RankPart(mine, lp_b, lp_e, digests_b == digests_e, checks)

    parts = [p for p in world.exchange(work) if p is not None]
    proof, entries, base, compute = local["proof"], local["entries"], local["base"], local["compute"]
    expect_parity = local["expect_parity"]
    torch_dtype = parse_dtype(dtype)
    checks = _combine_checks([p.checks for p in parts])
    logits_equal = all(p.logits_equal for p in parts)
    lp_b = _in_window_order([list(zip(p.windows, p.base, strict=True)) for p in parts], len(plan.windows))
    lp_e = _in_window_order([list(zip(p.windows, p.expanded, strict=True)) for p in parts], len(plan.windows))
    logprob_diff = max(
        (float((x - y).abs().max()) for x, y in zip(lp_b, lp_e, strict=True) if x.numel()), default=0.0
    )
    if math.isnan(logprob_diff):
        logprob_diff = math.inf
    m_b = metrics_from_logprobs(plan, lp_b)
    m_e = metrics_from_logprobs(plan, lp_e)

    vb, ve = m_b.values(), m_e.values()
    deltas = {k: ve[k] - vb[k] for k in vb if k in ve}
    widened = any(e.widened_noise is not None for e in entries)
    exact = torch_dtype in EXACT_DTYPES and not widened
    if widened and torch_dtype in EXACT_DTYPES:
        tol = WIDENED_RTOL if rtol is None else rtol
        tolerance = (
            f"relative {tol:g} on every perplexity figure (widened experts: duplicates split each routing "
            "weight in two, equal in exact arithmetic, summed in another order)"
        )
        parity = all(abs(ve[k] - vb[k]) <= tol * abs(vb[k]) for k in vb if k != "loglikelihood")
    elif exact:
        tolerance = "bitwise (float32/float64): logits and perplexities must be identical"
        parity = logits_equal and all(vb[k] == ve[k] for k in vb)
    else:
        tol = LOW_PRECISION_RTOL if rtol is None else rtol
        tolerance = f"relative {tol:g} on every perplexity figure ({_dtype_name(torch_dtype)})"
        parity = all(abs(ve[k] - vb[k]) <= tol * abs(vb[k]) for k in vb if k != "loglikelihood")
    first = next((c for c in checks if not c.equal), None)
    name, value_b = m_b.headline()
    value_e = ve[name]
    if expect_parity:
        if parity:
            same = "==" if value_b == value_e else "~="
            verdict = f"PARITY: function preserved ({name} {value_b:.6g} {same} {value_e:.6g}; {tolerance})"
            exit_code = 0
        else:
            where = (
                f"; first divergence at {first.name} (max |diff| {first.max_abs_diff:.3g})" if first else ""
            )
            where += f"; static check: {proof.reason}" if proof.reason else ""
            verdict = f"BROKEN: expected function preservation, {name} {value_b:.6g} -> {value_e:.6g}{where}"
            exit_code = 1
    else:
        # a widened model's parity is a tolerance: say "unchanged" only when nothing moved at all
        unchanged = logits_equal if widened else parity
        change = "unchanged" if unchanged else f"{value_b:.8g} -> {value_e:.8g}"
        verdict = f"no parity expected (not function-preserving): {name} {change}"
        exit_code = 0
    if plan.reproduces:
        verdict += f" [wikitext figures of {plan.reproduces}]"
    return VerifyReport(
        base_model=str(base_dir),
        expanded_model=str(expanded_dir),
        device=device_kind(base.device),
        dtype=_dtype_name(torch_dtype),
        base=m_b,
        expanded=m_e,
        deltas=deltas,
        expect_parity=bool(expect_parity),
        parity=parity,
        verdict=verdict,
        exit_code=exit_code,
        tolerance=tolerance,
        logits_equal=logits_equal,
        logprob_max_abs_diff=logprob_diff,
        first_divergence=first,
        checks=checks,
        proof=proof,
        compute=compute,
        timings=clock.total(),
    )
