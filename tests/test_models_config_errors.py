"""Invalid draft configurations fail at construction with messages that name the fix."""

import pytest

from hf_dspark import DFlashConfig, DFlashModel, DSparkConfig, DSparkModel, Eagle3Config, Eagle3Model

from conftest import make_tiny_target

BASE = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
            num_target_layers=6, target_layer_ids=[1, 3], mask_token_id=5)


def test_final_target_layer_is_rejected_with_a_suggestion():
    with pytest.raises(ValueError, match=r"final decoder layer.*post-norm"):
        DSparkConfig(**{**BASE, "target_layer_ids": [1, 5]})
    target = make_tiny_target("llama")
    with pytest.raises(ValueError, match="final decoder layer"):
        DSparkModel.from_target(target, target_layer_ids=[0, 5])


def test_layer_ids_outside_the_target_are_rejected():
    with pytest.raises(ValueError, match=r"has 6 decoder layers: valid ids are -1 \(embeddings\) to 4"):
        DFlashConfig(**{**BASE, "target_layer_ids": [1, 9]})
    with pytest.raises(ValueError, match="duplicates"):
        Eagle3Config(**{**BASE, "target_layer_ids": [1, 1]})
    with pytest.raises(ValueError, match="is empty"):
        Eagle3Config(**{**BASE, "target_layer_ids": []})


def test_markov_head_requested_with_rank_zero():
    with pytest.raises(ValueError, match=r"markov_head_type='gated' needs markov_rank > 0"):
        DSparkConfig(**BASE, markov_rank=0, markov_head_type="gated")


def test_unknown_markov_head_type():
    with pytest.raises(ValueError, match=r"markov_head_type='lstm' is not one of 'vanilla', 'gated', 'rnn'"):
        DSparkConfig(**BASE, markov_head_type="lstm")


def test_confidence_with_markov_needs_a_markov_head():
    with pytest.raises(ValueError, match="confidence_head_with_markov=True needs a Markov head"):
        DSparkConfig(**BASE, markov_rank=0, markov_head_type=None, confidence_head_with_markov=True)
    # Without the Markov input the confidence head is fine.
    config = DSparkConfig(**BASE, markov_rank=0, markov_head_type=None, confidence_head_with_markov=False)
    assert not config.has_markov_head and config.enable_confidence_head


def test_confidence_loss_without_confidence_head():
    with pytest.raises(ValueError, match="enable_confidence_head=False"):
        DSparkConfig(**BASE, enable_confidence_head=False, confidence_head_alpha=1.0)


def test_dflash_refuses_heads():
    with pytest.raises(ValueError, match="DFlash drafts have no Markov head"):
        DFlashConfig(**BASE, markov_rank=256, markov_head_type="vanilla")
    config = DFlashConfig(**BASE)
    assert (config.ce_loss_alpha, config.l1_loss_alpha, config.confidence_head_alpha) == (1.0, 0.0, 0.0)


def test_eagle3_has_one_layer_and_a_valid_decay():
    with pytest.raises(ValueError, match="exactly one decoder layer"):
        Eagle3Config(**BASE, num_hidden_layers=2)
    with pytest.raises(ValueError, match="step_loss_decay"):
        Eagle3Config(**BASE, step_loss_decay=1.5)


def test_bad_sizes_and_token_ids():
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        DSparkConfig(**BASE, block_size=0)
    with pytest.raises(ValueError, match=r"mask_token_id=500 is outside the vocabulary \[0, 96\)"):
        DSparkConfig(**{**BASE, "mask_token_id": 500})
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        DSparkConfig(**{**BASE, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="confidence_temperatures must hold 7 positive values"):
        DSparkConfig(**BASE, confidence_temperatures=[1.0, 2.0])


def test_models_need_target_wiring():
    bare = {k: v for k, v in BASE.items() if k not in ("target_layer_ids", "mask_token_id")}
    with pytest.raises(ValueError, match="target_layer_ids is not set"):
        Eagle3Model(Eagle3Config(**bare))
    with pytest.raises(ValueError, match="mask_token_id is not set"):
        DFlashModel(DFlashConfig(**bare, target_layer_ids=[1]))


def test_context_features_of_the_wrong_width_are_refused():
    import torch

    target = make_tiny_target("llama")
    draft = DSparkModel.from_target(target, num_hidden_layers=1, target_layer_ids=[1, 2])
    ids = torch.randint(3, 96, (1, 10))
    wrong = torch.randn(1, 10, 3 * 32)
    with pytest.raises(ValueError, match=r"other target layers or another target"):
        draft(ids, wrong, torch.ones_like(ids))
