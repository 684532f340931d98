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

import contextlib
import logging
from collections.abc import Sequence

import torch

from ..compilation import capture
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
    layer ids).

    Calling it copies the batch into the shape's static buffers, replays, and returns copies of the outputs (a later
    replay overwrites the graph's own). It returns None where it cannot serve the call: not on CUDA, a shape's first
    call, more than `max_shapes` shapes, or after a capture failed (logged once; the caller then runs the forward
    uncaptured). A shape is captured when it comes a second time: one-off shapes (an epoch's last, smaller batch,
    the evaluation's) cost no warm-up and capture and keep no graph memory.
    `layers` is the `CompiledLayers` of the target (or None): the warm-up and capture run inside it, so the graph
    replays the compiled kernels.
    All shapes' graphs share one memory pool: a graph may reuse the memory another graph's intermediates and outputs
    took, which is safe because every replay's outputs are copied before anything else runs on the stream (one
    forward's worth of activations for all shapes, not one per shape)."""

    def __init__(self, target, layers=None, max_shapes: int = 8, quiet: bool = False):
        """quiet: an unsupported target is logged at info level (the default setting), not warned about."""
        self.target, self.layers, self.max_shapes = target, layers, max_shapes
        self.graphs: dict[tuple, tuple] = {}
        self.seen: set[tuple] = set()  # shapes called once, not captured (yet)
        self._pool = None  # the graphs' shared memory pool, made at the first capture
        self.failed: str | None = explicit_mask_unsupported(target)
        if self.failed:
            log = logger.info if quiet else logger.warning
            log("the online target's forward runs without CUDA graphs: %s", self.failed)

    def __call__(self, input_ids: torch.Tensor, layer_ids: Sequence[int], attention_mask: torch.Tensor | None = None):
        if self.failed is not None or not self._serves(input_ids):
            return None
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        key = (tuple(input_ids.shape), input_ids.device, tuple(layer_ids))
        entry = self.graphs.get(key)
        if entry is None:
            if key not in self.seen:
                self.seen.add(key)
                return None
            if len(self.graphs) >= self.max_shapes:
                return None
            entry = self._capture(input_ids, list(layer_ids), attention_mask)
            if entry is None:
                return None
            self.graphs[key] = entry
        graph, ids, mask, outputs = entry
        ids.copy_(input_ids, non_blocking=True)
        mask.copy_(attention_mask, non_blocking=True)
        graph.replay()
        return tuple(t.clone() for t in outputs)

    @staticmethod
    def _serves(input_ids: torch.Tensor) -> bool:
        return input_ids.device.type == "cuda"

    def _capture(self, input_ids, layer_ids, attention_mask):
        ids, mask = input_ids.clone(), attention_mask.clone()

        def forward():
            return target_features(self.target, ids, layer_ids, target_mask(self.target, mask))

        try:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            with self.layers if self.layers is not None else contextlib.nullcontext():
                graph, outputs = capture(forward, pool=self._pool)
        except Exception as err:  # noqa: BLE001 - the uncaptured forward computes the same features
            self.failed = f"{type(err).__name__}: {err}"
            logger.warning("the online target's forward runs without CUDA graphs (capture failed: %s); "
                           "target_cuda_graphs=False skips the attempt", self.failed)  # fmt: skip
            self.graphs.clear()
            self._pool = None
            return None
        return graph, ids, mask, outputs


__all__ = ["CapturedTargetFeatures", "padded_causal_mask", "target_mask"]
