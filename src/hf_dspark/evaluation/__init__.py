"""Evaluation of drafts: per-slot calibration (`calibration`),
the decoding runs (`runner.evaluate_drafts`), reports and plots (`report`, `plots`), `evaluate` metric modules
(`evaluate_metrics`) and the `hf-dspark eval` command (`cli`)."""

from .._lazy import lazy_attributes

_EXPORTS = {
    "AcceptanceStats": "hf_dspark.metrics",
    "calibration_summary": ".calibration",
    "load_metric": ".evaluate_metrics",
    "save_results": ".report",
    "StaticTargetBaseline": ".static_baseline",
    **dict.fromkeys(["EvaluationResults", "evaluate_drafts", "generation_stats", "load_drafts", "load_target"],
                    ".runner"),
}  # fmt: skip
__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS, globals())
__all__ = list(_EXPORTS)
