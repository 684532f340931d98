"""Anchor sampling and the anchor-block attention rule of DFlash/DSpark training.

A training row holds many blocks at once. Block n starts at anchor position p_n; its slot j (0-based) sits at
RoPE position p_n + j and predicts token p_n + j + 1. The attention rule, identical in training and inference:
a slot sees context positions strictly before its anchor and every slot of its own block, nothing else.
"""

from __future__ import annotations

import logging

import torch

try:
    from torch.nn.attention.flex_attention import BlockMask
except ImportError:  # pragma: no cover
    BlockMask = None

logger = logging.getLogger(__name__)


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] -> bool [B, T]: positions p < T-1 with loss_mask[p] = loss_mask[p+1] = 1."""
    lm = loss_mask.bool()
    cand = torch.zeros_like(lm)
    cand[:, :-1] = lm[:, :-1] & lm[:, 1:]
    return cand


def sample_anchors(
    loss_mask: torch.Tensor,
    num_anchors: int,
    generator: torch.Generator | None = None,
    fixed_count: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `num_anchors` candidates per row, uniformly without replacement, sorted.

    Returns `(positions [B, N], valid [B, N])`; rows with fewer candidates are padded with masked dummy anchors
    at position 0, placed last. N = min(num_anchors, most candidates in any row), which reads the count on the
    host; with `fixed_count=True`, N = min(num_anchors, T - 1) is fixed by the shape, so a training step needs no
    host synchronization (the trainer's choice). Random numbers are drawn where `generator` lives.
    """
    cand = anchor_candidates(loss_mask)
    seq = cand.shape[1]
    if fixed_count:
        n = fixed_anchor_count(num_anchors, seq)
    else:
        n = max(1, min(num_anchors, int(cand.sum(dim=1).max().item()) if seq else 0))
    device = cand.device if generator is None else generator.device
    scores = torch.rand(cand.shape, generator=generator, device=device).to(cand.device)
    top, idx = scores.masked_fill(~cand, -1.0).topk(n, dim=1)
    valid = top >= 0
    order = torch.where(valid, idx, torch.full_like(idx, seq)).argsort(dim=1)
    positions = torch.where(valid, idx, torch.zeros_like(idx)).gather(1, order)
    return positions, valid.gather(1, order)


def covering_anchor_passes(loss_mask: torch.Tensor, num_anchors: int, passes: int | None = None):
    """Every anchor candidate of every row, split over passes of the training step's shape: each pass is
    `(positions [B, N], valid [B, N])` as `sample_anchors(..., fixed_count=True)` returns them (sorted, masked
    dummy anchors at position 0 placed last, N = `fixed_anchor_count(num_anchors, T)`). Pass j holds each row's
    candidates j, j + P, j + 2P, ... (in position order) for P passes, so every pass spreads over the whole row.
    Blocks do not see each other, so the passes together give a block at every candidate, as if N were T: what
    a held-out walk needs (`metrics.decoding_walk_estimates`), with no new compiled shapes.

    P = `covering_pass_count`; `passes` (at least that) overrides it, e.g. the largest P over processes, so that
    sharded models run the same number of forwards on every process."""
    cand = anchor_candidates(loss_mask)
    seq = cand.shape[1]
    n = fixed_anchor_count(num_anchors, seq)
    needed = _passes_needed(cand, n)
    if passes is None:
        passes = needed
    elif passes < needed:
        raise ValueError(f"{passes} passes of {n} anchors cannot cover a row with up to {needed * n} candidates")
    rank = cand.long().cumsum(dim=1) - 1  # each candidate's index among its row's candidates
    where = torch.arange(seq, device=cand.device).expand_as(cand)
    out = []
    for j in range(passes):
        take = cand & (rank % passes == j)
        # Taken positions first, in order; the rest sort past the end (seq) and become dummy anchors.
        first = torch.where(take, where, torch.full_like(where, seq)).sort(dim=1).values[:, :n]
        valid = first < seq
        out.append((torch.where(valid, first, torch.zeros_like(first)), valid))
    return out


def covering_pass_count(loss_mask: torch.Tensor, num_anchors: int) -> int:
    """How many passes `covering_anchor_passes` needs: ceil(most candidates in a row / anchors a pass), at least 1.
    Reads the count on the host."""
    cand = anchor_candidates(loss_mask)
    return _passes_needed(cand, fixed_anchor_count(num_anchors, cand.shape[1]))


def _passes_needed(cand: torch.Tensor, per_pass: int) -> int:
    return max(1, -(-int(cand.sum(dim=1).max().item()) // per_pass)) if cand.shape[1] else 1


def fixed_anchor_count(num_anchors: int, seq_len: int) -> int:
    """Blocks per row when the count is fixed by the padded length (`sample_anchors(..., fixed_count=True)`)."""
    return max(1, min(num_anchors, seq_len - 1))


def anchor_slots_bound(loss_mask: torch.Tensor, num_anchors: int, block_size: int) -> int:
    """At most how many block slots of a batch are supervised (its loss rows): every anchor
    `sample_anchors(..., fixed_count=True)` can find, times the block size (slots past an answer's end are not
    supervised, so the bound is above the count by a few slots an answer). From a collated batch on the host, it
    sizes the loss's row buffer without a read-back from the device. `loss_mask` already times the attention mask."""
    per_row = anchor_candidates(loss_mask).sum(dim=1)
    n = fixed_anchor_count(num_anchors, loss_mask.shape[1])
    return block_size * int(per_row.clamp(max=n).sum())


def block_positions(anchor_positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, N] -> [B, N * block_size]: RoPE position p_n + j of every slot."""
    offsets = torch.arange(block_size, device=anchor_positions.device)
    return (anchor_positions[:, :, None] + offsets).flatten(1)


def dense_block_mask(anchor_positions: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """bool [B, 1, N*K, T + N*K], True where a slot may attend (keys ordered `[context; blocks]`)."""
    batch, num_blocks = anchor_positions.shape
    device = anchor_positions.device
    q_anchor = anchor_positions.repeat_interleave(block_size, dim=1)  # [B, N*K]
    ctx = torch.arange(context_len, device=device)
    sees_ctx = ctx[None, None, :] < q_anchor[:, :, None]  # [B, N*K, T]
    block_id = torch.arange(num_blocks, device=device).repeat_interleave(block_size)
    sees_block = (block_id[:, None] == block_id[None, :]).expand(batch, -1, -1)
    return torch.cat([sees_ctx, sees_block], dim=-1).unsqueeze(1)


# flex_attention's query and key tile (BlockMask.BLOCK_SIZE).
FLEX_TILE = 128


def flex_block_mask(anchor_positions: torch.Tensor, context_len: int, block_size: int):
    """The same rule as a flex_attention BlockMask (sparse: blocks skip masked tiles).

    The tile map is computed from the anchors directly (`anchor_block_tiles`), not by `create_block_mask`, which
    evaluates the rule on every query x key pair and had to be compiled anew for every batch shape and grad mode
    (96 s of a 12-minute training run went to those compilations).

    On CPU the mask covers keys padded to whole 128-key tiles (`attend` pads keys/values to
    `mask.seq_lengths[1]`): torch's compiled CPU flex kernel reads key rows past the end of a partial last tile
    on some ISAs (seen with AVX2, torch 2.13), so the last batch row attended to whatever memory followed the key
    tensor (NaN or garbage). Padded keys fall outside every block and are masked out. CUDA needs no padding.
    """
    if BlockMask is None:  # pragma: no cover
        raise RuntimeError("flex_attention is not available in this torch build")
    batch, num_blocks = anchor_positions.shape
    q_len = num_blocks * block_size
    kv_len = flex_key_length(context_len + q_len, anchor_positions.device)
    q_anchor = anchor_positions.repeat_interleave(block_size, dim=1)  # [B, Q]

    def mask_mod(b, h, q_idx, kv_idx):
        in_ctx = kv_idx < context_len
        sees_ctx = kv_idx < q_anchor[b, q_idx]
        same_block = (kv_idx - context_len) // block_size == q_idx // block_size  # padding: block >= N
        return (in_ctx & sees_ctx) | (~in_ctx & same_block)

    partial, full = anchor_block_tiles(q_anchor, context_len, block_size, kv_len)
    return tiles_block_mask(partial, full, mask_mod, q_len, kv_len)


def flex_key_length(kv_len: int, device: torch.device) -> int:
    """The key length a BlockMask covers: on CPU whole 128-key tiles (`flex_block_mask` says why; `attend` pads the
    keys to it), on CUDA the keys themselves."""
    return -(-kv_len // FLEX_TILE) * FLEX_TILE if device.type == "cpu" else kv_len


def tiles_block_mask(partial: torch.Tensor, full: torch.Tensor, mask_mod, q_len: int, kv_len: int):
    """A BlockMask from tile maps bool [B, 1, Q tiles, KV tiles] (partly / wholly attended tiles) and the rule
    `mask_mod` applied inside the partial ones."""
    try:
        return BlockMask.from_kv_blocks(
            *_ordered_tiles(partial), *_ordered_tiles(full), BLOCK_SIZE=FLEX_TILE, mask_mod=mask_mod,
            seq_lengths=(q_len, kv_len),
        )  # fmt: skip
    except TypeError as err:  # a torch whose from_kv_blocks takes other arguments: the compiled derivation
        from torch.nn.attention.flex_attention import create_block_mask

        logger.warning("BlockMask.from_kv_blocks failed (%s); using create_block_mask", err)
        return create_block_mask(mask_mod, partial.shape[0], None, q_len, kv_len, device=partial.device, _compile=True)


def anchor_block_tiles(
    q_anchor: torch.Tensor, context_len: int, block_size: int, kv_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which FLEX_TILE x FLEX_TILE tiles of the anchor-block rule are partly and which wholly attended.

    q_anchor [B, Q]: the anchor of each query row (row q is slot q % block_size of block q // block_size; an
    anchor never exceeds context_len - 1). Keys: context [0, context_len), then the blocks, then padding up to
    kv_len. Row q attends context keys k < anchor(q) and the keys of its own block. Returns bool
    `(partial, full)` [B, 1, Q tiles, KV tiles], exactly what create_block_mask derives from the dense mask
    (edge tiles, padded with masked entries, are never full), from per-tile bounds: O(B x tiles), no [Q, KV] mask.
    """
    batch, q_len = q_anchor.shape
    device, tile = q_anchor.device, FLEX_TILE
    q_tiles, kv_tiles = -(-q_len // tile), -(-kv_len // tile)
    pad = q_tiles * tile - q_len
    # Per query tile: the largest and smallest anchor of its rows and the range of blocks they belong to.
    a_max = _pad_right(q_anchor, pad, -1).view(batch, q_tiles, tile).amax(-1)[:, :, None]  # [B, QT, 1]
    a_min = _pad_right(q_anchor, pad, kv_len).view(batch, q_tiles, tile).amin(-1)[:, :, None]
    q0 = torch.arange(q_tiles, device=device) * tile
    q1 = (q0 + tile).clamp(max=q_len)
    blocks_lo = (context_len + (q0 // block_size) * block_size)[:, None]  # [QT, 1]: first key of the first block
    blocks_hi = (context_len + ((q1 - 1) // block_size + 1) * block_size)[:, None]  # one past the last block's
    single_block = ((q0 // block_size) == ((q1 - 1) // block_size))[:, None]
    whole_q = (q1 - q0 == tile)[:, None]
    k0 = torch.arange(kv_tiles, device=device) * tile
    k1 = (k0 + tile).clamp(max=kv_len)
    whole = whole_q & (k1 - k0 == tile)[None, :]  # [QT, KT]

    any_ctx = k0 < a_max  # some row's anchor lies past the tile's first key (anchors sit inside the context)
    any_block = torch.maximum(k0, blocks_lo) < torch.minimum(k1, blocks_hi)
    full_ctx = whole & (k1 - 1 < a_min)  # every key before every row's anchor
    full_block = whole & single_block & (k0 >= blocks_lo) & (k1 <= blocks_hi)  # only when block_size >= a tile
    full = full_ctx | full_block
    partial = (any_ctx | any_block) & ~full
    return partial.unsqueeze(1), full.unsqueeze(1)


def _pad_right(x: torch.Tensor, right: int, value: int) -> torch.Tensor:
    """Pad the last dimension of `x` on the right with `value`."""
    return torch.nn.functional.pad(x, (0, right), value=value) if right else x


def _ordered_tiles(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [B, H, QT, KT] -> (tiles per query row [B, H, QT], their indices first, ascending [B, H, QT, KT])."""
    dense = tiles.to(torch.int32)
    indices = torch.argsort(dense, dim=-1, descending=True, stable=True)
    return dense.sum(-1, dtype=torch.int32), indices.to(torch.int32)


__all__ = [
    "anchor_block_tiles",
    "anchor_candidates",
    "sample_anchors",
    "block_positions",
    "dense_block_mask",
    "flex_block_mask",
    "flex_key_length",
    "tiles_block_mask",
]
