"""The compiled static-cache baseline: one cache length for a run, one compilation for prompts of every length,
and the same tokens as the plain target.generate() (float32, greedy)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target

from hf_dspark.data.prompts import left_pad
from hf_dspark.evaluation.static_baseline import StaticTargetBaseline, static_cache_length

NEW_TOKENS = 8


def prompts_of(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (n,), generator=gen).tolist() for n in lengths]


def test_cache_length_is_the_longest_prompt_plus_new_tokens_rounded_up():
    assert static_cache_length([[1] * 5, [1] * 9], 16) == 256
    assert static_cache_length([[1] * 5, [1] * 300], 16) == 512
    assert static_cache_length([[1] * 240], 16) == 256  # 256 exactly fits: generate() needs prompt + new - 1
    with pytest.raises(ValueError, match="max_new_tokens"):
        static_cache_length([], 16)


@pytest.mark.parametrize("family, rows", [("llama", 1), ("llama", 2), ("qwen3", 2), ("gemma3", 2)])
def test_one_cache_per_batch_shape_and_the_target_generate_tokens(family, rows):
    target = make_tiny_target(family)  # gemma3: sliding-window layers, the window (16) shorter than some calls
    target.generation_config.cache_implementation = "static"  # as some checkpoints ship it: must not conflict
    prompts = prompts_of([5, 17, 3, 11, 9, 4, 13])
    baseline = StaticTargetBaseline(target, prompts, NEW_TOKENS)
    assert baseline.cache_len == 256
    batches = [prompts[i : i + rows] for i in range(0, len(prompts), rows)]
    caches = {}
    for batch in batches:
        ids, mask = left_pad(batch, 0, torch.device("cpu"))
        kwargs = baseline.generate_kwargs(ids)
        out = target.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
        ref = target.generate(
            ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation=None
        )
        assert torch.equal(out, ref)  # a reused cache (stale keys past the prompt) changes nothing
        cache = kwargs[baseline.cache_kwarg]
        layer = next(layer for layer in cache.layers if not layer.is_sliding)
        assert layer.keys.shape[0] == len(batch) and layer.keys.shape[2] == baseline.cache_len
        held = caches.setdefault(len(batch), (cache, layer.keys.data_ptr()))
        assert held == (cache, layer.keys.data_ptr())  # one object, one address per batch shape
    assert baseline.record() == {
        "static_cache_len": 256,
        "static_cache_batch_shapes": sorted({len(b) for b in batches}),
        "static_warmup_calls": 0,
    }


def test_warm_up_calls_once_per_batch_shape():
    target = make_tiny_target("llama")
    prompts = prompts_of([4, 6, 8, 5, 7])
    baseline = StaticTargetBaseline(target, prompts, NEW_TOKENS)
    warmed = []
    baseline.warm_up([prompts[0:2], prompts[2:4], prompts[4:5]], warmed.append)
    baseline.warm_up([prompts[0:2], prompts[2:4], prompts[4:5]], warmed.append)  # later calls: shapes known
    assert warmed == [prompts[0:2], prompts[4:5]]
    assert baseline.record()["static_warmup_calls"] == 2


def test_a_prompt_longer_than_the_run_is_refused():
    target = make_tiny_target("llama")
    baseline = StaticTargetBaseline(target, prompts_of([4]), NEW_TOKENS)
    with pytest.raises(ValueError, match="every prompt of the run"):
        baseline.generate_kwargs(torch.ones(1, 250, dtype=torch.long))


def test_one_compilation_for_prompts_of_every_length():
    """generate() compiles the decoding step on CUDA only; asked to compile on every device (with dynamo's eager
    backend), the count of compiled graphs shows what happens there: plain cache_implementation="static" sizes each
    call's cache by its prompt and recompiles for a longer one; the baseline's fixed cache compiles once."""
    from torch._dynamo.utils import counters
    from transformers.generation.configuration_utils import CompileConfig

    compile_config = CompileConfig(backend="eager", mode=None)
    compile_config._compile_all_devices = True
    prompts = prompts_of([5, 12, 7, 16])
    graphs = {}
    try:
        for name in ("plain", "baseline"):
            torch._dynamo.reset()
            counters.clear()
            target = make_tiny_target("llama", num_layers=2)
            baseline = StaticTargetBaseline(target, prompts, NEW_TOKENS)
            for prompt in prompts:
                ids = torch.tensor([prompt])
                kwargs = baseline.generate_kwargs(ids) if name == "baseline" else {"cache_implementation": "static"}
                out = target.generate(
                    ids, max_new_tokens=NEW_TOKENS, do_sample=False, compile_config=compile_config, **kwargs
                )
                ref = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
                assert torch.equal(out, ref)
            graphs[name] = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert graphs["baseline"] == 1
    assert graphs["plain"] > 1
