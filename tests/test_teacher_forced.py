"""Teacher-forced τ on the target's own answers (hf_dspark.evaluation.teacher_forced), used by `hf-dspark eval`."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target

from hf_dspark import DSparkModel, Eagle3Model
from hf_dspark.evaluation.teacher_forced import teacher_forced_estimates


def answers(target, n=3, prompt_len=6, new=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, target.config.vocab_size, (prompt_len + i,), generator=g).tolist() for i in range(n)]
    completions = []
    with torch.no_grad():
        for p in prompts:
            out = target.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, pad_token_id=0)
            completions.append(out[0, len(p):].tolist())
    return prompts, completions


@pytest.mark.parametrize("cls", [DSparkModel, Eagle3Model])
def test_estimates_are_deterministic_bounded_and_leave_the_draft_as_it_was(cls):
    target = make_tiny_target("qwen3")
    kwargs = {"num_hidden_layers": 1} if cls is DSparkModel else {}
    draft = cls.from_target(target, block_size=4, **kwargs) if cls is DSparkModel else cls.from_target(target, ttt_length=4)
    draft.eval()
    before = {n: p.detach().clone() for n, p in draft.named_parameters()}
    prompts, completions = answers(target)
    first = teacher_forced_estimates(draft, target, prompts, completions, batch_size=2)
    second = teacher_forced_estimates(draft, target, prompts, completions, batch_size=2)
    assert first == second and first["sequences"] == 3
    assert 1.0 <= first["tau_greedy"] <= 5.0 and 1.0 <= first["tau_prob"] <= 5.0
    assert len(first["accept_rate_by_position"]) == 4
    assert all(0.0 <= a <= 1.0 for a in first["accept_rate_by_position"])
    for name, p in draft.named_parameters():  # evaluated, not trained
        assert torch.equal(p, before[name]) and p.grad is None, name
    assert not draft.training and "block_mask_kind" not in vars(draft)  # the dense-mask switch is undone
    # Answers too short for a block are left out; none left: no estimate.
    assert teacher_forced_estimates(draft, target, prompts, [c[:1] for c in completions]) == {}


def test_a_failing_estimate_is_recorded_in_the_row_and_the_evaluation_goes_on(monkeypatch, caplog):
    """The teacher-forced score is a diagnostic: if it fails, the row says why and the decoding rows survive."""
    from hf_dspark.evaluation import runner

    def broken(*args, **kwargs):
        raise RuntimeError("no memory left")

    monkeypatch.setattr(runner, "teacher_forced_estimates", broken)
    call = runner._CallResult(new_tokens=3, seconds=1.0, prompts=[[5, 6]], completions=[[7, 8, 9]])
    with caplog.at_level("WARNING"):
        assert runner._teacher_forced(None, None, [call], 1, 0) == {"error": "RuntimeError: no memory left"}
    assert "teacher-forced estimates failed" in caplog.text
