"""The PyTorch loss's row chunks replayed from CUDA graphs (`loss_cuda_graphs`, opt-in).

`fused_head_loss` walks a step's loss rows in chunks (34 of 1,280 rows in a SmolLM2 batch), and for each the host
issues two products, the compiled math and the gradient products: about 16 operators a chunk. In an H200 profile the
host spent 22 of the 55 ms it took to issue a SmolLM2 step on the loss. Here each chunk index has a CUDA graph that
reads its rows of static input buffers and writes its rows of static output buffers, so a call copies its inputs
in, replays one graph per chunk and copies the outputs out: about 30 operators plus one launch a chunk.

Row counts vary from batch to batch (the anchors' blocks that fit), so graphs belong to chunk positions, not to row
counts: a batch of n chunks replays the first n graphs, and rows past its count hold zero weights (they add nothing
to the loss or the gradients, as the compiled math's padding of a last chunk already does). The buffers hold the
largest row count reserved (`reserve`: a batch's rows before the zero-weight ones are dropped), so they are
allocated once per setting. All graphs share one memory pool for the chunks' intermediates, which is safe because
they replay one after another and keep nothing in it between chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..compilation import GraphRunner

# What one chunk does, given the setting's work buffers and its rows of the static buffers (`losses`):
#   chunk_fn(work, h, z, th, labels, a, b, c, grad_out, grad_w2) -> (ce, l1, soft_ce, match)
ChunkFn = Callable[..., tuple]


@dataclass
class _Buffers:
    """Static inputs and outputs of one setting's graphs, `capacity` rows each (whole chunks)."""

    capacity: int
    inputs: dict[str, torch.Tensor | None]  # h [cap, d (+ r)], th [cap, d_t], labels, a, b, c [cap]
    outputs: dict[str, torch.Tensor | None]  # grad [cap, d (+ r)], ce, l1, soft_ce, match [cap], grad_w2 [V, r]
    work: dict[str, torch.Tensor]  # what the chunks read besides their rows (the products' weights)
    graphs: list = field(default_factory=list)  # graphs[k]: chunk k


class LossGraphs(GraphRunner):
    """Replays `fused_head_loss`'s PyTorch chunks from one CUDA graph per chunk index and setting.

    `run(...)` returns the loss's outputs, or None where it does not serve the call and the caller runs the chunks
    itself: a setting's first call (it runs plain, settling the fused GEMMs' check and compiling the math), more
    than `max_settings` settings, or after a capture failed (logged once; `loss_cuda_graphs=False` skips the
    attempt)."""

    def __init__(self, max_settings: int = 4):
        super().__init__("the loss's forward", "loss_cuda_graphs=False")
        self.max_settings = max_settings
        self.states: dict[tuple, _Buffers] = {}
        self.seen: set[tuple] = set()
        self.capacity_rows = 0  # `reserve`

    def reserve(self, rows: int) -> None:
        """Size the static buffers for calls of up to `rows` rows (a batch shape's rows before the zero-weight ones
        are dropped), so that they are allocated once instead of growing with the row counts."""
        self.capacity_rows = max(self.capacity_rows, int(rows))

    def run(self, key: tuple, inputs: dict, dtype: torch.dtype, chunk_rows: int, out_shapes: dict, work_shapes: dict,
            prepare: Callable[[dict, dict], None], chunk_fn: ChunkFn):  # fmt: skip
        """The chunks of one call. `inputs`: h [S, d] or its column blocks (hidden, markov) as a tuple, th, labels,
        a, b, c (None where absent), S rows; `dtype`: the products' dtype (h and th are held in it). `out_shapes`
        and `work_shapes`: name -> (shape, dtype) or None, `ROWS` standing for the capacity in per-row shapes.
        `prepare(work, outputs)` runs first, in chunk 0's graph (the weights into the work buffers, accumulators
        zeroed). Returns the outputs (copies: the per-row ones' first S rows, the others whole), or None."""
        if self.failed is not None:
            return None
        if key not in self.states and (key not in self.seen or len(self.states) >= self.max_settings):
            self.seen.add(key)
            return None
        rows = _rows_tensor(inputs["h"]).shape[0]
        chunks = -(-rows // chunk_rows)
        state = self.states.get(key)
        try:
            if state is None or state.capacity < chunks * chunk_rows:
                capacity = max(chunks, -(-self.capacity_rows // chunk_rows)) * chunk_rows
                state = self.states[key] = _allocate(inputs, dtype, out_shapes, work_shapes, capacity)
            self._fill(state, inputs, rows, chunks * chunk_rows)
            if len(state.graphs) < chunks:
                self._capture_chunks(state, chunks, chunk_rows, prepare, chunk_fn)
            for graph in state.graphs[:chunks]:
                graph.replay()
        except Exception as err:  # noqa: BLE001 - the caller's plain chunks compute the same outputs
            self._give_up(err)
            self.states.clear()
            return None
        per_row = lambda shape: shape is not None and shape[0][0] is ROWS  # noqa: E731
        return {name: None if t is None else (t[:rows] if per_row(out_shapes[name]) else t).clone()
                for name, t in state.outputs.items()}  # fmt: skip

    @staticmethod
    def _fill(state: _Buffers, inputs: dict, rows: int, padded: int) -> None:
        """This call's rows into the static inputs; the per-row weights of the rows up to the last chunk's end
        zeroed (those rows then add nothing; their other inputs are whatever an earlier call left, all finite)."""
        for name, value in inputs.items():
            static = state.inputs[name]
            if value is None:
                continue
            if isinstance(value, tuple):  # column blocks of one static tensor ([h, z])
                start = 0
                for block in value:
                    static[:rows, start : start + block.shape[1]].copy_(block, non_blocking=True)
                    start += block.shape[1]
            else:
                static[:rows].copy_(value, non_blocking=True)
        for name in ("a", "b", "c"):
            if state.inputs.get(name) is not None and padded > rows:
                state.inputs[name][rows:padded].zero_()

    def _capture_chunks(self, state: _Buffers, chunks: int, chunk_rows: int, prepare, chunk_fn) -> None:
        """Graphs for chunk indices up to `chunks`. Capturing runs nothing, but its warm-ups write the outputs (and
        add into the accumulators): the caller replays every chunk afterwards, from chunk 0's zeroing on."""
        ins, outs, work = state.inputs, state.outputs, state.work
        for k in range(len(state.graphs), chunks):
            rows = slice(k * chunk_rows, (k + 1) * chunk_rows)

            def one_chunk(k=k, rows=rows):
                if k == 0:
                    prepare(work, outs)
                piece = lambda t: None if t is None else t[rows]  # noqa: E731
                stats = chunk_fn(work, ins["h"][rows], ins["z"][rows] if ins.get("z") is not None else None,
                                 piece(ins["th"]), ins["labels"][rows], piece(ins["a"]), piece(ins["b"]),
                                 piece(ins["c"]), piece(outs["grad"]), outs["grad_w2"])  # fmt: skip
                for name, value in zip(("ce", "l1", "soft_ce", "match"), stats):
                    if outs[name] is not None and value is not None:
                        outs[name][rows].copy_(value)

            state.graphs.append(self._counted_capture(one_chunk)[0])


def _allocate(inputs: dict, dtype: torch.dtype, out_shapes: dict, work_shapes: dict, capacity: int) -> _Buffers:
    """Zeroed static buffers of `capacity` rows for these inputs, outputs and work buffers."""
    device = _rows_tensor(inputs["h"]).device

    def like(name, value):
        if value is None:
            return None
        if isinstance(value, tuple):  # column blocks: one tensor, as wide as all of them
            return torch.zeros(capacity, sum(block.shape[1] for block in value), dtype=dtype, device=device)
        held = dtype if name in ("h", "th") else value.dtype
        return torch.zeros(capacity, *value.shape[1:], dtype=held, device=device)

    def made(spec):
        if spec is None:
            return None
        shape, held = spec
        return torch.zeros(tuple(capacity if s is ROWS else s for s in shape), dtype=held, device=device)

    static_in = {name: like(name, value) for name, value in inputs.items()}
    h = inputs["h"]
    static_in["z"] = static_in["h"][:, h[0].shape[1] :] if isinstance(h, tuple) else None  # [h, z]: z's columns
    return _Buffers(capacity, static_in, {name: made(spec) for name, spec in out_shapes.items()},
                    {name: made(spec) for name, spec in work_shapes.items()})  # fmt: skip


def _rows_tensor(value) -> torch.Tensor:
    return value[0] if isinstance(value, tuple) else value


# Stands for the capacity in `out_shapes`' shapes.
ROWS = object()

__all__ = ["LossGraphs", "ROWS"]
