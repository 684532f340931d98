"""The one definition of tau, conditional acceptance, verify efficiency and calibration metrics."""

import numpy as np
import pytest
import torch

from hf_dspark.metrics import (
    AcceptanceStats,
    auroc,
    branched_tau,
    multi_candidate_acceptance,
    top_candidates_match,
    brier_score,
    expected_calibration_error,
    fit_sts_temperatures,
    slot_calibration_data,
    decoding_walk_estimates,
    training_acceptance_estimates,
    tau_difference_interval,
    tau_interval,
    wilson_interval,
)


def test_tau_counts_the_bonus_token_and_acceptance_is_conditional():
    stats = AcceptanceStats()
    stats.add_round(proposed=[4, 4, 4, 2], accepted=[4, 1, 0, 2])
    assert stats.tau == pytest.approx((5 + 2 + 1 + 3) / 4)
    # slot 1 reached by 4 rounds, accepted by 3; slot 2 reached by 3 (4, 1, 2) accepted by 2 (4, 2).
    rates = stats.accept_rate_by_position
    assert rates[0] == pytest.approx(3 / 4)
    assert rates[1] == pytest.approx(2 / 3)
    assert rates[2] == pytest.approx(1 / 1)  # only the first round proposed slot 3 with slots 1-2 accepted
    assert stats.verify_efficiency == pytest.approx(11 / 18)
    assert stats.accept_count_by_position == [4, 3, 1, 1]  # the denominators behind the rates
    assert stats.to_dict()["accept_count_by_position"] == [4, 3, 1, 1]
    with pytest.raises(ValueError):
        stats.add_round(proposed=[1], accepted=[2])


def test_merge_equals_one_accumulator():
    a, b, both = AcceptanceStats(), AcceptanceStats(max_positions=3), AcceptanceStats()
    a.add_round([3, 3], [1, 3])
    b.add_round([2], [0])
    both.add_round([3, 3, 2], [1, 3, 0])
    assert a.merge(b).to_dict() == both.to_dict()


def test_requests_are_counted_apart_and_merged_calls_number_theirs_after():
    a, b = AcceptanceStats(), AcceptanceStats()
    a.add_round([3, 3], [1, 3], requests=[0, 1])
    a.add_round([3], [2], requests=[1])
    b.add_round([3, 3], [0, 0], requests=[0, 5])
    assert [x.tolist() for x in a.per_request()] == [[1, 2], [2, 7]]
    merged = a.merge(b)
    rounds, committed = merged.per_request()
    assert rounds.tolist() == [1, 2, 1, 1] and committed.tolist() == [2, 7, 1, 1]
    assert rounds.sum() == merged.rounds and committed.sum() == merged.committed
    assert merged.to_dict()["requests"] == 4
    assert AcceptanceStats().to_dict()["tau_ci95"] is None  # no requests named: no interval


def test_tau_interval_covers_the_true_tau_at_its_level():
    """Requests of unequal difficulty (rounds within one are alike): the bootstrap over requests covers the
    population τ in about 95% of repeated experiments."""
    rng = np.random.default_rng(0)
    trials, covered = 300, 0
    true_tau = 1 + 0.5 * 3  # each request's acceptance rate is uniform on [0, 1]: mean τ over a 3-slot geometric
    for trial in range(trials):
        rounds = rng.integers(20, 40, size=24)
        p = rng.uniform(0, 1, size=24)
        committed = np.array([(1 + rng.binomial(3, q, size=n)).sum() for q, n in zip(p, rounds)])
        lo, hi = tau_interval([(rounds, committed)], resamples=400, seed=trial)
        # The population τ of this design: E[committed] / E[rounds] = 1 + 3 E[p] (rounds independent of p).
        covered += lo <= true_tau <= hi
    assert 0.88 <= covered / trials <= 0.99, covered / trials
    # A mean over two datasets resamples each apart: the same data twice reads as two independent samples, the
    # same centre and an interval narrower by about sqrt(2).
    one = tau_interval([(rounds, committed)], seed=1)
    two = tau_interval([(rounds, committed), (rounds, committed)], seed=1)
    assert sum(two) / 2 == pytest.approx(sum(one) / 2, abs=0.03)
    assert (two[1] - two[0]) / (one[1] - one[0]) == pytest.approx(2**-0.5, rel=0.15)
    assert tau_interval([([3], [5])]) is None  # one request: no interval


def test_paired_difference_sees_a_gap_the_separate_intervals_cannot():
    """Prompts differ far more than two drafts do: the drafts' own intervals overlap, but paired over the same
    prompts a consistent gain of 0.1 τ is resolved; identical drafts differ by exactly 0."""
    rng = np.random.default_rng(1)
    n = 32
    rounds = rng.integers(20, 40, size=n)
    base = rng.uniform(1.2, 3.5, size=n)  # per-prompt τ: the prompts set most of the spread
    committed_b = np.round(base * rounds)
    committed_a = committed_b + np.round(0.1 * rounds)  # draft A commits 0.1 more per round on every prompt
    a, b = tau_interval([(rounds, committed_a)]), tau_interval([(rounds, committed_b)])
    assert a[0] < b[1]  # apart, the intervals overlap
    paired = tau_difference_interval([((rounds, committed_a), (rounds, committed_b))])
    assert paired["difference"] == pytest.approx(committed_a.sum() / rounds.sum() - committed_b.sum() / rounds.sum())
    assert 0 < paired["ci95"][0] <= paired["difference"] <= paired["ci95"][1]
    same = tau_difference_interval([((rounds, committed_b), (rounds, committed_b))] * 2)
    assert same == {"difference": 0.0, "ci95": [0.0, 0.0]}
    assert tau_difference_interval([((rounds, committed_a), (rounds[:-1], committed_b[:-1]))]) is None  # unpaired


def test_training_estimates():
    rate = torch.tensor([[0.5, 0.5, 1.0], [1.0, 1.0, 1.0]])
    match = torch.tensor([[1, 0, 1], [1, 1, 1]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    est = training_acceptance_estimates(rate, match, mask)
    assert est["blocks"] == 2
    assert est["tau_prob_sum"].item() == pytest.approx((1 + 0.5 + 0.25 + 0.25) + (1 + 1 + 1))
    assert est["tau_greedy_sum"].item() == pytest.approx((1 + 1) + (1 + 2))


def walk_blocks(loss_mask: list[int], easy: set[int], k: int, rate: float = 1.0):
    """Blocks anchored at every candidate of one row: slot j of the block at p predicts token p + j + 1, matched
    greedily where that token is in `easy`; accept rate `rate` there, 0.2 elsewhere."""
    from hf_dspark.models.anchors import anchor_candidates

    lm = torch.tensor([loss_mask])
    cand = anchor_candidates(lm)
    positions = cand[0].nonzero().flatten()
    seq = len(loss_mask)
    target = positions[:, None] + torch.arange(1, k + 1)  # [N, K] token each slot predicts
    inside = target < seq
    mask = inside & lm[0][target.clamp(max=seq - 1)].bool()
    match = torch.tensor([[int(t) in easy for t in row] for row in target]) & mask
    rate_t = torch.where(match, torch.tensor(rate), torch.tensor(0.2))
    valid = torch.ones_like(positions[None], dtype=torch.bool)
    return rate_t[None], match[None], mask[None], positions[None], valid, cand


def simulated_greedy_rounds(loss_mask, easy, k) -> tuple[int, int]:
    """Decoding by hand: from the first candidate, commit the leading easy supervised tokens + 1, until the answer
    is passed. (tokens predicted by blocks, rounds)."""
    cand = [p for p in range(len(loss_mask) - 1) if loss_mask[p] and loss_mask[p + 1]]
    supervised = {i for i, m in enumerate(loss_mask) if m}
    p, rounds = cand[0], 0
    while p in cand:
        accepted = 0
        while accepted < k and p + accepted + 1 in easy & supervised:
            accepted += 1
        p, rounds = p + accepted + 1, rounds + 1
    return len(cand), rounds


def test_decoding_walk_counts_the_rounds_decoding_would_run():
    """Easy tokens in one stretch: the all-anchor mean counts every position of the stretch, decoding crosses it
    in a few rounds (the inspection paradox that made held-out τ overstate decoded τ)."""
    loss_mask = [0] * 3 + [1] * 26 + [0] * 3  # prompt, a 26-token answer, padding
    easy = set(range(4, 16))  # the first half of the answer is a loop the draft always gets right
    blocks = walk_blocks(loss_mask, easy, k=3)
    walk = decoding_walk_estimates(*blocks)
    tokens, rounds = simulated_greedy_rounds(loss_mask, easy, k=3)
    assert (walk["walk_tokens"], walk["walk_rounds_greedy"]) == (tokens, rounds) == (25, 16)
    all_anchor = training_acceptance_estimates(*blocks[:3])
    assert all_anchor["tau_greedy_sum"] / all_anchor["blocks"] == pytest.approx(2.32)  # (10*4 + 3 + 2 + 13*1) / 25
    assert walk["walk_tokens"] / walk["walk_rounds_greedy"] == pytest.approx(25 / 16)  # 1.56: what decoding sees
    # Every token easy: each round commits K + 1 = 4 (the last one runs past the answer's end).
    every = decoding_walk_estimates(*walk_blocks(loss_mask, set(range(32)), k=3))
    assert every["walk_rounds_greedy"] == 7 and every["walk_rounds_prob"] == pytest.approx(7)
    assert (every["walk_rows"], every["walk_rows_skipped"]) == (1, 0)


def test_decoding_walk_expected_rounds_match_simulated_sampling():
    """The sampled walk's expected rounds (a backward recursion) against Monte Carlo decoding of the same blocks."""
    torch.manual_seed(0)
    loss_mask = [0] * 2 + [1] * 40 + [0] * 2
    rate, match, mask, positions, valid, cand = walk_blocks(loss_mask, set(range(10, 30)), k=4)
    rate = torch.rand(rate.shape) * mask  # any acceptance rates in [0, 1)
    walk = decoding_walk_estimates(rate, match, mask, positions, valid, cand)
    rng = np.random.default_rng(0)
    anchor_of = {int(p): n for n, p in enumerate(positions[0])}
    samples = []
    for _ in range(20000):
        p, rounds = int(positions[0, 0]), 0
        while p in anchor_of:
            n, accepted = anchor_of[p], 0
            while accepted < 4 and mask[0, n, accepted] and rng.random() < rate[0, n, accepted]:
                accepted += 1
            p, rounds = p + accepted + 1, rounds + 1
        samples.append(rounds)
    assert walk["walk_rounds_prob"] == pytest.approx(np.mean(samples), abs=4 * np.std(samples) / np.sqrt(20000))


def test_decoding_walk_skips_rows_whose_anchors_do_not_cover_the_answer():
    rate, match, mask, positions, valid, cand = walk_blocks([0, 1, 1, 1, 1, 1, 1, 0], set(), k=2)
    valid = valid.clone()
    valid[0, 2] = False  # one candidate without a block: this row cannot be walked
    walk = decoding_walk_estimates(rate, match, mask, positions, valid, cand)
    assert (walk["walk_rows"], walk["walk_rows_skipped"], walk["walk_tokens"]) == (0, 1, 0)


def recursive_rejection_sample(p: np.ndarray, q: np.ndarray, k: int, rng, distinct=False) -> tuple[int, int | None]:
    """The procedure itself: k drafts drawn from q (independently, or `distinct`: each from q without the earlier
    ones), tried one after another against the residual the rejections before left; (committed token, index of
    the accepted draft or None)."""
    residual, left = p.copy(), q.copy()
    for i in range(k):
        q_i = left / left.sum() if distinct else q
        if q_i.sum() <= 0 or not np.isfinite(q_i).all():  # no token left to draw
            break
        x = rng.choice(len(q), p=q_i)
        if rng.random() * q_i[x] < residual[x]:  # accept with chance min(1, r(x) / q_i(x))
            return x, i
        residual = np.maximum(residual - q_i, 0)
        residual /= residual.sum()
        left[x] = 0
    return rng.choice(len(p), p=residual), None


@pytest.mark.parametrize("k", [1, 2, 3])
def test_multi_candidate_acceptance_matches_the_procedure_and_keeps_the_target_distribution(k):
    rng = np.random.default_rng(k)
    p = rng.dirichlet(np.full(6, 0.7))
    q = rng.dirichlet(np.full(6, 0.7))
    expected = multi_candidate_acceptance(torch.tensor(p), torch.tensor(q), 3)
    assert expected[0].item() == pytest.approx(np.minimum(p, q).sum(), abs=1e-6)  # one draft: 1 - TV
    assert bool((expected[1:] >= expected[:-1]).all())
    n = 40000
    draws = [recursive_rejection_sample(p, q, k, rng) for _ in range(n)]
    accepted = np.mean([i is not None for _, i in draws])
    rate = expected[k - 1].item()
    assert accepted == pytest.approx(rate, abs=4 * np.sqrt(rate * (1 - rate) / n))
    counts = np.bincount([x for x, _ in draws], minlength=6) / n
    assert np.abs(counts - p).max() < 4 * np.sqrt(p.max() / n)  # lossless: the committed token follows p


@pytest.mark.parametrize("k", [2, 3])
def test_multi_candidate_acceptance_without_replacement_matches_the_procedure_and_beats_independent_draws(k):
    rng = np.random.default_rng(10 + k)
    p = rng.dirichlet(np.full(6, 0.7))
    q = rng.dirichlet(np.full(6, 0.3))  # sharper than p: independent draws repeat its top token
    gen = torch.Generator().manual_seed(k)
    distinct = multi_candidate_acceptance(torch.tensor(p), torch.tensor(q), 3, replacement=False, samples=20000,
                                          generator=gen)  # fmt: skip
    independent = multi_candidate_acceptance(torch.tensor(p), torch.tensor(q), 3)
    assert distinct[0].item() == pytest.approx(independent[0].item(), abs=0.01)  # one draft: 1 - TV (estimated)
    assert bool((distinct[1:] > independent[1:] + 0.01).all())
    n = 40000
    draws = [recursive_rejection_sample(p, q, k, rng, distinct=True) for _ in range(n)]
    accepted = np.mean([i is not None for _, i in draws])
    rate = distinct[k - 1].item()
    assert accepted == pytest.approx(rate, abs=4 * np.sqrt(rate * (1 - rate) / n) + 0.005)  # (+ the estimate's own)
    counts = np.bincount([x for x, _ in draws], minlength=6) / n
    assert np.abs(counts - p).max() < 4 * np.sqrt(p.max() / n)  # lossless: the committed token follows p
    # Batched over leading dimensions; a candidate past q's support (two tokens here) is no draw and adds nothing.
    two = torch.tensor([[0.0, 0.0, 0.6, 0.4]])
    rates = multi_candidate_acceptance(torch.full((2, 1, 4), 0.25), two.expand(2, 1, 4), 3, replacement=False,
                                       samples=4000, generator=gen)  # fmt: skip
    assert rates.shape == (2, 1, 3) and torch.equal(rates[..., 2], rates[..., 1])
    assert torch.allclose(rates[..., 1], torch.tensor(0.5), atol=0.02)  # 0.6 * 5/12 + 0.4 * 5/8 (the second: never)


def test_multi_candidate_acceptance_of_an_exact_or_disjoint_draft():
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]])
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5]])
    rates = multi_candidate_acceptance(p, q, 3)
    assert rates.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]


def test_top_candidates_match_counts_the_target_argmax_among_the_draft_top_k():
    target = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 1.0, 2.0]])
    draft = torch.tensor([[0.0, 2.0, 3.0, 1.0], [0.0, 4.0, 3.0, 2.0]])  # ranks: [2, 1, 3, 0], [1, 2, 3, 0]
    assert top_candidates_match(target, draft, 4).tolist() == [[0, 1, 1, 1], [0, 0, 0, 1]]


def test_branched_tau_is_tau_prob_for_one_candidate_and_grows_with_the_first_slot():
    torch.manual_seed(0)
    rate = torch.rand(3, 5, 4)
    mask = torch.ones(3, 5, 4, dtype=torch.long)
    mask[0, 1, 2:] = 0  # a block cut by the answer's end
    mask[1, 4] = 0  # a dummy block
    first = torch.stack([rate[..., 0], rate[..., 0] * 0 + 1], dim=-1)  # k = 1: the draft's own; k = 2: certain
    tau = branched_tau(first, rate, mask)
    est = training_acceptance_estimates(rate, rate > 0.5, mask)
    assert tau[0].item() == pytest.approx((est["tau_prob_sum"] / est["blocks"]).item(), rel=1e-6)
    later = torch.cumprod(rate[..., 1:] * mask[..., 1:], -1).sum(-1)
    valid = mask[..., 0].bool()
    assert tau[1].item() == pytest.approx((2 + later)[valid].mean().item(), rel=1e-6)


def test_calibration_metrics():
    probs = np.array([0.1, 0.4, 0.35, 0.8])
    out = np.array([0, 0, 1, 1])
    assert auroc(probs, out) == pytest.approx(0.75)
    assert auroc([0.2, 0.9], [0, 1]) == 1.0
    assert brier_score([1.0, 0.0], [1, 0]) == 0.0
    assert expected_calibration_error([0.9] * 10, [1] * 9 + [0]) == pytest.approx(0.0)
    assert expected_calibration_error([0.9] * 10, [1] * 5 + [0] * 5) == pytest.approx(0.4)


def test_sts_recovers_the_temperature_of_overconfident_scores():
    rng = np.random.default_rng(0)
    records = []
    for _ in range(4000):
        true_logits = rng.normal(1.0, 1.5, size=3)
        p = 1 / (1 + np.exp(-true_logits))
        accepted = 0
        while accepted < 3 and rng.random() < p[accepted]:
            accepted += 1
        overconfident = 1 / (1 + np.exp(-2.0 * true_logits))  # logits scaled by 2
        records.append((overconfident, accepted, 3))
    temps = fit_sts_temperatures(records, 3)
    assert temps[0] == pytest.approx(2.0, rel=0.15)
    before = expected_calibration_error(*slot_calibration_data(records, 0, kind="survival"))
    after = expected_calibration_error(*slot_calibration_data(records, 0, temps, kind="survival"))
    assert after < before / 3


def test_wilson_interval():
    # Reference values of the 95% Wilson score interval.
    low, high = wilson_interval(1, 1)
    assert low == pytest.approx(0.2065, abs=1e-4) and high == pytest.approx(1.0)
    low, high = wilson_interval(8, 10)
    assert low == pytest.approx(0.4902, abs=1e-4) and high == pytest.approx(0.9433, abs=1e-4)
    low, high = wilson_interval(0, 50)
    assert low == 0.0 and high == pytest.approx(0.0714, abs=1e-4)
    # Wider with fewer trials at the same rate; nan without trials.
    assert np.diff(wilson_interval(5, 10)) > np.diff(wilson_interval(500, 1000))
    assert all(np.isnan(wilson_interval(0, 0)))
