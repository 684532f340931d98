"""STS calibration of DSpark confidence heads: fitted from rollouts, stored in the config, restored on load."""

import numpy as np
import pytest
import torch
from conftest import make_tiny_target
from generation_utils import make_draft

from hf_dspark import DSparkModel
from hf_dspark.generation import calibrate_confidence
from hf_dspark.generation.calibration import calibrate_from_records, collect_rollouts
from hf_dspark.models.dspark.modeling_dspark import calibrated_confidence


def overconfident_records(num_rounds=3000, slots=4, seed=0):
    """Rounds whose true per-slot acceptance is p_k but whose head says sigmoid(3 * logit(p_k) + noise)."""
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(num_rounds):
        p = rng.uniform(0.3, 0.95, size=slots)
        accepted = 0
        while accepted < slots and rng.random() < p[accepted]:
            accepted += 1
        logits = 3.0 * np.log(p / (1 - p)) + rng.normal(0, 0.2, size=slots)
        records.append((1 / (1 + np.exp(-logits)), accepted, slots))
    return records


class PadOnly:
    """Tokenizer stand-in for prompts given as token ids: calibration only needs the pad id."""

    pad_token_id = 0
    eos_token_id = 2


def test_sts_from_records_lowers_calibration_error_and_is_stored_in_the_config(tmp_path):
    target = make_tiny_target("llama")
    draft = make_draft("dspark", target)
    report = calibrate_from_records(draft, overconfident_records(), holdout_fraction=0.3)
    assert report.ece_after < 0.5 * report.ece_before
    assert all(t > 1.5 for t in report.temperatures[:2])  # overconfident logits are cooled down
    assert draft.config.confidence_temperatures == report.temperatures
    assert report.fit_rounds + report.eval_rounds == 3000 and len(report.per_slot) == 4
    assert "ECE" in str(report)
    draft.save_pretrained(tmp_path)
    reloaded = DSparkModel.from_pretrained(tmp_path)
    assert reloaded.config.confidence_temperatures == report.temperatures
    logits = torch.randn(3, 4)
    expected = torch.sigmoid(logits / torch.tensor(report.temperatures))
    torch.testing.assert_close(calibrated_confidence(logits, reloaded.config.confidence_temperatures), expected)


def test_calibrate_confidence_runs_rollouts_with_the_raw_head():
    target = make_tiny_target("qwen3")
    draft = make_draft("dspark", target, block_size=4)
    prompts = [[1, 5, 6, 7], [1, 9, 8], [1, 3, 3, 4, 5], [1, 20]]
    kwargs = dict(max_new_tokens=12, batch_size=2, do_sample=False)
    raw, _ = collect_rollouts(draft, target, PadOnly(), prompts, **kwargs)
    draft.config.confidence_temperatures = [2.0] * 4
    records, stats = collect_rollouts(draft, target, PadOnly(), prompts, **kwargs)
    assert draft.config.confidence_temperatures == [2.0] * 4  # restored after the rollouts
    assert len(records) == stats.acceptance.reached[0] > 0  # one record per round that proposed tokens
    # Stored temperatures do not leak into the records: STS is always fitted on the raw head.
    for (c1, a1, p1), (c2, a2, p2) in zip(raw, records, strict=True):
        np.testing.assert_allclose(c1, c2, rtol=1e-5)
        assert (a1, p1) == (a2, p2) and p1 == len(c1)

    report = calibrate_confidence(draft, target, PadOnly(), prompts, max_new_tokens=12, batch_size=2, seed=0)
    assert len(draft.config.confidence_temperatures) == 4
    assert report.temperatures == draft.config.confidence_temperatures
    assert report.previous_temperatures == [2.0] * 4
    assert report.tau >= 1.0


def test_collect_rollouts_restores_temperatures_when_generation_fails():
    target = make_tiny_target("llama")
    draft = make_draft("dspark", target)
    draft.config.confidence_temperatures = [1.5] * draft.config.block_size
    with pytest.raises(ValueError, match="beam search"):
        collect_rollouts(draft, target, PadOnly(), [[1, 4, 5]], max_new_tokens=4, num_beams=2)
    assert draft.config.confidence_temperatures == [1.5] * draft.config.block_size


def test_drafts_without_a_confidence_head_cannot_be_calibrated():
    target = make_tiny_target("llama")
    for name in ("dflash", "eagle3"):
        with pytest.raises(ValueError, match="no confidence head"):
            calibrate_from_records(make_draft(name, target), overconfident_records(10))
