"""What both loss backends share: the row-chunk size that bounds a [rows, V] buffer, and a matmul that
accumulates half-precision inputs into float32 (losses.py, triton_head_loss.py)."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

# Elements of one [rows, V] fp32 buffer per chunk (2**26 = 256 MiB): 384 rows at V = 151,936.
DEFAULT_CHUNK_ELEMENTS = 2**26


def chunk_rows(vocab_size: int, chunk_elements: int | None = None) -> int:
    """Rows per chunk so that a [rows, vocab] fp32 buffer holds about `chunk_elements` elements."""
    budget = chunk_elements or DEFAULT_CHUNK_ELEMENTS
    rows = max(1, budget // max(1, vocab_size))
    return rows if rows < 128 else rows - rows % 128  # whole GEMM tiles


_MM_OUT_DTYPE_OK = True  # torch.mm(..., out_dtype=fp32) for bf16/fp16 inputs (CUDA kernels); probed on first use


def _gemm_accumulates(a: torch.Tensor, acc_dtype: torch.dtype) -> bool:
    """Where a GEMM can take half-precision inputs and accumulate (and write) fp32 itself (CUDA kernels)."""
    return a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and acc_dtype == torch.float32


def _dispatch_mode_active() -> bool:
    """A Python dispatch mode (torch's FlopCounterMode, an operator counter, a tracer) sees every operator. Its own
    failures say nothing of a kernel: FlopCounterMode's addmm formula rejects `out=` after the kernel ran. A failure
    under one must not switch the fused kernels off for the rest of the process (a FLOP count before a timed run
    did, and the timed steps then paid an extra pass over every [rows, V] buffer)."""
    return torch._C._len_torch_dispatch_stack() > 0


def _mm_acc(a: torch.Tensor, b: torch.Tensor, acc_dtype: torch.dtype) -> torch.Tensor:
    """a @ b returned in acc_dtype; half-precision inputs accumulate straight into fp32 where supported."""
    global _MM_OUT_DTYPE_OK
    if _MM_OUT_DTYPE_OK and _gemm_accumulates(a, acc_dtype):
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            if not _dispatch_mode_active():
                _MM_OUT_DTYPE_OK = False
    return (a @ b).to(acc_dtype)


# torch.addmm(c, a, b, out_dtype=fp32, out=c) for bf16/fp16 a, b: None until its first use, which is checked
# against the plain product (one host sync per process), then True; False after a failure or a mismatch.
_ADDMM_OUT_DTYPE_OK: bool | None = None


def _addmm_acc_(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """c += a @ b in place, c in the accumulation dtype: the GEMM adds into c where it can (no product tensor and
    no separate pass over c), else the product is added."""
    global _ADDMM_OUT_DTYPE_OK
    if a.dtype == c.dtype:
        return c.addmm_(a, b)
    # Under a dispatch mode the in-place kernel may have written c before the mode raised: the plain path, and no
    # verdict on the kernel (probed, or used, outside modes only).
    if _ADDMM_OUT_DTYPE_OK is not False and _gemm_accumulates(a, c.dtype) and not _dispatch_mode_active():
        expected = c + _mm_acc(a, b, c.dtype) if _ADDMM_OUT_DTYPE_OK is None else None
        try:
            torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
        except (TypeError, RuntimeError, NotImplementedError):
            _ADDMM_OUT_DTYPE_OK = False
            return c.copy_(expected) if expected is not None else c.add_(_mm_acc(a, b, c.dtype))
        if expected is not None:  # never a silently wrong loss from an untried kernel
            _ADDMM_OUT_DTYPE_OK = bool(torch.allclose(c, expected, rtol=1e-3, atol=1e-3))
            if not _ADDMM_OUT_DTYPE_OK:
                logger.warning("torch.addmm(out_dtype=float32) disagrees with the plain product here; not using it")
                c.copy_(expected)
        return c
    return c.add_(_mm_acc(a, b, c.dtype))


__all__ = ["DEFAULT_CHUNK_ELEMENTS", "chunk_rows"]
