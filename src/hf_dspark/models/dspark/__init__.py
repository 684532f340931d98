from .configuration_dspark import DSparkConfig
from .modeling_dspark import BlockDraftOutput, DSparkModel

__all__ = ["DSparkConfig", "DSparkModel", "BlockDraftOutput"]
