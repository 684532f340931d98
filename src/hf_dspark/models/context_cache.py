"""Per-request context cache of a draft at inference time.

It holds, for every request of a batch, the draft's keys/values of the *committed* positions only (the
target's context features projected through each draft layer; for Eagle3 the step-0 entries). Requests have
their own lengths: rows are packed to the left, so position i of a row is its i-th committed token whatever
padding the target batch uses. Speculative tokens never enter the cache, so it needs no cropping.

No host synchronization: `bound` is a host-side upper bound of the longest row (it grows by each write's width),
so attention reads `[:bound]` keys under `key_mask`, and writes scatter every column of a write (columns past a
row's count land beyond its new length, masked out and overwritten by the next write).
"""

from __future__ import annotations

from typing import Any

import torch


class DraftContextCache:
    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_key_value_heads: int,
        head_dim: int,
        device: torch.device | str,
        dtype: torch.dtype,
        capacity: int = 256,
    ):
        self.num_layers = num_layers
        self.batch_size = batch_size
        self._shape = (batch_size, num_key_value_heads, capacity, head_dim)
        self.keys = [torch.zeros(self._shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.values = [torch.zeros(self._shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.bound = 0  # host-side upper bound of lengths.max()
        # Fixed: never reallocated, attention always reads the whole capacity, so every shape is static and the
        # draft's per-round work can be captured as CUDA graphs (see generation/draft_graphs.py).
        self.fixed = False
        # Drafter-specific per-request state (Eagle3 keeps the hidden state of the last committed position).
        self.state: dict[str, Any] = {}

    @property
    def device(self) -> torch.device:
        return self.lengths.device

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def max_length(self) -> int:
        """Keys to attend over: an upper bound of the longest row (exact when every row commits alike)."""
        if self.fixed:
            return self.capacity
        return self.bound if self.batch_size else 0

    def _grow(self, needed: int) -> None:
        if self.fixed or needed <= self.capacity:
            return  # a fixed cache is sized for the whole generation up front
        new_cap = max(needed, 2 * self.capacity)
        pad = new_cap - self.capacity
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                store[i] = torch.cat([t, t.new_zeros(t.shape[0], t.shape[1], pad, t.shape[3])], dim=2)

    def positions(self, width: int) -> torch.Tensor:
        """Positions `lengths + i` [B, width] that the next `width` entries of each row will occupy."""
        return self.lengths[:, None] + torch.arange(width, device=self.device)

    def slots(self, counts: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`positions(width)` and which of them are real (the first `counts[r]`)."""
        offsets = torch.arange(width, device=self.device)
        return self.lengths[:, None] + offsets, offsets[None, :] < counts[:, None]

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor) -> None:
        """Store key/value [B, KV, width, hd] at `positions` [B, width] (from `positions` or `slots`, computed once
        for all layers): left-packed, entries past a row's count land beyond its new length, where nothing reads
        them."""
        self._grow(self.bound + key.shape[2])
        index = positions[:, None, :, None].expand_as(key)  # positions are distinct per row: a plain scatter
        self.keys[layer].scatter_(2, index, key.to(self.keys[layer].dtype))
        self.values[layer].scatter_(2, index, value.to(self.values[layer].dtype))

    def advance(self, counts: torch.Tensor, width: int | None = None) -> None:
        """Add counts [B] committed entries to each row; `width` (>= counts.max(), known on the host) keeps the
        bound without reading counts back from the device."""
        self.lengths += counts
        self.bound += int(counts.max().item()) if width is None else int(width)

    def layer_kv(self, layer: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        length = self.max_length if length is None else length
        return self.keys[layer][:, :, :length], self.values[layer][:, :, :length]

    def key_mask(self, length: int | None = None) -> torch.Tensor:
        """bool [B, length]: which cached entries are real for each row."""
        length = self.max_length if length is None else length
        return torch.arange(length, device=self.device)[None, :] < self.lengths[:, None]

    def select(self, rows: torch.Tensor) -> "DraftContextCache":
        """Keep only `rows` (e.g. drop finished requests); returns self."""
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.lengths = self.lengths[rows]
        self.batch_size = int(self.lengths.shape[0])  # the bound stays an upper bound
        self.state = {k: (v[rows] if torch.is_tensor(v) else v) for k, v in self.state.items()}
        return self


def pack_left(values: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move the valid entries of each row (dim 1) to the front, keeping their order.

    values [B, T, ...], valid bool [B, T] -> (packed values, counts [B]). Turns left-padded prompts or partially
    accepted blocks into the left-aligned layout the cache stores.
    """
    order = (~valid).to(torch.int8).argsort(dim=1, stable=True)
    index = order.view(*order.shape, *([1] * (values.dim() - 2))).expand(*order.shape, *values.shape[2:])
    return values.gather(1, index), valid.sum(dim=1)


__all__ = ["DraftContextCache", "pack_left"]
