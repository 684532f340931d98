from .configuration_dflash import DFlashConfig
from .modeling_dflash import DFlashModel

__all__ = ["DFlashConfig", "DFlashModel"]
