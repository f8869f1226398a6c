"""Evidence tools: `study` (expand with several methods, train the new layers, compare held-out
loss over seeds) and `diagnose` (does OT pair neurons that really co-activate?)."""

from otdus_cli.study.diagnose import DiagnoseResult, PairDiagnosis, diagnose, diagnose_tables, norm_bars
from otdus_cli.study.report import plot_curves, study_markdown, study_table
from otdus_cli.study.runner import (
    DEFAULT_METHODS,
    TABLE6_METHODS,
    MethodSummary,
    RunResult,
    RunSpec,
    StudyEvent,
    StudyResult,
    load_study_recipe,
    parse_method,
    run_recipe,
    study,
)

__all__ = [
    "DEFAULT_METHODS",
    "TABLE6_METHODS",
    "DiagnoseResult",
    "MethodSummary",
    "PairDiagnosis",
    "RunResult",
    "RunSpec",
    "StudyEvent",
    "StudyResult",
    "diagnose",
    "diagnose_tables",
    "load_study_recipe",
    "norm_bars",
    "parse_method",
    "plot_curves",
    "run_recipe",
    "study",
    "study_markdown",
    "study_table",
]
