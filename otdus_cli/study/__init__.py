"""Evidence tools: `study` (expand with several methods, train the new layers, compare held-out
loss over seeds) and `diagnose` (does OT pair neurons that really co-activate?).

The study is split by responsibility: otdus_cli.study_settings (one validated model of every
setting, the single source of their defaults; outside this package so that the CLI reads it
without importing torch), arms (method specs and expansions), train (one run's training loop and
stop rule), runner (data, the runs of each arm, learning-rate sweeps), results (summaries and
paired comparisons), recipe (YAML recipes), report and evidence (tables and docs)."""

from otdus_cli.study.arms import DEFAULT_METHODS, RunSpec, parse_method
from otdus_cli.study.diagnose import DiagnoseResult, PairDiagnosis, diagnose, diagnose_tables, norm_bars
from otdus_cli.study.recipe import PrimaryFamily, StudyRecipe, load_study_recipe, run_recipe
from otdus_cli.study.report import plot_curves, study_markdown, study_table
from otdus_cli.study.results import MethodSummary, RunResult, StudyResult, paired_difference
from otdus_cli.study.runner import StudyEvent, study
from otdus_cli.study_settings import PlateauRule, StudySettings

__all__ = [
    "DEFAULT_METHODS",
    "DiagnoseResult",
    "MethodSummary",
    "PairDiagnosis",
    "PlateauRule",
    "PrimaryFamily",
    "RunResult",
    "RunSpec",
    "StudyEvent",
    "StudyRecipe",
    "StudyResult",
    "StudySettings",
    "diagnose",
    "diagnose_tables",
    "load_study_recipe",
    "norm_bars",
    "paired_difference",
    "parse_method",
    "plot_curves",
    "run_recipe",
    "study",
    "study_markdown",
    "study_table",
]
