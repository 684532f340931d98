"""Prompts for generation: prompt files, chat rendering, left-padded batches, EOS ids, counting generated tokens.

Shared by everything that generates with the target (regeneration, STS calibration, evaluation, benchmarks).
"""

from __future__ import annotations

import gzip
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

logger = logging.getLogger(__name__)


@dataclass
class Prompt:
    id: str
    turns: list[str]
    extra: dict[str, Any] = field(default_factory=dict)  # carried into the output row (source, domain, ...)


def read_prompts(prompts: str | Path | Iterable[dict]) -> list[Prompt]:
    """Prompts from a JSONL(.gz) file or an iterable of dicts with a `turns` list (and optionally an `id`)."""
    where = str(prompts) if isinstance(prompts, (str, Path)) else "the prompt list"
    if isinstance(prompts, (str, Path)):
        path = Path(prompts)
        if not path.is_file():
            raise FileNotFoundError(f"prompt file {path} does not exist")
        opener = gzip.open if path.name.endswith(".gz") else open
        rows = []
        with opener(path, "rt", encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append((line_no, json.loads(line)))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}, line {line_no}: not valid JSON ({err})") from None
    else:
        rows = list(enumerate(prompts, 1))
    if not rows:
        raise ValueError(f"{where} contains no prompts: expected one {{'turns': [str, ...]}} object per line")
    out, seen = [], set()
    for index, (line_no, row) in enumerate(rows):
        turns = row.get("turns") if isinstance(row, dict) else None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise ValueError(
                f"{where}, row {line_no}: expected {{'turns': [non-empty str, ...]}}, got "
                f"{str(row)[:120]!r}"
            )
        pid = str(row.get("id", index))
        if pid in seen:
            raise ValueError(f"{where}, row {line_no}: duplicate id {pid!r}; ids must be unique to resume safely")
        seen.add(pid)
        extra = {k: v for k, v in row.items() if k not in ("id", "turns", "messages")}
        out.append(Prompt(pid, list(turns), extra))
    return out


def select_prompts(
    prompts: list[Prompt], rows: slice | None = None, max_prompt_chars: int | None = None
) -> list[Prompt]:
    """The prompts of the file rows `rows` (a slice of the file's prompt rows, counted before any filter), then
    only those whose turns are each at most `max_prompt_chars` characters long. Ids stay the file's, so a run on a
    selection resumes like one on the whole file."""
    if max_prompt_chars is not None and max_prompt_chars < 1:
        raise ValueError(f"max_prompt_chars must be >= 1, got {max_prompt_chars}")
    if rows is not None and rows.step not in (None, 1):
        raise ValueError(f"rows must be a contiguous range START:END, got a step of {rows.step}")
    chosen = prompts[rows] if rows is not None else prompts
    if max_prompt_chars is not None:
        chosen = [p for p in chosen if all(len(t) <= max_prompt_chars for t in p.turns)]
    if not chosen:
        raise ValueError(f"no prompt left after the selection (rows {_slice_text(rows)}, max_prompt_chars "
                         f"{max_prompt_chars}) of {len(prompts)} prompts: widen it")  # fmt: skip
    return chosen


def parse_rows(text: str) -> slice:
    """"START:END" (either end may be left out, as in Python) -> slice; the CLI's `--rows`."""
    start, sep, end = text.partition(":")
    try:
        if not sep:
            raise ValueError
        bounds = [int(x) if x.strip() else None for x in (start, end)]
    except ValueError:
        raise ValueError(f"rows must look like START:END (e.g. 19456:27861 or 1000:), got {text!r}") from None
    if any(b is not None and b < 0 for b in bounds):
        raise ValueError(f"rows counts from the file's first row (0): no negative bounds, got {text!r}")
    return slice(*bounds)


def _slice_text(rows: slice | None) -> str:
    if rows is None:
        return "all"
    return f"{'' if rows.start is None else rows.start}:{'' if rows.stop is None else rows.stop}"


def first_turns(path, limit: int | None = None) -> list[str]:
    """The first turn of the first `limit` rows (all when None) of a `{"turns": [...]}` JSONL(.gz) prompt file."""
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


__all__ = [
    "Prompt",
    "read_prompts",
    "first_turns",
    "encode_chat_prompts",
    "left_pad",
    "eos_token_ids",
    "new_token_lengths",
    "count_new_tokens",
]
