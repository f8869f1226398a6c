"""`otdus study`: expand a base with several methods, train the new layers, compare held-out loss.

Every method is expanded from the same base (into a temporary folder), then only its new layers
(the manifest's ``new_parameters``) are trained with AdamW on the same batches (the data order
depends on the seed only), for several seeds. An arm may shrink the base instead (study.arms'
``shrink:`` arms): the shrunk model is then healed, every parameter trained (a shrink adds no layer
to train alone), and its step-0 loss is the shrunk model's before any healing; its layers are scored
on the training text unless the arm names its own ``calib``. For each method the
result reports the final held-out loss and perplexity (mean and spread over seeds), the loss at step 0 (a
function-preserving expansion must start exactly at the base's loss; this is checked), and the
paired difference to a reference method, paired by seed and by evaluation window (study.results,
study.stats). Only differences to the reference are tested: the other methods are not ranked
against each other.

Training runs a fixed number of steps, with the held-out loss on a curve every ``eval_every``
steps; or, with a plateau rule and/or a learning-rate sweep (otdus_cli.study_settings), decisions are made
on a validation split held out of the training text: the plateau rule stops a run when its
validation loss stops falling, the sweep picks each method's learning rate by the validation loss
its first seed reaches. The held-out text is then scored only at step 0 and at the stop, so that
nothing chosen has seen it.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from otdus_cli.errors import OtdusError
from otdus_cli.io.output_dir import OutputReport
from otdus_cli.output_files import STUDY, claim_files
from otdus_cli.study.arms import DEFAULT_METHODS, ExpansionCache, RunSpec, arm_kind, resolve_runs
from otdus_cli.study.data import Documents, load_documents, split_documents, window_documents
from otdus_cli.study.results import RunResult, StudyResult, summarise
from otdus_cli.study.train import TrainConfig, TrainCurve, attention, load_model, train, window_losses
from otdus_cli.study_settings import StudySettings, study_settings

__all__ = ["StudyEvent", "study"]

OPTIMIZER = "AdamW(betas=(0.9, 0.95)), linear warmup then cosine to 10%, grad clip 1.0"
OPTIMIZER_PLATEAU = "AdamW(betas=(0.9, 0.95)), linear warmup then constant, grad clip 1.0"


@dataclass
class StudyEvent:
    """Progress report: ``kind`` is "data", "expand", "eval" or "run"."""

    kind: str
    label: str = ""
    seed: int | None = None
    step: int | None = None
    loss: float | None = None
    run: int = 0  # 1-based index of the training run (sweep runs included)
    runs: int = 0
    message: str = ""


@dataclass
class StudyData:
    """The token windows a study trains on, scores and (with a validation split) decides on."""

    train: torch.Tensor
    held_out: torch.Tensor
    validation: torch.Tensor | None
    info: dict[str, Any]  # study.json's ``data``
    notes: list[str] = field(default_factory=list)


def _check_disjoint(train_docs: Documents, eval_docs: Documents) -> None:
    shared = set(train_docs.documents) & set(eval_docs.documents)
    if shared:
        raise OtdusError(f"{len(shared)} document(s) occur in both the training and the evaluation text")


def prepare_data(
    tokenizer, train_text: str | os.PathLike[str], eval_text: str | os.PathLike[str] | None, s: StudySettings
) -> StudyData:
    """Split the texts into training, held-out and (when the settings need one) validation
    documents, disjoint by document, and cut each into windows."""
    source = train_docs = load_documents(train_text)
    if eval_text is None:
        train_docs, eval_docs = split_documents(train_docs, s.eval_fraction)
    else:
        eval_docs = load_documents(eval_text)
        _check_disjoint(train_docs, eval_docs)
    val_docs = None
    if s.uses_validation:  # the last documents of the training part, before any held-out ones
        kept, held = split_documents(Documents(source.name, train_docs.documents), s.validation_fraction)
        n, m = len(kept.documents), len(held.documents)
        train_docs = Documents(f"{source.name} (first {n} docs)", kept.documents)
        where = "next" if eval_text is None else "last"
        val_docs = Documents(f"{source.name} ({where} {m} docs, validation)", held.documents)
    train_w = window_documents(tokenizer, train_docs, s.seq_len, s.max_train_windows)[0]
    # spread over the held-out text: windows from many documents, not the first few (the paired
    # interval treats windows as independent draws from the evaluation text)
    wanted = None if s.eval_windows == "all" else s.eval_windows
    eval_w, eval_owner = window_documents(tokenizer, eval_docs, s.seq_len, wanted, spread=True)
    info: dict[str, Any] = {
        "train": train_docs.name,
        "eval": eval_docs.name,
        "train_documents": len(train_docs.documents),
        "eval_documents": len(eval_docs.documents),
        "train_windows": int(train_w.shape[0]),
        "eval_windows": int(eval_w.shape[0]),
        "seq_len": s.seq_len,
        "eval_tokens_scored": int(eval_w.shape[0] * (s.seq_len - 1)),
    }
    val_w = None
    if val_docs is not None:
        val_w = window_documents(tokenizer, val_docs, s.seq_len, s.validation_windows, spread=True)[0]
        info |= {
            "validation": val_docs.name,
            "validation_documents": len(val_docs.documents),
            "validation_windows": int(val_w.shape[0]),
        }
    else:
        info["train_tokens_seen"] = s.steps * s.batch * s.seq_len
    # the held-out document of each evaluation window's first token, in window order: what a
    # by-document (cluster) interval resamples (results stored before this have none)
    info["eval_window_documents"] = eval_owner
    notes = []
    if wanted is not None and info["eval_windows"] < wanted:
        notes.append(
            f"only {info['eval_windows']} evaluation window(s) of the {wanted} asked: the held-out "
            "text is short, and the evaluation-sample error is large"
        )
    return StudyData(train_w, eval_w, val_w, info, notes)


class _Runs:
    """Trains and scores every run of a study: one arm at a time, its learning-rate sweep first."""

    def __init__(self, s: StudySettings, data: StudyData, cache: ExpansionCache, dev, notify, total: int):
        self.s, self.data, self.cache, self.dev, self.notify = s, data, cache, dev, notify
        self.total, self.done = total, 0
        self.base_loss = self.base_validation = math.nan
        self._initial: dict[Path, list[float]] = {}  # held-out losses of each expansion at step 0

    def config(self, lr: float) -> TrainConfig:
        s = self.s
        return TrainConfig(
            steps=s.steps,
            lr=lr,
            batch=s.batch,
            eval_every=s.eval_every,
            weight_decay=s.weight_decay,
            warmup=s.warmup,
            plateau=s.until_plateau,
            eval_attention=s.eval_attention,
        )

    def score(self, model, windows: torch.Tensor) -> list[float]:
        with attention(model, self.s.eval_attention):
            return window_losses(model, windows, TrainConfig.eval_batch)

    def score_base(self, folder: str) -> None:
        model = load_model(folder, self.dev)
        self.base_loss = math.fsum(losses := self.score(model, self.data.held_out)) / len(losses)
        if self.data.validation is not None:
            val = self.score(model, self.data.validation)
            self.base_validation = math.fsum(val) / len(val)

    def arm(self, spec: RunSpec, seeds: list[int]) -> tuple[list[RunResult], list[dict[str, Any]] | None]:
        """Every seed's run of one arm, and its learning-rate sweep (None without one)."""
        if self.s.lr_sweep is None:
            return [
                self._finish(spec, seed, self.s.lr, *self._train(spec, seed, self.s.lr)) for seed in seeds
            ], None
        tried, best = [], None
        for lr in self.s.lr_sweep:  # on the first seed; its run at the chosen rate is kept
            model, curve, manifest, folder = self._train(spec, seeds[0], lr)
            val = curve.eval_loss[-1]
            tried.append(
                {
                    "lr": lr,
                    "validation_loss": val,
                    "steps": curve.eval_steps[-1],
                    "plateaued": curve.plateaued,
                }
            )
            if best is None or val < best[0]:
                best = (val, lr, model, curve, manifest, folder)
            del model
        _, lr, model, curve, manifest, folder = best
        runs = [self._finish(spec, seeds[0], lr, model, curve, manifest, folder)]
        runs += [self._finish(spec, seed, lr, *self._train(spec, seed, lr)) for seed in seeds[1:]]
        return runs, tried

    def _train(self, spec: RunSpec, seed: int, lr: float):
        self.done += 1
        k = self.done
        doing = arm_kind(spec.options).doing
        self.notify(StudyEvent("expand", spec.label, seed, run=k, runs=self.total, message=doing))
        folder, manifest = self.cache.get(spec.options, seed)
        torch.manual_seed(seed)
        model = load_model(str(folder), self.dev)
        if self.data.validation is not None and folder not in self._initial:
            self._initial[folder] = self.score(model, self.data.held_out)
        trainable = list(manifest["new_parameters"]) if self.s.train_new_only else None

        where = "held-out" if self.data.validation is None else "validation"

        def on_eval(step: int, loss: float) -> None:
            self.notify(StudyEvent("eval", spec.label, seed, step, loss, k, self.total, message=where))

        curve_windows = self.data.held_out if self.data.validation is None else self.data.validation
        curve = train(model, self.data.train, curve_windows, self.config(lr), seed, trainable, on_eval)
        step, loss = curve.eval_steps[-1], curve.eval_loss[-1]
        self.notify(StudyEvent("run", spec.label, seed, step, loss, k, self.total, message=where))
        return model, curve, manifest, folder

    def _finish(
        self, spec: RunSpec, seed: int, lr: float, model, curve: TrainCurve, manifest, folder
    ) -> RunResult:
        preserving = bool(manifest.get("function_preserving"))
        validated = self.data.validation is not None
        if validated:
            initial_windows = self._initial[folder]
            final_windows = self.score(model, self.data.held_out)
            checks = [(curve.eval_loss[0], self.base_validation, "validation")]
        else:
            initial_windows, final_windows, checks = [], curve.final_window_loss, []
        initial = math.fsum(initial_windows) / len(initial_windows) if validated else curve.eval_loss[0]
        final = math.fsum(final_windows) / len(final_windows) if validated else curve.eval_loss[-1]
        for got, want, what in [(initial, self.base_loss, "held-out"), *checks]:
            if preserving and not math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-7):
                raise OtdusError(
                    f"{spec.label}: a function-preserving expansion starts at {what} loss {got:.8f}, "
                    f"not the base's {want:.8f}"
                )
        return RunResult(
            label=spec.label,
            seed=seed,
            eval_steps=[0, curve.eval_steps[-1]] if validated else curve.eval_steps,
            eval_loss=[initial, final] if validated else curve.eval_loss,
            train_loss=curve.train_loss,
            initial_loss=initial,
            final_loss=final,
            function_preserving=preserving,
            initial_equals_base=initial == self.base_loss,
            trainable_parameters=curve.trainable_parameters,
            num_hidden_layers=int(manifest["num_hidden_layers"]),
            seconds=curve.seconds,
            final_window_loss=final_windows,
            lr=lr if validated else None,
            validation_steps=curve.eval_steps if validated else [],
            validation_loss=curve.eval_loss if validated else [],
            plateaued=curve.plateaued,
        )


def _config(
    s: StudySettings, labels: list[str], eval_text, dev, threads: int, expand_options, shrink_options=None
) -> dict[str, Any]:
    """study.json's ``config``: what the numbers depend on (the keys of results stored before the
    validation settings existed are kept as they were, so that later arms can join them)."""
    config: dict[str, Any] = {
        "methods": labels,
        "seeds": s.seeds,
        "steps": s.steps,
        "lr": s.lr,
        "batch": s.batch,
        "seq_len": s.seq_len,
        "eval_every": s.eval_every,
        "eval_windows": s.eval_windows,
        "eval_fraction": s.eval_fraction if eval_text is None else None,
        "train_new_only": s.train_new_only,
        "weight_decay": s.weight_decay,
        "warmup": s.warmup,
        "optimizer": OPTIMIZER_PLATEAU if s.until_plateau else OPTIMIZER,
        "device": str(dev),
        "threads": threads,
        "expand_options": expand_options or {},
        "torch": torch.__version__,
    }
    if s.uses_validation:
        config |= {
            "until_plateau": s.until_plateau.model_dump() if s.until_plateau else None,
            "lr_sweep": s.lr_sweep,
            "validation_fraction": s.validation_fraction,
            "validation_windows": s.validation_windows,
        }
    if s.eval_attention != "eager":
        config["eval_attention"] = s.eval_attention
    if shrink_options:
        config["shrink_options"] = shrink_options
    return config


def study(
    base: str,
    train_text: str | os.PathLike[str],
    eval_text: str | os.PathLike[str] | None = None,
    *,
    methods: Sequence[str | RunSpec] = DEFAULT_METHODS,
    settings: StudySettings | None = None,
    reference: str | None = "ot",
    expand_options: dict[str, Any] | None = None,
    shrink_options: dict[str, Any] | None = None,
    out_dir: str | os.PathLike[str] | None = None,
    work_dir: str | os.PathLike[str] | None = None,
    progress: Callable[[StudyEvent], None] | None = None,
    force: bool = False,
    protected: Sequence[str | os.PathLike[str]] = (),
    on_note: Callable[[str], None] | None = None,
    expansions: ExpansionCache | None = None,
    **overrides: Any,
) -> StudyResult:
    """Expand ``base`` with each method, train the new layers, compare held-out loss over seeds.

    ``train_text`` / ``eval_text``: text specs (a file, ``bundled:tinystories-sample``,
    ``bundled:wikitext-test``; see study.data). Without ``eval_text`` the last ``eval_fraction`` of
    the training documents is held out (documents are never shared).
    ``settings``: a :class:`~otdus_cli.study_settings.StudySettings` (its defaults otherwise);
    ``overrides``: any of its fields as keyword arguments (``steps=10``, ``seeds=[0]``, ...).
    ``expand_options``: ExpandOptions fields applied to every method (e.g. layers, position);
    ``shrink_options``: ShrinkOptions fields applied to every ``shrink:`` arm (e.g. layers, calib).
    ``reference``: label of the method the others are paired with (None: no pairing; the default
    "ot" absent from the methods: no pairing, said in ``notes``; any other absent label: an error).
    ``out_dir``: the folder of study.json and loss_curves.png (None: nothing written), an otdus study
    output (output_files.py) claimed before any work: never a link, the base, or a folder otdus did
    not write; ``force`` replaces only an unchanged earlier study output there; ``protected``:
    folders besides the base's that it may not touch; ``on_note`` hears of stale temporary folders
    beside it (removed or kept) as they are found; ``expansions``: a cache the caller owns (its
    folder and what it holds outlive the study, e.g. to measure the arms' checkpoints after it),
    instead of one in a temporary folder removed at the end.
    """
    s = study_settings(settings, **overrides)
    notify = progress or (lambda event: None)
    specs = [
        replace(r, options=arm_kind(r.options).in_study(r.options, str(train_text)))
        for r in resolve_runs(methods, expand_options, shrink_options)
    ]
    labels = [r.label for r in specs]
    whole = [r.label for r in specs if not arm_kind(r.options).adds_layers]
    if whole and s.train_new_only:
        raise OtdusError(
            f"{', '.join(whole)} add no layers to train alone: heal the whole model "
            "(train_new_only: false, or --train-all)"
        )
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
    from otdus_cli.source import resolve_source

    dev = resolve_device(s.device)
    base_dir = str(resolve_source(base).folder)
    with contextlib.ExitStack() as claimed:
        # the output is claimed before any work: a refused --out costs nothing; its temporary folder
        # also holds the expansions trained (removed before the results are written), so a SIGKILLed
        # study's are swept with it by the next run to that --out
        staged = (
            None
            if out_dir is None
            else claim_files(
                claimed,
                out_dir,
                STUDY,
                protected=[Path(base_dir), *map(Path, protected)],
                force=force,
                report=OutputReport(notify=on_note),
            )
        )
        result = _run(base, base_dir, train_text, eval_text, specs, s, dev, reference=ref, notes=notes,
                      notify=notify, expand_options=expand_options, shrink_options=shrink_options,
                      work_dir=staged if work_dir is None else work_dir,
                      expansions=expansions)  # fmt: skip
        if staged is not None:
            result.write_files(staged)
    return result


def _run(
    base: str,
    base_dir: str,
    train_text: str | os.PathLike[str],
    eval_text: str | os.PathLike[str] | None,
    specs: list[RunSpec],
    s: StudySettings,
    dev: Any,
    *,
    reference: str | None,
    notes: list[str],
    notify: Callable[[StudyEvent], None],
    expand_options: dict[str, Any] | None,
    shrink_options: dict[str, Any] | None,
    work_dir: str | os.PathLike[str] | None,
    expansions: ExpansionCache | None = None,
) -> StudyResult:
    """The study itself: the data, every arm's runs, the summaries."""
    from otdus_cli.verify.metrics import load_tokenizer

    t0 = time.perf_counter()
    labels = [r.label for r in specs]
    ref = reference
    threads_before = torch.get_num_threads()
    if s.threads:
        torch.set_num_threads(s.threads)
    data = prepare_data(load_tokenizer(base_dir), train_text, eval_text, s)
    notes += data.notes
    notify(
        StudyEvent(
            "data", message=f"{data.info['train_windows']} train / {data.info['eval_windows']} eval windows"
        )
    )
    per_arm = len(s.seeds) + (len(s.lr_sweep) - 1 if s.lr_sweep else 0)
    tmp = Path(tempfile.mkdtemp(prefix="otdus-study-", dir=work_dir))
    results: list[RunResult] = []
    sweeps: dict[str, list[dict[str, Any]]] = {}
    try:
        cache = ExpansionCache(base, tmp) if expansions is None else expansions
        runs = _Runs(s, data, cache, dev, notify, len(specs) * per_arm)
        runs.score_base(base_dir)
        for spec in specs:
            arm_runs, sweep = runs.arm(spec, s.seeds)
            results += arm_runs
            if sweep is not None:
                sweeps[spec.label] = sweep
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        torch.set_num_threads(threads_before)

    summaries = summarise(specs, s.seeds, results, ref, data.info["eval_window_documents"], sweeps or None)
    return StudyResult(
        base=base,
        reference=ref or "",
        config=_config(
            s, labels, eval_text, dev, s.threads or threads_before, expand_options, shrink_options
        ),
        data=data.info,
        base_loss=runs.base_loss,
        methods=summaries,
        runs=results,
        seconds=time.perf_counter() - t0,
        notes=notes,
    )
