"""Grouped-query attention through SDPA without copying keys and values, for decoding over a masked static cache.

transformers' "sdpa" attention passes `enable_gqa` to SDPA only when there is no attention mask; with one (every
static-cache decoding step has one), it first repeats each key/value head once per query head of its group
(`repeat_kv`). At large batch that copy dominates a decoding step: SmolLM2-135M (9 query heads, 3 key/value heads)
at batch 512 over a 1,280-token static cache writes and reads about 90 GB of repeated keys and values per step,
against 15 GB for the cache itself, and `hf-dspark regenerate` measured 34.6 ms a step there.

`grouped_sdpa_attention` computes the same attention by folding the query heads of each group into the query
length instead: queries [B, H, q, d] become [B, KV, (H / KV) * q, d], each folded row keeps its query position's
mask row, and SDPA runs once per key/value head on the cache as it is. `grouped_sdpa(model)` switches a model to it
for the duration of a `with` block. Models with one query head per key/value head, calls without a mask and calls
with extras plain SDPA does not take (sinks, softcapping, ...) go to transformers' own "sdpa" function.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "hf_dspark_grouped_sdpa"
# Keyword arguments transformers' attention modules pass that plain SDPA ignores or does not need.
_PLAIN_KWARGS = {"dropout", "scaling", "is_causal", "position_ids", "cache_position", "output_attentions",
                 "sliding_window", "use_cache", "past_key_values", "past_key_value", "layer_idx"}  # fmt: skip


def grouped_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                           **kwargs):  # fmt: skip
    """query [B, H, q, d], key/value [B, KV, S, d], attention_mask [B, 1 or H, q, S] (bool or additive) ->
    ([B, q, H, d], None), the same contract as transformers' `sdpa_attention_forward`."""
    groups = getattr(module, "num_key_value_groups", 1)
    extras = {k for k, v in kwargs.items() if v is not None and k not in _PLAIN_KWARGS}
    if groups == 1 or attention_mask is None or extras or kwargs.get("output_attentions"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)  # fmt: skip
    batch, heads, q_len, head_dim = query.shape
    kv_heads = key.shape[1]
    # Query head h belongs to key/value head h // groups (repeat_kv's order), so [B, KV, groups, q, d] lines up.
    folded = query.reshape(batch, kv_heads, groups * q_len, head_dim)
    mask = attention_mask
    if mask.shape[1] == 1:  # one mask for every head: row (g, i) of the fold uses query position i's row
        mask = mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(mask.shape[0], 1, groups * q_len, -1)
    else:  # a mask per query head: fold it like the queries
        mask = mask.reshape(mask.shape[0], kv_heads, groups * q_len, -1)
    out = F.scaled_dot_product_attention(
        folded, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
    )  # [B, KV, groups * q, d]
    return out.reshape(batch, heads, q_len, head_dim).transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the function (and transformers' SDPA mask format) under NAME; returns NAME."""
    AttentionInterface.register(NAME, grouped_sdpa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def applies(model) -> bool:
    """Whether `grouped_sdpa(model)` changes anything: the model attends with "sdpa" and groups query heads."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads, kv_heads = getattr(config, "num_attention_heads", 0), getattr(config, "num_key_value_heads", None)
    return model.config._attn_implementation == "sdpa" and kv_heads is not None and 0 < kv_heads < heads


@contextmanager
def grouped_sdpa(model) -> Iterator[bool]:
    """Within the block, `model` attends through `grouped_sdpa_attention` where `applies(model)`; yields whether it
    does. The model's own setting is restored on exit."""
    if not applies(model):
        yield False
        return
    model.set_attn_implementation(register())
    try:
        yield True
    finally:
        model.set_attn_implementation("sdpa")


__all__ = ["NAME", "applies", "grouped_sdpa", "grouped_sdpa_attention", "register"]
