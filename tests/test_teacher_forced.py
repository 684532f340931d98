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


def test_the_walked_estimate_is_the_tau_greedy_decoding_delivers(tmp_path):
    """A draft trained on a loopy target's greedy text: greedy decoding (float32, every answer the target's own)
    commits exactly the walked estimate's τ, while the mean over every position counts the easy loops at each of
    their positions and promises more."""
    import datasets
    from transformers import set_seed

    from hf_dspark.training import DraftTrainer, DraftTrainingArguments

    target = make_tiny_target("gemma3")
    with torch.no_grad():  # larger weights: varied greedy text with loops in it, not one repeated token
        for name, param in target.named_parameters():
            if "norm" not in name:
                param.mul_(4)
    prompts, completions = answers(target, n=16, prompt_len=5, new=32)
    rows = [{"input_ids": p + c, "loss_mask": [0] * len(p) + [1] * len(c)} for p, c in zip(prompts, completions)]
    set_seed(0)
    args = DraftTrainingArguments(output_dir=str(tmp_path), max_steps=60, per_device_train_batch_size=8,
                                  learning_rate=1e-2, lr_scheduler_type="constant", report_to="none",
                                  save_strategy="no", use_cpu=True, disable_tqdm=True, block_size=4,
                                  num_hidden_layers=1, num_anchors=64, seed=0)  # fmt: skip
    trainer = DraftTrainer(args=args, train_dataset=datasets.Dataset.from_list(rows), target_model=target)
    trainer.train()
    draft = trainer.model.eval()
    forced = teacher_forced_estimates(draft, target, prompts[:8], completions[:8])
    committed = rounds = 0
    for prompt, completion in zip(prompts[:8], completions[:8]):
        out = target.generate(torch.tensor([prompt]), assistant_model=draft, max_new_tokens=32, do_sample=False,
                              pad_token_id=0)  # fmt: skip
        assert out[0, len(prompt):].tolist() == completion  # the same text the estimate walked
        acceptance = draft.last_generation_stats.acceptance.to_dict()
        committed, rounds = committed + acceptance["committed_tokens"], rounds + acceptance["rounds"]
    assert committed / rounds > 1.5  # acceptance is not trivial, so the equality below says something
    assert forced["tau_walk_greedy"] == pytest.approx(committed / rounds, rel=1e-6)
    assert forced["tau_greedy"] > forced["tau_walk_greedy"] + 0.2, (forced, committed / rounds)
