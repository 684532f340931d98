"""Draft models: one folder per drafter, the shared backbone written once (backbone.py, heads.py)."""

from transformers import AutoConfig, AutoModel

from ..target import TargetFeatureHooks, TargetSpec, default_target_layer_ids, target_features
from .configuration_draft import DraftConfig
from .dflash import DFlashConfig, DFlashModel
from .dspark import BlockDraftOutput, DSparkConfig, DSparkModel
from .eagle3 import Eagle3Config, Eagle3Model, Eagle3Output
from .modeling_draft import DraftPreTrainedModel, DraftProposal

# The drafter registry: model_type -> (config class, model class). Adding a drafter = adding a folder + a row.
DRAFTERS = {
    "dspark": (DSparkConfig, DSparkModel),
    "dflash": (DFlashConfig, DFlashModel),
    "eagle3": (Eagle3Config, Eagle3Model),
}


def register_auto_classes() -> None:
    for model_type, (config_cls, model_cls) in DRAFTERS.items():
        AutoConfig.register(model_type, config_cls, exist_ok=True)
        AutoModel.register(config_cls, model_cls, exist_ok=True)


def drafter_classes(name: str):
    """(config class, model class) for a drafter name; the error lists the valid names."""
    try:
        return DRAFTERS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown drafter {name!r}: choose one of {', '.join(DRAFTERS)}") from None


register_auto_classes()

__all__ = [
    "DRAFTERS",
    "drafter_classes",
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
