"""`otdus study`: expand a base with several methods, train the new layers, compare held-out loss.

Every method is expanded from the same base (into a temporary folder), then only its new layers
(the manifest's ``new_parameters``) are trained with AdamW for the same number of steps on the
same batches (the data order depends on the seed only), for several seeds. The held-out loss is
evaluated at intervals. For each method the result reports the final loss and perplexity (mean
and spread over seeds), the loss at step 0 (a function-preserving expansion must start exactly at
the base's loss; this is checked), and the paired difference to a reference method, paired by seed
and by evaluation window, with an interval that includes the evaluation-sample error (every run is
scored on the same windows, so more seeds do not shrink it) and Holm-adjusted p-values over all the
comparisons (study.stats). Only differences to the reference are tested: the other methods are not
ranked against each other.

Method specs (strings): ``method[:variant][+zero|+nozero]``, e.g. ``ot`` (OT-DUS, paper variant,
zero-init), ``ot+nozero``, ``ot:structured``, ``ot:official``, ``average`` (Avg-DeUS, no
zero-init), ``average+zero``, ``copy``, ``random``, ``llama-pro``, ``solar``, ``lesa`` (LESA, pair
variant, zero-init), ``lesa:published`` (LESA as its notebook builds it, nothing zeroed), ``interpose``
(every chosen layer duplicated in place), ``stack`` (the whole stack repeated). Full expand options
can be given instead with :class:`RunSpec` or in a YAML recipe (:func:`run_recipe`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from otdus_cli.errors import OtdusError
from otdus_cli.options import ExpandOptions, invalid, merge_options, method_spec_options, read_yaml
from otdus_cli.study.data import (
    Documents,
    load_documents,
    split_documents,
    tokenize_windows,
    window_documents,
)
from otdus_cli.study.stats import by_document_mean_ci, crossed_mean_ci, holm, mean_std, sign_flip_p
from otdus_cli.study.train import TrainConfig, evaluate, load_model, train

__all__ = [
    "DEFAULT_METHODS",
    "TABLE6_METHODS",
    "MethodSummary",
    "RunResult",
    "RunSpec",
    "StudyEvent",
    "StudyRecipe",
    "StudyResult",
    "load_study_recipe",
    "paired_difference",
    "parse_method",
    "run_recipe",
    "study",
]

DEFAULT_METHODS = ("ot", "average", "average+zero", "copy", "random")
# Paper Table 6 ablation plus the review's 2x2 (OT / Average x zero-init), the OT variants, sharper
# plans (exact assignment; Sinkhorn at reg 0.01), and LESA (the paper's remaining baseline), with
# zero-init and as published. Labels are names (recipes/study-table6.yaml), not method specs.
TABLE6_METHODS = (
    "ot",
    "ot+nozero",
    "average+zero",
    "average",
    "ot:structured",
    "ot:official",
    "ot/emd",
    "ot/reg0.01",
    "ot:activation/emd",
    "copy",
    "random",
    "lesa",
    "lesa:published",
)


@dataclass(frozen=True)
class RunSpec:
    """One arm of the study: a label and the full expand options that build it."""

    label: str
    options: ExpandOptions


def parse_method(spec: str, overrides: dict[str, Any] | None = None) -> RunSpec:
    """``method[:variant][+zero|+nozero]`` (see the module docstring) as a :class:`RunSpec`;
    ``overrides`` as in :func:`otdus_cli.options.method_spec_options`."""
    return RunSpec(spec.strip(), method_spec_options(spec, overrides))


@dataclass
class StudyEvent:
    """Progress report: ``kind`` is "data", "expand", "eval" or "run"."""

    kind: str
    label: str = ""
    seed: int | None = None
    step: int | None = None
    loss: float | None = None
    run: int = 0  # 1-based index of the (method, seed) run
    runs: int = 0
    message: str = ""


@dataclass
class RunResult:
    label: str
    seed: int
    eval_steps: list[int]
    eval_loss: list[float]
    train_loss: list[float]
    initial_loss: float
    final_loss: float
    function_preserving: bool
    initial_equals_base: bool
    trainable_parameters: int
    num_hidden_layers: int
    seconds: float
    # the final evaluation's loss on each held-out window (window order shared by every run);
    # empty in results saved before it was recorded
    final_window_loss: list[float] = field(default_factory=list)


@dataclass
class MethodSummary:
    label: str
    options: dict[str, Any]
    seeds: list[int]
    function_preserving: bool
    initial_loss: float  # mean over seeds
    initial_equals_base: bool  # every seed's step-0 loss is bit-identical to the base's
    final_loss: float
    final_loss_std: float
    final_ppl: float
    num_hidden_layers: int
    trainable_parameters: int
    # paired difference of the final loss to the reference (method - reference; < 0: lower loss), by
    # seed and evaluation window, with its interval and Holm-adjusted p (runner.paired_difference)
    vs_reference: dict[str, Any] | None = None


@dataclass
class StudyResult:
    base: str
    reference: str
    config: dict[str, Any]
    data: dict[str, Any]
    base_loss: float
    methods: list[MethodSummary]
    runs: list[RunResult]
    seconds: float
    figures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what a reader of the tables must know

    @property
    def base_ppl(self) -> float:
        return math.exp(self.base_loss)

    def summary(self, label: str) -> MethodSummary:
        for m in self.methods:
            if m.label == label:
                return m
        raise KeyError(label)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["base_ppl"] = self.base_ppl
        return out

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def contrast(self, label: str, reference: str) -> dict[str, Any]:
        """``label``'s final loss minus ``reference``'s, as in ``vs_reference`` but for any two methods
        (no multiple-comparison adjustment: adjust over the family of contrasts you report)."""
        labels = [m.label for m in self.methods]
        for name in (label, reference):
            if name not in labels:
                raise OtdusError(f"method {name!r} is not among the methods ({', '.join(labels)})")
        seeds = [int(s) for s in self.config["seeds"]]
        return paired_difference(self.runs, seeds, label, reference, self.data.get("eval_window_documents"))

    def recompute(self, reference: str | None = None) -> StudyResult:
        """A copy whose comparisons are re-derived from the stored runs, with the current statistics
        (a result saved by an older version; or another ``reference`` among the methods)."""
        ref = self.reference if reference is None else reference
        labels = [m.label for m in self.methods]
        if ref and ref not in labels:
            raise OtdusError(f"reference method {ref!r} is not among the methods ({', '.join(labels)})")
        out = StudyResult.from_dict(self.to_dict())
        out.reference = ref or ""
        seeds = [int(s) for s in out.config["seeds"]]
        _compare(out.methods, seeds, out.runs, ref or None, out.data.get("eval_window_documents"))
        return out

    def with_arms(
        self, other: StudyResult, order: Sequence[str] | None = None, tol: float = 1e-6
    ) -> StudyResult:
        """This study with ``other``'s arms added (a later run of the same study with more methods,
        e.g. ``run_recipe(..., runs=[...])``), comparisons re-derived over all of them.

        Both must share the base, the data, the settings and the seeds; every (method, seed) run in
        both must agree window by window to ``tol`` (the shared arms, at least the reference, show
        that the later run reproduces the earlier one), and this study's copy of it is kept.
        ``order``: the methods' order in the result (default: this study's, then the new ones).
        """
        mine = {k: v for k, v in self.config.items() if k not in ("methods", "threads")}
        theirs = {k: v for k, v in other.config.items() if k not in ("methods", "threads")}
        # a study stored before the window documents were recorded still takes a later run's arms
        late = "eval_window_documents"
        data_mine, data_theirs = dict(self.data), dict(other.data)
        if late not in data_mine or late not in data_theirs:
            data_mine.pop(late, None), data_theirs.pop(late, None)
        if self.base != other.base or data_mine != data_theirs or mine != theirs:
            diff = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
            raise OtdusError(
                f"not the same study (base, data or settings differ: {', '.join(diff) or 'base/data'})"
            )
        by = {(r.label, r.seed): r for r in self.runs}
        shared = [r for r in other.runs if (r.label, r.seed) in by]
        if not shared:
            raise OtdusError("the studies share no run to check that the later one reproduces the earlier")
        worst = max(
            max(
                abs(x - y)
                for x, y in zip(r.final_window_loss, by[r.label, r.seed].final_window_loss, strict=True)
            )
            for r in shared
        )
        if not worst <= tol:
            raise OtdusError(f"the shared runs differ by up to {worst:.3g} per window (more than {tol:g})")
        out = StudyResult.from_dict(self.to_dict())
        if late in other.data:
            out.data.setdefault(late, other.data[late])
        known = {m.label for m in out.methods}
        added = StudyResult.from_dict(other.to_dict())
        out.methods += [m for m in added.methods if m.label not in known]
        out.runs += [r for r in added.runs if r.label not in known]
        labels = [m.label for m in out.methods]
        if order is not None:
            if sorted(order) != sorted(labels):
                raise OtdusError(f"order must list exactly the methods ({', '.join(labels)})")
            out.methods.sort(key=lambda m: list(order).index(m.label))
            out.runs.sort(key=lambda r: list(order).index(r.label))
        out.config["methods"] = [m.label for m in out.methods]
        out.seconds = self.seconds + other.seconds
        out.notes = list(dict.fromkeys(self.notes + other.notes))
        new = ", ".join(sorted(set(labels) - known))
        out.notes.append(
            f"arms {new} added from a later run (its runs shared with this one agree to {worst:.2g})"
        )
        return out.recompute()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StudyResult:
        data = {k: v for k, v in data.items() if k != "base_ppl"}
        data["methods"] = [MethodSummary(**m) for m in data["methods"]]
        data["runs"] = [RunResult(**r) for r in data["runs"]]
        return cls(**data)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> StudyResult:
        """A result written by :meth:`save` (a study.json file or its folder)."""
        path = Path(path)
        if path.is_dir():
            path = path / "study.json"
        return cls.from_dict(json.loads(path.read_text()))

    def save(self, out_dir: str | os.PathLike[str], plot: bool = True) -> list[Path]:
        """Write ``study.json`` and, when matplotlib is installed, ``loss_curves.png``."""
        from otdus_cli.study.report import plot_curves

        folder = Path(out_dir)
        folder.mkdir(parents=True, exist_ok=True)
        written = []
        if plot:
            png = plot_curves(self, folder / "loss_curves.png")
            if png is not None:
                self.figures = [png.name]
                written.append(png)
        (folder / "study.json").write_text(self.to_json() + "\n")
        written.insert(0, folder / "study.json")
        return written


def _resolve_runs(methods: Sequence[str | RunSpec], overrides: dict[str, Any] | None) -> list[RunSpec]:
    runs = [m if isinstance(m, RunSpec) else parse_method(m, overrides) for m in methods]
    labels = [r.label for r in runs]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise OtdusError(f"methods listed twice: {', '.join(dupes)}")
    if not runs:
        raise OtdusError("no methods to study")
    return runs


class _ExpansionCache:
    """Expanded checkpoints in a temporary folder, one per distinct options (seed only for random)."""

    def __init__(self, base: str, root: Path):
        self.base = base
        self.root = root
        self._made: dict[str, tuple[Path, dict]] = {}

    def get(self, options: ExpandOptions, seed: int) -> tuple[Path, dict]:
        from otdus_cli.expand import expand
        from otdus_cli.methods.registry import get_method

        seeded = get_method(options.method).seeded_by_study
        opts = options.model_copy(update={"seed": seed if seeded else options.seed})
        key = opts.model_dump_json()
        if key not in self._made:
            out = self.root / f"m{len(self._made)}"
            result = expand(self.base, out, opts)
            self._made[key] = (out, result.manifest)
        return self._made[key]


def study(
    base: str,
    train_text: str | os.PathLike[str],
    eval_text: str | os.PathLike[str] | None = None,
    *,
    methods: Sequence[str | RunSpec] = DEFAULT_METHODS,
    seeds: Sequence[int] = (0, 1, 2),
    steps: int = 150,
    lr: float = 2e-3,
    batch: int = 8,
    seq_len: int = 128,
    eval_every: int = 25,
    eval_windows: int = 128,
    eval_fraction: float = 0.05,
    max_train_windows: int | None = None,
    train_new_only: bool = True,
    weight_decay: float = 0.0,
    warmup: float = 0.1,
    reference: str | None = "ot",
    device: str = "auto",
    threads: int | None = None,
    expand_options: dict[str, Any] | None = None,
    out_dir: str | os.PathLike[str] | None = None,
    work_dir: str | os.PathLike[str] | None = None,
    progress: Callable[[StudyEvent], None] | None = None,
) -> StudyResult:
    """Expand ``base`` with each method, train the new layers, compare held-out loss over seeds.

    ``train_text`` / ``eval_text``: text specs (a file, ``bundled:tinystories-sample``,
    ``bundled:wikitext-test``; see study.data). Without ``eval_text`` the last ``eval_fraction`` of
    the training documents is held out (documents are never shared). ``eval_windows`` windows of
    ``seq_len`` tokens, evenly spaced over the held-out text, are scored at step 0, every
    ``eval_every`` steps and at the end.
    ``expand_options``: ExpandOptions fields applied to every method (e.g. layers, position).
    ``reference``: label of the method the others are paired with (None: no pairing; the default
    "ot" absent from the methods: no pairing, said in ``notes``; any other absent label: an error).
    ``threads``: torch CPU threads for the duration (on a busy machine 1 is often fastest).
    ``out_dir``: where study.json and loss_curves.png go (None: nothing written).
    """
    t0 = time.perf_counter()
    notify = progress or (lambda event: None)
    runs_spec = _resolve_runs(methods, expand_options)
    seeds = [int(s) for s in seeds]
    if not seeds or len(set(seeds)) != len(seeds):
        raise OtdusError("seeds must be a non-empty list of distinct integers")
    if steps < 1 or batch < 1 or seq_len < 2 or eval_every < 1 or eval_windows < 1:
        raise OtdusError("steps, batch, eval_every, eval_windows must be >= 1 and seq_len >= 2")
    labels = [r.label for r in runs_spec]
    ref = reference if reference in labels else None
    notes = []
    if reference and ref is None:
        if reference != "ot":
            raise OtdusError(f"reference method {reference!r} is not among the methods ({', '.join(labels)})")
        # the default reference: a study without OT is legitimate, but say why there are no differences
        notes.append(
            "no paired differences: the default reference 'ot' is not among the methods "
            "(choose one of them as the reference)"
        )
    from otdus_cli.device import resolve_device

    dev = resolve_device(device)
    threads_before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(int(threads))
    from otdus_cli.source import resolve_source
    from otdus_cli.verify.metrics import load_tokenizer

    source = resolve_source(base)
    base_dir = str(source.folder)
    tokenizer = load_tokenizer(base_dir)
    train_docs = load_documents(train_text)
    if eval_text is None:
        train_docs, eval_docs = split_documents(train_docs, eval_fraction)
    else:
        eval_docs = load_documents(eval_text)
        _check_disjoint(train_docs, eval_docs)
    train_w = tokenize_windows(tokenizer, train_docs, seq_len, max_train_windows)
    # spread over the held-out text: windows from many documents, not the first few (the paired
    # interval treats windows as independent draws from the evaluation text)
    eval_w, eval_owner = window_documents(tokenizer, eval_docs, seq_len, eval_windows, spread=True)
    data = {
        "train": train_docs.name,
        "eval": eval_docs.name,
        "train_documents": len(train_docs.documents),
        "eval_documents": len(eval_docs.documents),
        "train_windows": int(train_w.shape[0]),
        "eval_windows": int(eval_w.shape[0]),
        "seq_len": seq_len,
        "eval_tokens_scored": int(eval_w.shape[0] * (seq_len - 1)),
        "train_tokens_seen": steps * batch * seq_len,
        # the held-out document of each evaluation window's first token, in window order: what a
        # by-document (cluster) interval resamples (results stored before this have none)
        "eval_window_documents": eval_owner,
    }
    if data["eval_windows"] < eval_windows:
        notes.append(
            f"only {data['eval_windows']} evaluation window(s) of the {eval_windows} asked: the held-out "
            "text is short, and the evaluation-sample error is large"
        )
    notify(StudyEvent("data", message=f"{data['train_windows']} train / {data['eval_windows']} eval windows"))
    config = TrainConfig(
        steps=steps, lr=lr, batch=batch, eval_every=eval_every, weight_decay=weight_decay, warmup=warmup
    )
    base_model = load_model(base_dir, dev)
    base_loss = evaluate(base_model, eval_w, config.eval_batch)
    del base_model

    tmp = Path(tempfile.mkdtemp(prefix="otdus-study-", dir=work_dir))
    results: list[RunResult] = []
    total = len(runs_spec) * len(seeds)
    try:
        cache = _ExpansionCache(base, tmp)
        k = 0
        for spec in runs_spec:
            for seed in seeds:
                k += 1
                notify(StudyEvent("expand", spec.label, seed, run=k, runs=total))
                folder, manifest = cache.get(spec.options, seed)
                results.append(
                    _one_run(
                        spec,
                        seed,
                        folder,
                        manifest,
                        train_w,
                        eval_w,
                        config,
                        base_loss,
                        train_new_only,
                        dev,
                        notify,
                        k,
                        total,
                    )
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        torch.set_num_threads(threads_before)

    summaries = _summarise(runs_spec, seeds, results, ref, data["eval_window_documents"])
    result = StudyResult(
        base=base,
        reference=ref or "",
        config={
            "methods": labels,
            "seeds": seeds,
            "steps": steps,
            "lr": lr,
            "batch": batch,
            "seq_len": seq_len,
            "eval_every": eval_every,
            "eval_windows": eval_windows,
            "eval_fraction": eval_fraction if eval_text is None else None,
            "train_new_only": train_new_only,
            "weight_decay": weight_decay,
            "warmup": warmup,
            "optimizer": "AdamW(betas=(0.9, 0.95)), linear warmup then cosine to 10%, grad clip 1.0",
            "device": str(dev),
            "threads": threads or threads_before,
            "expand_options": expand_options or {},
            "torch": torch.__version__,
        },
        data=data,
        base_loss=base_loss,
        methods=summaries,
        runs=results,
        seconds=time.perf_counter() - t0,
        notes=notes,
    )
    if out_dir is not None:
        result.save(out_dir)
    return result


def _check_disjoint(train_docs: Documents, eval_docs: Documents) -> None:
    shared = set(train_docs.documents) & set(eval_docs.documents)
    if shared:
        raise OtdusError(f"{len(shared)} document(s) occur in both the training and the evaluation text")


def _one_run(
    spec, seed, folder, manifest, train_w, eval_w, config, base_loss, train_new_only, dev, notify, k, total
) -> RunResult:
    torch.manual_seed(seed)
    model = load_model(str(folder), dev)
    trainable = list(manifest["new_parameters"]) if train_new_only else None

    def on_eval(step: int, loss: float) -> None:
        notify(StudyEvent("eval", spec.label, seed, step, loss, k, total))

    curve = train(model, train_w, eval_w, config, seed, trainable, on_eval)
    preserving = bool(manifest.get("function_preserving"))
    initial = curve.eval_loss[0]
    equal = initial == base_loss
    if preserving and not math.isclose(initial, base_loss, rel_tol=1e-6, abs_tol=1e-7):
        raise OtdusError(
            f"{spec.label}: a function-preserving expansion starts at loss {initial:.8f}, "
            f"not the base's {base_loss:.8f}"
        )
    run = RunResult(
        label=spec.label,
        seed=seed,
        eval_steps=curve.eval_steps,
        eval_loss=curve.eval_loss,
        train_loss=curve.train_loss,
        initial_loss=initial,
        final_loss=curve.eval_loss[-1],
        function_preserving=preserving,
        initial_equals_base=equal,
        trainable_parameters=curve.trainable_parameters,
        num_hidden_layers=int(manifest["num_hidden_layers"]),
        seconds=curve.seconds,
        final_window_loss=curve.final_window_loss,
    )
    notify(StudyEvent("run", spec.label, seed, config.steps, run.final_loss, k, total))
    return run


def _summarise(
    specs: list[RunSpec],
    seeds: list[int],
    runs: list[RunResult],
    ref: str | None,
    documents: Sequence[int] | None = None,
) -> list[MethodSummary]:
    by = {(r.label, r.seed): r for r in runs}
    out = []
    for spec in specs:
        rs = [by[spec.label, s] for s in seeds]
        finals = [r.final_loss for r in rs]
        mean, sd = mean_std(finals)
        out.append(
            MethodSummary(
                label=spec.label,
                options=json.loads(spec.options.model_dump_json()),
                seeds=seeds,
                function_preserving=rs[0].function_preserving,
                initial_loss=sum(r.initial_loss for r in rs) / len(rs),
                initial_equals_base=all(r.initial_equals_base for r in rs),
                final_loss=mean,
                final_loss_std=sd,
                final_ppl=math.exp(mean),
                num_hidden_layers=rs[0].num_hidden_layers,
                trainable_parameters=rs[0].trainable_parameters,
            )
        )
    _compare(out, seeds, runs, ref, documents)
    return out


def _compare(
    summaries: list[MethodSummary],
    seeds: list[int],
    runs: list[RunResult],
    ref: str | None,
    documents: Sequence[int] | None = None,
) -> None:
    """Each method's final loss minus the reference's, paired by seed and by evaluation window
    (:func:`paired_difference`); ``p_holm`` adjusts the p-values of all the comparisons against the
    reference together (Holm), and the verdicts use it."""
    compared = [m for m in summaries if ref is not None and m.label != ref]
    for m in summaries:
        m.vs_reference = None
    for m in compared:
        m.vs_reference = paired_difference(runs, seeds, m.label, ref, documents)
    for m, q in zip(compared, holm([m.vs_reference["p"] for m in compared]), strict=True):
        m.vs_reference["p_holm"] = q
        m.vs_reference["comparisons"] = len(compared)


def paired_difference(
    runs: Sequence[RunResult],
    seeds: Sequence[int],
    label: str,
    ref: str,
    documents: Sequence[int] | None = None,
) -> dict[str, Any]:
    """``label``'s final loss minus ``ref``'s, paired by seed and by evaluation window.

    The interval accounts for both seeds and the shared evaluation windows (stats.crossed_mean_ci;
    seeds only when the runs carry no per-window losses). Not adjusted for multiple comparisons.
    With ``documents`` (each window's held-out document), ``by_document`` adds the interval with
    documents as the sampled unit (stats.by_document_mean_ci).
    """
    by = {(r.label, r.seed): r for r in runs}
    pairs = [(by[label, s], by[ref, s]) for s in seeds]
    diffs = [a.final_loss - b.final_loss for a, b in pairs]
    windows = {len(r.final_window_loss) for pair in pairs for r in pair}
    if len(windows) == 1 and windows != {0}:
        table = [
            [x - y for x, y in zip(a.final_window_loss, b.final_window_loss, strict=True)] for a, b in pairs
        ]
    else:  # results saved before per-window losses were recorded
        table = [[x] for x in diffs]
    by_document = {}
    if documents is not None and len(table[0]) == len(documents) > 1:
        by_document = {"by_document": by_document_mean_ci(table, documents)}
    return {
        "reference": ref,
        "diffs": diffs,  # per seed (mean over the windows)
        "n": len(diffs),
        "std": mean_std(diffs)[1],
        **crossed_mean_ci(table),
        "seeds_lower": sum(x < 0 for x in diffs),
        "sign_flip_p": sign_flip_p(diffs),
        **by_document,
    }


# -- recipes --------------------------------------------------------------------------------------
class _RecipeRun(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    expand: dict[str, Any] = Field(default_factory=dict)


class _RecipeStudy(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    train_text: str
    eval_text: str | None = None
    description: str | None = None
    settings: dict[str, Any] = Field(default_factory=dict)  # per-study overrides of the defaults


class PrimaryFamily(BaseModel):
    """The comparisons a recipe declares, before its data, as the primary (confirmatory) family:
    ``reference`` minus each of ``against`` in every study, Holm-adjusted within the study; with
    TOST at ``equivalence_margin`` (nats) behind any "no difference" reading. Everything else a
    study reports is exploratory. ``declared`` says when (and whether before the data)."""

    model_config = ConfigDict(extra="forbid")

    reference: str
    against: list[str] = Field(min_length=1)
    alpha: float = Field(0.05, gt=0, lt=1)
    equivalence_margin: float = Field(gt=0)
    declared: str


class StudyRecipe(BaseModel):
    """A YAML study recipe: a base, shared settings, expand options, runs (arms), studies (domains)."""

    model_config = ConfigDict(extra="forbid")

    base: str
    description: str | None = None
    reference: str | None = "ot"
    settings: dict[str, Any] = Field(default_factory=dict)  # study() keyword arguments
    expand: dict[str, Any] = Field(default_factory=dict)  # ExpandOptions fields for every run
    runs: list[_RecipeRun]
    studies: list[_RecipeStudy]
    primary: PrimaryFamily | None = None

    def run_specs(self, overrides: dict[str, Any] | None = None) -> list[RunSpec]:
        """Each run's full expand options; ``overrides`` (ExpandOptions fields) win over the recipe's."""
        specs = []
        for r in self.runs:
            # option groups (ot, ...) merge key by key: a run's ot.reg keeps the recipe's ot.variant
            data = merge_options(self.expand, r.expand, overrides or {})
            try:
                specs.append(RunSpec(r.name, ExpandOptions.model_validate(data)))
            except ValidationError as exc:
                raise OtdusError(f"run {r.name!r}: {invalid(exc)}") from None
        return specs


_SETTINGS = {
    "seeds",
    "steps",
    "lr",
    "batch",
    "seq_len",
    "eval_every",
    "eval_windows",
    "eval_fraction",
    "max_train_windows",
    "train_new_only",
    "weight_decay",
    "warmup",
    "device",
    "threads",
}


def load_study_recipe(path: str | os.PathLike[str]) -> StudyRecipe:
    path = Path(path)
    data = read_yaml(path)
    try:
        recipe = StudyRecipe.model_validate(data)
    except ValidationError as exc:
        raise OtdusError(f"recipe {path}: {invalid(exc)}") from None
    for where, settings in [("settings", recipe.settings)] + [
        (f"studies.{s.name}", s.settings) for s in recipe.studies
    ]:
        unknown = sorted(set(settings) - _SETTINGS)
        if unknown:
            raise OtdusError(f"recipe {path}: {where}: unknown setting(s) {', '.join(unknown)}")
    recipe.run_specs()  # validates every run's expand options
    return recipe


def _resolve_text(spec: str | None, folder: Path) -> str | None:
    if spec is None or spec.startswith("bundled:") or os.path.isabs(spec):
        return spec
    return os.path.normpath(folder / spec)  # "recipes/../data/x" is reported as "data/x"


def run_recipe(
    path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str] | None = None,
    only: Sequence[str] | None = None,
    overrides: dict[str, Any] | None = None,
    progress: Callable[[StudyEvent], None] | None = None,
    runs: Sequence[str] | None = None,
    reference: str | None = None,
    expand_overrides: dict[str, Any] | None = None,
) -> dict[str, StudyResult]:
    """Run every study of a recipe (or those named in ``only``); results under ``out_dir/<study>/``.

    Relative text paths are resolved against the recipe's folder. ``overrides``: study() settings
    that win over the recipe's (e.g. ``{"steps": 10, "seeds": [0]}`` for a smoke run);
    ``reference``: instead of the recipe's; ``expand_overrides``: ExpandOptions fields that win over
    every run's (e.g. ``{"layers": 1}``); ``runs``: only these of the recipe's runs (by name), plus
    the reference, e.g. to add arms to a study already run (seeds fix the batches, so the reference
    reproduces its earlier numbers; :meth:`StudyResult.with_arms` merges the two).
    """
    path = Path(path)
    recipe = load_study_recipe(path)
    unknown = sorted(set(overrides or {}) - _SETTINGS)
    if unknown:
        raise OtdusError(f"unknown setting(s) {', '.join(unknown)}")
    specs = recipe.run_specs(expand_overrides)
    ref = recipe.reference if reference is None else reference
    if runs is not None:
        unknown = sorted(set(runs) - {s.label for s in specs})
        if unknown:
            known = ", ".join(s.label for s in specs)
            raise OtdusError(f"recipe {path}: unknown run(s) {', '.join(unknown)} (runs: {known})")
        specs = [s for s in specs if s.label in runs or s.label == ref]
    chosen = [s for s in recipe.studies if only is None or s.name in only]
    if only is not None and len(chosen) != len(set(only)):
        known = ", ".join(s.name for s in recipe.studies)
        raise OtdusError(f"recipe {path}: unknown study in {list(only)} (studies: {known})")
    results = {}
    for s in chosen:
        settings = {**recipe.settings, **s.settings, **(overrides or {})}
        results[s.name] = study(
            recipe.base,
            _resolve_text(s.train_text, path.parent),
            _resolve_text(s.eval_text, path.parent),
            methods=specs,
            reference=ref,
            out_dir=None if out_dir is None else Path(out_dir) / s.name,
            progress=progress,
            **settings,
        )
    return results
