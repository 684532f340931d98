"""hf_dspark: speculative-decoding draft models (DSpark, DFlash, Eagle3) as first-class Hugging Face models.

`import hf_dspark` registers the drafts with AutoConfig/AutoModel and routes
`target.generate(..., assistant_model=draft)` to hf_dspark's lossless speculative loop. The data, training,
evaluation and hub stages are imported on first use of one of their names.
"""

from __future__ import annotations

from ._lazy import lazy_attributes
from .generation import (
    CalibrationReport,
    SpeculativeConfig,
    SpeculativeStats,
    SPSTable,
    TokenSampler,
    calibrate_confidence,
    load_or_profile_sps,
    profile_sps,
)
from .models import (
    DRAFTERS,
    DrafterSpec,
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
    drafter_spec,
    target_features,
)
from .models.modeling_draft import bind_hub_services

__version__ = "0.1.0"


def _hub_function(name: str):
    """`hf_dspark.hub.<name>`, imported on first call (the hub stage stays unloaded until a draft uses it)."""

    def call(*args, **kwargs):
        from . import hub

        return getattr(hub, name)(*args, **kwargs)

    return call


# Draft.from_pretrained (foreign layouts, deprecated) and draft.push_to_hub are hub services; the models layer
# sits below hub and receives them here rather than importing upward.
bind_hub_services(
    foreign_format=_hub_function("foreign_format"),
    load_foreign_draft=_hub_function("load_foreign_draft"),
    push_draft=_hub_function("push_draft"),
)

# name -> stage module, imported lazily (keeps `import hf_dspark` light: no Trainer, datasets or matplotlib).
_LAZY = {
    **dict.fromkeys(
        ["load_conversations", "tokenize_conversations", "regenerate_responses", "build_target_cache",
         "load_target_cache", "TargetCacheDataset", "TargetCacheError"],
        "hf_dspark.data",
    ),
    **dict.fromkeys(
        ["DraftTrainer", "DraftTrainingArguments", "DraftDataCollator", "DraftScriptArguments", "train_draft",
         "build_draft", "draft_loss"],
        "hf_dspark.training",
    ),
    **dict.fromkeys(
        ["evaluate_drafts", "EvaluationResults", "AcceptanceStats", "load_metric"], "hf_dspark.evaluation"
    ),
    **dict.fromkeys(
        ["push_draft", "export_draft", "load_draft", "generate_model_card", "apply_lora", "merge_lora"],
        "hf_dspark.hub",
    ),
    **dict.fromkeys(["load_default_target", "default_target_path"], "hf_dspark.resources"),
}  # fmt: skip


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())


__all__ = [
    "DRAFTERS",
    "DrafterSpec",
    "drafter_classes",
    "drafter_spec",
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
    "TokenSampler",
    "SpeculativeConfig",
    "SpeculativeStats",
    "SPSTable",
    "profile_sps",
    "load_or_profile_sps",
    "calibrate_confidence",
    "CalibrationReport",
    *_LAZY,
]
