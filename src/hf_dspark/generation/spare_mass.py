"""Block verification's spare mass, S[r, k] = sum_v max(0, w[r, k] p[r, k, v] - q[r, k, v]) (rejection.py).

Eagerly, or replayed in a CUDA graph, the PyTorch expression is four kernels (multiply, subtract, clamp, sum),
each streaming [R, K, V] fp32 tensors through memory: at R 16, K 6, V 49,152 about 19 MB apiece, some 4% of a
batch-16 sampled round on an H100 (3.88 against 3.73 ms). On CUDA one Triton kernel (`triton_spare_mass.py`) reads
p and q once and writes [R, K]: replayed in a graph at those shapes, a sampled `verify_block` took 0.196 ms against
0.226 with the expression (H100, benchmarks/verify_cost.py, with BLOCK_V 2048 before the block size was tuned);
with the kernel as shipped, 0.171 against 0.208 on an H200 (0.175 against 0.186 at R 1, V 151,936).

Eagerly the kernel does not pay at that size: a Triton launch costs the host about 40 us more than the
expression's four, and an eager sampled `verify_block` took 0.405 ms with it against 0.354 (at R 32, 0.401 against
0.417). "auto" still takes it for every CUDA call: the decoding round runs from a CUDA graph, and its eager warm-up
runs must compile and load the kernel before the capture records its launch.

Backends: "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "torch" (the expression above), and "auto" (the
default): Triton for CUDA tensors when triton imports and takes the inputs, else torch, and torch for the rest of
the process once the kernel has failed. Under torch.compile "auto" is torch too (inductor fuses the expression
itself). `DEFAULT_BACKEND` is what callers that name none get (benchmarks/verify_cost.py switches it to time both).
"""

from __future__ import annotations

import logging

import torch

from ..kernel_backends import KERNEL_BACKENDS, choose_kernel_backend

logger = logging.getLogger(__name__)

BACKENDS = KERNEL_BACKENDS
DEFAULT_BACKEND = "auto"
_TRITON_FAILED = False  # set when "auto" saw the kernel fail: later calls go straight to torch


def torch_spare_mass(weight: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The reference expression: [R, K] from weight [R, K], p and q [R, K, V]."""
    return (weight[..., None] * p - q).clamp_min(0).sum(dim=-1)


def resolve_backend(weight: torch.Tensor, p: torch.Tensor, q: torch.Tensor, backend: str | None = None) -> str:
    """The backend that runs for these inputs, "triton" or "torch" (module docstring); errors name the fix."""
    backend = DEFAULT_BACKEND if backend is None else backend
    prefer_torch = _TRITON_FAILED or not p.is_cuda or torch.compiler.is_compiling()
    return choose_kernel_backend("spare-mass", backend, f"{__package__}.triton_spare_mass", (weight, p, q),
                                 prefer_torch=prefer_torch)  # fmt: skip


def spare_mass(weight: torch.Tensor, p: torch.Tensor, q: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """sum_v max(0, weight[r, k] p[r, k, v] - q[r, k, v]) as [R, K], for weight [R, K], p and q [R, K, V].

    Any strides on the first two dimensions (slices of larger tensors are read in place). backend: one of BACKENDS,
    None for DEFAULT_BACKEND. No host syncs on any backend: safe inside CUDA graph capture.
    """
    global _TRITON_FAILED
    backend = DEFAULT_BACKEND if backend is None else backend
    if resolve_backend(weight, p, q, backend) == "triton":
        try:
            from .triton_spare_mass import triton_spare_mass

            return triton_spare_mass(weight, p, q)
        except Exception as err:  # noqa: BLE001 - "auto" promises a result: the torch expression is exact
            if backend == "triton":
                raise
            logger.warning("Triton spare-mass kernel failed (%s: %s); using PyTorch", type(err).__name__, err)
            _TRITON_FAILED = True
    return torch_spare_mass(weight, p, q)


__all__ = [
    "BACKENDS",
    "resolve_backend",
    "spare_mass",
    "torch_spare_mass",
]
