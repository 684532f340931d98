"""Capturing a function of static buffers as a CUDA graph: the one recipe the draft, verification and whole-round
runners share (`draft_graphs.py`, `target_graphs.py`, `round_graph.py`)."""

from __future__ import annotations

import torch


def capture(fn, warmups: int = 2, before_warmup=None, pool=None):
    """(graph, outputs of the captured call). `fn` is run `warmups` times eagerly on a side stream first (lazy
    library initialization, e.g. cuBLAS handles, must not happen inside a capture); `before_warmup()` may put the
    buffers in a state where those runs change nothing that is read later."""
    if before_warmup is not None:
        before_warmup()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = fn()
    return graph, outputs


__all__ = ["capture"]
