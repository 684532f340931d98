"""Draft models: one folder per drafter, the shared backbone written once (backbone.py, heads.py), one registry
entry per drafter (registry.py)."""

from transformers import AutoConfig, AutoModel

from ..target import TargetFeatureHooks, TargetSpec, default_target_layer_ids, target_features
from .configuration_draft import DraftConfig
from .dflash import DFlashConfig, DFlashModel
from .dspark import BlockDraftOutput, DSparkConfig, DSparkModel
from .eagle3 import Eagle3Config, Eagle3Model, Eagle3Output
from .modeling_draft import DraftPreTrainedModel, DraftProposal
from .registry import DRAFTERS, DrafterSpec, drafter_classes, drafter_spec


def register_auto_classes() -> None:
    for spec in DRAFTERS.values():
        AutoConfig.register(spec.model_type, spec.config_class, exist_ok=True)
        AutoModel.register(spec.config_class, spec.model_class, exist_ok=True)


register_auto_classes()

__all__ = [
    "DRAFTERS",
    "DrafterSpec",
    "drafter_classes",
    "drafter_spec",
    "register_auto_classes",
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
    "default_target_layer_ids",
    "target_features",
]
