"""DFlash draft: the DSpark block backbone without Markov or confidence head (fully parallel drafting)."""

from __future__ import annotations

from ..dspark.modeling_dspark import DSparkModel
from .configuration_dflash import DFlashConfig


class DFlashModel(DSparkModel):
    """Same training forward and inference protocol as [`DSparkModel`]; every slot is drawn independently."""

    config_class = DFlashConfig


__all__ = ["DFlashModel"]
