"""Triton kernel of `spare_mass.spare_mass`: S[r, k] = sum_v max(0, w[r, k] p[r, k, v] - q[r, k, v]) in one pass.

A program per (row, slot) walks the vocabulary in BLOCK_V steps, reads p and q once, keeps a BLOCK_V-wide fp32
partial sum in registers and writes one number. Where the (row, slot) pairs are too few to occupy the GPU (batch 1:
six programs), each pair's vocabulary is split over several programs and one small sum adds their partial sums in
a fixed order (`num_splits_for`). Nothing but the output and those partial sums is allocated and nothing is read
back on the host, so the launch can sit inside a captured CUDA graph (block verification runs in the round's).
Imported only where the kernel may run: importing this module imports triton.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl

# On an H100 at R 16, K 6, V 49,152 (96 programs, unsplit; CUDA graph replays, L2 flushed) 8192 x 8 warps took
# 24 us, 2048 x 8 warps 39 us, the PyTorch expression 66 us; no other shape was tuned.
BLOCK_V = 8192
NUM_WARPS = 8
# Unsplit, one program streams about 16 GB/s: at batch 1 (six programs, V 151,936, BLOCK_V 2048) the kernel took
# 75 us, the PyTorch expression 24. Splits add programs up to this many per multiprocessor.
PROGRAMS_PER_SM = 1


def interpreting() -> bool:
    """Kernels run on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1, set before import)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _spare_mass_kernel(w_ptr, p_ptr, q_ptr, out_ptr, K, V, per_split, num_splits, stride_wr, stride_wk, stride_pr,
                       stride_pk, stride_qr, stride_qk, BLOCK_V: tl.constexpr):  # fmt: skip
    """Program (r * K + k, s): the sum over vocabulary entries [s * per_split, (s + 1) * per_split) of (r, k)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    # int64 offsets: R * K * V passes 2^31 at large vocabularies and batches.
    r = (pid // K).to(tl.int64)
    k = (pid % K).to(tl.int64)
    w = tl.load(w_ptr + r * stride_wr + k * stride_wk).to(tl.float32)
    p_row = p_ptr + r * stride_pr + k * stride_pk
    q_row = q_ptr + r * stride_qr + k * stride_qk
    first = split * per_split
    end = tl.minimum(first + per_split, V)
    cols = tl.arange(0, BLOCK_V)
    acc = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for start in range(first, end, BLOCK_V):
        v = start + cols
        ok = v < end
        # Masked lanes load p = q = 0 and add max(0, 0) = 0.
        p = tl.load(p_row + v, mask=ok, other=0.0).to(tl.float32)
        q = tl.load(q_row + v, mask=ok, other=0.0).to(tl.float32)
        acc += tl.maximum(w * p - q, 0.0)
    tl.store(out_ptr + pid.to(tl.int64) * num_splits + split, tl.sum(acc, axis=0))


def unsupported_reason(weight: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> str | None:
    """Why the kernel cannot take these inputs (None when it can)."""
    if p.dim() != 3 or q.shape != p.shape or weight.shape != p.shape[:2]:
        shapes = ", ".join(f"{name} {tuple(t.shape)}" for name, t in (("weight", weight), ("p", p), ("q", q)))
        return f"shapes {shapes}: not [R, K], [R, K, V], [R, K, V]"
    if {weight.dtype, p.dtype, q.dtype} != {torch.float32}:
        return f"the kernel takes float32 inputs, got {weight.dtype}, {p.dtype}, {q.dtype}"
    devices = {weight.device, p.device, q.device}
    if len(devices) != 1:
        return f"inputs on several devices: {sorted(map(str, devices))}"
    if not (p.is_cuda or (interpreting() and p.device.type == "cpu")):
        return f"the kernel runs on CUDA tensors (got {p.device.type}; TRITON_INTERPRET=1 runs it on CPU)"
    return None


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def num_splits_for(rows_slots: int, vocab: int, device: torch.device, block_v: int = BLOCK_V) -> int:
    """Vocabulary splits per (row, slot): as many as keep the programs within PROGRAMS_PER_SM per multiprocessor,
    at most one per block. On a 132-SM GPU batch 16 with 6 slots stays at one program per (row, slot) (the layout
    timed above); batch 1 at V 151,936 takes one program per block, 19 for each slot."""
    blocks = triton.cdiv(max(vocab, 1), block_v)
    wanted = PROGRAMS_PER_SM * _multiprocessors(device) // max(rows_slots, 1)
    return max(1, min(wanted, blocks))


def triton_spare_mass(
    weight: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor,
    block_v: int = BLOCK_V,
    num_warps: int = NUM_WARPS,
    num_splits: int | None = None,
) -> torch.Tensor:
    """[R, K] float32 from weight [R, K], p and q [R, K, V] (float32, any strides on the first two dims).

    num_splits: vocabulary ranges per (row, slot) (None: `num_splits_for`). With one the kernel writes the output
    directly; with more it writes [R * K, splits] partial sums and one small sum adds them (in a fixed order).
    """
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= 16 (tl.arange), got {block_v}")
    rows, slots, vocab = p.shape
    # The vocabulary is walked with unit steps; any other layout is copied once (verify_block's never is).
    p = p if p.stride(-1) == 1 else p.contiguous()
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(rows, slots, dtype=torch.float32, device=p.device)
    if out.numel() == 0:
        return out
    if num_splits is None:
        num_splits = num_splits_for(rows * slots, vocab, p.device, block_v)
    per_split = triton.cdiv(triton.cdiv(max(vocab, 1), max(num_splits, 1)), block_v) * block_v
    num_splits = triton.cdiv(max(vocab, 1), per_split)  # rounding to whole blocks may leave fewer, never empty
    partial = out if num_splits == 1 else torch.empty(rows * slots, num_splits, dtype=torch.float32, device=p.device)
    # Triton launches on the current device: make it p's.
    with torch.cuda.device(p.device) if p.is_cuda else contextlib.nullcontext():
        _spare_mass_kernel[(rows * slots, num_splits)](
            weight, p, q, partial, slots, vocab, per_split, num_splits, *weight.stride(), *p.stride()[:2],
            *q.stride()[:2], BLOCK_V=block_v, num_warps=num_warps,
        )  # fmt: skip
    if num_splits > 1:
        torch.sum(partial, dim=1, out=out.view(-1))
    return out


__all__ = [
    "BLOCK_V",
    "NUM_WARPS",
    "PROGRAMS_PER_SM",
    "num_splits_for",
    "triton_spare_mass",
    "unsupported_reason",
]
