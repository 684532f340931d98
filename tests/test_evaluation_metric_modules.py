"""The local `evaluate` metric modules give exactly the numbers of `hf_dspark.metrics`."""

import math

import numpy as np
import pytest

from hf_dspark.evaluation import load_metric
from hf_dspark.evaluation.evaluate_metrics import metric_path
from hf_dspark.metrics import AcceptanceStats, calibration_report, slot_calibration_data


def same(a, b):
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return (math.isnan(a) and math.isnan(b)) if isinstance(a, float) and math.isnan(a) else a == b


@pytest.fixture(scope="module")
def rounds():
    rng = np.random.default_rng(0)
    proposed = rng.integers(1, 8, size=500)
    accepted = np.minimum(rng.geometric(0.3, size=500) - 1, proposed)
    confidences = 1 / (1 + np.exp(-rng.normal(0.5, 2.0, size=(500, 7))))
    return proposed, accepted, confidences


def test_modules_load_by_path_without_the_hub(monkeypatch):
    import evaluate

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("acceptance", "calibration"):
        module = evaluate.load(str(metric_path(name)))
        assert isinstance(module, evaluate.Metric) and module.name == name
    with pytest.raises(ValueError, match="acceptance, calibration"):
        load_metric("bleu")


def test_acceptance_module_matches_acceptance_stats(rounds):
    proposed, accepted, _ = rounds
    stats = AcceptanceStats()
    stats.add_round(proposed, accepted)
    got = load_metric("acceptance").compute(proposed=proposed.tolist(), accepted=accepted.tolist())
    assert set(got) == set(stats.to_dict())
    assert all(same(got[k], v) for k, v in stats.to_dict().items())
    assert got["tau"] == pytest.approx(1 + accepted.mean())

    committed = np.maximum(accepted, 1)  # e.g. EOS cut rounds short
    stats = AcceptanceStats()
    stats.add_round(proposed, accepted, committed=committed)
    metric = load_metric("acceptance")
    got = metric.compute(proposed=proposed.tolist(), accepted=accepted.tolist(), committed=committed.tolist())
    assert all(same(got[k], v) for k, v in stats.to_dict().items())


def test_acceptance_module_accumulates_batches(rounds):
    proposed, accepted, _ = rounds
    metric = load_metric("acceptance")
    for start in range(0, 500, 128):
        batch = slice(start, start + 128)
        metric.add_batch(proposed=proposed[batch].tolist(), accepted=accepted[batch].tolist())
    stats = AcceptanceStats()
    stats.add_round(proposed, accepted)
    assert metric.compute() == stats.to_dict()


def test_calibration_module_matches_calibration_report_per_slot(rounds):
    proposed, accepted, confidences = rounds
    stats = AcceptanceStats()
    stats.add_round(proposed, accepted, confidences=confidences)
    metric = load_metric("calibration")
    for kind in ("conditional", "survival"):
        for slot in range(4):
            pred, out = slot_calibration_data(stats.confidence_records, slot, kind=kind)
            got = metric.compute(predictions=pred.tolist(), references=out.astype(int).tolist(), n_bins=10)
            assert got == calibration_report(pred, out, 10)


def test_calibration_module_rejects_non_probabilities():
    metric = load_metric("calibration")
    with pytest.raises(ValueError, match="probabilities"):
        metric.compute(predictions=[1.5], references=[1])
    with pytest.raises(ValueError, match="0 or 1"):
        metric.compute(predictions=[0.5], references=[2])
