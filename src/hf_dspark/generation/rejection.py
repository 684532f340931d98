"""The one rejection-sampling routine of hf_dspark (docs/ALGORITHMS.md, "Speculative decoding", step 5).

Every decoding path (batch 1, batched, calibration rollouts, benchmarks) verifies draft blocks through
`verify_block`, so losslessness is argued once:

- sampling: slot k's draft token x_k is accepted with probability min(1, p_k(x_k) / q_k(x_k)), left to right;
  at the first rejection the next token is drawn from normalize(max(0, p_k - q_k)); if all proposed slots are
  accepted, the bonus token is drawn from p_{l+1}. q must be exactly the distribution x_k was drawn from
  (`DraftProposal.probs`) and p the target's distribution after the same logits processing generate() applies.
- greedy: accept while argmax p_k == x_k; the next token is argmax p at the first mismatch (or the bonus slot).

Rows verify different numbers of slots (`num_proposed`, chosen by a scheduler before verification and never
from tokens after the slot it admits); slots beyond a row's count are ignored. Fully vectorized: no host syncs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import sample_from


@dataclass
class VerifyResult:
    """num_accepted [R]: accepted draft tokens (a prefix); next_tokens [R]: the correction or bonus token."""

    num_accepted: torch.LongTensor
    next_tokens: torch.LongTensor


def verify_block(
    target_scores: torch.Tensor,
    draft_tokens: torch.LongTensor,
    draft_probs: torch.Tensor | None,
    num_proposed: torch.LongTensor,
    do_sample: bool,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Verify one proposed block per row.

    target_scores [R, n+1, V]: the target's processed logits at [anchor, x_1..x_n] (slot k's row predicts x_k,
    the last one the bonus token); draft_tokens [R, n]; draft_probs [R, n, V]: the exact distributions the draft
    sampled from (unused when greedy); num_proposed [R]: how many leading slots each row verifies (<= n).
    """
    rows, width, _ = target_scores.shape
    n = width - 1
    if draft_tokens.shape[1] < n:
        raise ValueError(f"draft_tokens cover {draft_tokens.shape[1]} slots but target_scores has {n} draft slots")
    draft_tokens = draft_tokens[:, :n]
    slot = torch.arange(n, device=target_scores.device)
    proposed = slot[None, :] < num_proposed[:, None]  # [R, n]

    if not do_sample:
        # Scores of any float dtype: argmax of bf16 values is the argmax of their (exact) float32 casts.
        choice = target_scores.argmax(dim=-1)  # [R, n+1]
        accepted = (choice[:, :n] == draft_tokens) & proposed
        num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)
        return VerifyResult(num_accepted, choice.gather(1, num_accepted[:, None]).squeeze(1))

    if draft_probs is None and n > 0:
        raise ValueError("sampling verification needs draft_probs: the distributions the draft tokens were drawn from")
    p = torch.softmax(target_scores.float(), dim=-1)  # [R, n+1, V]
    if n > 0:
        q = draft_probs[:, :n].float()
        p_x = p[:, :n].gather(-1, draft_tokens[..., None]).squeeze(-1)
        q_x = q.gather(-1, draft_tokens[..., None]).squeeze(-1)
        u = torch.rand(rows, n, device=p.device, generator=generator)
        # u < p/q  <=>  u * q < p: accept with probability min(1, p/q), no division by q.
        accepted = (u * q_x < p_x) & proposed
        num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)
    else:
        num_accepted = torch.zeros(rows, dtype=torch.long, device=p.device)

    p_next = _row_slot(p, num_accepted)  # [R, V]: p_{a+1}
    if n > 0:
        rejected = (num_accepted < num_proposed)[:, None]
        q_next = _row_slot(q, num_accepted.clamp(max=n - 1)) * rejected
        residual = (p_next - q_next).clamp_min(0)
        mass = residual.sum(dim=-1, keepdim=True)
        # p == q up to rounding makes a rejection (almost) impossible; fall back to p rather than divide by ~0.
        p_next = torch.where(mass > 1e-12, residual / mass.clamp_min(1e-30), p_next)
    next_tokens = sample_from(p_next, generator)
    return VerifyResult(num_accepted, next_tokens)


def _row_slot(values: torch.Tensor, slot: torch.LongTensor) -> torch.Tensor:
    """values [R, k, V] -> [R, V]: each row's entry at `slot` [R] (one gather, no row index)."""
    index = slot[:, None, None].expand(-1, 1, values.shape[-1])
    return values.gather(1, index).squeeze(1)


def block_tokens(window: torch.LongTensor, result: VerifyResult) -> torch.LongTensor:
    """[R, n+1]: the token after each window position [anchor, x_1..x_n]: x_{j+1} while accepted, then the
    correction or bonus token (columns after it keep unaccepted drafts, which no caller reads)."""
    shifted = torch.cat([window[:, 1:], window[:, :1]], dim=1)
    return shifted.scatter(1, result.num_accepted[:, None], result.next_tokens[:, None])


def cut_at_stop(tokens: torch.LongTensor, counts: torch.LongTensor, stop_ids: torch.LongTensor):
    """(counts cut just after the first stop token among each row's first `counts` tokens, rows that stopped)."""
    width = tokens.shape[1]
    slot = torch.arange(width, device=tokens.device)
    first = slot.masked_fill(torch.isin(tokens, stop_ids, invert=True), width).amin(dim=-1)  # width: none
    return torch.minimum(counts, first + 1), first < counts


__all__ = ["VerifyResult", "block_tokens", "cut_at_stop", "verify_block"]
