"""Deprecated path: `TokenSampler` and the sampling helpers moved to `hf_dspark.sampling`, below the drafts that
use them."""

from .._lazy import moved_module

__getattr__, __dir__ = moved_module(__name__, "hf_dspark.sampling")
