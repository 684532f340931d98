"""The compiled static-cache target-alone baseline, compiled once per batch shape and timed warm.

Both speed tools (`hf-dspark eval --static_baseline`, `benchmarks/generation_speed.py --static-target`) compare
speculative decoding with transformers' fastest target-alone decoding: `target.generate()` on a `StaticCache`,
whose one-token decoding step generate() compiles (`torch.compile`, mode "reduce-overhead": CUDA graphs) when the
device allows it (CUDA).

Why `cache_implementation="static"` alone is no honest baseline over a prompt set (transformers 5.17 and 5.24,
`generation/utils.py`): generate() builds a new `StaticCache` in every call (`_prepare_static_cache`), sized
`max(prompt length + max_new_tokens - 1, the largest size an earlier call used)` (`_previous_max_cache_length`).
The compiled step's inputs (the cache tensors [rows, kv_heads, max_cache_len, head_dim] and the 4D mask
[rows, 1, 1, max_cache_len] that `prepare_inputs_for_generation` builds for compileable caches) are shaped by that
size, so every prompt longer than all before it changes their shapes: dynamo recompiles (the second time with the
length dynamic) and a new CUDA graph is recorded for each new length. And the new cache tensors are marked
static addresses without a guard (`torch._dynamo.mark_static_address`), so a cache that lands at other addresses
makes the CUDA graphs re-record. Measured on an H200 (SmolLM2-135M, 128 new tokens): 39 s for the first prompt,
10 s for the second, then ~0.45 s; the timed tokens/s were mostly compilation.

`StaticTargetBaseline` fixes both for a whole run: one cache length (the run's longest prompt + max_new_tokens,
rounded up to `CAPACITY_STEP` like the capacity of hf_dspark's own static verification path, so both attend over
comparably long caches) and one `StaticCache` per batch shape, built once, emptied in place (`reset()`) before
each call and passed to generate() as its cache object: the compiled step then sees one shape and one set of
addresses per batch shape, and `warm_up` compiles each shape once, untimed. (generate()'s own `max_cache_len`
option, in 5.17 and 5.24, fixes the length but still allocates a new cache per call.) Its `record()` says how the baseline
was made, for the result rows.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch

from ..generation.cuda_graphs import CAPACITY_STEP
from ..generation.scheduler import cache_kwarg_name
from ..target import static_cache_length


class StaticTargetBaseline:
    """`target.generate()` on transformers' `StaticCache` with one cache length for every call of a run.

    Use: `target.generate(input_ids, ..., **baseline.generate_kwargs(input_ids))`; `warm_up(batches, call)` runs
    `call(batch)` once, untimed, for every batch shape not warmed yet. On CPU generate() compiles nothing; the calls
    are plain static-cache decoding."""

    def __init__(self, target, prompts: Iterable[Sequence[int]], max_new_tokens: int):
        self.target = target
        self.max_new_tokens = int(max_new_tokens)
        self.cache_len = static_cache_length(prompts, max_new_tokens, CAPACITY_STEP)
        self.cache_kwarg = cache_kwarg_name(target)
        self._caches: dict[int, object] = {}  # batch rows -> its StaticCache, kept for the whole run
        self._warmed: set[int] = set()  # batch shapes warmed up: one untimed call each

    def generate_kwargs(self, input_ids: torch.Tensor) -> dict:
        """generate() keywords for this batch: the StaticCache of its shape, emptied, and cache_implementation=None
        (generate() refuses a cache object next to one, even one set in the target's generation_config)."""
        from transformers import StaticCache

        rows, prompt = input_ids.shape
        if prompt + self.max_new_tokens - 1 > self.cache_len:
            raise ValueError(
                f"a {prompt}-token prompt + {self.max_new_tokens} new tokens do not fit the baseline's static cache "
                f"of {self.cache_len}: build StaticTargetBaseline with every prompt of the run"
            )
        cache = self._caches.get(rows)
        if cache is None:
            config = self.target.config.get_text_config(decoder=True)
            cache = self._caches[rows] = StaticCache(config=config, max_cache_len=self.cache_len)
        else:
            cache.reset()  # keeps the tensors (and their addresses, which the CUDA graphs read)
        return {self.cache_kwarg: cache, "cache_implementation": None}

    def warm_up(self, batches: Iterable[Sequence], call: Callable[[Sequence], object]) -> None:
        """`call(batch)` for the first batch of each batch shape not warmed yet: compiles and records the decoding
        step for that shape before anything is timed (the cache length is the same for all)."""
        for batch in batches:
            if len(batch) not in self._warmed:
                call(batch)
                self._warmed.add(len(batch))

    def record(self) -> dict:
        """How the baseline was made so far in the run, for the result rows: the cache length, the batch shapes
        with a cache, and the untimed warm-up calls."""
        return {
            "static_cache_len": self.cache_len,
            "static_cache_batch_shapes": sorted(self._caches),
            "static_warmup_calls": len(self._warmed),
        }


__all__ = ["StaticTargetBaseline", "static_cache_length"]
