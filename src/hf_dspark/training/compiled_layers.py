"""Compiled layer methods for training, swapped in only inside a `with` block.

The trainer compiles the online target's decoder layers (`compile_target`) and the draft's own layer
methods (`compile_draft_layers`). Outside the block each layer keeps its own methods, so `generate()`, saving and
the inference paths never see the compiled ones.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Sequence

import torch
from torch import nn


class CompiledLayers:
    """`torch.compile`d versions of the named methods of each layer. One compilation serves every layer of a
    kind (the same code; the weights are graph inputs); a new input shape compiles again (with `dynamic=None`
    the second one is dynamic). `recompile_limit` raises dynamo's per-function limit (default 8) inside the
    block: past it dynamo silently runs the function uncompiled. Forward hooks stay outside the compiled code.
    The methods named in `input_grad_methods` get a first argument that requires grad in grad mode
    (`with_input_grad`). `mode` is torch.compile's (e.g. "max-autotune-no-cudagraphs": inductor tries kernel
    configurations, flex attention's included, and keeps the fastest; slower to compile, cached across runs)."""

    def __init__(
        self,
        layers: Iterable[nn.Module],
        methods: Sequence[str] = ("forward",),
        dynamic: bool | None = None,
        recompile_limit: int | None = None,
        input_grad_methods: Sequence[str] = (),
        mode: str | None = None,
    ):
        def compiled(layer, name):
            fn = torch.compile(getattr(layer, name), dynamic=dynamic, mode=mode)
            return with_input_grad(fn) if name in input_grad_methods else fn

        self.pairs = [(layer, name, compiled(layer, name)) for layer in layers for name in methods]
        if not self.pairs:
            raise ValueError(f"no layer has the methods {tuple(methods)} to compile")
        self._limits = {}
        if recompile_limit is not None:
            config = torch._dynamo.config
            key = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
            self._limits = {key: max(getattr(config, key), recompile_limit)}
        self._saved: list = []
        self._patch = contextlib.nullcontext()

    def __enter__(self) -> "CompiledLayers":
        self._saved = [layer.__dict__.get(name) for layer, name, _ in self.pairs]  # e.g. an accelerate wrapper
        for layer, name, compiled in self.pairs:
            setattr(layer, name, compiled)
        self._patch = torch._dynamo.config.patch(**self._limits) if self._limits else contextlib.nullcontext()
        self._patch.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._patch.__exit__(*exc)
        for (layer, name, _), saved in zip(self.pairs, self._saved):
            if saved is None:
                layer.__dict__.pop(name, None)  # back to the class's method
            else:
                setattr(layer, name, saved)


def with_input_grad(fn):
    """`fn` whose first argument, a floating-point tensor, requires grad whenever grad mode is on.

    Dynamo guards on each input's requires_grad, so a layer whose input has none (the first draft layer reads
    frozen embeddings) and one whose input has it (every later layer) compile apart: 8 forward graphs instead of 4
    for a 2-layer DSpark draft over four lengths, 30.7 of the 65.6 s of torch.compile on an H200, and backward
    graphs to match. The price is the first layer's input gradient, a few small matmuls a step."""

    @functools.wraps(fn)
    def call(x, *args, **kwargs):
        if torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.is_floating_point() and not x.requires_grad:
            x = x.detach().requires_grad_()
        return fn(x, *args, **kwargs)

    return call


def compiled_draft_layers(draft: nn.Module, mode: str | None = None) -> CompiledLayers:
    """The draft's `compiled_layer_methods`, as training compiles them (`compile_draft_layers`): static shapes,
    since flex attention inside is compiled per padded length anyway and CPU inductor cannot compile it with
    symbolic lengths; a padded length per recompilation, so dynamo's limit is raised. Every decoder layer's
    input requires grad, so a stack's first layer shares the later ones' graphs (Eagle3 compiles no `forward`: its
    one layer's pieces keep their inputs as they are)."""
    return CompiledLayers(draft.layers, draft.compiled_layer_methods, dynamic=False, recompile_limit=64,
                          input_grad_methods=("forward",), mode=mode)  # fmt: skip


__all__ = ["CompiledLayers", "compiled_draft_layers", "with_input_grad"]
