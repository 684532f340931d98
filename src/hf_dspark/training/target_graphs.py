"""The online target's no-grad feature forward, replayed from CUDA graphs.

A SmolLM2 target's forward is 30 compiled decoder-layer calls, each launching its own kernels. Issuing them one by one
took the host longer than the GPU took to run them: in a profile of 16 conversations padded to multiples of 256 on
an H100 the GPU sat idle 21 ms a step while the host issued the target's forward (`benchmarks/profile_training.py`,
`device_idle`). A captured graph replays the whole forward with one launch. One graph is kept per batch shape
(training pads to a few lengths), after warm-up runs that compile the target's layers as `compile_target` does.
On by default on CUDA (`target_cuda_graphs`): on an H200 the host issued the forward in 0.6 ms (22.2 without graphs)
and the GPU idled 0.24 ms a step during it (README, "Measured results").
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ..compilation import KeyedGraphs
from ..target import additive_mask, explicit_mask_unsupported, target_features

logger = logging.getLogger(__name__)


def padded_causal_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] 0/1 padding mask -> bool [B, 1, L, L]: query i sees key j <= i where key j is not padding, and always
    itself. transformers builds the same mask from the 2-D form, after testing on the host whether the batch has
    padding at all (no mask, a causal kernel, when it has none), a read-back no CUDA graph can hold. A padding query
    sees itself so that no row of the mask is empty; no real position sees a padding key either way."""
    length = attention_mask.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=attention_mask.device).tril()
    keys = attention_mask.bool()[:, None, None, :]
    return (causal & keys) | torch.eye(length, dtype=torch.bool, device=attention_mask.device)


def target_mask(target, attention_mask: torch.Tensor) -> torch.Tensor:
    """`padded_causal_mask` as the target's attention adds it: 0 / the dtype's minimum in the target's dtype. eager
    attention takes only this form; sdpa takes a boolean one too but turns it into this in every layer (the same
    choice as the verification mask of `generation.speculative`)."""
    return additive_mask(padded_causal_mask(attention_mask), target.dtype)


class CapturedTargetFeatures:
    """`target_features(target, input_ids, layer_ids, attention_mask)` replayed from a CUDA graph per (batch, length,
    layer ids): `compilation.KeyedGraphs`, which says when a call is served (None: the caller runs the forward
    uncaptured, as off CUDA) and why the graphs share one memory pool.
    `layers` is the `CompiledLayers` of the target (or None): the warm-up and capture run inside it, so the graph
    replays the compiled kernels."""

    def __init__(self, target, layers=None, max_shapes: int = 8, quiet: bool = False):
        """quiet: an unsupported target is logged at info level (the default setting), not warned about."""
        self.target = target
        self.graphs = KeyedGraphs("the online target's forward", "target_cuda_graphs=False", max_shapes, layers)
        self.graphs.failed = explicit_mask_unsupported(target)
        if self.graphs.failed:
            log = logger.info if quiet else logger.warning
            log("the online target's forward runs without CUDA graphs: %s", self.graphs.failed)

    @property
    def failed(self) -> str | None:
        return self.graphs.failed

    def __call__(self, input_ids: torch.Tensor, layer_ids: Sequence[int], attention_mask: torch.Tensor | None = None):
        if not self.graphs.serves(input_ids):
            return None
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        layer_ids = list(layer_ids)

        def forward(ids, mask):
            return target_features(self.target, ids, layer_ids, target_mask(self.target, mask))

        return self.graphs(tuple(layer_ids), forward, (input_ids, attention_mask))


__all__ = ["CapturedTargetFeatures", "padded_causal_mask", "target_mask"]
