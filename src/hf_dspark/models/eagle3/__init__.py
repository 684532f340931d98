from .configuration_eagle3 import Eagle3Config
from .modeling_eagle3 import Eagle3Model, Eagle3Output

__all__ = ["Eagle3Config", "Eagle3Model", "Eagle3Output"]
