"""LoRA on a trained draft: the adapter trains through DraftTrainer (online), merges into a plain draft, and
saves/loads alone in PEFT's layout."""

from __future__ import annotations

import copy

import datasets
import pytest
import torch
from conftest import make_tiny_target
from safetensors.torch import load_file
from transformers import set_seed

from hf_dspark import DSparkModel, Eagle3Model
from hf_dspark.hub.peft_utils import (
    apply_lora,
    default_lora_targets,
    has_lora,
    load_lora_adapter,
    lora_parameters,
    merge_lora,
    save_lora_adapter,
)
from hf_dspark.target import target_features
from hf_dspark.training import DraftTrainer, DraftTrainingArguments


@pytest.fixture(scope="module")
def qwen3():
    return make_tiny_target("qwen3")


def trained_draft(target, **kw):
    """Stands in for a draft trained on another domain: random weights everywhere (W2 included)."""
    set_seed(0)
    draft = DSparkModel.from_target(target, num_hidden_layers=1, markov_rank=8, block_size=4, num_anchors=8, **kw)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if name not in ("embed_tokens.weight", "lm_head.weight"):
                param.normal_(0, 0.1)
    return draft


def new_domain(n: int = 8) -> datasets.Dataset:
    """A narrow 'domain': the same arithmetic-progression answer in every row (easy to fit, far from init)."""
    rows = [{"input_ids": [5 + i] * 3 + [(7 * t) % 80 + 10 for t in range(17)], "loss_mask": [0] * 3 + [1] * 17}
            for i in range(n)]
    return datasets.Dataset.from_list(rows)


def block_outputs(draft, target, ids):
    context, last = target_features(target, ids, draft.config.target_layer_ids)
    with torch.no_grad():
        anchors = torch.tensor([[1, 6, 9]])
        out = draft(ids, context, torch.ones_like(ids), target_last_hidden=last, anchor_positions=anchors)
    return out.hidden_states, out.markov_features, out.confidence_logits


def test_lora_trains_through_draft_trainer_and_merges_into_a_plain_draft(qwen3, tmp_path):
    # An L1-heavy loss (the reference mix): on this tiny domain its total falls by a clear 30% in 24 steps, where a
    # CE-heavier total (dominated by a CE of ~4.5, label or soft, that a rank-4 adapter barely moves) falls by 13%.
    draft = trained_draft(qwen3, ce_loss_alpha=0.1, l1_loss_alpha=0.9, soft_ce_loss_alpha=0.0)
    base = {k: v.clone() for k, v in draft.state_dict().items()}
    apply_lora(draft, r=4)
    counts = lora_parameters(draft)
    assert 0 < counts["trainable"] < counts["total"] // 4

    args = DraftTrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=24, per_device_train_batch_size=4, learning_rate=3e-2,
        logging_steps=4, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
    )
    trainer = DraftTrainer(model=draft, args=args, train_dataset=new_domain(), target_model=qwen3)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < 0.8 * losses[0]

    state = draft.state_dict()
    for key, value in base.items():  # the base weights never moved
        module, _, leaf = key.rpartition(".")
        stored = state.get(key, state.get(f"{module}.base_layer.{leaf}"))
        assert torch.equal(stored, value), key
    lora_b = {k: v for k, v in state.items() if "lora_B" in k or "lora_embedding_B" in k}
    assert lora_b and all(v.abs().sum() > 0 for v in lora_b.values())  # every adapted module got gradient

    ids = torch.tensor([[5, 5, 5] + [(7 * t) % 80 + 10 for t in range(11)]])
    draft.eval()
    adapted = block_outputs(draft, qwen3, ids)
    merge_lora(draft)
    assert type(draft) is DSparkModel and not has_lora(draft)
    for a, b in zip(adapted, block_outputs(draft, qwen3, ids)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    draft.save_pretrained(tmp_path / "merged")
    saved = load_file(tmp_path / "merged" / "model.safetensors")
    assert not any("lora" in k or "base_layer" in k for k in saved)
    reloaded = DSparkModel.from_pretrained(tmp_path / "merged")
    assert reloaded.state_dict().keys() == base.keys()
    assert all(torch.equal(reloaded.state_dict()[k], draft.state_dict()[k]) for k in base)
    changed = [k for k in base if not torch.equal(base[k], reloaded.state_dict()[k])]
    assert "fc.weight" in changed and "layers.0.self_attn.q_proj.weight" in changed
    assert "embed_tokens.weight" not in changed and "lm_head.weight" not in changed


def test_lora_adapter_saves_and_loads_alone(qwen3, tmp_path):
    draft = trained_draft(qwen3)
    pristine = copy.deepcopy(draft)
    apply_lora(draft, r=4)
    with torch.no_grad():  # stand-in for training: non-zero adapter weights
        for name, param in draft.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                param.normal_(0, 0.05)
    path = save_lora_adapter(draft, tmp_path / "adapter")
    assert (path / "adapter_config.json").exists()
    adapter = load_file(path / "adapter_model.safetensors")
    assert all("lora" in k for k in adapter) and sum(v.numel() for v in adapter.values()) < 0.5 * sum(
        p.numel() for p in pristine.parameters()
    )
    ids = torch.tensor([[4, 9, 17, 30, 31, 50, 8, 9, 10, 11, 12, 13]])
    draft.eval()
    expected = block_outputs(draft, qwen3, ids)
    load_lora_adapter(pristine, path).eval()
    for a, b in zip(expected, block_outputs(pristine, qwen3, ids)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_lora_targets_skip_target_copies_and_matrices_used_outside_forward(qwen3, head):
    targets = default_lora_targets(trained_draft(qwen3, markov_head_type=head))
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "fc", "markov_w1",
            "confidence_head.proj"} <= set(targets)
    assert ("markov_head.gate_proj" in targets) == (head == "gated") and ("rnn_proj" in targets) == (head == "rnn")
    assert not {"embed_tokens", "lm_head", "markov_w2"} & set(targets)


def test_eagle3_draft_takes_a_lora_adapter(tmp_path):
    llama = make_tiny_target("llama")
    draft = Eagle3Model.from_target(llama, target_layer_ids=[0, 2, 4])
    apply_lora(draft, r=2)
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert default_lora_targets(draft) == projections + ["fc"]
    trainable = [n for n, p in draft.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    merge_lora(draft).save_pretrained(tmp_path / "merged")
    assert type(Eagle3Model.from_pretrained(tmp_path / "merged")) is Eagle3Model


def test_lora_misuse_is_refused(qwen3, tmp_path):
    from hf_dspark.hub import export_draft, push_draft

    draft = trained_draft(qwen3)
    with pytest.raises(ValueError, match="no LoRA adapter"):
        merge_lora(draft)
    apply_lora(draft, r=2)
    with pytest.raises(ValueError, match="merge it first"):
        apply_lora(draft, r=2)
    with pytest.raises(ValueError, match="merge it first"):
        export_draft(draft, "deepspec", tmp_path / "out")
    with pytest.raises(ValueError, match="merge it first"):
        push_draft(draft, "me/never-created")
