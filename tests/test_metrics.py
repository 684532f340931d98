"""The one definition of tau, conditional acceptance, verify efficiency and calibration metrics."""

import numpy as np
import pytest
import torch

from hf_dspark.metrics import (
    AcceptanceStats,
    auroc,
    brier_score,
    expected_calibration_error,
    fit_sts_temperatures,
    slot_calibration_data,
    training_acceptance_estimates,
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


def test_training_estimates():
    rate = torch.tensor([[0.5, 0.5, 1.0], [1.0, 1.0, 1.0]])
    match = torch.tensor([[1, 0, 1], [1, 1, 1]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    est = training_acceptance_estimates(rate, match, mask)
    assert est["blocks"] == 2
    assert est["tau_prob_sum"].item() == pytest.approx((1 + 0.5 + 0.25 + 0.25) + (1 + 1 + 1))
    assert est["tau_greedy_sum"].item() == pytest.approx((1 + 1) + (1 + 2))


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
