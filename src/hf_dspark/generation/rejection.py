"""The one rejection-sampling routine of hf_dspark (docs/ALGORITHMS.md, "Speculative decoding", step 5).

Every decoding path (batch 1, batched, calibration rollouts, benchmarks) verifies draft blocks through
`verify_block`, so losslessness is argued once:

- token sampling (`method="token"`): slot k's draft token x_k is accepted with probability min(1, p_k(x_k) /
  q_k(x_k)), left to right; at the first rejection the next token is drawn from normalize(max(0, p_k - q_k)); if
  all proposed slots are accepted, the bonus token is drawn from p_{l+1}. In both sampling methods q must be exactly
  the distribution x_k was drawn from (`DraftProposal.probs`) and p the target's distribution after the same logits
  processing generate() applies.
- block sampling (the default; Sun et al. 2024, "Block Verification Accelerates Speculative Decoding"): the block
  is judged jointly. With w_0 = 1 and w_k = min(1, w_{k-1} p_k(x_k) / q_k(x_k)), slot k < n may end the accepted
  prefix with probability h_k = S_k / (S_k + 1 - w_k), S_k = sum_x max(0, w_k p_{k+1}(x) - q_{k+1}(x)), and the
  last proposed slot with probability w_n; the prefix is as long as the *last* slot whose coin came up (none: 0
  slots), and the next token is drawn from normalize(max(0, w_a p_{a+1} - q_{a+1})), or from p_{n+1} after all
  n. The output distribution is the target's, and the expected prefix is at least token sampling's (optimal among
  verifiers that read these distributions only): a slot the draft over-weighted no longer ends the block at once
  when the slots before it left probability to spare.
- greedy: accept while argmax p_k == x_k; the next token is argmax p at the first mismatch (or the bonus slot).

Rows verify different numbers of slots (`num_proposed`, chosen by a scheduler before verification and never
from tokens after the slot it admits); slots beyond a row's count are ignored. Fully vectorized: no host syncs.
Block sampling's S_k, a pass over the vocabulary for every slot, run as one fused kernel on CUDA (`spare_mass.py`:
the same sums as the PyTorch expression, added in another order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import rejection_step, sample_from
from .spare_mass import spare_mass

VERIFICATIONS = ("block", "token")


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
    method: str = "block",
) -> VerifyResult:
    """Verify one proposed block per row.

    target_scores [R, n+1, V]: the target's processed logits at [anchor, x_1..x_n] (slot k's row predicts x_k,
    the last one the bonus token); draft_tokens [R, n]; draft_probs [R, n, V]: the exact distributions the draft
    sampled from (unused when greedy); num_proposed [R]: how many leading slots each row verifies (<= n);
    method: "block" or "token" sampling verification (greedy verification is the same for both).
    """
    if method not in VERIFICATIONS:
        raise ValueError(f"verification method {method!r} is not one of {', '.join(map(repr, VERIFICATIONS))}")
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
    if n == 0:
        return VerifyResult(torch.zeros(rows, dtype=torch.long, device=p.device), sample_from(p[:, 0], generator))
    q = draft_probs[:, :n].float()
    p_x = p[:, :n].gather(-1, draft_tokens[..., None]).squeeze(-1)
    q_x = q.gather(-1, draft_tokens[..., None]).squeeze(-1)
    u = torch.rand(rows, n, device=p.device, generator=generator)
    if method == "token":
        # u < p/q  <=>  u * q < p: accept with probability min(1, p/q), no division by q.
        accepted = (u * q_x < p_x) & proposed
        num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)
        weight = torch.ones(rows, device=p.device)
    else:
        num_accepted, weight = _block_prefix(p, q, p_x, q_x, u, num_proposed)

    p_next = _row_slot(p, num_accepted)  # [R, V]: p_{a+1}
    rejected = (num_accepted < num_proposed)[:, None]
    q_next = _row_slot(q, num_accepted.clamp(max=n - 1)) * rejected
    residual = (weight[:, None] * p_next - q_next).clamp_min(0)
    mass = residual.sum(dim=-1, keepdim=True)
    # p == q up to rounding makes a rejection (almost) impossible; fall back to p rather than divide by ~0.
    p_next = torch.where(mass > 1e-12, residual / mass.clamp_min(1e-30), p_next)
    return VerifyResult(num_accepted, sample_from(p_next, generator))


@dataclass
class CandidatesResult:
    """chain [R]: the accepted first-slot candidate (-1: none); num_accepted [R]: accepted drafts along it (0 when
    none, else 1 + those after its first slot); next_tokens [R]: the correction or bonus token."""

    chain: torch.LongTensor
    num_accepted: torch.LongTensor
    next_tokens: torch.LongTensor


def verify_candidates(
    target_scores: torch.Tensor,
    draft_tokens: torch.LongTensor,
    draft_probs: torch.Tensor | None,
    num_proposed: torch.LongTensor,
    do_sample: bool,
    generator: torch.Generator | None = None,
    method: str = "block",
    replacement: bool = False,
) -> CandidatesResult:
    """Verify k chains that share an anchor: a tree that branches at the first slot (docs/ALGORITHMS.md, "Several
    candidates a slot").

    target_scores [R, 1 + k n, V]: the target's processed logits at [anchor, chain 1's x_1..x_n, ..., chain k's]
    (each chain's row j predicts its slot j + 1, its last row the bonus token); draft_tokens [R, k, n];
    draft_probs [R, k, n, V]: the distributions each chain was drawn from, every chain's first slot holding the
    same q_1 (unused when greedy); num_proposed [R]: the leading slots of each chain a row verifies.

    Sampling: the first slot by recursive rejection sampling. The first tokens were drawn from q_1 without
    replacement (`sampling.sample_without_replacement`; `replacement=True`: independently), so candidate i was drawn
    from q_i, q_1 without the earlier candidates, renormalized (q_i = q_1 with replacement). Candidate i is
    accepted with probability min(1, r_i(x^i) / q_i(x^i)), r_1 = p_1, r_{i+1} = normalize(max(0, r_i - q_i)); if
    all fail, the next token is drawn from r_{k+1}. Each step keeps the target's law whatever q_i is, given the
    draws before it; without replacement no candidate repeats one already rejected (which could never be accepted),
    so more are accepted. A candidate with no mass left to draw from (fewer than k tokens in q_1's support) is
    never accepted. Greedy: the candidate equal to the target's argmax, if any. The accepted candidate's chain is
    then verified from its second slot by `verify_block` (its drafts were drawn given that candidate, independently
    of the other chains, so the two steps together keep the target's distribution)."""
    rows, k, n = draft_tokens.shape
    vocab = target_scores.shape[-1]
    if target_scores.shape[1] != 1 + k * n:
        raise ValueError(f"target_scores has {target_scores.shape[1]} positions; {k} chains of {n} need {1 + k * n}")
    proposed = num_proposed > 0
    row = torch.arange(rows, device=target_scores.device)
    first_tokens = draft_tokens[:, :, 0]  # [R, k]
    if not do_sample:
        best = target_scores[:, 0].argmax(dim=-1)
        hit = (first_tokens == best[:, None]) & proposed[:, None]
        chain = torch.where(hit.any(dim=-1), hit.long().argmax(dim=-1), -1)
        first_next = best
    else:
        if draft_probs is None:
            raise ValueError("sampling verification needs draft_probs: the distributions the chains were drawn from")
        residual = torch.softmax(target_scores[:, 0].float(), dim=-1)
        q_left = draft_probs[:, 0, 0].float()  # q_1, less the earlier candidates when drawn without replacement
        chain = torch.full((rows,), -1, dtype=torch.long, device=residual.device)
        for i in range(k):
            q_x, r_x, after, q_left = rejection_step(residual, q_left, first_tokens[:, i, None], replacement)
            u = torch.rand(rows, device=residual.device, generator=generator)
            pending = (chain < 0) & proposed & (q_x > 0)  # (q_x = 0: no draw was left for this candidate)
            accept = pending & (u * q_x < r_x)
            chain = torch.where(accept, i, chain)
            residual = torch.where((pending & ~accept)[:, None], after, residual)
        first_next = sample_from(residual, generator)
    picked = chain.clamp(min=0)
    scores = target_scores[:, 1:].reshape(rows, k, n, vocab)[row, picked]  # [R, n, V]: after the chain's slots
    tokens = draft_tokens[row, picked]
    probs = None if draft_probs is None or not do_sample else draft_probs[row, picked]
    rest = verify_block(
        scores, tokens[:, 1:], None if probs is None else probs[:, 1:], (num_proposed - 1).clamp(min=0), do_sample,
        generator, method,
    )
    found = chain >= 0
    return CandidatesResult(
        chain,
        torch.where(found, rest.num_accepted + 1, 0),
        torch.where(found, rest.next_tokens, first_next),
    )


def tree_depths(candidates: int, n: int, device=None) -> torch.LongTensor:
    """[1 + k n]: each window column's offset from the anchor in the tree layout of `verify_candidates`
    ([anchor, chain 1's slots 1..n, ..., chain k's]): 0, then 1..n for every chain."""
    slots = torch.arange(1, n + 1, device=device).repeat(candidates)
    return torch.cat([slots.new_zeros(1), slots])


def tree_attention(candidates: int, n: int, device=None) -> torch.BoolTensor:
    """[W, W], W = 1 + k n: which window columns each column attends to in that layout: the anchor, and its own
    chain's slots up to itself (each chain sees the sequence it continues, as a single chain would)."""
    chains = torch.arange(candidates, device=device).repeat_interleave(n)
    chain = torch.cat([chains.new_full((1,), -1), chains])
    depth = tree_depths(candidates, n, device)
    own = (chain[:, None] == chain[None, :]) & (depth[None, :] <= depth[:, None])
    return own | (depth == 0)[None, :]


def _block_prefix(p, q, p_x, q_x, u, num_proposed):
    """Block verification's accepted prefix [R] and its weight w_a [R] (module docstring)."""
    rows, n = u.shape
    # w_k = min(1, w_{k-1} r_k) is a clamped random walk in log space: log w_k = c_k - max(0, c_1..c_k) with c the
    # running sum of log r. A token the target never draws (p = 0) sends the walk, and every weight after it, to 0.
    steps = torch.log(p_x) - torch.log(q_x.clamp_min(1e-30))
    walk = torch.cat([steps.new_zeros(rows, 1), steps.cumsum(dim=-1)], dim=1)  # c_0..c_n
    weight = torch.exp(walk - walk.cummax(dim=-1).values)  # [R, n+1]: w_0..w_n
    # h_k for k = 1..n-1 reads slot k+1's distributions; the row's last proposed slot ends with probability w_n.
    spare = spare_mass(weight[:, 1:n], p[:, 1:n], q[:, 1:n])  # [R, n-1]: S_1..S_{n-1}
    denominator = spare + 1 - weight[:, 1:n]
    stop = torch.where(denominator > 1e-12, spare / denominator.clamp_min(1e-30), torch.ones_like(spare))
    stop = torch.cat([stop, stop.new_zeros(rows, 1)], dim=1)  # [R, n]: h_1..h_n; each row's last slot takes w below
    slot = torch.arange(1, n + 1, device=u.device)[None, :]
    last = slot == num_proposed[:, None]
    stop = torch.where(last, weight[:, 1:], stop)
    ends = (u < stop) & (slot <= num_proposed[:, None])
    num_accepted = (ends.long() * slot).amax(dim=-1)  # the last slot whose coin came up; 0 if none did
    return num_accepted, weight.gather(1, num_accepted[:, None]).squeeze(1)


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


__all__ = [
    "VERIFICATIONS", "CandidatesResult", "VerifyResult", "block_tokens", "cut_at_stop", "verify_block",
    "verify_candidates", "tree_attention", "tree_depths",
]
