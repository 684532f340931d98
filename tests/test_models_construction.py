"""Drafts as Hugging Face models: built from any target, saved and loaded through the Auto classes."""

import pytest
import torch
from transformers import AutoConfig, AutoModel

import hf_dspark
from hf_dspark import DFlashModel, DSparkModel, Eagle3Model, default_target_layer_ids, target_features
from hf_dspark.target import TargetSpec

from conftest import FAMILIES, make_tiny_target

DRAFTS = [DSparkModel, DFlashModel, Eagle3Model]


def build(cls, target, **kw):
    kw.setdefault("num_hidden_layers", None if cls is Eagle3Model else 2)
    kw.setdefault("block_size", 4)
    return cls.from_target(target, **kw)


def random_batch(target, draft, batch=2, seq=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, target.config.vocab_size, (batch, seq), generator=g)
    feats, last = target_features(target, ids, draft.config.target_layer_ids)
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :4] = 0
    return ids, feats, last, loss_mask


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cls", DRAFTS, ids=lambda c: c.__name__)
def test_from_target_forward_save_and_auto_load(family, cls, tmp_path):
    target = make_tiny_target(family)
    draft = build(cls, target)
    spec = TargetSpec.from_model(target)
    assert draft.config.hidden_size == spec.hidden_size
    assert draft.config.num_target_layers == spec.num_hidden_layers
    assert draft.config.target_model_type == spec.model_type

    # Embeddings and lm_head are frozen copies of the target's.
    assert torch.equal(draft.get_input_embeddings().weight, target.get_input_embeddings().weight)
    assert torch.equal(draft.get_output_embeddings().weight, target.get_output_embeddings().weight)
    assert not draft.get_input_embeddings().weight.requires_grad
    assert not draft.get_output_embeddings().weight.requires_grad
    trainable = [n for n, p in draft.named_parameters() if p.requires_grad]
    assert trainable and not any(n.startswith(("embed_tokens", "lm_head")) for n in trainable)

    ids, feats, last, loss_mask = random_batch(target, draft)
    out = draft(ids, feats, loss_mask, target_last_hidden=last)
    assert torch.isfinite(out.hidden_states).all()
    assert out.eval_mask.any()

    draft.save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    assert type(config) is cls.config_class
    loaded = AutoModel.from_pretrained(tmp_path)
    assert type(loaded) is cls
    ref, got = draft.state_dict(), loaded.state_dict()
    assert ref.keys() == got.keys()
    for key in ref:
        assert torch.equal(ref[key], got[key]), key
    assert not loaded.get_input_embeddings().weight.requires_grad
    assert loaded.config.target_layer_ids == draft.config.target_layer_ids


def test_default_layer_ids_are_evenly_spaced_and_exclude_the_final_layer():
    assert default_target_layer_ids(36) == [1, 9, 17, 25, 33]
    ids = default_target_layer_ids(30)
    assert 29 not in ids and len(ids) == 5 and ids == sorted(ids)
    assert default_target_layer_ids(3) == [0, 1]
    for layers in range(2, 64):
        ids = default_target_layer_ids(layers)
        assert ids and max(ids) <= layers - 2


def test_gemma_facts_are_read_from_the_target():
    target = make_tiny_target("gemma3")
    draft = DSparkModel.from_target(target, num_hidden_layers=1)
    assert draft.config.embedding_multiplier == pytest.approx(32**0.5)
    assert draft.config.final_logit_softcapping == 30.0
    assert draft.config.use_qk_norm
    assert draft.config.head_dim == 8
    # The draft's embedding reproduces the target's scaled embedding.
    ids = torch.tensor([[5, 6, 7]])
    torch.testing.assert_close(draft.embed(ids), target.get_input_embeddings()(ids))


def test_qwen3_draft_uses_qk_norm_and_llama_does_not():
    assert DFlashModel.from_target(make_tiny_target("qwen3")).config.use_qk_norm
    llama_draft = DFlashModel.from_target(make_tiny_target("llama"))
    assert not llama_draft.config.use_qk_norm
    assert not hasattr(llama_draft.layers[0].self_attn, "q_norm")


def test_target_logits_equal_the_target_lm_head():
    target = make_tiny_target("gemma3")
    draft = DSparkModel.from_target(target, num_hidden_layers=1)
    ids = torch.randint(3, 96, (1, 12))
    _, last = target_features(target, ids, draft.config.target_layer_ids)
    with torch.no_grad():
        expected = target(ids).logits
    torch.testing.assert_close(draft.target_logits(last), expected, rtol=1e-5, atol=1e-5)
    # A vocabulary slice gives the matching columns (what chunked losses rely on).
    torch.testing.assert_close(draft.target_logits(last, slice(10, 40)), expected[..., 10:40], rtol=1e-5, atol=1e-5)


def test_hook_features_match_output_hidden_states():
    target = make_tiny_target("qwen2")
    ids = torch.randint(3, 96, (2, 9))
    feats, last = target_features(target, ids, [-1, 1, 3])
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states  # classic (L+1)-tuple
    torch.testing.assert_close(feats, torch.cat([hs[0], hs[2], hs[4]], dim=-1))
    torch.testing.assert_close(last, hs[-1])


def test_drafts_are_importable_from_the_package_root():
    for name in ("DSparkConfig", "DSparkModel", "DFlashConfig", "DFlashModel", "Eagle3Config", "Eagle3Model"):
        assert hasattr(hf_dspark, name)
    assert AutoConfig.for_model("dspark").model_type == "dspark"


def test_frozen_target_copies_are_saved_in_bf16_only_when_lossless(tmp_path):
    from safetensors import safe_open

    target = make_tiny_target("llama")
    with torch.no_grad():  # a target trained and shipped in bf16, loaded in float32 (the default target's case)
        for p in target.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    draft = build(DSparkModel, target)
    draft.save_pretrained(tmp_path / "bf16")
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("embed_tokens.weight").dtype == torch.bfloat16
        assert f.get_tensor("fc.weight").dtype == torch.float32  # trained weights keep their dtype
    loaded = AutoModel.from_pretrained(tmp_path / "bf16")
    assert loaded.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(loaded.embed_tokens.weight, draft.embed_tokens.weight)

    target.config.tie_word_embeddings = True  # a tied lm_head is still stored once
    build(DSparkModel, target).save_pretrained(tmp_path / "tied")
    with safe_open(str(tmp_path / "tied" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and f.get_tensor("embed_tokens.weight").dtype == torch.bfloat16

    fp32_target = make_tiny_target("llama")  # float32 values: bf16 would round them, so they stay float32
    build(DSparkModel, fp32_target).save_pretrained(tmp_path / "fp32")
    with safe_open(str(tmp_path / "fp32" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("embed_tokens.weight").dtype == torch.float32


def test_a_draft_warns_once_when_the_target_has_other_weights(caplog):
    target = make_tiny_target("llama")
    draft = build(DSparkModel, target)
    with caplog.at_level("WARNING", logger="hf_dspark.models.modeling_draft"):
        draft.check_target(target)
        assert not caplog.records
        other = make_tiny_target("llama")
        with torch.no_grad():
            other.get_input_embeddings().weight.add_(1.0)  # same shape, other weights
        draft.check_target(other)
        draft.check_target(other)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "other weights" in messages[0]


def test_import_has_no_side_effects_beyond_the_auto_classes():
    """`import hf_dspark` registers the Auto classes only: generate() stays transformers' own until a draft
    exists, and dynamo's global limits are untouched."""
    import subprocess
    import sys

    code = (
        "import torch, hf_dspark\n"
        "from transformers import AutoConfig\n"
        "from transformers.generation.utils import GenerationMixin\n"
        "from hf_dspark.generation import integration\n"
        "assert AutoConfig.for_model('dspark').model_type == 'dspark'\n"
        "assert not integration.is_installed()\n"
        "assert 'torch._dynamo' not in __import__('sys').modules or torch._dynamo.config.recompile_limit == 8\n"
        "hf_dspark.DSparkConfig  # noqa\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
