"""Training: the drafters' objectives, `DraftTrainingArguments`, `DraftTrainer` and the `train_draft` recipe."""

from .arguments import DraftTrainingArguments
from .collator import DraftDataCollator
from .losses import DraftLossOutput, block_draft_loss, draft_loss, eagle3_loss, fused_head_loss
from .script import DraftScriptArguments, train_draft
from .trainer import DraftTrainer, build_draft

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
]
