"""Batching for draft training: right padding of token rows and (when cached) their target features."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

FEATURE_KEYS = ("context_features", "target_last_hidden")
# A Python int in the batch, not a tensor (so it stays on the host): at most how many loss rows the batch has.
LOSS_ROWS_BOUND = "loss_rows_bound"


def _as_tensor(value: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    return value if torch.is_tensor(value) else torch.as_tensor(value, dtype=dtype)


@dataclass
class DraftDataCollator:
    """Right-pads `input_ids` / `loss_mask` (and `context_features` / `target_last_hidden` when the rows carry
    them) to the longest row, rounded up to `pad_to_multiple_of`, and adds `attention_mask`.

    Rows of a tokenized dataset (online mode) hold `input_ids` and `loss_mask`; rows of a target cache also hold
    the features, which keep their storage dtype (bf16/fp16) until the draft casts them. Padding has
    `loss_mask = attention_mask = 0`, so it is never an anchor nor a label.

    `loss_rows_bound` (the draft's `loss_rows_bound_fn()`, which `DraftTrainer` sets where it is None) adds
    `LOSS_ROWS_BOUND`: its value on the batch's loss mask, counted here on the host so that the training step
    need not read it back. False: never (the loss then counts its rows on the device, one wait a step).
    """

    pad_token_id: int = 0
    pad_to_multiple_of: int | None = 8
    loss_rows_bound: Callable[[torch.Tensor], int] | bool | None = None

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        if not rows:
            raise ValueError("cannot collate an empty batch")
        for key in ("input_ids", "loss_mask"):
            if key not in rows[0]:
                raise ValueError(
                    f"training rows need `input_ids` and `loss_mask`, got {sorted(rows[0])}: tokenize conversations "
                    "with `tokenize_conversations` (or load a target cache with `load_target_cache`)"
                )
        ids = [_as_tensor(r["input_ids"], torch.long).long() for r in rows]
        lengths = [len(x) for x in ids]
        if min(lengths) < 2:
            raise ValueError(f"a training row has {min(lengths)} token(s); rows need at least 2 (anchor and label)")
        width = max(lengths)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = len(rows)
        batch_out = {
            "input_ids": torch.full((batch, width), self.pad_token_id, dtype=torch.long),
            "loss_mask": torch.zeros(batch, width, dtype=torch.long),
            "attention_mask": torch.zeros(batch, width, dtype=torch.long),
        }
        present = [key for key in FEATURE_KEYS if key in rows[0]]
        for key in present:
            first = _as_tensor(rows[0][key])
            batch_out[key] = torch.zeros(batch, width, first.shape[-1], dtype=first.dtype)
        for i, (row, n) in enumerate(zip(rows, lengths)):
            mask = _as_tensor(row["loss_mask"], torch.long).long()
            if len(mask) != n:
                raise ValueError(f"row {i}: loss_mask has {len(mask)} entries but input_ids has {n}")
            batch_out["input_ids"][i, :n] = ids[i]
            batch_out["loss_mask"][i, :n] = mask
            batch_out["attention_mask"][i, :n] = 1
            for key in present:
                if key not in row:
                    raise ValueError(f"row {i} lacks `{key}` while other rows of the batch have it")
                value = _as_tensor(row[key])
                if value.shape[0] != n:
                    raise ValueError(f"row {i}: `{key}` covers {value.shape[0]} positions but the row has {n} tokens")
                batch_out[key][i, :n] = value
        if callable(self.loss_rows_bound):
            batch_out[LOSS_ROWS_BOUND] = int(self.loss_rows_bound(batch_out["loss_mask"] * batch_out["attention_mask"]))
        return batch_out


__all__ = ["DraftDataCollator", "FEATURE_KEYS", "LOSS_ROWS_BOUND"]
