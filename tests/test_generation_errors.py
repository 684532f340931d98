"""Bad input to generate(..., assistant_model=draft): clear errors that name the fix, or a documented fix."""

import pytest
import torch
from conftest import make_tiny_target
from generation_utils import left_padded, make_draft
from transformers import DynamicCache, GenerationConfig
from transformers.generation.streamers import BaseStreamer

import hf_dspark  # noqa: F401
from hf_dspark.generation.scheduler import cache_kwarg_name

IDS = torch.tensor([[1, 5, 6, 7]])


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("llama")


@pytest.fixture(scope="module")
def draft(target):
    return make_draft("dspark", target)


def _generate(target, draft, ids=IDS, **kwargs):
    kwargs.setdefault("max_new_tokens", 4)
    kwargs.setdefault("do_sample", False)
    return target.generate(ids, assistant_model=draft, **kwargs)


def test_a_draft_for_another_vocabulary_is_rejected(target):
    other = make_draft("dspark", make_tiny_target("llama", vocab_size=64))
    with pytest.raises(ValueError, match="draft vocab 64 != target vocab 96"):
        _generate(target, other)


def test_a_draft_for_other_target_layers_is_rejected(target):
    deeper = make_tiny_target("llama", num_layers=10)
    draft = make_draft("eagle3", deeper, target_layer_ids=[1, 4, 7])
    with pytest.raises(ValueError, match="num_target_layers=10 but this target has 6"):
        _generate(target, draft)
    draft.config.num_target_layers = None  # not recorded: the layer ids themselves are checked
    with pytest.raises(ValueError, match="target layers this target cannot provide"):
        _generate(target, draft)


def test_a_draft_for_another_architecture_is_rejected(target):
    with pytest.raises(ValueError, match="target_model_type='qwen3' but this target has 'llama'"):
        _generate(target, make_draft("dflash", make_tiny_target("qwen3")))


def test_beam_search_is_rejected(target, draft):
    with pytest.raises(ValueError, match="num_beams=1"):
        _generate(target, draft, num_beams=2)


def test_a_quantized_cache_is_rejected(target, draft):
    with pytest.raises(ValueError, match="use the default dynamic cache, or 'static'"):
        _generate(target, draft, cache_implementation="offloaded_static")


def test_a_static_cache_verifies_on_fixed_shapes_and_returns_no_cache(target, draft):
    out = _generate(target, draft, cache_implementation="static", return_dict_in_generate=True)
    assert torch.equal(out.sequences, target.generate(IDS, max_new_tokens=4, do_sample=False))
    assert getattr(out, "past_key_values", None) is None and getattr(out, "cache", None) is None
    assert out.speculative_stats.target_graphs is False  # fixed shapes, run eagerly without CUDA


def test_target_graphs_setting_picks_the_verification_path(target, draft):
    from hf_dspark.generation import target_graphs

    target_graphs._RUNNERS.pop(target, None)
    _generate(target, draft)  # "auto" on CPU: the dynamic cache
    assert target not in target_graphs._RUNNERS
    _generate(target, draft, dspark_target_graphs=True)  # forced: the static path, eagerly
    assert target in target_graphs._RUNNERS
    with pytest.raises(ValueError, match="dspark_target_graphs must be True, False or 'auto'"):
        _generate(target, draft, dspark_target_graphs="always")
    with pytest.raises(ValueError, match="drop one of them"):
        _generate(target, draft, cache_implementation="static", dspark_target_graphs=False)
    sliding = make_tiny_target("gemma3")
    with pytest.raises(ValueError, match="dspark_target_graphs=True cannot be used.*sliding-window"):
        _generate(sliding, make_draft("dspark", sliding), dspark_target_graphs=True)


def test_a_static_cache_needs_a_4d_mask_and_no_sliding_window():
    sliding = make_tiny_target("gemma3")
    with pytest.raises(ValueError, match="sliding-window layers"):
        _generate(sliding, make_draft("dspark", sliding), cache_implementation="static")
    target = make_tiny_target("llama")
    draft = make_draft("dspark", target)
    target.set_attn_implementation("flex_attention")
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        _generate(target, draft, cache_implementation="static")


def test_a_prefilled_cache_is_rejected(target, draft):
    cache = DynamicCache(config=target.config)
    target(IDS[:, :2], use_cache=True, **{cache_kwarg_name(target): cache})
    with pytest.raises(ValueError, match="without past_key_values"):
        _generate(target, draft, **{cache_kwarg_name(target): cache})


def test_use_cache_false_is_rejected(target, draft):
    with pytest.raises(ValueError, match="use_cache=True"):
        _generate(target, draft, use_cache=False)


def test_attentions_and_hidden_states_are_rejected(target, draft):
    with pytest.raises(ValueError, match="output_attentions / output_hidden_states"):
        _generate(target, draft, return_dict_in_generate=True, output_attentions=True)


def test_a_draft_on_another_device_is_rejected(target):
    draft = make_draft("dspark", target).to("meta")
    with pytest.raises(ValueError, match=r"draft.to\('cpu'\)"):
        _generate(target, draft)


def test_a_draft_in_another_dtype_is_used_as_is(target):
    draft = make_draft("eagle3", target).to(torch.bfloat16)  # features are cast to the draft's dtype
    ids, mask = left_padded([[5, 6, 7], [9, 10, 11, 12]])
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert torch.equal(_generate(target, draft, ids, attention_mask=mask, max_new_tokens=10), expected)


def test_confidence_schedules_need_a_confidence_head(target):
    for name in ("dflash", "eagle3"):
        with pytest.raises(ValueError, match="confidence head"):
            _generate(target, make_draft(name, target), dspark_schedule="threshold")


def test_unknown_schedule_and_bad_threshold(target, draft):
    with pytest.raises(ValueError, match="dspark_schedule='fast'"):
        _generate(target, draft, dspark_schedule="fast")
    with pytest.raises(ValueError, match="dspark_threshold"):
        _generate(target, draft, dspark_schedule="threshold", dspark_threshold=1.5)


def test_block_length_override(target):
    block = make_draft("dspark", target, block_size=4)
    with pytest.raises(ValueError, match="exceeds the draft's block_size 4"):
        _generate(target, block, num_assistant_tokens=6)
    expected = target.generate(IDS, max_new_tokens=10, do_sample=False)
    assert torch.equal(_generate(target, block, max_new_tokens=10, dspark_block_size=2), expected)
    stats = block.last_generation_stats
    assert stats.block_size == 2 and stats.acceptance.proposed_total <= 2 * stats.acceptance.rounds
    # Eagle3 drafts autoregressively: more tokens than its training unroll is allowed (they just get worse).
    eagle = make_draft("eagle3", target, block_size=3)
    assert torch.equal(_generate(target, eagle, max_new_tokens=10, num_assistant_tokens=5), expected)


def test_generation_config_fields_are_read_from_the_models_generation_config(target):
    draft = make_draft("dspark", target)
    target.generation_config.dspark_schedule = "threshold"
    target.generation_config.dspark_threshold = 0.99
    try:
        _generate(target, draft, max_new_tokens=8)
    finally:
        del target.generation_config.dspark_schedule, target.generation_config.dspark_threshold
    stats = draft.last_generation_stats
    assert stats.schedule == "threshold"
    assert stats.acceptance.proposed_total == 0  # a random head never reaches 0.99 confidence
    # ... or from a GenerationConfig passed to generate(); keywords win over both.
    config = GenerationConfig(max_new_tokens=8, do_sample=False, dspark_schedule="threshold", dspark_threshold=0.0)
    _generate(target, draft, generation_config=config)
    assert draft.last_generation_stats.acceptance.proposed_total > 0
    _generate(target, draft, generation_config=config, dspark_schedule="none", dspark_block_size=1)
    assert draft.last_generation_stats.schedule == "none" and draft.last_generation_stats.block_size == 1


def test_streamer_needs_batch_size_one(target, draft):
    ids, mask = left_padded([[5, 6, 7], [9, 10]])
    with pytest.raises(ValueError, match="batch size 1"):
        _generate(target, draft, ids, attention_mask=mask, streamer=BaseStreamer())


def test_stop_strings_need_the_tokenizer(target, draft):
    with pytest.raises(ValueError, match="tokenizer="):
        _generate(target, draft, stop_strings=["."])


def test_other_assistance_kinds_cannot_be_combined(target, draft):
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens"):
        _generate(target, draft, prompt_lookup_num_tokens=3)
    with pytest.raises(ValueError, match="custom_generate"):
        _generate(target, draft, custom_generate=lambda *a, **k: None)


def test_draft_graphs_setting_is_checked(target, draft):
    with pytest.raises(ValueError, match="dspark_draft_graphs must be True, False or 'auto'"):
        _generate(target, draft, dspark_draft_graphs="yes")
    # The static draft path needs processors that do not read the sequence (the graph has no per-round inputs).
    with pytest.raises(ValueError, match="reads the sequence.*dspark_draft_graphs='auto'"):
        _generate(target, draft, dspark_draft_graphs=True, repetition_penalty=1.3)
    # 'auto' falls back to the dynamic path there, and on CPU: no graphs were captured.
    _generate(target, draft, dspark_draft_graphs="auto", repetition_penalty=1.3)
    assert draft.last_generation_stats.draft_graphs is False
    _generate(target, draft, dspark_draft_graphs=True)
    assert draft.last_generation_stats.draft_graphs is False  # static shapes, run eagerly without CUDA


def test_a_sliding_window_target_refuses_forced_draft_graphs():
    target = make_tiny_target("gemma3")
    draft = make_draft("dspark", target)
    ids, mask = left_padded([[5, 6, 7, 8], [3, 4]])
    with pytest.raises(ValueError, match="sliding-window target"):
        target.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, assistant_model=draft,
                        dspark_draft_graphs=True)  # fmt: skip


def test_auto_target_graphs_on_cuda_only_where_the_static_path_fits():
    """The "auto" rule, on a stand-in for a CUDA model (no GPU here)."""
    from types import SimpleNamespace

    from hf_dspark.generation.speculative import SpeculativeConfig, _use_static_target

    def model(attn="sdpa", device="cuda"):
        weight = SimpleNamespace(device=torch.device(device))
        return SimpleNamespace(config=SimpleNamespace(_attn_implementation=attn), parameters=lambda: iter([weight]))

    def use(m, cfg=SpeculativeConfig(), sliding=False):
        return _use_static_target(m, cfg, sliding, False, rows=2, width=8)

    assert use(model()) and use(model("eager"))
    assert not use(model(device="cpu"))
    assert not use(model("flex_attention")) and not use(model(), sliding=True)
    # "prefix" and "threshold" take it where the cost table is flat, else keep their verification savings.
    for schedule in ("prefix", "threshold"):
        assert use(model(), SpeculativeConfig(schedule=schedule, sps_table={2: 100.0, 16: 95.0}))
        assert not use(model(), SpeculativeConfig(schedule=schedule, sps_table={2: 100.0, 16: 20.0}))
    assert not use(model(), SpeculativeConfig(target_graphs=False))


def test_fused_round_needs_the_static_path_whole_blocks_and_no_per_step_scores(target, draft):
    with pytest.raises(ValueError, match="dspark_fused_round must be True, False or 'auto'"):
        _generate(target, draft, dspark_fused_round="yes")
    with pytest.raises(ValueError, match="dspark_compile_draft must be True, False or 'auto'"):
        _generate(target, draft, dspark_compile_draft="yes")
    # "auto" (the default) fuses only on CUDA: here the forced static path keeps separate runners.
    out = _generate(target, draft, return_dict_in_generate=True, dspark_target_graphs=True)
    assert not out.speculative_stats.fused_round
    with pytest.raises(ValueError, match="static verification path is not in use"):
        _generate(target, draft, dspark_fused_round=True)  # on CPU "auto" keeps the dynamic cache
    static = dict(dspark_fused_round=True, dspark_target_graphs=True)
    with pytest.raises(ValueError, match="whole blocks only"):
        _generate(target, draft, dspark_schedule="threshold", **static)
    with pytest.raises(ValueError, match="output_scores / output_logits"):
        _generate(target, draft, return_dict_in_generate=True, output_scores=True, **static)
    with pytest.raises(ValueError, match="reads the sequence"):
        _generate(target, draft, repetition_penalty=1.3, **static)
    out = _generate(target, draft, return_dict_in_generate=True, **static)
    assert out.speculative_stats.fused_round and torch.equal(out.sequences, _generate(target, draft))
    # "prefix" verifies whole blocks on the static path, so it can run fused.
    out = _generate(target, draft, dspark_schedule="prefix", dspark_sps_table={1: 100.0, 64: 3.0}, **static)
    assert torch.equal(out, _generate(target, draft))


def test_a_failing_compiled_capture_falls_back_to_the_plain_functions_once(caplog):
    """The three CUDA-graph runners share one fallback: a capture that fails while compiled functions are in use is
    retried once with the plain functions (and a warning); a failure without compiled functions is not hidden."""
    from hf_dspark.generation.cuda_graphs import capture_or_uncompiled

    state = {"compiled": True, "attempts": 0}

    def capture_fn():
        state["attempts"] += 1
        if state["compiled"]:
            raise RuntimeError("inductor refused")
        return "graph"

    def uncompile():
        state["compiled"] = False

    with caplog.at_level("WARNING"):
        assert capture_or_uncompiled("verify forward", capture_fn, True, uncompile) == "graph"
    assert state == {"compiled": False, "attempts": 2}
    assert "compiled verify forward failed (RuntimeError: inductor refused); capturing uncompiled" in caplog.text

    def broken():
        raise RuntimeError("capture refused")

    with pytest.raises(RuntimeError, match="capture refused"):
        capture_or_uncompiled("draft functions", broken, False, uncompile)


def test_first_slot_candidates_name_what_they_need(target, draft):
    for value in (0, 1.5, True, "2"):
        with pytest.raises(ValueError, match="dspark_candidates must be a whole number >= 1"):
            _generate(target, draft, dspark_candidates=value)
    with pytest.raises(ValueError, match="needs a block drafter"):
        _generate(target, make_draft("eagle3", target), dspark_candidates=2)
    with pytest.raises(ValueError, match="use dspark_schedule='none'"):
        _generate(target, draft, dspark_candidates=2, dspark_schedule="threshold")
    with pytest.raises(ValueError, match="keep to position-free ones"):
        _generate(target, draft, dspark_candidates=2, repetition_penalty=1.3)
    flash = make_tiny_target("llama")
    flash.config._attn_implementation = "flash_attention_2"  # (never run: refused before the first forward)
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        _generate(flash, make_draft("dspark", flash), dspark_candidates=2)
    # Batch 1 returns no cache: a tree round leaves the other chains' columns as holes in it.
    out = _generate(target, draft, dspark_candidates=2, return_dict_in_generate=True)
    assert getattr(out, "past_key_values", None) is None and getattr(out, "cache", None) is None
