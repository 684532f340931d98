"""Data: chat conversations -> tokenized rows with assistant loss masks -> the offline target cache.

- `load_conversations` / `tokenize_conversations` (chat.py): conversations in, `input_ids` + `loss_mask` out.
- `regenerate_responses` (regenerate.py): answer prompts with the target itself, resumably.
- `build_target_cache` / `load_target_cache` (cache.py): the target's features as sharded, memory-mapped Arrow.
"""

from .cache import (
    TargetCacheDataset,
    TargetCacheError,
    build_target_cache,
    cache_roundtrip,
    finalize_target_cache,
    load_target_cache,
    read_manifest,
    target_config_hash,
    target_weights_fingerprint,
    validate_target_cache,
)
from .chat import (
    encode_conversation,
    load_conversations,
    tokenize_conversations,
    tokenizer_fingerprint,
)
from .prompts import count_new_tokens, encode_chat_prompts, eos_token_ids, first_turns, left_pad
from .regenerate import read_prompts, regenerate_responses

__all__ = [
    "first_turns",
    "encode_chat_prompts",
    "left_pad",
    "eos_token_ids",
    "count_new_tokens",
    "load_conversations",
    "tokenize_conversations",
    "encode_conversation",
    "tokenizer_fingerprint",
    "regenerate_responses",
    "read_prompts",
    "build_target_cache",
    "load_target_cache",
    "finalize_target_cache",
    "read_manifest",
    "validate_target_cache",
    "cache_roundtrip",
    "target_config_hash",
    "target_weights_fingerprint",
    "TargetCacheDataset",
    "TargetCacheError",
]
