"""DraftTrainer: online and cached training, checkpoints, resuming, logging, frozen target, bad input."""

from __future__ import annotations

import json
import math
import os
import signal

import datasets
import pytest
import torch
from conftest import make_tiny_target
from host_syncs import HostSyncs
from transformers import AutoModel, TrainerCallback, set_seed

from hf_dspark import DSparkModel
from hf_dspark.data import TargetCacheError, build_target_cache, load_target_cache
from hf_dspark.training import DraftDataCollator, DraftTrainer, DraftTrainingArguments, build_draft
from hf_dspark.models import DRAFTERS
from hf_dspark.models.anchors import sample_anchors


def tokenized_rows(n: int = 8, seed: int = 0, vocab: int = 96) -> datasets.Dataset:
    """Tokenized conversations: a short unsupervised prompt, then an answer; lengths differ (padding matters)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = 18 + 3 * i
        prompt = 4 + i % 3
        ids = torch.randint(3, vocab, (length,), generator=gen).tolist()
        rows.append({"input_ids": ids, "loss_mask": [0] * prompt + [1] * (length - prompt)})
    return datasets.Dataset.from_list(rows)


def make_args(tmp_path, **kw) -> DraftTrainingArguments:
    defaults = dict(
        output_dir=str(tmp_path / "out"),
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=2e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        block_size=4,
        num_hidden_layers=1,
        num_anchors=8,
        seed=7,
    )
    return DraftTrainingArguments(**{**defaults, **kw})


def build_cache(target, rows, path, layer_ids):
    path = build_target_cache(
        target, rows, path, target_layer_ids=layer_ids, batch_size=1, progress=False, process_index=0, num_processes=1
    )
    return path


def losses(trainer):
    return [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]


def trainable_state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


# -- online and cached ----------------------------------------------------------------------------------------------


def fresh_draft(target, tmp_path, **kw):
    set_seed(11)
    return build_draft(target, make_args(tmp_path, **kw))


def test_online_and_cached_training_give_the_same_loss(tmp_path):
    target = make_tiny_target("llama").to(torch.bfloat16)  # bf16 features: exactly what a bf16 cache stores
    rows = tokenized_rows()
    online = DraftTrainer(model=fresh_draft(target, tmp_path), args=make_args(tmp_path), train_dataset=rows,
                          target_model=target)  # fmt: skip
    path = build_cache(target, rows, tmp_path / "cache", online.model.config.target_layer_ids)
    cache = load_target_cache(path, draft_config=online.model.config, target=target)
    cached = DraftTrainer(model=fresh_draft(target, tmp_path), args=make_args(tmp_path), train_dataset=cache)
    assert cached.target_model is None
    online.train()
    cached.train()
    assert len(losses(online)) == 3
    assert losses(online) == losses(cached)
    cached_state = trainable_state(cached.model)
    for name, value in trainable_state(online.model).items():
        torch.testing.assert_close(value, cached_state[name], rtol=0, atol=0)


def test_online_target_is_frozen_and_outside_the_optimizer(tmp_path):
    target = make_tiny_target("qwen3")
    before = {n: p.detach().clone() for n, p in target.named_parameters()}
    trainer = DraftTrainer(args=make_args(tmp_path, max_steps=2), train_dataset=tokenized_rows(), target_model=target)
    trainer.train()
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert not any(id(p) in optimized for p in target.parameters())
    assert not any(p.requires_grad for p in target.parameters()) and not target.training
    for name, p in target.named_parameters():
        assert torch.equal(p, before[name]), name
    draft = trainer.model  # the draft's own copies of the target's embeddings / lm_head are frozen too
    assert id(draft.lm_head.weight) not in optimized and id(draft.embed_tokens.weight) not in optimized
    assert torch.equal(draft.lm_head.weight, target.lm_head.weight)


# -- checkpoints, resuming, logging -------------------------------------------------------------------------------


def test_checkpoints_load_as_drafts_and_resuming_continues_the_same_run(tmp_path):
    target = make_tiny_target("llama")
    rows = tokenized_rows()
    args = dict(max_steps=4, save_strategy="steps", save_steps=2)
    straight = DraftTrainer(args=make_args(tmp_path / "a", **args), train_dataset=rows, target_model=target)
    straight.train()
    checkpoint = tmp_path / "a" / "out" / "checkpoint-4"
    loaded = AutoModel.from_pretrained(checkpoint)
    assert isinstance(loaded, DSparkModel)
    assert not loaded.lm_head.weight.requires_grad
    for name, value in trainable_state(straight.model).items():
        torch.testing.assert_close(dict(loaded.named_parameters())[name], value, rtol=0, atol=0)

    # A new process resumes the interrupted run from checkpoint-2 (fresh draft, weights come from the checkpoint).
    resumed = DraftTrainer(args=make_args(tmp_path / "b", **args), train_dataset=rows, target_model=target)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "out" / "checkpoint-2"))
    assert losses(resumed)[-2:] == losses(straight)[-2:]
    resumed_state = trainable_state(resumed.model)
    for name, value in trainable_state(straight.model).items():
        torch.testing.assert_close(resumed_state[name], value, rtol=0, atol=0)


class SignalAt(TrainerCallback):
    """Sends this process `signum` as step `step` begins (as a scheduler's preemption would, mid-run)."""

    def __init__(self, step: int, signum=signal.SIGTERM, times: int = 1):
        self.step, self.signum, self.times = step, signum, times

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step - 1:
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_signal_saves_a_checkpoint_and_stops_and_resuming_it_ends_as_the_uninterrupted_run(tmp_path, signum):
    """checkpoint_on_signal (the default): the step in progress completes, a resumable checkpoint is saved although
    the run saves none otherwise, training stops, and the process's own handler is back afterwards."""
    target = make_tiny_target("llama")
    rows = tokenized_rows()
    before = signal.getsignal(signum)
    straight = DraftTrainer(args=make_args(tmp_path / "a", max_steps=4), train_dataset=rows, target_model=target)
    straight.train()
    assert straight.stopped_by_signal is None

    stopped = DraftTrainer(args=make_args(tmp_path / "b", max_steps=4), train_dataset=rows, target_model=target)
    stopped.add_callback(SignalAt(2, signum))
    stopped.train()
    assert stopped.stopped_by_signal == signum and stopped.state.global_step == 2
    assert signal.getsignal(signum) == before
    assert (tmp_path / "b" / "out" / "checkpoint-2" / "optimizer.pt").exists()

    resumed = DraftTrainer(args=make_args(tmp_path / "b", max_steps=4), train_dataset=rows, target_model=target)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.stopped_by_signal is None and losses(resumed)[-2:] == losses(straight)[-2:]
    resumed_state = trainable_state(resumed.model)
    for name, value in trainable_state(straight.model).items():
        torch.testing.assert_close(resumed_state[name], value, rtol=0, atol=0)


def test_a_second_signal_goes_to_the_handler_that_was_there_and_the_option_can_be_off(tmp_path):
    target = make_tiny_target("llama")
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        trainer = DraftTrainer(args=make_args(tmp_path / "a", max_steps=3), train_dataset=tokenized_rows(),
                               target_model=target)  # fmt: skip
        trainer.add_callback(SignalAt(1, signal.SIGUSR1, times=2))
        trainer.train()
        assert seen == [signal.SIGUSR1] and trainer.state.global_step == 1  # the first stopped it, the second passed

        seen.clear()
        off = DraftTrainer(args=make_args(tmp_path / "b", max_steps=3, checkpoint_on_signal=False),
                           train_dataset=tokenized_rows(), target_model=target)  # fmt: skip
        off.add_callback(SignalAt(1, signal.SIGUSR1))
        off.train()
        assert seen == [signal.SIGUSR1] and off.state.global_step == 3 and off.stopped_by_signal is None
        assert not (tmp_path / "b" / "out" / "checkpoint-1").exists()
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_logs_report_tau_estimates_and_each_loss_term(tmp_path):
    target = make_tiny_target("gemma3")
    trainer = DraftTrainer(args=make_args(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=2),
                           train_dataset=tokenized_rows(), eval_dataset=tokenized_rows(4, seed=1),
                           target_model=target)  # fmt: skip
    trainer.train()
    train_logs = [h for h in trainer.state.log_history if "loss" in h]
    eval_logs = [h for h in trainer.state.log_history if "eval_loss" in h]
    expected = {"loss_ce", "loss_l1", "loss_soft_ce", "loss_conf", "tau_prob", "tau_greedy", "accept@1", "accept@4"}
    assert expected <= set(train_logs[0])
    assert {"eval_" + k for k in expected} <= set(eval_logs[0])
    for log in train_logs:
        assert 1.0 <= log["tau_greedy"] <= 5.0 and 1.0 <= log["tau_prob"] <= 5.0
        assert 0.0 <= log["accept@1"] <= 1.0
        alphas = trainer.model.config
        combined = alphas.ce_loss_alpha * log["loss_ce"] + alphas.l1_loss_alpha * log["loss_l1"]
        combined += alphas.soft_ce_loss_alpha * log["loss_soft_ce"] + alphas.confidence_head_alpha * log["loss_conf"]
        assert math.isclose(combined, log["loss"], rel_tol=1e-5)
    # Evaluation anchors depend on the batch only: evaluating twice gives the same numbers.
    first, second = trainer.evaluate(), trainer.evaluate()
    assert first["eval_loss"] == second["eval_loss"] and first["eval_tau_prob"] == second["eval_tau_prob"]


def test_training_batches_are_whole_and_evaluation_sees_every_row(tmp_path, monkeypatch):
    """A smaller last batch is a new shape (recompiled kernels on GPU): training skips it (drop_last, on by
    default; the order changes each epoch), evaluation still reads every held-out row."""
    target = make_tiny_target("llama")
    trainer = DraftTrainer(args=make_args(tmp_path, max_steps=7, per_device_train_batch_size=2,
                                          per_device_eval_batch_size=2),
                           train_dataset=tokenized_rows(7), eval_dataset=tokenized_rows(5, seed=1),
                           target_model=target)  # fmt: skip
    assert trainer.args.dataloader_drop_last
    seen = {"train": [], "eval": []}
    compute_loss = trainer.compute_loss

    def recording(model, inputs, *a, **kw):
        seen["train" if model.training else "eval"].append(inputs["input_ids"].shape[0])
        return compute_loss(model, inputs, *a, **kw)

    monkeypatch.setattr(trainer, "compute_loss", recording)
    trainer.train()  # 7 rows, batches of 2: three whole batches an epoch, seven steps over three epochs
    assert seen["train"] == [2] * 7
    trainer.evaluate()
    assert seen["eval"] == [2, 2, 1]
    assert trainer.args.dataloader_drop_last  # restored after building the evaluation loader


def test_fewer_rows_than_a_batch_still_train(tmp_path, caplog):
    """drop_last would skip the only (partial) batch and train nothing, silently: the run keeps it and says so."""
    trainer = DraftTrainer(args=make_args(tmp_path, max_steps=3, per_device_train_batch_size=4),
                           train_dataset=tokenized_rows(3), target_model=make_tiny_target("llama"))  # fmt: skip
    with caplog.at_level("WARNING"):
        trainer.train()
    assert trainer.state.global_step == 3
    assert "only 3 training rows, fewer than one batch of 4" in caplog.text


def test_evaluation_in_grad_mode_gives_the_same_numbers_and_leaves_no_gradients(tmp_path, monkeypatch):
    """Where the loss or attention is compiled, evaluation runs in grad mode to reuse the training step's compiled
    graphs (`_evaluation_grad_mode`); the numbers must be the no_grad ones and no gradient may be left behind."""
    target = make_tiny_target("qwen3")
    trainer = DraftTrainer(args=make_args(tmp_path, max_steps=1), train_dataset=tokenized_rows(),
                           eval_dataset=tokenized_rows(4, seed=1), target_model=target)  # fmt: skip
    trainer.train()
    trainer.model.zero_grad(set_to_none=True)
    assert isinstance(trainer._evaluation_grad_mode(), torch.no_grad)  # CPU, eager loss: nothing compiled
    plain = trainer.evaluate()
    trainer.args.compile_loss = True
    assert isinstance(trainer._evaluation_grad_mode(), torch.enable_grad)
    trainer.args.compile_loss = False
    monkeypatch.setattr(trainer, "_evaluation_grad_mode", torch.enable_grad)  # the compiled case's grad mode
    in_grad_mode = trainer.evaluate()
    for key in ("eval_loss", "eval_tau_prob", "eval_tau_greedy", "eval_loss_l1"):
        assert in_grad_mode[key] == pytest.approx(plain[key], rel=1e-6), key
    assert all(p.grad is None for p in trainer.model.parameters())
    # A grad-mode evaluation that fails (e.g. out of memory) is redone under no_grad, and later ones start there.
    compute_loss, failures = trainer.compute_loss, []

    def fails_with_grad(model, inputs, *args, **kwargs):
        if torch.is_grad_enabled():
            failures.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory")
        return compute_loss(model, inputs, *args, **kwargs)

    from hf_dspark.training import losses

    monkeypatch.undo()  # the real _evaluation_grad_mode, told that something is compiled (the loss stays eager)
    trainer.args.compile_loss = True
    monkeypatch.setattr(losses, "_get_chunk_math", lambda compile: losses._chunk_math)
    monkeypatch.setattr(trainer, "compute_loss", fails_with_grad)
    recovered = trainer.evaluate()
    assert recovered["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-6) and failures == [1]
    assert isinstance(trainer._evaluation_grad_mode(), torch.no_grad)


def learnable_rows(n: int = 8) -> datasets.Dataset:
    """Sequences of a fixed recurrence x -> 7x + 5 (mod 93): the next tokens are predictable from the anchor."""
    rows = []
    for i in range(n):
        x, ids = 3 + (11 * i) % 90, []
        for _ in range(24):
            ids.append(x)
            x = 3 + (7 * x + 5) % 93
        rows.append({"input_ids": ids, "loss_mask": [0] * 4 + [1] * 20})
    return datasets.Dataset.from_list(rows)


@pytest.mark.parametrize("algorithm", ["dspark", "dflash", "eagle3"])
def test_every_drafter_learns(tmp_path, algorithm):
    """Fifteen steps (with gradient accumulation): the loss goes down and the frozen head stays as it was."""
    target = make_tiny_target("qwen2")
    with torch.no_grad():  # a confident target: its distributions are far from the untrained draft's
        target.lm_head.weight.mul_(10)
    args = make_args(tmp_path, algorithm=algorithm, max_steps=15, learning_rate=1e-2, lr_scheduler_type="constant",
                     num_anchors=None if algorithm == "eagle3" else 8, gradient_accumulation_steps=2)  # fmt: skip
    trainer = DraftTrainer(args=args, train_dataset=learnable_rows(), target_model=target)
    head = trainer.model.lm_head.weight.detach().clone()
    trainer.train()
    curve = [loss for _, loss in losses(trainer)]
    assert len(curve) == 15 and all(math.isfinite(x) for x in curve)
    assert sum(curve[-3:]) < 0.9 * sum(curve[:3]), curve
    assert torch.equal(trainer.model.lm_head.weight, head)
    assert trainer.model.config.model_type == algorithm


# -- anchors and batches --------------------------------------------------------------------------------------------


def test_anchor_count_depends_on_the_shape_only_and_is_seeded():
    loss_mask = torch.zeros(3, 16, dtype=torch.long)
    loss_mask[0, 2:] = 1
    loss_mask[1, 10:14] = 1  # 3 candidates: 10, 11, 12
    positions, valid = sample_anchors(loss_mask, 6, torch.Generator().manual_seed(0), fixed_count=True)
    assert positions.shape == valid.shape == (3, 6)
    assert valid[0].all() and valid.sum(1).tolist() == [6, 3, 0]
    assert positions[1, :3].tolist() == [10, 11, 12]
    assert (positions[0].diff() > 0).all() and (positions[0] >= 2).all() and (positions[0] < 15).all()
    again, _ = sample_anchors(loss_mask, 6, torch.Generator().manual_seed(0), fixed_count=True)
    other, _ = sample_anchors(loss_mask, 6, torch.Generator().manual_seed(1), fixed_count=True)
    assert torch.equal(positions, again) and not torch.equal(positions[0], other[0])
    assert sample_anchors(loss_mask, 512, torch.Generator(), fixed_count=True)[0].shape == (3, 15)


def test_collator_right_pads_to_a_multiple_of_8_with_masked_padding():
    def row(ids, mask):
        n = len(ids)
        return {"input_ids": ids, "loss_mask": mask, "context_features": torch.ones(n, 4, dtype=torch.bfloat16),
                "target_last_hidden": torch.ones(n, 2, dtype=torch.bfloat16)}  # fmt: skip

    rows = [row([5, 6, 7], [0, 1, 1]), row(list(range(3, 13)), [1] * 10)]
    batch = DraftDataCollator(pad_token_id=1, pad_to_multiple_of=8)(rows)
    assert batch["input_ids"].shape == (2, 16)
    assert batch["input_ids"][0].tolist() == [5, 6, 7] + [1] * 13
    assert batch["attention_mask"].sum(1).tolist() == [3, 10]
    assert batch["loss_mask"][0].tolist() == [0, 1, 1] + [0] * 13
    assert batch["context_features"].dtype == torch.bfloat16 and batch["context_features"].shape == (2, 16, 4)
    assert batch["context_features"][0, 3:].abs().sum() == 0
    with pytest.raises(ValueError, match="loss_mask has 2 entries"):
        DraftDataCollator()([{"input_ids": [1, 2, 3], "loss_mask": [1, 1]}])


# -- bad input ------------------------------------------------------------------------------------------------------


def test_algorithm_typo_lists_the_valid_names(tmp_path):
    with pytest.raises(ValueError, match="dspark, dflash, eagle3"):
        DraftTrainer(args=make_args(tmp_path, algorithm="dsaprk"), train_dataset=tokenized_rows(),
                     target_model=make_tiny_target("llama"))  # fmt: skip


def test_draft_vocab_must_match_the_target(tmp_path):
    draft = fresh_draft(make_tiny_target("llama"), tmp_path)
    other = make_tiny_target("llama", vocab_size=128)
    with pytest.raises(ValueError, match="draft vocab 96 != target vocab 128"):
        DraftTrainer(model=draft, args=make_args(tmp_path), train_dataset=tokenized_rows(), target_model=other)


def test_a_cache_of_another_target_or_other_layers_is_refused(tmp_path):
    target = make_tiny_target("llama")
    rows = tokenized_rows(4)
    draft = fresh_draft(target, tmp_path, target_layer_ids=[1, 3])
    path = build_cache(target, rows, tmp_path / "cache", [0, 2])
    with pytest.raises(TargetCacheError, match="target_layer_ids"):
        DraftTrainer(model=draft, args=make_args(tmp_path), train_dataset=load_target_cache(path))
    same_layers = fresh_draft(target, tmp_path, target_layer_ids=[0, 2])
    retrained = make_tiny_target("llama", seed=1)  # same architecture, other weights
    with pytest.raises(TargetCacheError, match="target_weights_fingerprint"):
        DraftTrainer(model=same_layers, args=make_args(tmp_path), train_dataset=load_target_cache(path),
                     target_model=retrained)  # fmt: skip
    qwen_draft = fresh_draft(make_tiny_target("qwen3"), tmp_path, target_layer_ids=[0, 2])
    with pytest.raises(TargetCacheError, match="target_model_type"):
        DraftTrainer(model=qwen_draft, args=make_args(tmp_path), train_dataset=load_target_cache(path))


def test_empty_untokenized_or_featureless_data_is_refused(tmp_path):
    target = make_tiny_target("llama")
    draft = fresh_draft(target, tmp_path)
    with pytest.raises(ValueError, match="train_dataset is empty"):
        DraftTrainer(model=draft, args=make_args(tmp_path), train_dataset=tokenized_rows().select([]),
                     target_model=target)  # fmt: skip
    chats = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ValueError, match="tokenize_conversations"):
        DraftTrainer(model=draft, args=make_args(tmp_path), train_dataset=chats, target_model=target)
    with pytest.raises(ValueError, match="pass target_model"):
        DraftTrainer(model=draft, args=make_args(tmp_path), train_dataset=tokenized_rows())


def test_bf16_training_runs_the_loss_in_bf16(tmp_path, monkeypatch):
    """The vocabulary-wide loss runs after model.forward, outside accelerate's autocast: the trainer must put it
    under the same autocast, or its matmuls silently run in the float32 master weights' dtype."""
    from hf_dspark.training import losses as losses_module

    seen = []
    original = losses_module._compute_dtype
    monkeypatch.setattr(losses_module, "_compute_dtype", lambda t, w: seen.append(original(t, w)) or seen[-1])
    target = make_tiny_target("llama")
    trainer = DraftTrainer(args=make_args(tmp_path, bf16=True, max_steps=1), train_dataset=tokenized_rows(),
                           target_model=target)  # fmt: skip
    trainer.train()
    assert seen and all(dtype == torch.bfloat16 for dtype in seen), seen


def test_max_train_minutes_stops_training_and_saves(tmp_path):
    target = make_tiny_target("llama")
    args = make_args(tmp_path, max_steps=10_000, max_train_minutes=0.02, save_strategy="steps", save_steps=10_000)
    trainer = DraftTrainer(args=args, train_dataset=tokenized_rows(), target_model=target)
    trainer.train()
    assert 0 < trainer.state.global_step < 10_000  # stopped by the deadline (~1.2 s), not by max_steps
    saved = list((tmp_path / "out").glob("checkpoint-*"))
    assert [p.name for p in saved] == [f"checkpoint-{trainer.state.global_step}"]
    with pytest.raises(ValueError, match="max_train_minutes must be > 0"):
        make_args(tmp_path, max_train_minutes=0)


def test_fitted_lr_factor_warms_up_then_decays_to_zero_at_the_planned_total():
    from hf_dspark.training.trainer import fitted_lr_factor

    assert fitted_lr_factor("cosine", 0, 100, 10) == 0.0
    assert fitted_lr_factor("cosine", 5, 100, 10) == 0.5
    assert fitted_lr_factor("cosine", 10, 100, 10) == pytest.approx(1.0)
    assert fitted_lr_factor("cosine", 55, 100, 10) == pytest.approx(0.5)
    assert fitted_lr_factor("cosine", 100, 100, 10) == pytest.approx(0.0)
    assert fitted_lr_factor("cosine", 140, 100, 10) == pytest.approx(0.0)  # past the plan: stays at 0
    assert fitted_lr_factor("linear", 55, 100, 10) == pytest.approx(0.5)
    assert fitted_lr_factor("constant_with_warmup", 90, 100, 10) == 1.0


@pytest.mark.parametrize("kwargs", [{"min_lr_rate": 0.1}, {"min_lr": 2e-4}])
def test_fitted_cosine_with_min_lr_is_transformers_schedule_of_that_name(kwargs):
    """At a fixed total, the fitted cosine_with_min_lr takes the values of transformers' own schedule, step by step,
    from either way of giving its floor (the peak rate here is 2e-3, so both floors are a tenth of it)."""
    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

    from hf_dspark.training.trainer import fitted_lr_factor, min_lr_rate

    peak, total, warmup = 2e-3, 50, 5
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    reference = get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup, total, **kwargs)
    floor = min_lr_rate("cosine_with_min_lr", kwargs, peak)
    assert floor == pytest.approx(0.1)
    for step in range(total + 1):
        expected = reference.lr_lambdas[0](step)
        assert fitted_lr_factor("cosine_with_min_lr", step, total, warmup, floor) == pytest.approx(expected), step
    assert fitted_lr_factor("cosine_with_min_lr", total + 40, total, warmup, floor) == pytest.approx(0.1)
    assert min_lr_rate("cosine", kwargs, peak) == 0.0  # other schedules keep decaying to zero


@pytest.mark.parametrize(
    "kwargs, match",
    [(None, "exactly one of min_lr / min_lr_rate"), ({"min_lr": 1e-4, "min_lr_rate": 0.1}, "exactly one"),
     ({"min_lr_rate": 1.5}, "between 0 and the peak rate")],
)  # fmt: skip
def test_cosine_with_min_lr_without_a_valid_floor_is_refused(kwargs, match):
    from hf_dspark.training.trainer import min_lr_rate

    with pytest.raises(ValueError, match=match):
        min_lr_rate("cosine_with_min_lr", kwargs, 2e-3)


def test_time_budget_with_cosine_with_min_lr_ends_at_its_floor(tmp_path):
    """The floor reaches a fitted run the way a user passes it on the command line (a JSON string)."""
    target = make_tiny_target("llama")
    args = make_args(tmp_path, max_steps=100_000, max_train_minutes=0.05, warmup_steps=0.1,
                     lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs='{"min_lr_rate": 0.5}')  # fmt: skip
    trainer = DraftTrainer(args=args, train_dataset=tokenized_rows(), target_model=target)
    trainer.train()
    rates = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    assert max(rates) > 0.75 * args.learning_rate  # warmed up past the floor (logged steps miss the exact peak)
    assert min(rates[len(rates) // 2 :]) >= 0.5 * args.learning_rate * (1 - 1e-6), rates


def test_time_budget_fits_the_schedule_so_it_ends_annealed(tmp_path):
    """A budget with a far larger max_steps: the planned schedule, not max_steps, sets the decay, so the run ends
    with its learning rate near zero instead of being cut at the peak."""
    target = make_tiny_target("llama")
    args = make_args(tmp_path, max_steps=100_000, max_train_minutes=0.05, warmup_steps=0.1)
    trainer = DraftTrainer(args=args, train_dataset=tokenized_rows(), target_model=target)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "learning_rate" in h]
    planned = [h["planned_steps"] for h in logs if "planned_steps" in h]
    assert planned, "no step logged the planned schedule"
    assert trainer.state.global_step < 100_000
    assert logs[-1]["learning_rate"] < 0.2 * args.learning_rate, logs[-1]
    assert max(h["learning_rate"] for h in logs) > 0.5 * args.learning_rate  # it did reach the peak
    summary = trainer.state.log_history[-1]
    assert summary["train_steps_per_second"] == pytest.approx(trainer.state.global_step / summary["train_runtime"], rel=0.01)


def _simulated_deadline(minutes):
    """A TrainingDeadline on a fake clock, with the Trainer state and arguments its callbacks read."""
    from types import SimpleNamespace

    from transformers import TrainerControl, TrainerState

    from hf_dspark.training.trainer import TrainingDeadline

    now = [0.0]
    deadline = TrainingDeadline(minutes, fit_schedule=True, clock=lambda: now[0])
    state, control = TrainerState(), TrainerControl()
    state.max_steps = 10**6
    args = SimpleNamespace(save_strategy="no", device=torch.device("cpu"))
    deadline.on_train_begin(args, state, control)
    return deadline, now, state, control, args


def test_the_plan_uses_typical_step_times_not_compilation_pauses():
    """A 10-minute budget whose first step compiles for 60 s and whose 9th step recompiles for 10 s: the first plan
    holds the steps the remaining time allows at the typical 0.15 s, the recompilation counted as only CLIP steps
    (a mean rate with the pauses would plan ~1/3 of that)."""
    deadline, now, state, control, args = _simulated_deadline(10.0)
    for step in range(1, 31):
        now[0] += 60.0 if step == 1 else 10.0 if step == 9 else 0.15
        state.global_step = step
        deadline.on_step_end(args, state, control)
    timed = 30 - deadline.MARK_STEP  # durations after the mark: one 10 s pause, clipped to CLIP x 0.15
    typical = ((timed - 1) * 0.15 + deadline.CLIP * 0.15) / timed
    assert deadline.planned_steps == pytest.approx(30 + (600 - now[0]) / typical, rel=0.01)
    assert not control.should_training_stop


def _run_until_stop(deadline, now, state, control, args, step_time, evaluate_every=0, evaluate_s=0.0):
    """Steps (and evaluations) on the fake clock until the deadline stops the run: (steps, plans from step 50 on)."""
    step, plans = 0, []
    while not control.should_training_stop:
        step += 1
        now[0] += step_time(step)
        state.global_step = step
        deadline.on_step_end(args, state, control)
        if step >= 50:
            plans.append(deadline.planned_steps)
        if evaluate_every and step % evaluate_every == 0 and not control.should_training_stop:
            now[0] += evaluate_s
            deadline.on_evaluate(args, state, control)
    return step, plans


@pytest.mark.parametrize("evaluate_every", [0, 100])
def test_the_plan_holds_what_the_budget_holds_with_unequal_steps_and_evaluations(evaluate_every):
    """Batches grouped by length make steps of 0.1-0.5 s (median 0.1, mean 0.2), and evaluations may pause the run:
    every plan from step 50 on is already close to the steps the run will do (a median-only plan is twice too
    long: the schedule's shape then shifts as it is corrected, or the clock cuts it before the rate has decayed)."""
    deadline, now, state, control, args = _simulated_deadline(5.0)
    lengths = (0.1, 0.1, 0.1, 0.5)
    steps, plans = _run_until_stop(deadline, now, state, control, args, lambda s: lengths[s % 4], evaluate_every, 5.0)
    per_step = 0.2 + (5.0 / evaluate_every if evaluate_every else 0.0)
    assert steps == pytest.approx(300 / per_step, rel=0.05)
    assert deadline.planned_steps == pytest.approx(steps, rel=0.03)  # the schedule, not the clock, ended it
    assert now[0] == pytest.approx(300, rel=0.03)
    # Before the first evaluation its cost is unknown: the plans may then be long by the evaluations still to come.
    tolerance = 0.06 + (5.0 / evaluate_every / 0.2 if evaluate_every else 0.0)
    assert all(abs(plan - steps) <= tolerance * steps for plan in plans), (min(plans), max(plans), steps)


class FakeSeconds(TrainerCallback):
    """A clock for the trainer's deadline that advances one second a step (from `start`: another machine's clock)."""

    def __init__(self, start: float = 0.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def on_step_begin(self, args, state, control, **kwargs):
        self.now += 1.0


def test_a_time_budgeted_run_resumed_after_a_signal_keeps_its_budget_and_schedule(tmp_path):
    """A 1-minute budget at one (fake) second a step plans a ~60-step cosine schedule. Stopped by SIGTERM at step 23
    and resumed on a clock that reads otherwise, the run spends only the rest of the budget, on the same learning
    rates, and ends on the uninterrupted run's weights (without the recorded budget it planned anew: 60 more steps,
    its schedule restarted from max_steps)."""
    target = make_tiny_target("llama")
    rows = tokenized_rows()
    args = dict(max_steps=10_000, max_train_minutes=1.0, lr_scheduler_type="cosine", warmup_steps=0)

    def trainer(folder, clock_start=0.0):
        made = DraftTrainer(args=make_args(tmp_path / folder, **args), train_dataset=rows, target_model=target)
        clock = FakeSeconds(clock_start)
        made.deadline.clock = clock
        made.add_callback(clock)
        return made

    straight = trainer("a")
    straight.train()
    steps = straight.state.global_step
    assert 40 < steps < 80 and straight.deadline.planned_steps == steps

    stopped = trainer("b")
    stopped.add_callback(SignalAt(23))
    stopped.train()
    assert stopped.state.global_step == 23
    resumed = trainer("b", clock_start=1_000.0)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == steps

    def rates(run):
        return [h["learning_rate"] for h in run.state.log_history if "learning_rate" in h]

    assert rates(resumed)[-(steps - 23):] == rates(straight)[23:]
    resumed_state = trainable_state(resumed.model)
    for name, value in trainable_state(straight.model).items():
        torch.testing.assert_close(resumed_state[name], value, rtol=0, atol=0)


def test_time_budget_warns_when_max_steps_caps_the_plan(tmp_path, caplog):
    target = make_tiny_target("llama")
    args = make_args(tmp_path, max_steps=25, max_train_minutes=5.0)
    trainer = DraftTrainer(args=args, train_dataset=tokenized_rows(), target_model=target)
    with caplog.at_level("WARNING"):
        trainer.train()
    assert trainer.state.global_step == 25
    assert "raise --max_steps" in caplog.text
    last = [h for h in trainer.state.log_history if "learning_rate" in h][-1]
    assert last["learning_rate"] < 0.05 * args.learning_rate  # the capped plan still decays to its end


def test_time_budget_refuses_a_schedule_it_cannot_fit(tmp_path):
    target = make_tiny_target("llama")
    args = make_args(tmp_path, max_train_minutes=1.0, lr_scheduler_type="polynomial")
    trainer = DraftTrainer(args=args, train_dataset=tokenized_rows(), target_model=target)
    trainer.create_optimizer()
    with pytest.raises(ValueError, match="fit_schedule_to_budget false"):
        trainer.create_scheduler(10)


def test_defaults_are_the_tested_recipe():
    """A user who passes only the required arguments trains with the recipe benchmarks/README.md measured."""
    from transformers import HfArgumentParser

    from hf_dspark.training import DraftScriptArguments

    script, args = HfArgumentParser((DraftScriptArguments, DraftTrainingArguments)).parse_args_into_dataclasses(
        ["--train_file", "chats.jsonl", "--output_dir", "out", "--use_cpu", "true"]
    )
    assert (args.learning_rate, str(args.lr_scheduler_type.value if hasattr(args.lr_scheduler_type, "value")
            else args.lr_scheduler_type), args.warmup_steps) == (6e-4, "cosine", 0.04)  # fmt: skip
    assert args.per_device_train_batch_size == 16 and args.max_length == 1024 and args.pad_to_multiple_of == 256
    assert args.train_sampling_strategy == "group_by_length" and args.loss_backend == "torch"
    assert args.bf16 is False and args.compile_loss is False  # no GPU: full precision, eager loss
    assert args.compile_target is False  # the online target compiled on CUDA only
    assert args.compile_draft_layers is False and args.target_cuda_graphs is False
    assert args.max_loop_repeats == 2  # cut answers keep two repeats of a final loop
    from hf_dspark.data.cli import BuildCacheArguments

    assert BuildCacheArguments.max_loop_repeats == args.max_loop_repeats  # a cache of the recipe's rows by default
    # The measured recipe's depth: 2 layers for block drafters (a 1-layer default once trained the wrong draft).
    target = make_tiny_target("llama")
    assert build_draft(target, args).config.num_hidden_layers == 2
    assert build_draft(target, args).config.num_anchors == 256  # DSpark's recipe; the config's own default is 512
    args.algorithm = "eagle3"
    assert build_draft(target, args).config.num_hidden_layers == 1


def test_draft_config_flags_reach_the_draft_and_drafters_without_the_field_refuse_them(tmp_path):
    """--markov_rank / --ce_loss_alpha / --l1_loss_alpha set the draft's config (unset: the drafter's own defaults);
    a drafter without the field refuses the flag naming why, rather than training something else."""
    target = make_tiny_target("llama")
    draft = build_draft(target, make_args(tmp_path, markov_rank=16, ce_loss_alpha=0.2, l1_loss_alpha=0.8))
    assert (draft.config.markov_rank, draft.config.ce_loss_alpha, draft.config.l1_loss_alpha) == (16, 0.2, 0.8)
    assert draft.markov_head.markov_w1.weight.shape[1] == 16  # the head is built at that rank
    plain = build_draft(target, make_args(tmp_path)).config
    # DSpark learns from the target's distribution (soft CE + L1), DFlash from the label (CE alone).
    assert (plain.markov_rank, plain.ce_loss_alpha, plain.l1_loss_alpha, plain.soft_ce_loss_alpha) == (256, 0, 0.5, 0.5)
    dflash = build_draft(target, make_args(tmp_path, algorithm="dflash", l1_loss_alpha=0.5)).config
    assert (dflash.ce_loss_alpha, dflash.l1_loss_alpha, dflash.soft_ce_loss_alpha) == (1.0, 0.5, 0.0)
    label = build_draft(target, make_args(tmp_path, ce_loss_alpha=0.5, soft_ce_loss_alpha=0.0)).config
    assert (label.ce_loss_alpha, label.soft_ce_loss_alpha, label.l1_loss_alpha) == (0.5, 0.0, 0.5)
    with pytest.raises(ValueError, match="soft_ce_loss_alpha does not apply to eagle3"):
        build_draft(target, make_args(tmp_path, algorithm="eagle3", num_anchors=None, soft_ce_loss_alpha=0.5))
    with pytest.raises(ValueError, match="ce_loss_alpha does not apply to eagle3"):
        build_draft(target, make_args(tmp_path, algorithm="eagle3", num_anchors=None, ce_loss_alpha=0.5))
    with pytest.raises(ValueError, match="DFlash drafts have no Markov head"):
        build_draft(target, make_args(tmp_path, algorithm="dflash", markov_rank=8))
    # CE alone still trains the confidence head: its targets come from the L1 distance, computed either way.
    trainer = DraftTrainer(args=make_args(tmp_path, ce_loss_alpha=1.0, l1_loss_alpha=0.0, soft_ce_loss_alpha=0.0),
                           train_dataset=tokenized_rows(), target_model=target)  # fmt: skip
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 3 and all(math.isfinite(h["loss"]) and h["loss_conf"] > 0 for h in logged)


@pytest.mark.parametrize("algorithm", ["dspark", "dflash", "eagle3"])
def test_intermediate_size_widens_the_draft_mlp_of_every_drafter(tmp_path, algorithm):
    """--intermediate_size sets the draft layers' MLP width (unset: the target's); a width below 1 is refused."""
    target = make_tiny_target("llama")
    kw = dict(algorithm=algorithm, num_anchors=None) if algorithm == "eagle3" else dict(algorithm=algorithm)
    plain = build_draft(target, make_args(tmp_path, **kw))
    assert plain.config.intermediate_size == target.config.intermediate_size
    wide = 2 * target.config.intermediate_size
    draft = build_draft(target, make_args(tmp_path, intermediate_size=wide, **kw))
    assert draft.config.intermediate_size == wide
    mlps = [m for m in draft.modules() if type(m).__name__ == "DraftMLP"]
    assert mlps and all(m.up_proj.out_features == wide and m.down_proj.in_features == wide for m in mlps)
    with pytest.raises(ValueError, match="intermediate_size must be >= 1"):
        build_draft(target, make_args(tmp_path, intermediate_size=0, **kw))


def test_evaluation_batch_follows_the_training_batch_unless_given(tmp_path):
    """The held-out forward reuses the training step's compiled graphs only at the same batch shape."""
    out = str(tmp_path)
    assert DraftTrainingArguments(output_dir=out, per_device_train_batch_size=12).per_device_eval_batch_size == 12
    assert DraftTrainingArguments(output_dir=out).per_device_eval_batch_size == 16
    given = DraftTrainingArguments(output_dir=out, per_device_train_batch_size=12, per_device_eval_batch_size=4)
    assert given.per_device_eval_batch_size == 4


def test_compiled_parts_default_on_with_cuda(monkeypatch, tmp_path):
    """Where CUDA is visible the loss, the online target's layers and the draft's layers are compiled unless the
    user says otherwise; the draft's layers not by default where the trainer would ignore them (no warning then)."""
    from hf_dspark.training import arguments

    monkeypatch.setattr(arguments, "_cuda_available", lambda: True)
    monkeypatch.setattr(arguments, "_bf16_available", lambda: False)
    args = DraftTrainingArguments(output_dir=str(tmp_path))
    assert args.compile_loss is True and args.compile_target is True and args.compile_draft_layers is True
    assert args.target_cuda_graphs is True and args._target_cuda_graphs_defaulted
    args = DraftTrainingArguments(output_dir=str(tmp_path), compile_target=False, compile_draft_layers=False,
                                  target_cuda_graphs=False)  # fmt: skip
    assert args.compile_target is False and args.compile_draft_layers is False and args.target_cuda_graphs is False
    assert not args._target_cuda_graphs_defaulted
    args = DraftTrainingArguments(output_dir=str(tmp_path), gradient_checkpointing=True)
    assert args.compile_draft_layers is False
    args = DraftTrainingArguments(output_dir=str(tmp_path), gradient_checkpointing=True, compile_draft_layers=True)
    assert args.compile_draft_layers is True  # asked for: the trainer ignores it with a warning (test below)
    # One rule for the arguments' default and the trainer: what rules the compiled draft layers out.
    assert arguments.draft_layer_compile_blocker(False, False, False) is None
    assert arguments.draft_layer_compile_blocker(True, True, False) == "gradient checkpointing"
    assert arguments.draft_layer_compile_blocker(False, True, False) == "DeepSpeed"
    assert arguments.draft_layer_compile_blocker(False, False, True) == "FSDP"


def test_optional_switches_take_a_bare_flag_on_the_command_line():
    """`--compile_draft_layers` alone turns it on (it did when the field was a plain bool); `false` turns it off and
    leaving it out keeps the machine's default. The same parser serves examples/train_dspark.py and hf-dspark train."""
    from hf_dspark.training import training_argument_parser
    from hf_dspark.training.cli import build_train_parser

    required = ["--train_file", "chats.jsonl", "--output_dir", "out", "--use_cpu", "true"]
    for parser in (training_argument_parser(), build_train_parser()):
        parse = lambda *flags: parser.parse_args_into_dataclasses([*required, *flags])[1]  # noqa: E731, B023
        assert parse("--compile_draft_layers").compile_draft_layers is True
        assert parse("--compile_draft_layers", "false").compile_draft_layers is False
        assert parse().compile_draft_layers is False  # no CUDA here
        assert parse("--compile_target", "--no_fit_schedule_to_budget").compile_target is True
        assert parse("--target_cuda_graphs", "false").target_cuda_graphs is False
        assert parse("--target_cuda_graphs").target_cuda_graphs is True  # asked for; CPU runs still capture nothing


def test_length_grouped_order_is_fixed_by_data_seed_and_epoch():
    from hf_dspark.training.trainer import SeededLengthGroupedSampler

    lengths = [int(x) for x in torch.randint(10, 1000, (400,), generator=torch.Generator().manual_seed(0))]
    make = lambda seed: SeededLengthGroupedSampler(8, lengths, seed)  # noqa: E731
    first = list(make(1))
    assert sorted(first) == list(range(400)) and first == list(make(1))  # a permutation, the same every run
    assert first != list(make(2))
    later = make(1)
    later.set_epoch(1)
    assert list(later) != first  # a new order each epoch, and the same one when a resumed run reaches that epoch
    spread = lambda order: sum(max(lengths[i] for i in b) - min(lengths[i] for i in b)  # noqa: E731
                               for b in (order[k : k + 8] for k in range(0, 400, 8)))
    shuffled = torch.randperm(400, generator=torch.Generator().manual_seed(3)).tolist()
    assert spread(first) < spread(shuffled) / 2  # batches of similar lengths: less padding


def test_a_wrong_launch_fails_at_once_naming_the_change(tmp_path, monkeypatch):
    """What `accelerate launch` passes through the environment is checked when the arguments are parsed."""
    import importlib.util

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.raises(ValueError, match="mixed_precision: fp16 but the training flags ask for bf16"):
        DraftTrainingArguments(output_dir=str(tmp_path), bf16=True, use_cpu=True)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert DraftTrainingArguments(output_dir=str(tmp_path), use_cpu=True).bf16 is True  # no flag: the launcher's
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real_find_spec(name, *a))
    with pytest.raises(ImportError, match="deepspeed is not installed: pip install"):
        DraftTrainingArguments(output_dir=str(tmp_path), use_cpu=True)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    from hf_dspark.training import arguments

    with pytest.raises(ValueError, match="4 processes were launched on this machine but it has 2 GPU"):
        arguments._check_launch(_launch_args(use_cpu=False))


def _launch_args(**kw):
    from types import SimpleNamespace

    return SimpleNamespace(bf16=False, fp16=False, deepspeed=None, **kw)


def test_a_time_budget_replaces_the_step_bar_with_one_in_seconds(tmp_path):
    from transformers.trainer_callback import ProgressCallback

    from hf_dspark.training.trainer import TrainingDeadline

    target = make_tiny_target("llama")
    shown = DraftTrainer(args=make_args(tmp_path, max_train_minutes=1.0, disable_tqdm=False), train_dataset=tokenized_rows(),
                         target_model=target)  # fmt: skip
    kinds = {type(c) for c in shown.callback_handler.callbacks}
    assert TrainingDeadline in kinds and ProgressCallback not in kinds
    hidden = DraftTrainer(args=make_args(tmp_path, max_train_minutes=1.0), train_dataset=tokenized_rows(), target_model=target)
    assert not next(c for c in hidden.callback_handler.callbacks if isinstance(c, TrainingDeadline)).show_progress


def test_compiled_target_failure_falls_back_to_the_eager_target(tmp_path, caplog):
    """compile_target is on by default on CUDA, so a target the compiler cannot handle must not stop training: the
    step reruns the eager forward (same features), says so once, and later steps skip the compiled layers."""
    from hf_dspark.target import decoder_layers

    target = make_tiny_target("llama")
    trainer = DraftTrainer(args=make_args(tmp_path, compile_target=True), train_dataset=tokenized_rows(),
                           target_model=target)  # fmt: skip
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("inductor could not lower this op")

    trainer._compiled_target_layers.pairs = [(layer, "forward", broken) for layer in decoder_layers(target)]
    with caplog.at_level("WARNING"):
        trainer.train()
    assert len(calls) == 1 and trainer._compiled_target_layers is None
    assert sum("compiled target forward failed" in r.getMessage() for r in caplog.records) == 1
    assert all("forward" not in layer.__dict__ for layer in decoder_layers(target))  # the swap was undone
    assert len([h for h in trainer.state.log_history if "loss" in h]) == 3


def test_compiled_target_layers_train_like_eager_and_leave_the_target_untouched(tmp_path):
    """compile_target: the online target's decoder layers run compiled inside the trainer's forward only; the
    losses match the eager run's (float32 on CPU) and the target's layers keep their own forward afterwards."""
    from torch._dynamo.utils import counters

    from hf_dspark.target import decoder_layers

    losses = {}
    for compiled in (False, True):
        counters.clear()
        torch._dynamo.reset()  # an earlier test in this process may have compiled the same code objects
        target = make_tiny_target("llama")
        trainer = DraftTrainer(args=make_args(tmp_path, compile_target=compiled), train_dataset=tokenized_rows(),
                               target_model=target)  # fmt: skip
        trainer.train()
        losses[compiled] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        assert all("forward" not in layer.__dict__ for layer in decoder_layers(target))
        # Logs say how much of the run went to compiling (cumulative since train() began).
        compile_s = [h["compile_s"] for h in trainer.state.log_history if "loss" in h]
        assert compile_s == sorted(compile_s) and (compile_s[-1] > 0) == compiled
        # compile_report.json says which functions compiled, how often and how long.
        report = json.loads((tmp_path / "out" / "compile_report.json").read_text())
        assert (report["compilations"] > 0) == compiled
        if compiled:
            layer = [f for f in report["frames"] if f["where"].startswith("modeling_")]  # the decoder layer's call
            assert layer and "forward" in layer[0]["function"] and 1 <= layer[0]["count"] <= 2
            assert 0 < report["total_s"] <= compile_s[-1] + 1.0
    assert (trainer._compiled_target_layers is not None) and len(losses[True]) == 3
    assert 1 <= counters["frames"]["ok"] <= 2  # it compiled: once for all layers (twice with a new length)
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)


def test_the_target_forward_comes_from_its_graphs_where_they_serve_it(tmp_path):
    """target_cuda_graphs: on CPU nothing is captured; where the graph runner serves a batch (here a stand-in that
    runs the plain forward and counts), its features train the draft, and where it declines (None) the plain forward
    runs: the losses are those of the plain run either way."""
    from hf_dspark.target import target_features

    args = make_args(tmp_path, compile_target=False, target_cuda_graphs=True)
    plain = DraftTrainer(args=args, train_dataset=tokenized_rows(), target_model=make_tiny_target("llama"))
    assert plain._target_graphs is None  # CUDA only
    plain.train()
    expected = [h["loss"] for h in plain.state.log_history if "loss" in h]
    for serves in (True, False):
        trainer = DraftTrainer(args=args, train_dataset=tokenized_rows(), target_model=make_tiny_target("llama"))
        calls = []

        def runner(input_ids, layer_ids, attention_mask):
            calls.append(tuple(input_ids.shape))
            return target_features(trainer.target_model, input_ids, layer_ids, attention_mask) if serves else None

        trainer._target_graphs = runner
        trainer.train()
        assert len(calls) == 3
        assert [h["loss"] for h in trainer.state.log_history if "loss" in h] == pytest.approx(expected, rel=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_training_with_the_target_from_cuda_graphs_matches_the_plain_forward(tmp_path):
    """On a GPU, target_cuda_graphs captures the target's forward once per batch shape (when the shape comes a
    second time: two epochs here) and the run's losses are the plain run's (float32 weights; the captured path passes
    an explicit mask, so equal up to kernel rounding)."""
    losses = {}
    for graphs in (False, True):
        args = make_args(tmp_path, use_cpu=False, bf16=False, compile_target=False, compile_loss=False, max_steps=8,
                         compile_draft_layers=False, target_cuda_graphs=graphs, pad_to_multiple_of=32)  # fmt: skip
        target = make_tiny_target("llama", attn_implementation="sdpa")
        trainer = DraftTrainer(args=args, train_dataset=tokenized_rows(), target_model=target)
        trainer.train()
        losses[graphs] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        if graphs:
            assert trainer._target_graphs.failed is None and 1 <= len(trainer._target_graphs.graphs) <= 2
    assert losses[True] == pytest.approx(losses[False], rel=1e-3)


@pytest.mark.parametrize("algorithm", ["dspark", "eagle3"])
def test_compiled_draft_layers_train_like_eager_and_are_swapped_back(tmp_path, algorithm):
    """compile_draft_layers: the draft's layer methods run compiled inside the training forward only; the losses
    and the trained weights match the eager run's (float32 on CPU), and the layers keep their own methods."""
    from torch._dynamo.utils import counters

    runs = {}
    for compiled in (False, True):
        counters.clear()
        # The counts below are this run's: an earlier test in this process (pytest-xdist) may have compiled the same
        # layer code objects, whose cached graphs would then recompile here for new layer objects.
        torch._dynamo.reset()
        target = make_tiny_target("llama")
        args = make_args(tmp_path, algorithm=algorithm, num_hidden_layers=2 if algorithm != "eagle3" else 1,
                         num_anchors=None if algorithm == "eagle3" else 8, compile_target=False,
                         compile_draft_layers=compiled)  # fmt: skip
        set_seed(3)
        trainer = DraftTrainer(args=args, train_dataset=tokenized_rows(), target_model=target)
        methods = trainer.model.compiled_layer_methods
        assert (trainer._compiled_draft_layers is not None) == compiled
        trainer.train()
        runs[compiled] = (losses(trainer), trainable_state(trainer.model))
        assert not any(name in layer.__dict__ for layer in trainer.model.layers for name in methods)
        report = json.loads((tmp_path / "out" / "compile_report.json").read_text())
        layer_frames = [f for f in report["frames"] if f["function"] in methods]
        assert bool(layer_frames) == compiled, report["frames"]
        # Three steps of one padded length: compiled once per method, the layer forward once more for the first
        # layer (its input, the frozen embeddings' output, needs no gradient) and never again per step.
        assert all(f["count"] <= 2 and all("requires_grad" in r for r in f["reasons"]) for f in layer_frames), layer_frames
    assert trainer._compiled_draft_layers is not None and counters["frames"]["ok"] >= len(methods)
    (eager_losses, eager_state), (compiled_losses, compiled_state) = runs[False], runs[True]
    assert [s for s, _ in compiled_losses] == [s for s, _ in eager_losses]
    assert [x for _, x in compiled_losses] == pytest.approx([x for _, x in eager_losses], rel=1e-4)
    for name, value in eager_state.items():
        torch.testing.assert_close(compiled_state[name], value, rtol=1e-4, atol=1e-5)


def test_compiled_draft_layers_failure_falls_back_and_sharding_or_checkpointing_skip_it(tmp_path, caplog):
    """A draft the compiler cannot handle still trains: the forward reruns eagerly, a warning says so once, and
    the swap is undone. Gradient checkpointing (layers called through the checkpoint function) skips it."""
    target = make_tiny_target("llama")
    trainer = DraftTrainer(args=make_args(tmp_path, compile_target=False, compile_draft_layers=True),
                           train_dataset=tokenized_rows(), target_model=target)  # fmt: skip
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("inductor could not lower this op")

    trainer._compiled_draft_layers.pairs = [(layer, "forward", broken) for layer in trainer.model.layers]
    with caplog.at_level("WARNING"):
        trainer.train()
    assert len(calls) == 1 and trainer._compiled_draft_layers is None
    assert sum("compiled draft layers failed" in r.getMessage() for r in caplog.records) == 1
    assert all("forward" not in layer.__dict__ for layer in trainer.model.layers)
    assert len(losses(trainer)) == 3 and all(math.isfinite(x) for _, x in losses(trainer))

    caplog.clear()
    with caplog.at_level("WARNING"):
        checkpointed = DraftTrainer(
            args=make_args(tmp_path, compile_draft_layers=True, gradient_checkpointing=True),
            train_dataset=tokenized_rows(), target_model=target,
        )  # fmt: skip
    assert checkpointed._compiled_draft_layers is None
    assert any("compile_draft_layers is ignored with gradient checkpointing" in r.getMessage() for r in caplog.records)

    # Defaulted on where only the trainer sees what rules it out (DeepSpeed or FSDP from an accelerate config, here
    # stood in for by checkpointing turned on after the arguments resolved): off again with a note, not a warning.
    args = make_args(tmp_path)
    args.compile_draft_layers, args.gradient_checkpointing = True, True
    caplog.clear()
    with caplog.at_level("INFO"):
        quiet = DraftTrainer(args=args, train_dataset=tokenized_rows(), target_model=target)
    notes = [r for r in caplog.records if "compile_draft_layers is ignored" in r.getMessage()]
    assert quiet._compiled_draft_layers is None and notes and all(r.levelname == "INFO" for r in notes)


@pytest.mark.parametrize("algorithm", ["dspark", "eagle3"])
def test_loss_cuda_graphs_feed_the_loss_and_train_as_without_them(tmp_path, caplog, algorithm):
    """`loss_cuda_graphs`: off CUDA it is ignored with a warning. Where it serves (a CPU stand-in for the graphs,
    which re-runs the captured function on its static inputs), the trainer's loss goes through it and training
    logs the same losses as without it."""
    from conftest import replaying_on_cpu

    from hf_dspark.training.loss_graphs import LossGraphs

    target = make_tiny_target("llama")
    args = dict(algorithm=algorithm, max_steps=4, per_device_train_batch_size=1, compile_target=False)
    if algorithm == "eagle3":
        args.update(num_anchors=None, block_size=None)
    with caplog.at_level("WARNING"):
        plain = DraftTrainer(args=make_args(tmp_path, loss_cuda_graphs=True, **args), train_dataset=tokenized_rows(),
                             target_model=target)  # fmt: skip
    assert plain._loss_graphs is None and "loss_cuda_graphs is ignored off CUDA" in caplog.text
    plain.train()
    replayed = DraftTrainer(args=make_args(tmp_path, **args), train_dataset=tokenized_rows(), target_model=target)
    replayed._loss_graphs = replaying_on_cpu(LossGraphs)()
    replayed.train()
    assert replayed._loss_graphs.captures >= 1 and replayed._loss_graphs.failed is None
    for (step, want), (_, got) in zip(losses(plain), losses(replayed), strict=True):
        assert got == pytest.approx(want, rel=1e-5), step


@pytest.mark.parametrize("algorithm", ["dspark", "eagle3"])
def test_evaluation_walks_the_held_out_text_as_decoding_would(tmp_path, algorithm):
    """Held-out τ is also reported as decoding would see it (`metrics.decoding_walk_estimates`). Held-out batches
    take a block at every answer position, in passes of the training step's anchor count when a row has more
    positions than that: fewer anchors than positions give the same held-out figures as enough anchors for one
    pass (blocks do not see each other), and no row is left unwalked."""
    rows = tokenized_rows(4, seed=1)
    anchors = None if algorithm == "eagle3" else 64  # more than any row's answer positions
    trainer = DraftTrainer(args=make_args(tmp_path, algorithm=algorithm, num_anchors=anchors), eval_dataset=rows,
                           target_model=make_tiny_target("llama"))  # fmt: skip
    metrics = trainer.evaluate()
    slots = len([k for k in metrics if k.startswith("eval_accept@")])
    for key in ("eval_tau_walk_greedy", "eval_tau_walk_prob"):
        assert 1.0 <= metrics[key] <= slots + 1, key
    assert "eval_walk_rows_skipped" not in metrics
    if algorithm == "eagle3":
        return
    trainer.args.num_anchors = trainer.model.config.num_anchors = 8  # fewer than every row's answer positions
    passes = trainer.evaluate()
    assert "eval_walk_rows_skipped" not in passes
    for key in ("eval_tau_prob", "eval_tau_greedy", "eval_tau_walk_greedy", "eval_tau_walk_prob"):
        assert passes[key] == pytest.approx(metrics[key], rel=1e-5), key


def _drafter_kw(algorithm: str) -> dict:
    anchored = hasattr(DRAFTERS[algorithm].config_class, "num_anchors")
    return {"algorithm": algorithm, "num_anchors": 8 if anchored else None}


@pytest.mark.parametrize("algorithm", list(DRAFTERS))
@pytest.mark.parametrize("case", ["default", "nan-inf-filter", "rows counted on the device"])
def test_a_training_step_never_makes_the_host_wait(tmp_path, algorithm, case):
    """A host synchronization leaves the GPU idle while the host prepares what comes next. The loss's row
    compaction counted its rows on the device (one wait a step) until the collator counted them on the host
    (`loss_rows_bound_fn`); with `loss_rows_bound=False` it still does. transformers' NaN/inf filter of the
    logged loss adds two a step (`torch.isnan(loss) or torch.isinf(loss)`), so the draft's arguments turn it off."""
    target = make_tiny_target("llama")
    kw = {"logging_nan_inf_filter": True} if case == "nan-inf-filter" else {}
    args = make_args(tmp_path, max_steps=5, logging_steps=100, num_hidden_layers=2, **_drafter_kw(algorithm), **kw)
    assert args.logging_nan_inf_filter is (case == "nan-inf-filter")
    collator = DraftDataCollator(loss_rows_bound=False) if case == "rows counted on the device" else None
    current = {"step": None}

    class Steps(TrainerCallback):  # label the calls from a step's start to its end (logging comes after)
        def on_step_begin(self, args, state, control, **kwargs):
            current["step"] = state.global_step

        def on_step_end(self, args, state, control, **kwargs):
            current["step"] = None

    trainer = DraftTrainer(model=fresh_draft(target, tmp_path, **_drafter_kw(algorithm)), args=args,
                           train_dataset=tokenized_rows(16), target_model=target, callbacks=[Steps()],
                           data_collator=collator)  # fmt: skip
    with HostSyncs(lambda: current["step"]) as syncs:
        trainer.train()
    per_step = {"default": 0, "nan-inf-filter": 2, "rows counted on the device": 1}[case]
    assert dict(syncs.counts) == ({step: per_step for step in range(5)} if per_step else {}), dict(syncs.calls)
    assert all(name in ("nonzero", "__bool__") for _, name in syncs.calls), dict(syncs.calls)


@pytest.mark.parametrize("given", [None, {"non_blocking": False}, '{"split_batches": false}'])
def test_training_batches_reach_the_device_without_a_host_wait(tmp_path, monkeypatch, given):
    """A blocking copy of the batch to the GPU waits for all the work queued there: a synchronization each step
    that HostSyncs cannot see on CPU (a copy to the CPU is no copy). The trainer's batches go through accelerate's
    `send_to_device` with non_blocking=True unless the caller's accelerator_config says otherwise."""
    import accelerate.data_loader

    calls = []
    send = accelerate.data_loader.send_to_device

    def recording(tensor, device, non_blocking=False, **kwargs):
        calls.append(non_blocking)
        return send(tensor, device, non_blocking=non_blocking, **kwargs)

    monkeypatch.setattr(accelerate.data_loader, "send_to_device", recording)
    target = make_tiny_target("llama")
    kw = {} if given is None else {"accelerator_config": given}
    # use_cpu=False: batches pinned as on a GPU (here the device is still the CPU); use_cpu turns pinning off, and
    # with it the asynchronous copy (a copy from unpinned memory waits anyway, and transformers warns).
    assert make_args(tmp_path, **kw).accelerator_config.non_blocking is False
    args = make_args(tmp_path, max_steps=2, use_cpu=False, **kw)
    expected = given != {"non_blocking": False}
    assert args.dataloader_pin_memory and args.accelerator_config.non_blocking is expected
    trainer = DraftTrainer(model=fresh_draft(target, tmp_path), args=args, train_dataset=tokenized_rows(16),
                           target_model=target)  # fmt: skip
    trainer.train()
    assert len(calls) >= 2 and set(calls) == {expected}


@pytest.mark.parametrize("algorithm", list(DRAFTERS))
def test_the_host_counted_loss_rows_bound_every_step(tmp_path, monkeypatch, algorithm):
    """The collator's count (`loss_rows_bound_fn`) is never below the rows the step's loss has: exact for Eagle3,
    above it for block drafters only by slots past an answer's end, in training and evaluation batches."""
    from hf_dspark.training import losses

    seen = []
    masked_rows_loss = losses._masked_rows_loss

    def recording(row_mask, *args, max_rows=None, **kwargs):
        seen.append((int(row_mask.sum()), max_rows, row_mask.numel()))
        return masked_rows_loss(row_mask, *args, max_rows=max_rows, **kwargs)

    monkeypatch.setattr(losses, "_masked_rows_loss", recording)
    target = make_tiny_target("llama")
    args = make_args(tmp_path, max_steps=4, **_drafter_kw(algorithm))
    trainer = DraftTrainer(model=fresh_draft(target, tmp_path, **_drafter_kw(algorithm)), args=args,
                           train_dataset=tokenized_rows(16), eval_dataset=tokenized_rows(4, seed=1),
                           target_model=target)  # fmt: skip
    trainer.train()
    trainer.evaluate()
    assert len(seen) >= 5 and all(bound is not None for _, bound, _ in seen)
    block = args.block_size
    for count, bound, rows in seen:
        if not _drafter_kw(algorithm)["num_anchors"]:  # Eagle3: exact
            assert bound == count
        else:  # each sequence (rows / (8 anchors x K slots)) loses at most 1 + 2 + ... + (K - 1) slots at its end
            sequences = rows // (8 * block)
            assert count <= bound <= count + sequences * block * (block - 1) // 2, (count, bound, sequences)


def test_row_lengths_for_length_grouping_come_from_arrow_and_follow_selections():
    from hf_dspark.training.trainer import _row_lengths

    rows = tokenized_rows(12)
    picked = rows.select([7, 2, 11]).filter(lambda r: len(r["input_ids"]) > 20)  # an indices mapping, then a filter
    for dataset in (rows, picked):
        assert _row_lengths(dataset) == [len(ids) for ids in dataset["input_ids"]]


def test_the_summary_says_how_long_the_first_step_took_to_come(tmp_path):
    """startup_s (process start to train()) and first_step_s (train() to the end of step 1) in the run's summary:
    together the wait for the first step that the throughput goal bounds."""
    target = make_tiny_target("llama")
    trainer = DraftTrainer(model=fresh_draft(target, tmp_path), args=make_args(tmp_path, max_steps=3),
                           train_dataset=tokenized_rows(), target_model=target)  # fmt: skip
    trainer.train()
    summary = next(h for h in trainer.state.log_history if "train_runtime" in h)
    assert 0 < summary["first_step_s"] <= summary["elapsed_s"] + 0.05  # both from the train() call
    assert trainer.startup_s is not None and summary["startup_s"] == round(trainer.startup_s, 1) > 0
    first_loss_at = next(h["elapsed_s"] for h in trainer.state.log_history if "loss" in h)  # logged after step 1
    assert trainer.first_step_s <= first_loss_at + 0.05


def test_zero3_init_disabled_lets_a_model_load_whole_and_restores_zero3(tmp_path):
    """Once a ZeRO-3 config is registered (TrainingArguments under `accelerate launch` with a DeepSpeed config do
    it), transformers loads every model partitioned; inside `zero3_init_disabled` it loads whole."""
    pytest.importorskip("deepspeed")  # transformers' DeepSpeed config object needs it (the dev extra installs it)
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

    from hf_dspark.training import zero3_init_disabled

    with zero3_init_disabled():  # nothing registered: nothing to do
        assert not is_deepspeed_zero3_enabled()
    config = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    try:
        assert is_deepspeed_zero3_enabled()
        with zero3_init_disabled():
            assert not is_deepspeed_zero3_enabled()
        assert is_deepspeed_zero3_enabled()
        with pytest.raises(RuntimeError, match="inside"), zero3_init_disabled():
            raise RuntimeError("inside")
        assert is_deepspeed_zero3_enabled()  # restored after an error too
    finally:
        unset_hf_deepspeed_config()
    del config


def test_a_target_partitioned_by_zero3_is_refused_with_the_fix(tmp_path):
    target = make_tiny_target("llama")
    next(target.parameters()).ds_id = 0  # what deepspeed.zero.Init leaves on every weight it partitions
    with pytest.raises(ValueError, match="partitioned by DeepSpeed ZeRO-3.*zero3_init_disabled"):
        DraftTrainer(args=make_args(tmp_path), train_dataset=tokenized_rows(), target_model=target)


def test_the_step_unwraps_the_model_once_per_wrapper(tmp_path):
    """compute_loss needs the bare draft every step; accelerate's unwrap_model reads package metadata on each call
    (about 2 ms a step with DeepSpeed installed), so the trainer asks it once per wrapper object."""
    args = make_args(tmp_path, max_steps=4)
    trainer = DraftTrainer(args=args, train_dataset=tokenized_rows(), target_model=make_tiny_target("llama"))
    calls = []
    unwrap = trainer.accelerator.unwrap_model
    trainer.accelerator.unwrap_model = lambda model, *a, **kw: calls.append(model) or unwrap(model, *a, **kw)
    trainer.train()
    stepped = [m for m in calls if m is trainer.model_wrapped or m is trainer.model]
    assert trainer.state.global_step == 4 and len(stepped) <= 2, len(stepped)
    assert trainer._unwrap(trainer.model_wrapped) is trainer.model
    for _ in range(3):  # models of later trials (hyperparameter search) do not keep earlier ones alive
        trainer._unwrap(torch.nn.Linear(1, 1))
    assert len(trainer._unwrapped) == 2
