"""Evaluation of drafts: the one definition of the metrics (`metrics`), per-slot calibration (`calibration`),
the decoding runs (`runner.evaluate_drafts`), reports and plots (`report`, `plots`), `evaluate` metric modules
(`evaluate_metrics`) and the `hf-dspark eval` command (`cli`)."""

from .calibration import calibration_summary
from .evaluate_metrics import load_metric
from .metrics import AcceptanceStats
from .report import save_results
from .runner import EvaluationResults, evaluate_drafts, generation_stats, load_drafts, load_target

__all__ = [
    "AcceptanceStats",
    "EvaluationResults",
    "calibration_summary",
    "evaluate_drafts",
    "generation_stats",
    "load_drafts",
    "load_metric",
    "load_target",
    "save_results",
]
