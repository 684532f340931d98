"""Where hf_dspark keeps files between runs. Imports nothing heavy: the CLI reads it before torch is loaded."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$HF_DSPARK_CACHE`, default `~/.cache/hf_dspark`: the converted default target, SPS tables, rendered help."""
    return Path(os.environ.get("HF_DSPARK_CACHE", Path.home() / ".cache" / "hf_dspark"))


__all__ = ["cache_root"]
