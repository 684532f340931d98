"""Data: chat conversations -> tokenized rows with assistant loss masks -> the offline target cache.

- `load_conversations` / `tokenize_conversations` (chat.py): conversations in, `input_ids` + `loss_mask` out.
- `regenerate_responses` (regenerate.py): answer prompts with the target itself, resumably.
- `build_target_cache` / `load_target_cache` (cache.py): the target's features as sharded, memory-mapped Arrow.
"""

from .._lazy import lazy_attributes

_EXPORTS = {
    **dict.fromkeys(
        ["TargetCacheDataset", "TargetCacheError", "build_target_cache", "cache_roundtrip", "finalize_target_cache",
         "load_target_cache", "read_manifest", "target_config_hash", "target_weights_fingerprint",
         "validate_target_cache"],
        ".cache",
    ),
    **dict.fromkeys(["encode_conversation", "load_conversations", "tokenize_conversations", "tokenizer_fingerprint"],
                    ".chat"),
    **dict.fromkeys(
        ["count_new_tokens", "encode_chat_prompts", "eos_token_ids", "first_turns", "left_pad", "new_token_lengths"],
        ".prompts",
    ),
    "read_prompts": ".prompts",
    "regenerate_responses": ".regenerate",
}  # fmt: skip
__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS, globals())
__all__ = list(_EXPORTS)
