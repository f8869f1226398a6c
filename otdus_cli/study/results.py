"""A study's results: every run's curve and per-window losses, each method's summary, and the
paired comparisons with the reference (by seed and by evaluation window, study.stats), with saving,
loading and merging of later arms."""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from otdus_cli.errors import OtdusError
from otdus_cli.study.arms import RunSpec
from otdus_cli.study.stats import by_document_mean_ci, crossed_mean_ci, holm, mean_std, sign_flip_p

__all__ = ["MethodSummary", "RunResult", "StudyResult", "compare", "paired_difference", "summarise"]


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
    # with a validation split (plateau rule or learning-rate sweep): the learning rate used, the
    # validation curve that decided when to stop, and whether the plateau rule stopped the run
    # (False: it reached max_steps); eval_steps/eval_loss are then the held-out loss at step 0 and
    # at the stop only
    lr: float | None = None
    validation_steps: list[int] = field(default_factory=list)
    validation_loss: list[float] = field(default_factory=list)
    plateaued: bool | None = None


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
    # seed and evaluation window, with its interval and Holm-adjusted p (paired_difference)
    vs_reference: dict[str, Any] | None = None
    # with a learning-rate sweep: the rate chosen, and each rate's final validation loss on the first
    # seed ({"lr", "validation_loss", "steps", "plateaued"})
    lr: float | None = None
    lr_sweep: list[dict[str, Any]] | None = None


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
        compare(out.methods, seeds, out.runs, ref or None, out.data.get("eval_window_documents"))
        return out

    def with_arms(
        self,
        other: StudyResult,
        order: Sequence[str] | None = None,
        tol: float = 1e-6,
        shared_run: bool = True,
    ) -> StudyResult:
        """This study with ``other``'s arms added (a later run of the same study with more methods,
        e.g. ``run_recipe(..., runs=[...])``), comparisons re-derived over all of them.

        Both must share the base, the data, the settings and the seeds; every (method, seed) run in
        both must agree window by window to ``tol`` (the shared arms, at least the reference, show
        that the later run reproduces the earlier one), and this study's copy of it is kept.
        ``shared_run=False`` takes arms run without the reference (in processes of their own): then
        the base's held-out loss must agree bit for bit instead, and the result's notes say so.
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
        if not shared and shared_run:
            raise OtdusError("the studies share no run to check that the later one reproduces the earlier")
        if not shared and self.base_loss != other.base_loss:
            raise OtdusError(f"the base's held-out loss differs ({self.base_loss!r} vs {other.base_loss!r})")
        worst = max(
            (
                max(
                    abs(x - y)
                    for x, y in zip(r.final_window_loss, by[r.label, r.seed].final_window_loss, strict=True)
                )
                for r in shared
            ),
            default=0.0,
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
            if shared
            else f"arms {new} added from a run of their own (no shared run; the base's held-out loss agrees "
            "bit for bit)"
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

    def save(
        self,
        out_dir: str | os.PathLike[str],
        plot: bool = True,
        *,
        force: bool = False,
        protected: Sequence[str | os.PathLike[str]] = (),
    ) -> list[Path]:
        """Write the folder ``out_dir`` as an otdus study output (output_files.py: staged, with a
        manifest, swapped into place; ``force`` replaces only an unchanged earlier study output;
        ``protected``: folders it may not touch); the paths of the files written there."""
        from otdus_cli.output_files import STUDY, claim_files

        with contextlib.ExitStack() as claimed:
            tmp = claim_files(claimed, out_dir, STUDY, protected=[Path(p) for p in protected], force=force)
            names = [p.name for p in self.write_files(tmp, plot)]
        return [Path(out_dir) / name for name in names]

    def write_files(self, folder: Path, plot: bool = True) -> list[Path]:
        """Write ``study.json`` and, when matplotlib is installed, ``loss_curves.png`` into the
        existing ``folder`` (the staged folder of a study output)."""
        from otdus_cli.study.report import plot_curves

        written = []
        if plot:
            png = plot_curves(self, folder / "loss_curves.png")
            if png is not None:
                self.figures = [png.name]
                written.append(png)
        (folder / "study.json").write_text(self.to_json() + "\n")
        written.insert(0, folder / "study.json")
        return written


def summarise(
    specs: list[RunSpec],
    seeds: list[int],
    runs: list[RunResult],
    ref: str | None,
    documents: Sequence[int] | None = None,
    sweeps: dict[str, list[dict[str, Any]]] | None = None,
) -> list[MethodSummary]:
    """Each method's summary over its seeds and its comparison with ``ref``; ``sweeps``: each
    method's learning-rate sweep (every run of a method then used the rate it chose)."""
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
                lr=rs[0].lr if sweeps else None,
                lr_sweep=(sweeps or {}).get(spec.label),
            )
        )
    compare(out, seeds, runs, ref, documents)
    return out


def compare(
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
