"""DeepSpeed ZeRO-3 and draft training: the frozen target stays whole, the loss's weights are gathered.

ZeRO-3 shards every weight of the engine's model over the processes and gathers a module's weights only around that
module's own forward and backward. Two things of a draft's training fall outside that: the frozen target, which runs
whole on every process outside the engine (but transformers partitions any model loaded once a ZeRO-3 config is
registered), and the chunked loss, which reads lm_head and the Markov head's W2 outside any module forward (W2 is
trained: its gradient must land on the whole weight). `DraftTrainer` uses these helpers for both.
"""

from __future__ import annotations

import contextlib

from torch import nn


@contextlib.contextmanager
def zero3_init_disabled():
    """Models loaded inside load whole, even where DeepSpeed ZeRO-3 is configured.

    Once `TrainingArguments` with a ZeRO-3 config exist (`accelerate launch` with a DeepSpeed config creates them),
    transformers builds every `from_pretrained` model under `deepspeed.zero.Init`, partitioned over the processes,
    whatever accelerate's `zero3_init_flag` says. The frozen target runs outside the DeepSpeed engine, on every
    process, so it must load whole; the draft is partitioned later, by the engine."""
    from transformers.integrations import deepspeed as hf_deepspeed

    ref = getattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)
    config = ref() if ref is not None else None
    if config is None:
        yield
        return
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed.set_hf_deepspeed_config(config)


def refuse_partitioned(target: nn.Module) -> None:
    """A target whose weights DeepSpeed ZeRO-3 partitioned (each process holds a slice) cannot run as the frozen
    target: refuse it with the fix instead of failing later on empty weights."""
    if any(hasattr(p, "ds_id") for p in target.parameters()):
        raise ValueError(
            "the target's weights are partitioned by DeepSpeed ZeRO-3 (it was loaded after TrainingArguments with a "
            "ZeRO-3 config existed, so transformers loaded it under deepspeed.zero.Init): load the frozen target "
            "whole, before creating the arguments or inside `with hf_dspark.training.zero3_init_disabled():`"
        )


def zero3_loss_weights(draft: nn.Module) -> list[nn.Parameter]:
    """Under ZeRO-3 (a registered config): lm_head and W2, the weights the chunked loss reads outside a module
    forward. Else none."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        return []
    params = [draft.lm_head.weight]
    if hasattr(draft, "markov_head"):
        params.append(draft.markov_head.markov_w2.weight)
    return params


def gathered(params: list[nn.Parameter]):
    """These ZeRO-3 weights whole inside the block (read-only for the others: no broadcast of changes)."""
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


__all__ = ["gathered", "refuse_partitioned", "zero3_init_disabled", "zero3_loss_weights"]
