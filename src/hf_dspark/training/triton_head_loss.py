"""Triton kernels for `fused_head_loss`: the vocabulary-wide loss without [rows, V] tensors in HBM.

Same function as the PyTorch path in `losses.py` (`_chunk_math` documents the math), computed in tiles of
BLOCK_M rows x BLOCK_V vocabulary entries. A logits tile, softcap(h W^T + z W2^T) for the draft and
softcap(t W^T) for the target, is formed in registers from a loop over the hidden size in BLOCK_D steps and
never stored. The L1 term and its gradient need the normalized distributions, so the vocabulary is walked
three times, recomputing the logit tiles each time:

    pass 1  online max / sum-exp of draft and target (-> both log-sum-exps), both argmaxes, the label logit
    pass 2  sum_v |p - q|,  sum_v sign(p - q) p,  sum_v q u                       (only with a target)
    pass 3  the gradient tile g (as in `_chunk_math`) and its products g W -> grad_h, g W2 -> grad_z,
            g^T z -> grad_W2, accumulated with fp32 atomics                       (only when gradients are needed)
Only the L1 gradient needs pass 2's sums before pass 3 (sum_w sign_w p_w); without an L1 weight (DFlash, Eagle3)
pass 3 forms them on the way and pass 2 is skipped. GRAD_MODES has an alternative for pass 3's products.

Each pass runs a grid of (row blocks) x (vocabulary splits): a program walks a contiguous range of vocabulary
tiles and writes its partial statistics, which the host combines ([splits, rows] numbers, negligible).
The frozen lm_head's weight gradient is never formed. Inputs are bf16, fp16 or fp32; products accumulate in
fp32 (fp32 inputs use IEEE fp32 products, not TF32, so they match the PyTorch path).

Cost. Recomputing is the price of holding nothing of size [rows, V]: per (row, vocabulary entry) the passes
take 3 (2d + r) + (d + 2r) multiply-adds with L1 (hidden size d, Markov rank r; 2 (2d + r) + ... without),
against 3d + 3r for the PyTorch path, which forms the logits once and streams [rows, V] fp32 buffers through
memory instead: 2.1-2.3x the matrix work at the SmolLM2 and production shapes. Which is faster depends on the
shapes and the GPU: benchmarks/loss_kernel.py measures both.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# How pass 3 turns gradient tiles into grad_h / grad_z / grad_W2:
#   "fused"    in the kernel (tile products, fp32 atomic adds): nothing of size [rows, V] in memory
#   "chunked"  the kernel writes g for a chunk of rows ([rows, V] in the compute dtype, `chunk_elements` large)
#              and cuBLAS multiplies: no atomics, one bounded buffer
GRAD_MODES = ("fused", "chunked")
DEFAULT_GRAD_MODE = "chunked"  # measured on an H200 at SmolLM2 shapes: 111 ms vs 143 ms fused (atomics)


@dataclass(frozen=True)
class TileConfig:
    """Tile shape and launch options shared by the three passes."""

    block_m: int = 64  # rows per tile
    block_v: int = 128  # vocabulary entries per tile
    block_d: int = 64  # hidden (and Markov-rank) step of the matmul loop
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_m", "block_v", "block_d"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"TileConfig.{name} must be a power of two >= 16 (tl.dot tiles), got {value}")


# Hopper defaults (sm_90 builds, ptxas resource usage): 64 x 128 tiles with 8 warps are the largest that no pass
# spills registers with (draft and target tiles, p, q and g live together in passes 2 and 3; 128 x 128 spills
# 0.1-0.8 KiB a thread); three stages of 64-wide operand tiles take 72 KiB of shared memory (136 KiB in pass
# 3). fp32 inputs use FMA products (no tensor cores at IEEE precision): smaller tiles.
DEFAULT_TILES = {
    torch.bfloat16: TileConfig(),
    torch.float16: TileConfig(),
    torch.float32: TileConfig(block_m=64, block_v=64, block_d=32, num_warps=4, num_stages=2),
}


def interpreting() -> bool:
    """Kernels run on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1, set before import)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# -- device code ----------------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr):
    """a @ b (+ acc) in fp32. Triton's interpreter mis-multiplies bf16/fp16 operands (3.9): there, upcast
    them first (exact products, fp32 sums, as the tensor cores compute them)."""
    if PRECISION == "interpreter":
        a = a.to(tl.float32)
        b = b.to(tl.float32)
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _matmul_tile(x_ptr, w_ptr, rows, row_ok, cols, col_ok, K, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
                 BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """x[rows, :K] @ w[cols, :K]^T in fp32, [BLOCK_M, BLOCK_V]; x and w are row-major with row stride K."""
    acc = tl.zeros((BLOCK_M, BLOCK_V), dtype=tl.float32)
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * K
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _dot(x, tl.trans(w), acc, PRECISION)
    return acc


@triton.jit
def _softcap(u, cap):
    """cap * tanh(u / cap), from exp(-2|x|) (no overflow for any u)."""
    x = u / cap
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0, -t, t)


@triton.jit
def _draft_logits(h_ptr, z_ptr, w_ptr, w2_ptr, rows, row_ok, cols, col_ok, D, R, cap, HAS_MARKOV: tl.constexpr,
                  SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
                  PRECISION: tl.constexpr):  # fmt: skip
    u = _matmul_tile(h_ptr, w_ptr, rows, row_ok, cols, col_ok, D, BLOCK_M, BLOCK_V, BLOCK_D, PRECISION)
    if HAS_MARKOV:
        u += _matmul_tile(z_ptr, w2_ptr, rows, row_ok, cols, col_ok, R, BLOCK_M, BLOCK_V, BLOCK_D, PRECISION)
    if SOFTCAP:
        u = _softcap(u, cap)
    return u


@triton.jit
def _target_logits(t_ptr, w_ptr, rows, row_ok, cols, col_ok, D, cap, SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    ut = _matmul_tile(t_ptr, w_ptr, rows, row_ok, cols, col_ok, D, BLOCK_M, BLOCK_V, BLOCK_D, PRECISION)
    if SOFTCAP:
        ut = _softcap(ut, cap)
    return ut


@triton.jit
def _online_update(u, start, m, s, arg):
    """Fold one tile (invalid columns at -inf) into the running max m, sum-exp s (relative to m) and argmax."""
    tile_max = tl.max(u, axis=1)
    m_new = tl.maximum(m, tile_max)
    s = s * tl.exp(m - m_new) + tl.sum(tl.exp(u - m_new[:, None]), axis=1)
    tile_idx = start + tl.argmax(u, axis=1)  # the first maximum within the tile
    arg = tl.where(tile_max > m, tile_idx, arg)  # strict: an earlier tile keeps ties, like torch.argmax
    return m_new, s, arg


@triton.jit
def _split_tiles(split, tiles_per_split, V, BLOCK_V: tl.constexpr):
    """The vocabulary tiles [first, last) of one split."""
    first = split * tiles_per_split
    return first, tl.minimum(first + tiles_per_split, tl.cdiv(V, BLOCK_V))


@triton.jit(do_not_specialize=["tiles_per_split"])  # one build for any split count
def _pass1_kernel(h_ptr, t_ptr, z_ptr, w_ptr, w2_ptr, labels_ptr, stats_ptr, idx_ptr, S, V, D, R, cap,
                  tiles_per_split, HAS_TARGET: tl.constexpr, HAS_MARKOV: tl.constexpr, SOFTCAP: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
                  PRECISION: tl.constexpr):  # fmt: skip
    """Per (row block, split): stats[0..4] = draft max, draft sum-exp, label logit, target max, target sum-exp;
    idx[0..1] = draft / target argmax. Buffers are [k, splits, S]."""
    split = tl.program_id(1)
    n_split = tl.num_programs(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < S
    labels = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_M,), tl.float32)
    arg = tl.zeros((BLOCK_M,), tl.int32)
    label_logit = tl.zeros((BLOCK_M,), tl.float32)
    mt = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    st = tl.zeros((BLOCK_M,), tl.float32)
    arg_t = tl.zeros((BLOCK_M,), tl.int32)
    first, last = _split_tiles(split, tiles_per_split, V, BLOCK_V)
    for tile in range(first, last):
        cols = tile * BLOCK_V + tl.arange(0, BLOCK_V)
        col_ok = cols < V
        u = _draft_logits(h_ptr, z_ptr, w_ptr, w2_ptr, rows, row_ok, cols, col_ok, D, R, cap, HAS_MARKOV, SOFTCAP,
                          BLOCK_M, BLOCK_V, BLOCK_D, PRECISION)  # fmt: skip
        label_logit += tl.sum(tl.where(cols[None, :] == labels[:, None], u, 0.0), axis=1)
        u = tl.where(col_ok[None, :], u, float("-inf"))
        m, s, arg = _online_update(u, tile * BLOCK_V, m, s, arg)
        if HAS_TARGET:
            ut = _target_logits(t_ptr, w_ptr, rows, row_ok, cols, col_ok, D, cap, SOFTCAP, BLOCK_M, BLOCK_V, BLOCK_D,
                                PRECISION)  # fmt: skip
            ut = tl.where(col_ok[None, :], ut, float("-inf"))
            mt, st, arg_t = _online_update(ut, tile * BLOCK_V, mt, st, arg_t)
    plane = n_split * S
    out = split * S + rows
    tl.store(stats_ptr + out, m, mask=row_ok)
    tl.store(stats_ptr + plane + out, s, mask=row_ok)
    tl.store(stats_ptr + 2 * plane + out, label_logit, mask=row_ok)
    tl.store(idx_ptr + out, arg, mask=row_ok)
    if HAS_TARGET:
        tl.store(stats_ptr + 3 * plane + out, mt, mask=row_ok)
        tl.store(stats_ptr + 4 * plane + out, st, mask=row_ok)
        tl.store(idx_ptr + plane + out, arg_t, mask=row_ok)


@triton.jit
def _probs(h_ptr, t_ptr, z_ptr, w_ptr, w2_ptr, lse_ptr, lse_t_ptr, rows, row_ok, cols, col_ok, D, R, cap,
           HAS_MARKOV: tl.constexpr, NEED_Q: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """Soft-capped draft logits u, draft probs p and (if NEED_Q) target probs q of one tile; 0 off the tile."""
    u = _draft_logits(h_ptr, z_ptr, w_ptr, w2_ptr, rows, row_ok, cols, col_ok, D, R, cap, HAS_MARKOV, SOFTCAP,
                      BLOCK_M, BLOCK_V, BLOCK_D, PRECISION)  # fmt: skip
    ok = row_ok[:, None] & col_ok[None, :]
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    p = tl.where(ok, tl.exp(u - lse[:, None]), 0.0)
    q = p
    if NEED_Q:
        ut = _target_logits(t_ptr, w_ptr, rows, row_ok, cols, col_ok, D, cap, SOFTCAP, BLOCK_M, BLOCK_V, BLOCK_D,
                            PRECISION)  # fmt: skip
        lse_t = tl.load(lse_t_ptr + rows, mask=row_ok, other=0.0)
        q = tl.where(ok, tl.exp(ut - lse_t[:, None]), 0.0)
    return u, p, q, ok


@triton.jit
def _sign(x):
    return tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, 0.0))


@triton.jit
def _l1_sums(p, q, u, ok):
    """Row sums over one tile: sum |p - q|, sum sign(p - q) p, sum q u (the L1 term, its gradient's scalar, SCE)."""
    diff = p - q
    return tl.sum(tl.abs(diff), axis=1), tl.sum(_sign(diff) * p, axis=1), tl.sum(tl.where(ok, q * u, 0.0), axis=1)


@triton.jit
def _store_sums(sums_ptr, split, n_split, S, rows, row_ok, l1, sign_p, qu):
    """One split's partial sums into the [3, splits, S] buffer."""
    plane = n_split * S
    out = split * S + rows
    tl.store(sums_ptr + out, l1, mask=row_ok)
    tl.store(sums_ptr + plane + out, sign_p, mask=row_ok)
    tl.store(sums_ptr + 2 * plane + out, qu, mask=row_ok)


@triton.jit(do_not_specialize=["tiles_per_split"])  # one build for any split count
def _pass2_kernel(h_ptr, t_ptr, z_ptr, w_ptr, w2_ptr, lse_ptr, lse_t_ptr, sums_ptr, S, V, D, R, cap, tiles_per_split,
                  HAS_MARKOV: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
                  BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """Per (row block, split): sums[0..2] = sum |p - q|, sum sign(p - q) p, sum q u. Buffer [3, splits, S]."""
    split = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < S
    l1 = tl.zeros((BLOCK_M,), tl.float32)
    sign_p = tl.zeros((BLOCK_M,), tl.float32)
    qu = tl.zeros((BLOCK_M,), tl.float32)
    first, last = _split_tiles(split, tiles_per_split, V, BLOCK_V)
    for tile in range(first, last):
        cols = tile * BLOCK_V + tl.arange(0, BLOCK_V)
        col_ok = cols < V
        u, p, q, ok = _probs(h_ptr, t_ptr, z_ptr, w_ptr, w2_ptr, lse_ptr, lse_t_ptr, rows, row_ok, cols, col_ok, D,
                             R, cap, HAS_MARKOV, True, SOFTCAP, BLOCK_M, BLOCK_V, BLOCK_D, PRECISION)  # fmt: skip
        tile_l1, tile_sign_p, tile_qu = _l1_sums(p, q, u, ok)
        l1 += tile_l1
        sign_p += tile_sign_p
        qu += tile_qu
    _store_sums(sums_ptr, split, tl.num_programs(1), S, rows, row_ok, l1, sign_p, qu)


@triton.jit(do_not_specialize=["tiles_per_split"])  # one build for any split count
def _pass3_kernel(h_ptr, t_ptr, z_ptr, w_ptr, w2_ptr, labels_ptr, lse_ptr, lse_t_ptr, sign_p_ptr, w_ce_ptr,
                  w_l1_ptr, w_soft_ptr, grad_h_ptr, grad_z_ptr, grad_w2_ptr, g_ptr, sums_ptr, S, V, D, R, cap,
                  tiles_per_split, HAS_MARKOV: tl.constexpr, HAS_L1: tl.constexpr, HAS_SOFT: tl.constexpr,
                  SOFTCAP: tl.constexpr, GRAD_H: tl.constexpr, GRAD_Z: tl.constexpr, GRAD_W2: tl.constexpr,
                  STORE_G: tl.constexpr, SUMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
                  BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """g = d(sum_i w_ce ce + w_l1 l1 + w_soft sce)/d(pre-softcap draft logits) per tile (`_chunk_math`), then
    grad_h += g W, grad_z += g W2, grad_w2 += g^T z (fp32 buffers, atomic adds); or (STORE_G) g itself.
    SUMS (only without L1, whose gradient needs them first): also pass 2's sums, saving that pass."""
    split = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < S
    labels = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
    w_ce = tl.load(w_ce_ptr + rows, mask=row_ok, other=0.0)[:, None]
    if HAS_L1:
        w_l1 = tl.load(w_l1_ptr + rows, mask=row_ok, other=0.0)[:, None]
        sign_p = tl.load(sign_p_ptr + rows, mask=row_ok, other=0.0)[:, None]
    if HAS_SOFT:
        w_soft = tl.load(w_soft_ptr + rows, mask=row_ok, other=0.0)[:, None]
    rows64 = rows.to(tl.int64)
    ks = tl.arange(0, BLOCK_D)
    l1 = tl.zeros((BLOCK_M,), tl.float32)
    sign_p_sum = tl.zeros((BLOCK_M,), tl.float32)
    qu = tl.zeros((BLOCK_M,), tl.float32)
    first, last = _split_tiles(split, tiles_per_split, V, BLOCK_V)
    for tile in range(first, last):
        cols = tile * BLOCK_V + tl.arange(0, BLOCK_V)
        col_ok = cols < V
        u, p, q, ok = _probs(h_ptr, t_ptr, z_ptr, w_ptr, w2_ptr, lse_ptr, lse_t_ptr, rows, row_ok, cols, col_ok, D,
                             R, cap, HAS_MARKOV, HAS_L1 or HAS_SOFT or SUMS, SOFTCAP, BLOCK_M, BLOCK_V, BLOCK_D,
                             PRECISION)  # fmt: skip
        if SUMS:
            tile_l1, tile_sign_p, tile_qu = _l1_sums(p, q, u, ok)
            l1 += tile_l1
            sign_p_sum += tile_sign_p
            qu += tile_qu
        # d CE/du = p - onehot;  d L1/du_v = p_v (sign_v - sum_w sign_w p_w);  d SCE/du = p - q.
        if HAS_L1:
            g = ((_sign(p - q) - sign_p) * w_l1 + w_ce) * p
        else:
            g = p * w_ce
        if HAS_SOFT:
            g += (p - q) * w_soft
        g -= tl.where(cols[None, :] == labels[:, None], w_ce, 0.0)
        if SOFTCAP:
            g *= 1.0 - (u / cap) * (u / cap)
        g = tl.where(ok, g, 0.0).to(w_ptr.dtype.element_ty)
        cols64 = cols.to(tl.int64)
        if STORE_G:
            tl.store(g_ptr + rows64[:, None] * V + cols64[None, :], g, mask=ok)
        if GRAD_H:
            for k0 in range(0, D, BLOCK_D):
                k = k0 + ks
                k_ok = k < D
                w = tl.load(w_ptr + cols64[:, None] * D + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
                part = _dot(g, w, None, PRECISION)
                tl.atomic_add(grad_h_ptr + rows64[:, None] * D + k[None, :], part,
                              mask=row_ok[:, None] & k_ok[None, :], sem="relaxed")  # fmt: skip
        if GRAD_Z or GRAD_W2:
            for k0 in range(0, R, BLOCK_D):
                k = k0 + ks
                k_ok = k < R
                if GRAD_Z:
                    w2 = tl.load(w2_ptr + cols64[:, None] * R + k[None, :], mask=col_ok[:, None] & k_ok[None, :],
                                 other=0.0)  # fmt: skip
                    part = _dot(g, w2, None, PRECISION)
                    tl.atomic_add(grad_z_ptr + rows64[:, None] * R + k[None, :], part,
                                  mask=row_ok[:, None] & k_ok[None, :], sem="relaxed")  # fmt: skip
                if GRAD_W2:
                    z = tl.load(z_ptr + rows64[:, None] * R + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                                other=0.0)  # fmt: skip
                    part = _dot(tl.trans(g), z, None, PRECISION)
                    tl.atomic_add(grad_w2_ptr + cols64[:, None] * R + k[None, :], part,
                                  mask=col_ok[:, None] & k_ok[None, :], sem="relaxed")  # fmt: skip
    if SUMS:
        _store_sums(sums_ptr, split, tl.num_programs(1), S, rows, row_ok, l1, sign_p_sum, qu)


# -- host side ------------------------------------------------------------------------------------------------


@dataclass
class TritonHeadLossResult:
    loss: torch.Tensor  # fp32 scalar
    ce: torch.Tensor  # [S] fp32
    l1: torch.Tensor | None
    soft_ce: torch.Tensor | None
    greedy_match: torch.Tensor | None  # [S] bool
    grad_hidden: torch.Tensor | None  # fp32, [S, d]
    grad_markov: torch.Tensor | None  # fp32, [S, r]
    grad_markov_weight: torch.Tensor | None  # fp32, [V, r]


def unsupported_reason(hidden: torch.Tensor, lm_weight: torch.Tensor, target_hidden, dtype: torch.dtype) -> str | None:
    """Why the Triton kernels cannot take these inputs (None when they can)."""
    if hidden.shape[0] == 0:
        return "no rows"
    if dtype not in SUPPORTED_DTYPES:
        return f"the Triton loss takes bf16, fp16 or fp32 inputs, got {dtype}"
    if not (hidden.is_cuda or (interpreting() and hidden.device.type == "cpu")):
        return f"the Triton loss runs on CUDA tensors (got {hidden.device.type}; TRITON_INTERPRET=1 runs it on CPU)"
    if target_hidden is not None and target_hidden.shape[-1] != lm_weight.shape[1]:
        return "target_hidden's width differs from the lm_head's input size"
    return None


def _splits(row_blocks: int, vocab_tiles: int, device: torch.device, num_splits: int | None) -> tuple[int, int]:
    """(splits, tiles per split): enough programs to fill the GPU several times over, no empty split."""
    if num_splits is None:
        if device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            num_splits = triton.cdiv(4 * sms, row_blocks)
        else:
            num_splits = 1
    num_splits = max(1, min(num_splits, vocab_tiles))
    per_split = triton.cdiv(vocab_tiles, num_splits)
    return triton.cdiv(vocab_tiles, per_split), per_split


def _lse(maxes: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """Log-sum-exp from per-split (max, sum of exp(x - max)) pairs, [splits, S] -> [S]."""
    top = maxes.max(0).values
    return top + (sums * torch.exp(maxes - top)).sum(0).log()


def _argmax(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The first index of the maximum across splits (splits cover ascending vocabulary ranges)."""
    best = values.max(0).values
    hit = values == best
    return torch.where(hit, indices.long(), torch.iinfo(torch.int64).max).min(0).values


def _on_hidden_device(fn):
    """Launch the kernels on hidden's GPU, whichever is current (Triton launches on the current one)."""

    @functools.wraps(fn)
    def wrapper(hidden, *args, **kwargs):
        if not hidden.is_cuda:
            return fn(hidden, *args, **kwargs)
        with torch.cuda.device(hidden.device):
            return fn(hidden, *args, **kwargs)

    return wrapper


@_on_hidden_device
def triton_head_loss(
    hidden: torch.Tensor,
    lm_weight: torch.Tensor,
    labels: torch.Tensor,
    w_ce: torch.Tensor,
    *,
    target_hidden: torch.Tensor | None = None,
    markov: torch.Tensor | None = None,
    markov_weight: torch.Tensor | None = None,
    w_l1: torch.Tensor | None = None,
    w_soft: torch.Tensor | None = None,
    softcap: float | None = None,
    grads: tuple[bool, bool, bool] = (True, True, True),
    tiles: TileConfig | None = None,
    num_splits: int | None = None,
    grad_mode: str | None = None,
    chunk_elements: int | None = None,
) -> TritonHeadLossResult:
    """Loss, per-row stats and gradients (hidden, markov, markov_weight; each where `grads` asks and it exists).

    grad_mode: see GRAD_MODES (default DEFAULT_GRAD_MODE); chunk_elements bounds the "chunked" g buffer.
    All tensors already in the compute dtype except labels (int) and the per-row weights (fp32, [S]).
    """
    S, D = hidden.shape
    V = lm_weight.shape[0]
    R = markov.shape[1] if markov is not None else 0
    has_target, has_markov = target_hidden is not None, markov is not None
    tiles = tiles or DEFAULT_TILES[hidden.dtype]
    if interpreting():
        precision = "interpreter"
    else:
        precision = "ieee" if hidden.dtype == torch.float32 else "tf32"  # tf32 is ignored for half inputs
    device = hidden.device
    f32 = dict(dtype=torch.float32, device=device)
    h, W = hidden.contiguous(), lm_weight.contiguous()
    t = target_hidden.contiguous() if has_target else h
    z = markov.contiguous() if has_markov else h
    W2 = markov_weight.contiguous() if has_markov else W
    labels = labels.to(torch.int32).contiguous()
    cap = float(softcap) if softcap is not None else 1.0
    row_blocks = triton.cdiv(max(S, 1), tiles.block_m)
    splits, per_split = _splits(row_blocks, triton.cdiv(V, tiles.block_v), device, num_splits)
    grid = (row_blocks, splits)
    shared = dict(
        BLOCK_M=tiles.block_m, BLOCK_V=tiles.block_v, BLOCK_D=tiles.block_d, PRECISION=precision,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip

    stats = torch.zeros(5, splits, S, **f32)
    idx = torch.zeros(2, splits, S, dtype=torch.int32, device=device)
    _pass1_kernel[grid](h, t, z, W, W2, labels, stats, idx, S, V, D, R, cap, per_split, HAS_TARGET=has_target,
                        HAS_MARKOV=has_markov, SOFTCAP=softcap is not None, **shared)  # fmt: skip
    lse = _lse(stats[0], stats[1])
    ce = lse - stats[2].sum(0)
    lse_t = match = sums = None
    grad_h_on, grad_z_on, grad_w2_on = grads[0], grads[1] and has_markov, grads[2] and has_markov
    any_grad = grad_h_on or grad_z_on or grad_w2_on
    # Pass 2 runs on its own only when the L1 gradient needs its sums; otherwise pass 3 forms them on the way.
    sums_in_pass3 = has_target and any_grad and w_l1 is None
    if has_target:
        lse_t = _lse(stats[3], stats[4])
        match = _argmax(stats[0], idx[0]) == _argmax(stats[3], idx[1])
        if not sums_in_pass3:
            sums = torch.zeros(3, splits, S, **f32)
            _pass2_kernel[grid](h, t, z, W, W2, lse, lse_t, sums, S, V, D, R, cap, per_split, HAS_MARKOV=has_markov,
                                SOFTCAP=softcap is not None, **shared)  # fmt: skip
            sums = sums.sum(1)  # [3, S]: sum |p - q|, sum sign(p - q) p, sum q u
    grad_h = torch.zeros(S, D, **f32) if grad_h_on else None
    grad_z = torch.zeros(S, R, **f32) if grad_z_on else None
    grad_w2 = torch.zeros(V, R, **f32) if grad_w2_on else None
    if any_grad:
        grad_mode = grad_mode or DEFAULT_GRAD_MODE
        if grad_mode not in GRAD_MODES:
            raise ValueError(f"grad_mode must be one of {', '.join(GRAD_MODES)}, got {grad_mode!r}")
        dummy = lse  # pointer arguments a disabled branch never reads
        per_row = {
            "h": h, "t": t, "z": z, "labels": labels, "lse": lse, "lse_t": lse_t if has_target else dummy,
            "sign_p": sums[1] if w_l1 is not None else dummy, "w_ce": w_ce.contiguous(),
            "w_l1": w_l1.contiguous() if w_l1 is not None else dummy,
            "w_soft": w_soft.contiguous() if w_soft is not None else dummy,
        }  # fmt: skip
        flags = dict(
            HAS_MARKOV=has_markov, HAS_L1=w_l1 is not None, HAS_SOFT=w_soft is not None,
            SOFTCAP=softcap is not None, SUMS=sums_in_pass3, **shared,
        )  # fmt: skip

        def pass3(x, n, grads_out, g):
            """Pass 3 over rows x (n rows); returns its [3, n] sums when it forms them."""
            row_blocks = triton.cdiv(max(n, 1), tiles.block_m)
            splits, per_split = _splits(row_blocks, triton.cdiv(V, tiles.block_v), device, num_splits)
            part = torch.zeros(3, splits, n, **f32) if sums_in_pass3 else dummy
            grad_h, grad_z, grad_w2 = (dummy if out is None else out for out in grads_out)
            _pass3_kernel[(row_blocks, splits)](
                x["h"], x["t"], x["z"], W, W2, x["labels"], x["lse"], x["lse_t"], x["sign_p"], x["w_ce"],
                x["w_l1"], x["w_soft"], grad_h, grad_z, grad_w2, g if g is not None else dummy, part, n, V, D, R,
                cap, per_split, GRAD_H=grads_out[0] is not None, GRAD_Z=grads_out[1] is not None,
                GRAD_W2=grads_out[2] is not None, STORE_G=g is not None, **flags,
            )  # fmt: skip
            return part.sum(1) if sums_in_pass3 else None

        if grad_mode == "fused":
            formed = pass3(per_row, S, (grad_h, grad_z, grad_w2), None)
            sums = formed if sums_in_pass3 else sums
        else:
            from .loss_buffers import _mm_acc, chunk_rows

            rows = max(tiles.block_m, chunk_rows(V, chunk_elements) // tiles.block_m * tiles.block_m)
            g_buffer = torch.empty(min(rows, S), V, dtype=W.dtype, device=device)
            pass3_sums = []
            for start in range(0, S, rows):
                n = min(rows, S - start)
                chunk = {k: v[start : start + n] for k, v in per_row.items()}  # the dummies are [S] too
                g = g_buffer[:n]
                pass3_sums.append(pass3(chunk, n, (None, None, None), g))
                if grad_h_on:
                    grad_h[start : start + n] = g @ W
                if grad_z_on:
                    grad_z[start : start + n] = g @ W2
                if grad_w2_on:
                    grad_w2 += _mm_acc(g.T, chunk["z"], torch.float32)
            if sums_in_pass3:
                sums = torch.cat(pass3_sums, dim=1)
    loss = (w_ce * ce).sum()
    l1 = soft_ce = None
    if has_target:
        l1, soft_ce = sums[0], lse - sums[2]
        if w_l1 is not None:
            loss = loss + (w_l1 * l1).sum()
        if w_soft is not None:
            loss = loss + (w_soft * soft_ce).sum()
    return TritonHeadLossResult(loss, ce, l1, soft_ce, match, grad_h, grad_z, grad_w2)
