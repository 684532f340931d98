"""Prompts for generation: chat rendering, left-padded batches, EOS ids, counting generated tokens.

Shared by everything that generates with the target (regeneration, STS calibration, evaluation, benchmarks).
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

logger = logging.getLogger(__name__)


def first_turns(path, limit: int | None = None) -> list[str]:
    """The first turn of the first `limit` rows (all when None) of a `{"turns": [...]}` JSONL(.gz) prompt file."""
    from .regenerate import read_prompts

    if limit is not None and limit < 1:
        raise ValueError(f"num_prompts must be >= 1 (or None for every prompt), got {limit}")
    prompts = read_prompts(path)
    if limit is not None and len(prompts) < limit:
        logger.warning("%s has only %d prompts (asked for %d): using all of them", path, len(prompts), limit)
    return [p.turns[0] for p in prompts[:limit]]


def encode_chat_prompts(tokenizer, prompts, use_chat_template: bool = True) -> list[list[int]]:
    """Token ids per prompt. Strings become a one-turn user chat with the generation prompt appended (or plain
    text with `use_chat_template=False`); lists of ids are passed through."""
    if use_chat_template and getattr(tokenizer, "chat_template", None) is None and any(
        isinstance(p, str) for p in prompts
    ):
        raise ValueError(
            "the tokenizer has no chat template: set `tokenizer.chat_template` to the target's template (or save "
            "the target folder with its tokenizer), or pass use_chat_template=False for plain-text prompts"
        )
    encoded = []
    for prompt in prompts:
        if not isinstance(prompt, str):
            encoded.append([int(i) for i in prompt])
            continue
        if use_chat_template:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            if isinstance(ids, dict) or hasattr(ids, "keys"):  # some tokenizer versions return a BatchEncoding
                ids = ids["input_ids"]
        else:
            ids = tokenizer(prompt)["input_ids"]
        encoded.append([int(i) for i in ids])
    return encoded


def left_pad(sequences: Sequence[Sequence[int]], pad_token_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded (input_ids, attention_mask) [B, max_len] for a batch of token-id lists."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        if len(seq):
            ids[i, width - len(seq) :] = torch.tensor(list(seq))
            mask[i, width - len(seq) :] = 1
    return ids.to(device), mask.to(device)


def eos_token_ids(target, tokenizer) -> list[int]:
    """The ids that end an answer: the target's generation_config EOS ids plus the tokenizer's."""
    ids: list[int] = []
    for value in (getattr(target.generation_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and int(v) not in ids:
                ids.append(int(v))
    if not ids:
        raise ValueError("neither the target's generation_config nor the tokenizer defines an eos token id")
    return ids


def new_token_lengths(new: torch.Tensor, eos_ids: Sequence[int]) -> torch.Tensor:
    """Output length of each row of generated tokens [B, n]: up to and including its first EOS (the padding after
    it is not output), else n."""
    if new.shape[1] == 0:
        return torch.zeros(new.shape[0], dtype=torch.long, device=new.device)
    is_eos = torch.isin(new, torch.tensor(list(eos_ids), device=new.device))
    return torch.where(is_eos.any(1), is_eos.long().argmax(1) + 1, new.shape[1])


def count_new_tokens(sequences: torch.Tensor, prompt_length: int, eos_ids: Sequence[int]) -> int:
    """Generated tokens per row up to and including the first EOS (padding after EOS is not counted), summed."""
    return int(new_token_lengths(sequences[:, prompt_length:], eos_ids).sum())


__all__ = ["first_turns", "encode_chat_prompts", "left_pad", "eos_token_ids", "new_token_lengths", "count_new_tokens"]
