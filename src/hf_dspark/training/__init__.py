"""Training: the drafters' objectives, `DraftTrainingArguments`, `DraftTrainer` and the `train_draft` recipe."""

from .._lazy import lazy_attributes

# name -> defining module, imported on first use (keeps `import hf_dspark.<stage>.cli` light for --help).
_EXPORTS = {
    **dict.fromkeys(["DraftTrainingArguments"], ".arguments"),
    **dict.fromkeys(["DraftDataCollator"], ".collator"),
    **dict.fromkeys(["DraftLossOutput", "block_draft_loss", "draft_loss", "eagle3_loss", "fused_head_loss"], ".losses"),
    **dict.fromkeys(["DraftScriptArguments", "train_draft", "training_argument_parser"], ".script"),
    **dict.fromkeys(["DraftTrainer", "build_draft"], ".trainer"),
    **dict.fromkeys(["zero3_init_disabled"], ".zero3"),
}  # fmt: skip
__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS, globals())

__all__ = [
    "DraftTrainingArguments",
    "DraftTrainer",
    "DraftDataCollator",
    "DraftScriptArguments",
    "DraftLossOutput",
    "build_draft",
    "block_draft_loss",
    "draft_loss",
    "eagle3_loss",
    "fused_head_loss",
    "train_draft",
    "training_argument_parser",
    "zero3_init_disabled",
]
