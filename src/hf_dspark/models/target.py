"""Deprecated path: target introspection moved to `hf_dspark.target`, below the drafts and the data stage."""

from .._lazy import moved_module

__getattr__, __dir__ = moved_module(__name__, "hf_dspark.target")
