"""The one definition of every speculative-decoding metric in hf_dspark (docs/ALGORITHMS.md, "Metrics").

Training logs, `generate()` statistics and the evaluation command all call these functions.

- tau: committed tokens per verification round = accepted draft tokens + 1 (the bonus/correction token).
- accept_rate@k (conditional): among rounds where slot k was proposed and slots 1..k-1 were accepted, the
  fraction where slot k was accepted.
- verify efficiency: committed tokens / tokens fed to the target in verification forwards.
- tau's interval: a percentile bootstrap over requests (prompts), since rounds of one request are not independent;
  a mean of several datasets' tau resamples the requests of each dataset apart.
- calibration: ECE, AUROC and Brier score of a predicted probability against a 0/1 outcome.
- decoding speed of batched generate() calls: tokens/s, the cost of one step (wall time over the steps the
  batches took, each as long as its longest row) and row fill (counted tokens over rows x steps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from .sampling import rejection_step, residual_after_rejection, sample_without_replacement


@dataclass
class AcceptanceStats:
    """Accumulates verification rounds; every decoding path records into one of these.

    A round of one request: `proposed` draft tokens were verified (the scheduler may cut the block), `accepted`
    of them were accepted (a prefix), and `accepted + 1` tokens were committed. The verification forward fed
    `proposed + 1` tokens to the target (the anchor plus the proposals).
    """

    max_positions: int = 16
    rounds: int = 0
    committed: int = 0
    fed: int = 0
    proposed_total: int = 0
    reached: np.ndarray = field(default=None)  # rounds where slot k was proposed with slots < k accepted
    hit: np.ndarray = field(default=None)  # ... and slot k was accepted
    # Optional confidence records for calibration: (confidences [n_slots], accepted, proposed) per round.
    confidence_records: list = field(default_factory=list)
    # Rounds and committed tokens of each request (a row of a generate() call) when the decoding loop names them;
    # merged statistics number the requests of each merged call after the ones before.
    request_rounds: dict = field(default_factory=dict)
    request_committed: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.reached is None:
            self.reached = np.zeros(self.max_positions, dtype=np.int64)
        if self.hit is None:
            self.hit = np.zeros(self.max_positions, dtype=np.int64)

    def add_round(self, proposed, accepted, confidences=None, committed=None, requests=None, fed=None) -> None:
        """Record one or more request-rounds: proposed/accepted are ints or 1-D tensors/arrays of equal length.

        committed defaults to accepted + 1; pass it when EOS or max_new_tokens cut the round short. fed defaults
        to proposed + 1 (the anchor and one chain); a tree of chains feeds more.
        confidences [rows, n_slots] (optional): the draft's c_k for the proposed slots.
        requests (optional): which request (row of the call) each entry belongs to, for `tau_interval`.
        """
        proposed = np.atleast_1d(_to_numpy(proposed)).astype(np.int64)
        accepted = np.atleast_1d(_to_numpy(accepted)).astype(np.int64)
        if np.any(accepted > proposed):
            raise ValueError("accepted cannot exceed proposed")
        committed = accepted + 1 if committed is None else np.atleast_1d(_to_numpy(committed)).astype(np.int64)
        if proposed.max(initial=0) > self.max_positions:
            self._grow(int(proposed.max()))
        self.rounds += len(proposed)
        self.committed += int(committed.sum())
        if requests is not None:
            for request, n in zip(np.atleast_1d(_to_numpy(requests)).tolist(), committed.tolist()):
                self.request_rounds[request] = self.request_rounds.get(request, 0) + 1
                self.request_committed[request] = self.request_committed.get(request, 0) + int(n)
        self.fed += int((proposed + 1).sum()) if fed is None else int(np.sum(_to_numpy(fed)))
        self.proposed_total += int(proposed.sum())
        k = np.arange(self.max_positions)
        # Slot k+1 (0-based k) was reached when the first k slots were accepted and it was proposed.
        reached = (accepted[:, None] >= k[None, :]) & (proposed[:, None] > k[None, :])
        self.reached += reached.sum(0)
        self.hit += (reached & (accepted[:, None] > k[None, :])).sum(0)
        if confidences is not None:
            conf = _to_numpy(confidences)
            for row in range(len(proposed)):
                if proposed[row] > 0:  # a round that proposed nothing (budget reached) has nothing to calibrate
                    self.confidence_records.append(
                        (conf[row, : proposed[row]].astype(np.float64), accepted[row], proposed[row])
                    )

    def _grow(self, size: int) -> None:
        pad = size - self.max_positions
        self.reached = np.concatenate([self.reached, np.zeros(pad, dtype=np.int64)])
        self.hit = np.concatenate([self.hit, np.zeros(pad, dtype=np.int64)])
        self.max_positions = size

    def merge(self, other: "AcceptanceStats") -> "AcceptanceStats":
        size = max(self.max_positions, other.max_positions)
        if self.max_positions < size:
            self._grow(size)
        self.rounds += other.rounds
        self.committed += other.committed
        self.fed += other.fed
        self.proposed_total += other.proposed_total
        self.reached[: other.max_positions] += other.reached
        self.hit[: other.max_positions] += other.hit
        self.confidence_records.extend(other.confidence_records)
        start = max(self.request_rounds, default=-1) + 1
        for offset, request in enumerate(sorted(other.request_rounds)):
            self.request_rounds[start + offset] = other.request_rounds[request]
            self.request_committed[start + offset] = other.request_committed[request]
        return self

    def per_request(self, requests: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(rounds, committed tokens) of each request recorded with `requests=`. With `requests` (a call's row
        count), one entry per row in row order, 0 for a row without rounds (answered in its first token)."""
        keys = sorted(self.request_rounds) if requests is None else range(requests)
        return (np.array([self.request_rounds.get(k, 0) for k in keys], dtype=np.int64),
                np.array([self.request_committed.get(k, 0) for k in keys], dtype=np.int64))  # fmt: skip

    @property
    def tau(self) -> float:
        return self.committed / self.rounds if self.rounds else float("nan")

    @property
    def verify_efficiency(self) -> float:
        return self.committed / self.fed if self.fed else float("nan")

    @property
    def _used_positions(self) -> int:
        """Positions up to the last one any round reached."""
        return int(np.max(np.nonzero(self.reached)[0]) + 1) if self.reached.any() else 0

    @property
    def accept_count_by_position(self) -> list[int]:
        """Rounds behind each accept_rate@k: slot k proposed with slots 1..k-1 accepted (its denominator)."""
        return [int(n) for n in self.reached[: self._used_positions]]

    @property
    def accept_rate_by_position(self) -> list[float]:
        reached, hit = self.reached, self.hit
        return [float(hit[k] / reached[k]) if reached[k] else float("nan") for k in range(self._used_positions)]

    def to_dict(self) -> dict:
        return {
            "tau": self.tau,
            "rounds": self.rounds,
            "committed_tokens": self.committed,
            "verified_tokens": self.fed,
            "proposed_tokens": self.proposed_total,
            "verify_efficiency": self.verify_efficiency,
            "accept_rate_by_position": self.accept_rate_by_position,
            "accept_count_by_position": self.accept_count_by_position,
            "requests": len(self.request_rounds),
            "tau_ci95": tau_interval([self.per_request()]),
        }


def _to_numpy(x) -> np.ndarray:
    if torch.is_tensor(x):
        return x.detach().float().cpu().numpy() if x.is_floating_point() else x.detach().cpu().numpy()
    return np.asarray(x)


def batched_decoding_speed(new_tokens: int, seconds: float, batches) -> dict:
    """Throughput of batched generate() calls and the cost of one decoding step. `batches`: (longest row's new
    tokens, rows) per call. A batch steps until its longest row stops, so rows that end early (greedy answers
    beside one caught in a loop) lower tokens/s while each step costs the same: `ms_per_longest_row_token` is the
    step's cost, `row_fill` the share of the decoded row-steps that produced a counted token (1.0 when rows end
    together)."""
    steps = sum(longest for longest, _ in batches)
    slots = sum(longest * rows for longest, rows in batches)
    nan = float("nan")
    return {
        "new_tokens": new_tokens,
        "wall_time_s": seconds,
        "tokens_per_s": new_tokens / seconds if seconds else nan,
        "longest_row_tokens": steps,
        "ms_per_longest_row_token": 1e3 * seconds / steps if steps else nan,
        "row_fill": new_tokens / slots if slots else nan,
    }


def _bootstrap_mean_tau(groups, resamples: int, seed: int) -> np.ndarray | None:
    """[resamples, drafts] mean over datasets of each draft's τ, per resample. `groups`: per dataset, one
    (rounds, committed) pair of per-prompt arrays per draft, in the same prompt order; each resample draws one set of
    prompt indices per dataset, shared by the drafts (paired). None when the prompts do not pair up or a dataset has
    fewer than two."""
    groups = [[(np.asarray(r, dtype=np.float64), np.asarray(c, dtype=np.float64)) for r, c in drafts]
              for drafts in groups]  # fmt: skip
    if not groups or any(len({len(r) for r, _ in drafts}) != 1 or len(drafts[0][0]) < 2 for drafts in groups):
        return None
    rng = np.random.default_rng(seed)
    taus = 0.0
    for drafts in groups:
        picks = rng.integers(0, len(drafts[0][0]), size=(resamples, len(drafts[0][0])))
        taus = taus + np.stack([c[picks].sum(1) / np.maximum(r[picks].sum(1), 1) for r, c in drafts], axis=1)
    return taus / len(groups)


def _percentiles(values: np.ndarray, level: float) -> list[float]:
    tail = (1 - level) / 2 * 100
    return [float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))]


def tau_interval(groups, level: float = 0.95, resamples: int = 2000, seed: int = 0) -> list[float] | None:
    """Percentile bootstrap interval of the mean over `groups` of each group's tau (committed / rounds, pooled over
    its requests). `groups`: one (rounds, committed) pair of per-request arrays per dataset; each resample draws
    every group's requests with replacement, apart. None when a group has fewer than two requests."""
    taus = _bootstrap_mean_tau([[group] for group in groups], resamples, seed)
    return None if taus is None else _percentiles(taus[:, 0], level)


def tau_difference_interval(pairs, level: float = 0.95, resamples: int = 2000, seed: int = 0) -> dict | None:
    """Paired bootstrap of the difference in mean τ between two drafts decoded on the same prompts. `pairs`: per
    dataset, ((rounds_a, committed_a), (rounds_b, committed_b)), per-prompt arrays in the same prompt order; each
    resample draws one set of prompt indices per dataset for both drafts. {"difference": τ_a - τ_b (means over the
    datasets), "ci95": [lo, hi]}; None when the prompts do not pair up or a dataset has fewer than two."""
    taus = _bootstrap_mean_tau(pairs, resamples, seed)
    if taus is None:
        return None
    point = np.mean([[np.sum(c) / max(np.sum(r), 1) for r, c in drafts] for drafts in pairs], axis=0)
    return {"difference": float(point[0] - point[1]), "ci95": _percentiles(taus[:, 0] - taus[:, 1], level)}


def wilson_interval(successes: float, trials: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial rate (95% for z = 1.96); (nan, nan) without trials. Unlike the normal
    approximation it stays inside [0, 1] and stays wide for a handful of trials (1 hit of 1 is [0.21, 1])."""
    if trials <= 0:
        return float("nan"), float("nan")
    rate = successes / trials
    denominator = 1 + z * z / trials
    center = (rate + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(rate * (1 - rate) / trials + z * z / (4 * trials * trials)) / denominator
    return max(0.0, center - half), min(1.0, center + half)


# -- training-time estimates ----------------------------------------------------------------------------------


def training_acceptance_estimates(
    accept_rate: torch.Tensor, greedy_match: torch.Tensor, eval_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Estimates of tau from a training batch (docs/ALGORITHMS.md, "DSpark / DFlash loss"):

    accept_rate [..., K] = c*_k = 1 - TV(p_d, p_t); greedy_match [..., K] = 1[argmax p_d = argmax p_t];
    eval_mask [..., K]. tau_prob = 1 + sum_k prod_{i<=k} accept_rate_i * eval_mask_i, tau_greedy likewise,
    averaged over blocks whose first slot is valid. Returns sums and counts (so ranks can be summed before
    dividing): tau_prob_sum, tau_greedy_sum, blocks, accept_sum [K], accept_count [K].
    """
    mask = eval_mask.float()
    valid_blocks = mask[..., 0]  # 1.0 for blocks whose first slot is valid
    survive_prob = torch.cumprod(accept_rate.float() * mask, dim=-1)
    survive_greedy = torch.cumprod(greedy_match.float() * mask, dim=-1)
    # Masked sums rather than boolean indexing: no device-to-host sync inside a training step.
    tau_prob = (1 + survive_prob.sum(-1)) * valid_blocks
    tau_greedy = (1 + survive_greedy.sum(-1)) * valid_blocks
    flat_mask = mask.reshape(-1, mask.shape[-1])
    return {
        "tau_prob_sum": tau_prob.sum(),
        "tau_greedy_sum": tau_greedy.sum(),
        "blocks": valid_blocks.sum(),
        "accept_sum": (accept_rate.float().reshape(-1, mask.shape[-1]) * flat_mask).sum(0),
        "accept_count": flat_mask.sum(0),
    }


def multi_candidate_acceptance(p: torch.Tensor, q: torch.Tensor, candidates: int, replacement: bool = True,
                               samples: int = 32, generator: torch.Generator | None = None) -> torch.Tensor:
    """Chance that one of k drafts is accepted, k = 1..`candidates`, for drafts drawn from q and verified one after
    another by recursive rejection sampling (docs/ALGORITHMS.md, "Several candidates a slot").

    p, q [..., V]: the target's and the draft's distributions at one slot. Drawn independently (`replacement`):
    candidate i is accepted with chance sum min(r_i, q), r_1 = p and r_{i+1} = norm(max(r_i - q, 0)) (the residual
    left by rejecting it), so all k fail with chance prod_i (1 - sum min(r_i, q)): exact. Drawn without
    replacement (as `generate(..., dspark_candidates=k)` samples them): candidate i comes from q_i, q without the
    earlier ones, and the chance depends on which were drawn, so it is averaged over `samples` draws of the k
    candidates per position, each draw's chance of all failing computed exactly (prod_i (1 - min(1, r_i(x_i) /
    q_i(x_i)))): unbiased, with far less spread than simulating the coins too. k = 1 is the single draft's
    1 - TV(p, q) (here in expectation). Returns [..., k]."""
    if not replacement:
        return _distinct_candidates_acceptance(p, q, candidates, samples, generator)
    residual = p.float()
    q = q.float()
    rejected = torch.ones(p.shape[:-1], dtype=torch.float32, device=p.device)
    accepted = []
    for _ in range(candidates):
        rejected = rejected * (1 - torch.minimum(residual, q).sum(-1)).clamp(min=0)
        accepted.append(1 - rejected)
        residual = residual_after_rejection(residual, q)
    return torch.stack(accepted, dim=-1)


def _distinct_candidates_acceptance(p, q, candidates, samples, generator) -> torch.Tensor:
    vocab = p.shape[-1]
    flat_p, flat_q = p.reshape(-1, vocab).float(), q.reshape(-1, vocab).float()
    out = torch.empty(flat_p.shape[0], candidates, device=p.device)
    step = max(1, 2**24 // (samples * vocab))  # positions at once: about 64 MB per [positions, samples, V] tensor
    for start in range(0, flat_p.shape[0], step):
        part = slice(start, start + step)
        rows = flat_p[part].shape[0]
        residual = flat_p[part, None].expand(rows, samples, vocab).reshape(-1, vocab)
        q_left = flat_q[part, None].expand(rows, samples, vocab).reshape(-1, vocab)
        drawn = sample_without_replacement(q_left, candidates, generator)
        failing = torch.ones(residual.shape[0], device=p.device)
        for i in range(candidates):
            q_x, r_x, after, q_left = rejection_step(residual, q_left, drawn[:, i, None])
            chance = torch.where(q_x > 0, (r_x / q_x.clamp_min(1e-30)).clamp(max=1), 0.0)  # (q_x = 0: no draw left)
            failing = failing * (1 - chance)
            out[part, i] = 1 - failing.view(rows, samples).mean(-1)
            residual = torch.where((q_x > 0)[:, None], after, residual)
    return out.view(*p.shape[:-1], candidates)


def top_candidates_match(target_logits: torch.Tensor, draft_logits: torch.Tensor, candidates: int) -> torch.Tensor:
    """Greedy counterpart of `multi_candidate_acceptance`: [..., k] = 1.0 where the target's argmax is among the
    draft's k highest-scoring tokens, k = 1..`candidates`."""
    top = draft_logits.topk(candidates, dim=-1).indices  # [..., candidates]
    hit = top == target_logits.argmax(-1, keepdim=True)
    return hit.float().cumsum(-1).clamp(max=1)


def branched_tau(first_slot: torch.Tensor, accept_rate: torch.Tensor, eval_mask: torch.Tensor) -> torch.Tensor:
    """Expected τ of a round whose first slot holds k candidates, each continued by its own chain of drafts.

    first_slot [..., C]: the chance that one of k candidates is accepted, k = 1..C (`multi_candidate_acceptance`,
    or `top_candidates_match` greedily); accept_rate [..., K]: each slot's acceptance given the slots before it
    (slots 2..K follow whichever candidate was accepted); eval_mask [..., K]. Per block
    τ_k = 1 + A_k m_1 (1 + sum_{j>=2} prod_{2<=i<=j} a_i m_i), which for k = 1 is `training_acceptance_estimates`'
    tau_prob. Returns [C]: the mean over blocks whose first slot is valid."""
    mask = eval_mask.float()
    valid = mask[..., 0]
    later = torch.cumprod(accept_rate[..., 1:].float() * mask[..., 1:], dim=-1).sum(-1)  # expected slots after 1
    tau = 1 + first_slot.float() * (valid * (1 + later))[..., None]
    flat = (tau * valid[..., None]).reshape(-1, tau.shape[-1]).sum(0)
    return flat / valid.sum().clamp(min=1)


def decoding_walk_estimates(
    accept_rate: torch.Tensor,
    greedy_match: torch.Tensor,
    eval_mask: torch.Tensor,
    anchor_positions: torch.Tensor,
    anchor_valid: torch.Tensor,
    candidates: torch.Tensor,
) -> dict[str, float]:
    """τ that decoding the same text would see, from teacher-forced blocks at every position (evaluation only).

    `training_acceptance_estimates` averages τ over all anchors alike. Decoding does not: a round starts where the
    previous one ended, so rounds start more often where the draft fails (right after a rejection) and skip the
    middle of easy stretches (loops, boilerplate), which the all-anchor mean counts at every position. Where easy
    and hard positions cluster that mean overstates decoding τ (an inspection paradox). Here each row is walked
    as decoding would: greedy, from each segment's first anchor, jump by the block's committed tokens (accepted +
    1); sampled, the expected number of rounds by R(p) = 1 + sum_m P_p(m) R(p + m), P_p(m) the chance that the
    block at p commits m tokens (from the survival products of accept_rate). τ = supervised tokens / rounds.

    accept_rate, greedy_match, eval_mask [B, N, K]: per block and slot (as for `training_acceptance_estimates`);
    anchor_positions, anchor_valid [B, N]: the blocks' anchors (sorted by position); candidates [B, T]: where an
    anchor may sit (`anchors.anchor_candidates`). Only rows with an anchor at every candidate can be walked;
    others are left out (`walk_rows_skipped`). Returns sums (add over batches and ranks, then divide):
    walk_tokens, walk_rounds_greedy, walk_rounds_prob, walk_rows, walk_rows_skipped. Copies to the host.
    """
    mask = eval_mask.float() * anchor_valid.bool()[..., None]
    survive_prob = torch.cumprod(accept_rate.float() * mask, dim=-1).cpu().numpy()  # [B, N, K]
    greedy_len = torch.cumprod(greedy_match.float() * mask, dim=-1).sum(-1).cpu().numpy()  # accepted slots
    positions, valid = anchor_positions.cpu().numpy(), anchor_valid.bool().cpu().numpy()
    cand = candidates.bool().cpu().numpy()
    rows, seq = cand.shape
    k = survive_prob.shape[-1]
    walkable = (cand.sum(1) == valid.sum(1)) & (cand.sum(1) > 0)
    # Per position: P(commit m tokens), m = 1..K+1, and the greedy commit; zero where no anchor sits.
    commit_prob = np.zeros((rows, seq, k + 1))
    commit_greedy = np.zeros((rows, seq), dtype=np.int64)
    r_idx, n_idx = np.nonzero(valid & walkable[:, None])
    p_idx = positions[r_idx, n_idx]
    s = survive_prob[r_idx, n_idx]  # [M, K]
    before = np.concatenate([np.ones((len(s), 1)), s], axis=1)  # S_0..S_K
    after = np.concatenate([s, np.zeros((len(s), 1))], axis=1)  # S_1..S_{K+1} = 0
    commit_prob[r_idx, p_idx] = before - after
    commit_greedy[r_idx, p_idx] = greedy_len[r_idx, n_idx].astype(np.int64) + 1
    # Backward over positions: rounds needed from p to the end of its segment (0 past a segment's end).
    pad = k + 1
    rounds_prob = np.zeros((rows, seq + pad))
    rounds_greedy = np.zeros((rows, seq + pad))
    steps = np.arange(1, k + 2)
    for p in range(seq - 1, -1, -1):
        here = cand[:, p] & walkable
        if not here.any():
            continue
        nxt_prob = rounds_prob[:, p + steps]  # [B, K+1]
        rounds_prob[:, p] = np.where(here, 1 + (commit_prob[:, p] * nxt_prob).sum(1), 0.0)
        nxt_greedy = rounds_greedy[np.arange(rows), p + commit_greedy[:, p]]
        rounds_greedy[:, p] = np.where(here, 1 + nxt_greedy, 0.0)
    # Rounds are counted from each segment's first candidate (decoding enters a segment there).
    starts = cand & walkable[:, None] & ~np.concatenate([np.zeros((rows, 1), dtype=bool), cand[:, :-1]], axis=1)
    return {
        "walk_tokens": float(cand[walkable].sum()),
        "walk_rounds_greedy": float(rounds_greedy[:, :seq][starts].sum()),
        "walk_rounds_prob": float(rounds_prob[:, :seq][starts].sum()),
        "walk_rows": float(walkable.sum()),
        "walk_rows_skipped": float((~walkable & (cand.sum(1) > 0)).sum()),
    }


# -- calibration ----------------------------------------------------------------------------------------------


def expected_calibration_error(probs, outcomes, n_bins: int = 15) -> float:
    """ECE with equal-width bins: sum_b |B_b|/N * |mean(prob) - mean(outcome)|."""
    probs, outcomes = np.asarray(probs, dtype=np.float64), np.asarray(outcomes, dtype=np.float64)
    if probs.size == 0:
        return float("nan")
    bins = np.clip((probs * n_bins).astype(int), 0, n_bins - 1)
    total = 0.0
    for b in range(n_bins):
        sel = bins == b
        if sel.any():
            total += sel.sum() * abs(probs[sel].mean() - outcomes[sel].mean())
    return float(total / probs.size)


def auroc(probs, outcomes) -> float:
    """Area under the ROC curve (rank statistic, ties averaged); nan when only one class is present."""
    probs, outcomes = np.asarray(probs, dtype=np.float64), np.asarray(outcomes).astype(bool)
    pos, neg = outcomes.sum(), (~outcomes).sum()
    if pos == 0 or neg == 0:
        return float("nan")
    order = probs.argsort()
    ranks = np.empty(len(probs), dtype=np.float64)
    sorted_probs = probs[order]
    i = 0
    while i < len(probs):
        j = i
        while j + 1 < len(probs) and sorted_probs[j + 1] == sorted_probs[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2.0 + 1
        i = j + 1
    return float((ranks[outcomes].sum() - pos * (pos + 1) / 2) / (pos * neg))


def brier_score(probs, outcomes) -> float:
    probs, outcomes = np.asarray(probs, dtype=np.float64), np.asarray(outcomes, dtype=np.float64)
    return float(np.mean((probs - outcomes) ** 2)) if probs.size else float("nan")


def reliability_curve(probs, outcomes, n_bins: int = 10) -> dict[str, list[float]]:
    """Per-bin mean predicted probability, observed frequency and count (for reliability diagrams)."""
    probs, outcomes = np.asarray(probs, dtype=np.float64), np.asarray(outcomes, dtype=np.float64)
    bins = np.clip((probs * n_bins).astype(int), 0, n_bins - 1)
    predicted, observed, counts = [], [], []
    for b in range(n_bins):
        sel = bins == b
        counts.append(int(sel.sum()))
        predicted.append(float(probs[sel].mean()) if sel.any() else float("nan"))
        observed.append(float(outcomes[sel].mean()) if sel.any() else float("nan"))
    return {"predicted": predicted, "observed": observed, "count": counts}


def calibration_report(probs, outcomes, n_bins: int = 15) -> dict[str, float]:
    return {
        "ece": expected_calibration_error(probs, outcomes, n_bins),
        "auroc": auroc(probs, outcomes),
        "brier": brier_score(probs, outcomes),
        "count": int(np.asarray(probs).size),
    }


def slot_calibration_data(records, slot: int, temperatures=None, kind: str = "conditional"):
    """(predicted, outcome) arrays for 0-based `slot` from AcceptanceStats.confidence_records.

    conditional: c_k against "slot k accepted" among rounds where slots < k were accepted;
    survival: a_k = prod_{i<=k} c_i against "slots 1..k all accepted" among rounds that proposed slot k.
    `temperatures` (STS) rescale the confidences' logits before use.
    """
    predicted, outcome = [], []
    for conf, accepted, proposed in records:
        if proposed <= slot:
            continue
        c = _apply_temperatures(conf[: slot + 1], temperatures)
        if kind == "conditional":
            if accepted < slot:
                continue
            predicted.append(c[slot])
            outcome.append(accepted > slot)
        elif kind == "survival":
            predicted.append(float(np.prod(c)))
            outcome.append(accepted > slot)
        else:
            raise ValueError(f"kind must be 'conditional' or 'survival', got {kind!r}")
    return np.asarray(predicted, dtype=np.float64), np.asarray(outcome, dtype=np.float64)


def _apply_temperatures(conf: np.ndarray, temperatures) -> np.ndarray:
    if temperatures is None:
        return conf
    eps = 1e-7
    c = np.clip(conf, eps, 1 - eps)
    logits = np.log(c) - np.log1p(-c)
    temps = np.asarray(temperatures[: len(conf)], dtype=np.float64)
    return 1.0 / (1.0 + np.exp(-logits / temps))


DEFAULT_STS_GRID = tuple(float(t) for t in np.round(np.exp(np.linspace(np.log(0.25), np.log(8.0), 121)), 4))


def fit_sts_temperatures(records, num_slots: int, grid=DEFAULT_STS_GRID, n_bins: int = 15) -> list[float]:
    """Sequential Temperature Scaling (paper 3.2.1).

    For k = 1..K, choose T_k on `grid` minimizing the ECE of prod_{i<=k} sigmoid(logit_i / T_i) against
    "first k slots all accepted", with T_1..T_{k-1} fixed. `records` as in AcceptanceStats.confidence_records
    (held-out rollouts). Slots without data keep T = 1.

    Equivalent to scoring `slot_calibration_data(records, k, temps + [t], kind="survival")` for every grid
    value, computed on arrays: the fixed slots' product is kept once instead of being rebuilt per grid value.
    """
    logits, accepted, proposed = _survival_arrays(records, num_slots)
    prefix = np.ones(len(accepted))  # prod_{i<k} sigmoid(logit_i / T_i), the slots already fixed
    temps: list[float] = []
    for slot in range(num_slots):
        rows = proposed > slot
        if not rows.any():  # no round proposed this slot (nor any later one)
            temps += [1.0] * (num_slots - slot)
            break
        fixed, slot_logits, outcome = prefix[rows], logits[rows, slot], accepted[rows] > slot
        best_t, best_ece = 1.0, float("inf")
        for t in grid:
            ece = expected_calibration_error(fixed * (1.0 / (1.0 + np.exp(-slot_logits / t))), outcome, n_bins)
            if ece < best_ece - 1e-12:
                best_t, best_ece = t, ece
        temps.append(float(best_t))
        prefix = prefix * (1.0 / (1.0 + np.exp(-logits[:, slot] / best_t)))
    return temps


def _survival_arrays(records, num_slots: int):
    """Confidence records -> (logits [N, num_slots] of the clipped confidences (0 past `proposed`),
    accepted [N], proposed [N]); the clipping is `_apply_temperatures`'s."""
    eps = 1e-7
    logits = np.zeros((len(records), num_slots), dtype=np.float64)
    accepted = np.zeros(len(records), dtype=np.int64)
    proposed = np.zeros(len(records), dtype=np.int64)
    for row, (conf, acc, prop) in enumerate(records):
        c = np.clip(np.asarray(conf[: min(prop, num_slots)], dtype=np.float64), eps, 1 - eps)
        logits[row, : len(c)] = np.log(c) - np.log1p(-c)
        accepted[row], proposed[row] = acc, prop
    return logits, accepted, proposed


__all__ = [
    "branched_tau",
    "multi_candidate_acceptance",
    "top_candidates_match",
    "batched_decoding_speed",
    "wilson_interval",
    "AcceptanceStats",
    "training_acceptance_estimates",
    "expected_calibration_error",
    "auroc",
    "brier_score",
    "reliability_curve",
    "calibration_report",
    "slot_calibration_data",
    "fit_sts_temperatures",
]
