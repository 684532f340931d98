"""hf_dspark: speculative-decoding draft models (DSpark, DFlash, Eagle3) as first-class Hugging Face models."""

from .generation.sampling import TokenSampler
from .models import (
    DRAFTERS,
    BlockDraftOutput,
    DFlashConfig,
    DFlashModel,
    DraftConfig,
    DraftPreTrainedModel,
    DraftProposal,
    DSparkConfig,
    DSparkModel,
    Eagle3Config,
    Eagle3Model,
    Eagle3Output,
    TargetFeatureHooks,
    TargetSpec,
    default_target_layer_ids,
    drafter_classes,
    target_features,
)

__version__ = "0.1.0"

__all__ = [
    "DRAFTERS",
    "drafter_classes",
    "DraftConfig",
    "DraftPreTrainedModel",
    "DraftProposal",
    "DSparkConfig",
    "DSparkModel",
    "BlockDraftOutput",
    "DFlashConfig",
    "DFlashModel",
    "Eagle3Config",
    "Eagle3Model",
    "Eagle3Output",
    "TargetSpec",
    "TargetFeatureHooks",
    "TokenSampler",
    "default_target_layer_ids",
    "target_features",
]
