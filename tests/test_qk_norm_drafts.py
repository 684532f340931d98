"""Drafts with query/key RMSNorm for targets that have none (Llama, Qwen2): every block-draft consumer (vLLM,
SGLang, DeepSpec, speculators) applies q/k norm, so these are the Llama-family drafts that can be served."""

from __future__ import annotations

import datasets
import pytest
import torch
from conftest import make_tiny_target
from transformers import set_seed

import hf_dspark  # noqa: F401  (installs the generate() routing)
from hf_dspark import DFlashModel, DSparkModel, Eagle3Model
from hf_dspark.hub import ExportError, export_draft, load_draft
from hf_dspark.training import DraftTrainer, DraftTrainingArguments, build_draft

DRAFTERS = {"dspark": DSparkModel, "dflash": DFlashModel, "eagle3": Eagle3Model}


def rows(n: int = 4, vocab: int = 96) -> datasets.Dataset:
    gen = torch.Generator().manual_seed(0)
    return datasets.Dataset.from_list(
        [{"input_ids": torch.randint(3, vocab, (20,), generator=gen).tolist(), "loss_mask": [0] * 4 + [1] * 16}
         for _ in range(n)]
    )


def args(tmp_path, **kw) -> DraftTrainingArguments:
    return DraftTrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=2, learning_rate=1e-2, warmup_steps=0,
        report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, block_size=4, num_hidden_layers=1,
        seed=7, **kw,
    )


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_use_qk_norm_flag_reaches_the_draft_and_none_follows_the_target(tmp_path, family):
    target = make_tiny_target(family)
    assert build_draft(target, args(tmp_path, algorithm="dspark", num_anchors=4)).config.use_qk_norm is False
    draft = build_draft(target, args(tmp_path, algorithm="dspark", num_anchors=4, use_qk_norm=True))
    assert draft.config.use_qk_norm is True
    attn = draft.layers[0].self_attn
    assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (draft.config.head_dim,)
    qwen3 = build_draft(make_tiny_target("qwen3"), args(tmp_path, algorithm="dspark", num_anchors=4, use_qk_norm=False))
    assert qwen3.config.use_qk_norm is False and not hasattr(qwen3.layers[0].self_attn, "q_norm")


@pytest.mark.parametrize("algorithm", ["dspark", "dflash", "eagle3"])
def test_llama_draft_with_qk_norm_trains_saves_loads_and_decodes_like_the_target(tmp_path, algorithm):
    target = make_tiny_target("llama")
    set_seed(3)
    extra = {} if algorithm == "eagle3" else {"num_anchors": 4}
    trainer = DraftTrainer(args=args(tmp_path, algorithm=algorithm, use_qk_norm=True, **extra),
                           train_dataset=rows(), target_model=target)
    q_norm = trainer.model.layers[0].self_attn.q_norm.weight.detach().clone()
    trainer.train()
    draft = trainer.model
    assert torch.isfinite(torch.tensor(trainer.state.log_history[-1]["train_loss"]))
    assert not torch.equal(draft.layers[0].self_attn.q_norm.weight, q_norm)  # the norm is trained
    draft.save_pretrained(tmp_path / "draft")
    back = DRAFTERS[algorithm].from_pretrained(tmp_path / "draft").eval()
    assert back.config.use_qk_norm is True
    for key, value in draft.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    expected = target.generate(ids, max_new_tokens=20, do_sample=False)
    assert torch.equal(target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=back), expected)


@pytest.mark.parametrize(
    "algorithm, formats",
    [
        ("dspark", ("vllm", "sglang", "speculators", "deepspec")),
        ("dflash", ("vllm", "deepspec")),
        ("eagle3", ("vllm", "speculators")),
    ],
)
def test_llama_draft_with_qk_norm_exports_where_the_layout_has_qk_norm(tmp_path, algorithm, formats):
    target = make_tiny_target("llama")
    kw = {"target_layer_ids": [0, 1, 2, 3, 4]} if algorithm == "eagle3" else {"markov_rank": 8} if algorithm == "dspark" else {}
    draft = DRAFTERS[algorithm].from_target(target, num_hidden_layers=1, use_qk_norm=True, **kw)
    draft.config.target_name_or_path = "org/tiny-llama"
    for fmt in formats:
        result = export_draft(draft, fmt, tmp_path / fmt)
        assert result.serve_command
        back = load_draft(tmp_path / fmt)
        assert back.config.use_qk_norm is True
        assert torch.equal(back.layers[0].self_attn.k_norm.weight, draft.layers[0].self_attn.k_norm.weight)
    # Without q/k norm the same Llama draft goes nowhere a block drafter is served, and the error names the fix.
    plain = DRAFTERS[algorithm].from_target(target, num_hidden_layers=1, **kw)
    if algorithm != "eagle3":
        with pytest.raises(ExportError, match="use_qk_norm=True"):
            export_draft(plain, "vllm", tmp_path / "refused")
