"""Local `evaluate` metric modules wrapping `hf_dspark.metrics` (loaded by path: no Hub access)."""

from __future__ import annotations

from pathlib import Path

METRICS = ("acceptance", "calibration")


def metric_path(name: str) -> Path:
    """File of a local metric module, for `evaluate.load(str(path))`."""
    if name not in METRICS:
        raise ValueError(f"unknown metric {name!r}: hf_dspark ships {', '.join(METRICS)}")
    return Path(__file__).with_name(f"{name}.py")


def load_metric(name: str, **kwargs):
    """`evaluate.load` of one of hf_dspark's metric modules ("acceptance", "calibration")."""
    import evaluate

    return evaluate.load(str(metric_path(name)), **kwargs)


__all__ = ["METRICS", "metric_path", "load_metric"]
