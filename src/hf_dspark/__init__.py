"""hf_dspark: speculative-decoding draft models (DSpark, DFlash, Eagle3) as first-class Hugging Face models.

`import hf_dspark` registers the drafts with AutoConfig/AutoModel and does nothing else. The first draft built or
loaded routes `target.generate(..., assistant_model=draft)` to hf_dspark's lossless speculative loop
(generation/integration.py). Every other name (generation, data, training, evaluation, hub) is imported on first
use.
"""

from __future__ import annotations

import os
import sys

from ._lazy import lazy_attributes

_MODELS = [
    "DRAFTERS", "BlockDraftOutput", "DFlashConfig", "DFlashModel", "DraftConfig", "DraftPreTrainedModel",
    "DraftProposal", "DSparkConfig", "DSparkModel", "Eagle3Config", "Eagle3Model", "Eagle3Output", "TargetFeatureHooks",
    "TargetSpec", "default_target_layer_ids", "drafter_classes", "target_features", "DrafterSpec", "drafter_spec",
]  # fmt: skip

__version__ = "0.1.0"

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
    **dict.fromkeys(_MODELS, "hf_dspark.models"),
    **dict.fromkeys(["load_default_target", "load_target", "default_target_path"], "hf_dspark.resources"),
    **dict.fromkeys(
        ["CalibrationReport", "SpeculativeConfig", "SpeculativeStats", "SPSTable", "TokenSampler",
         "calibrate_confidence", "load_or_profile_sps", "profile_sps"],
        "hf_dspark.generation",
    ),
}  # fmt: skip


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())

def _hub_function(name: str):
    """`hf_dspark.hub.<name>`, imported on first call (the hub stage stays unloaded until a draft uses it)."""

    def call(*args, **kwargs):
        from . import hub

        return getattr(hub, name)(*args, **kwargs)

    return call


def load_models() -> None:
    """Register the drafts with the Auto classes (imports torch and transformers) and hand the models layer its hub
    services: Draft.from_pretrained of foreign layouts (deprecated) and draft.push_to_hub live in the hub stage,
    which sits above the models and is bound here rather than imported upward."""
    from . import models  # noqa: F401
    from .models.modeling_draft import bind_services

    bind_services(
        foreign_format=_hub_function("foreign_format"),
        load_foreign_draft=_hub_function("load_foreign_draft"),
        push_draft=_hub_function("push_draft"),
        install_generation=_install_generation,
    )


def _install_generation() -> None:
    """Route generate(assistant_model=<draft>) to hf_dspark's loop; called when the first draft is built."""
    from .generation.integration import install

    install()


# The `hf-dspark` command skips this at import so that --help and argument errors are instant; it calls
# load_models() after parsing (cli.main).
if os.path.basename(sys.argv[0] if sys.argv else "") != "hf-dspark":
    load_models()


__all__ = [*_LAZY]
