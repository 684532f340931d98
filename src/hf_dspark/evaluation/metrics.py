"""Deprecated path: the metrics moved to `hf_dspark.metrics`, below every stage that computes them."""

from .._lazy import moved_module

__getattr__, __dir__ = moved_module(__name__, "hf_dspark.metrics")
