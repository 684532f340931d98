"""Grouped-query SDPA (hf_dspark.grouped_sdpa): the same attention as transformers' "sdpa", keys and values
never repeated."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, tiny_target_config
from transformers import AutoModelForCausalLM, GenerationConfig

import hf_dspark.grouped_sdpa as grouped


def sdpa_target(family: str, **overrides):
    config = tiny_target_config(family)
    for name, value in overrides.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def left_padded_batch(vocab: int):
    ids = torch.randint(3, vocab, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, :1] = 0
    return ids, mask


@pytest.mark.parametrize("family", FAMILIES)
def test_grouped_sdpa_equals_sdpa_and_never_repeats_keys(family, monkeypatch):
    """Left-padded prefill logits and static-cache greedy decoding (one-token steps over a masked cache) match the
    "sdpa" implementation, and SDPA only ever sees the model's own key/value heads."""
    model = sdpa_target(family)
    config = model.config
    assert config.num_key_value_heads < config.num_attention_heads and grouped.applies(model)
    ids, mask = left_padded_batch(config.vocab_size)
    decode = GenerationConfig(max_new_tokens=10, do_sample=False, cache_implementation="static", pad_token_id=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        tokens = model.generate(input_ids=ids, attention_mask=mask, generation_config=decode)
    key_heads = []
    sdpa = grouped.F.scaled_dot_product_attention

    def spy(query, key, value, **kw):
        key_heads.append(key.shape[1])
        return sdpa(query, key, value, **kw)

    monkeypatch.setattr(grouped.F, "scaled_dot_product_attention", spy)
    with torch.no_grad(), grouped.grouped_sdpa(model) as on:
        assert on and model.config._attn_implementation == grouped.NAME
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, generation_config=decode), tokens)
    assert key_heads and set(key_heads) == {config.num_key_value_heads}
    assert model.config._attn_implementation == "sdpa"  # restored


def test_grouped_sdpa_leaves_other_models_alone_and_restores_on_error():
    eager = AutoModelForCausalLM.from_config(tiny_target_config("llama"), attn_implementation="eager")
    one_head_per_kv = sdpa_target("llama", num_key_value_heads=4)
    for model in (eager, one_head_per_kv):
        with grouped.grouped_sdpa(model) as on:
            assert not on
    model = sdpa_target("qwen2")
    with pytest.raises(RuntimeError, match="inside"):
        with grouped.grouped_sdpa(model):
            raise RuntimeError("inside")
    assert model.config._attn_implementation == "sdpa"
