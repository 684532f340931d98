"""The target's verification forward on fixed shapes: a preallocated KV cache, replayed as a CUDA graph.

Asked for with `generate(..., assistant_model=draft, cache_implementation="static")`. A small target's decode
step is dispatch-bound in eager mode (SmolLM2-135M: ~24 ms of host time per step on an H200 for well under a
millisecond of GPU work), and so is the verification forward of every speculative round. This path makes the
verification one graph launch:

- the prompt is prefilled eagerly into a DynamicCache (as on the dynamic path), then copied into per-layer
  [rows, kv_heads, capacity, head_dim] buffers (`StaticVerifyCache`) sized for the whole call;
- every round verifies a window of fixed width (the block + 1) for every row of the call: slots past a row's
  verify length, and rows that already finished, are computed and never read;
- a round writes its window at the shared cache length and commits the longest accepted prefix among the running
  rows; rows that accepted fewer keep masked holes (the dynamic path crops the cache the same way). Which keys a
  row may read lives in `key_valid` [rows, capacity], and the 4D mask is built inside the captured function from
  it and the cache length, so one graph serves every round;
- holes make the shared length outgrow every row's own; when the next window would not fit, each row's keys are
  moved to the front in order (`_compact`, outside the graph, into the same buffers): attention does not depend
  on where a key sits, only on the mask and the position its rotary embedding already holds.

The same function runs eagerly without CUDA (the CPU tests exercise it), so the captured and the eager runs
compute one thing. Needs an attention implementation that takes a 4D mask (sdpa or eager) and a target without
sliding-window layers.
"""

from __future__ import annotations

import logging
import time
import weakref

import torch

from ..target import additive_mask
from .cuda_graphs import capture, capture_or_uncompiled, captured_or_warned, kept_runner
from .rejection import tree_attention

logger = logging.getLogger(__name__)


class StaticVerifyCache:
    """A transformers-compatible KV cache of fixed capacity: `update` writes a layer's new keys and values at the
    columns `write_cols` and returns the whole buffers (attention reads every column under the 4D mask)."""

    is_compileable = True

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], length: int):
        self.keys, self.values = keys, values
        self.length = length  # committed columns (host copy; the mask decides what each row reads)
        self.write_cols: torch.Tensor | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self.write_cols, key_states.to(keys.dtype))
        values.index_copy_(2, self.write_cols, value_states.to(values.dtype))
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def __len__(self) -> int:
        return len(self.keys)


class StaticTargetRunner:
    """Verify forwards on fixed shapes (a CUDA graph on CUDA when `capture`), reused across generate() calls of
    the same shape (`static_target_runner`): capturing costs about three eager forwards, more than a short
    generation saves."""

    def __init__(self, model, cache_kwarg: str, layer_shapes: list[tuple], rows: int, width: int, capacity: int,
                 capture: bool, device: torch.device, compile: bool = False, tree: tuple[int, int] | None = None):
        self._model = weakref.ref(model)  # runners are kept per model (static_target_runner): no cycle through it
        self.cache_kwarg = cache_kwarg
        self.rows, self.width, self.capacity = int(rows), int(width), int(capacity)
        self.mask_dtype = next(model.parameters()).dtype
        keys = [torch.zeros(rows, heads, capacity, dim, dtype=dtype, device=device) for heads, dim, dtype in layer_shapes]
        values = [torch.zeros_like(k) for k in keys]
        self.cache = StaticVerifyCache(keys, values, 0)
        self.key_valid = torch.zeros(rows, capacity, dtype=torch.bool, device=device)
        self.length_t = torch.zeros((), dtype=torch.long, device=device)
        self.window = torch.zeros(rows, self.width, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, self.width, dtype=torch.long, device=device)
        self.slot = torch.arange(self.width, device=device)
        # A window of k chains of n drafts after the anchor (`rejection.tree_attention`), or one chain (causal).
        self.tree = tree
        self.window_attention = None
        if tree is not None:
            if 1 + tree[0] * tree[1] != self.width:
                raise ValueError(f"a tree of {tree[0]} chains of {tree[1]} needs a window of {1 + tree[0] * tree[1]}")
            self.window_attention = tree_attention(*tree, device=device)
        self.cols = torch.arange(capacity, device=device)
        self.capture = capture and device.type == "cuda"
        self.hooks = None
        self._graph = None
        self._outputs = None
        # What verification runs (and captures): the forward, or its compiled version (dspark_compile).
        self.compiled = bool(compile)
        self._run = torch.compile(self._forward, dynamic=False) if compile else self._forward

    def load(self, prefill_cache, prompt_mask: torch.Tensor, hooks) -> None:
        """Start a call: the prompt's keys and values (a prefilled DynamicCache) and its mask [rows, prompt]."""
        prompt = prompt_mask.shape[1]
        if self.capacity < prompt + self.width:
            raise ValueError(f"static cache capacity {self.capacity} cannot hold the prompt ({prompt}) and a window")
        for layer, keys, values in zip(prefill_cache.layers, self.cache.keys, self.cache.values):
            keys[:, :, :prompt] = layer.keys
            values[:, :, :prompt] = layer.values
        self.key_valid.zero_()
        self.key_valid[:, :prompt] = prompt_mask.bool()
        self.cache.length = prompt
        self.length_t.fill_(prompt)
        self.hooks = hooks  # read by eager forwards (and the capture); a replay needs none
        if self.capture and self._graph is None and not captured_or_warned("verifying", self._capture):
            self._graph, self.capture = None, False

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def _mask(self) -> torch.Tensor:
        """[rows, 1, width, capacity]: each row's committed keys, plus the window causally (or as a tree)."""
        rel = self.cols[None, :] - self.length_t  # [1, capacity]: column offset from the window's start
        if self.window_attention is None:
            in_window = (rel >= 0) & (rel <= self.slot[:, None])  # [width, capacity]
        else:
            inside = (rel >= 0) & (rel < self.width)
            in_window = inside & self.window_attention[:, rel[0].clamp(0, self.width - 1)]
        allowed = self.key_valid[:, None, None, :] | in_window[None, None]
        return additive_mask(allowed, self.mask_dtype)

    def _forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.cache.write_cols = self.length_t + self.slot
        out = self._model()(
            input_ids=self.window,
            attention_mask=self._mask(),
            position_ids=self.positions,
            use_cache=True,
            logits_to_keep=self.width,
            **{self.cache_kwarg: self.cache},
        )
        return out.logits[:, -self.width :], self.hooks.features

    def _capture(self) -> None:
        # The warm-up runs (which also compile) write only uncommitted columns, which no row reads.
        start = time.perf_counter()
        self._graph, self._outputs = capture_or_uncompiled(
            "verify forward", lambda: capture(self._run), self.compiled, self._uncompile
        )
        if self.compiled:  # a first call's pause of tens of seconds deserves a word
            logger.info("compiled and captured the verify forward for %d rows x %d tokens (cache %d) in %.1f s; kept "
                        "for later calls of this shape (dspark_compile=False skips compiling)", self.rows, self.width,
                        self.capacity, time.perf_counter() - start)  # fmt: skip

    def _uncompile(self) -> None:
        self._run, self.compiled = self._forward, False

    # -- what the decoding loop calls -----------------------------------------------------------------------

    def verify(self, local_rows: torch.Tensor, window: torch.Tensor, positions: torch.Tensor):
        """Logits [R, w, V] and context features [R, w, F] of the running rows' windows (w <= width)."""
        w = window.shape[1]
        self.window[local_rows, :w] = window
        self.positions[local_rows, :w] = positions
        if w < self.width:  # the tail slots are never read; keep their positions in range
            self.positions[local_rows, w:] = positions[:, -1:]
        if self._graph is not None:
            self._graph.replay()
            logits, features = self._outputs
        else:
            logits, features = self._run()
        return logits[local_rows, :w], features[local_rows, :w]

    def commit(self, local_rows: torch.Tensor, committed: torch.Tensor, keep: int) -> None:
        """Keep the first `keep` window columns; `committed` [R, keep] says which each running row may read."""
        start = self.cache.length
        self.key_valid[:, start : start + keep] = False
        self.key_valid[local_rows, start : start + keep] = committed
        self.length_t.fill_(start + keep)
        self.kept(keep)

    def kept(self, keep: int) -> None:
        """The host length after a commit whose device side is done (by `commit`, or inside a graph in
        round_graph.py, which advances `length_t` itself), and compaction when the next window would not fit."""
        self.cache.length += keep
        if self.cache.length + self.width > self.capacity:
            self._compact()
            self.length_t.fill_(self.cache.length)

    def _compact(self) -> None:
        """Move every row's readable keys (and values) to the front of the buffers, in order."""
        order = torch.sort((~self.key_valid).to(torch.int8), dim=1, stable=True).indices  # readable first
        index = order[:, None, :, None]
        for buffer in (*self.cache.keys, *self.cache.values):
            buffer.copy_(buffer.gather(2, index.expand_as(buffer)))
        count = self.key_valid.sum(dim=1)
        self.key_valid.copy_(self.cols[None, :] < count[:, None])
        self.cache.length = int(count.max())  # a host synchronization, only when the buffers are full
        if self.cache.length + self.width > self.capacity:
            raise RuntimeError(
                f"static verification cache overflow ({self.cache.length} keys + a {self.width}-token window > "
                f"capacity {self.capacity})"
            )


_RUNNERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (key, runner): one per target


def static_target_runner(model, cache_kwarg: str, prefill_cache, rows: int, width: int, capacity: int,
                         capture: bool, compile: bool = False, tree: tuple[int, int] | None = None) -> StaticTargetRunner:
    """The target's runner for this call: the last one when the shape matches and its capacity fits, so its graph
    is replayed again; else a new one (`kept_runner`)."""
    layers = tuple((layer.keys.shape[1], layer.keys.shape[3], layer.keys.dtype) for layer in prefill_cache.layers)
    device = prefill_cache.layers[0].keys.device
    # Replaced weights (a reload, .to()) would leave a graph reading freed memory: their address is in the key.
    key = (cache_kwarg, layers, rows, width, capture, compile, tree, str(device), next(model.parameters()).data_ptr())
    build = lambda cap: StaticTargetRunner(  # noqa: E731
        model, cache_kwarg, list(layers), rows, width, cap, capture, device, compile, tree
    )
    return kept_runner(_RUNNERS, model, key, capacity, lambda r: r.capacity, build)


__all__ = ["StaticTargetRunner", "StaticVerifyCache", "static_target_runner"]
