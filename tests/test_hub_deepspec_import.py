"""DeepSpec checkpoints (the released deepseek-ai/*_block7 and *_ttt7 layout) load as hf_dspark drafts.

The folders here are written from the format description alone (FORMATS.md: a Qwen3 config plus DeepSpec's
fields, flat weight names), not by hf_dspark's exporter, in the style of the released files (transformers-4.x
config keys `rope_theta`/`torch_dtype`, bf16 weights).
"""

from __future__ import annotations

import json

import pytest
import torch
from fake_hub import fake_hub  # noqa: F401  (fixture)
from safetensors.torch import load_file, save_file

from hf_dspark import DFlashModel, DSparkModel, Eagle3Model
from hf_dspark.sampling import TokenSampler
from hf_dspark.hub import load_draft

VOCAB, D, HEADS, KV, HEAD_DIM, INTER, RANK = 96, 32, 4, 2, 16, 64, 8


def qwen3_config(**fields) -> dict:
    """A Qwen3 config as transformers 4.x writes it (what DeepSpec copies from the target)."""
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": VOCAB,
        "hidden_size": D,
        "intermediate_size": INTER,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.1",
    }
    config.update(fields)
    return config


def layer_weights(prefix: str, input_size: int, gen) -> dict[str, torch.Tensor]:
    shapes = {
        "self_attn.q_proj.weight": (HEADS * HEAD_DIM, input_size),
        "self_attn.k_proj.weight": (KV * HEAD_DIM, input_size),
        "self_attn.v_proj.weight": (KV * HEAD_DIM, input_size),
        "self_attn.o_proj.weight": (D, HEADS * HEAD_DIM),
        "self_attn.q_norm.weight": (HEAD_DIM,),
        "self_attn.k_norm.weight": (HEAD_DIM,),
        "mlp.gate_proj.weight": (INTER, D),
        "mlp.up_proj.weight": (INTER, D),
        "mlp.down_proj.weight": (D, INTER),
        "input_layernorm.weight": (D,),
        "post_attention_layernorm.weight": (D,),
    }
    return {prefix + k: torch.randn(s, generator=gen) for k, s in shapes.items()}


def write(folder, config: dict, weights: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))


def deepspec_block_folder(folder, *, markov_rank=RANK, head="vanilla", confidence=True, layers=2, seed=0):
    """A Qwen3DSparkModel folder (DSpark; markov_rank 0 and no confidence head = DFlash)."""
    gen = torch.Generator().manual_seed(seed)
    layer_ids = [1, 2, 4]
    fields = {
        "architectures": ["Qwen3DSparkModel"],
        "num_hidden_layers": layers,
        "num_target_layers": 6,
        "block_size": 7,
        "mask_token_id": 95,
        "target_layer_ids": layer_ids,
        "num_anchors": 512,
        "markov_rank": markov_rank,
        "enable_confidence_head": confidence,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * layers,
    }
    if markov_rank:
        fields["markov_head_type"] = head
    if confidence:
        fields["confidence_head_with_markov"] = bool(markov_rank)
    weights = {
        "embed_tokens.weight": torch.randn(VOCAB, D, generator=gen),
        "norm.weight": torch.randn(D, generator=gen),
        "fc.weight": torch.randn(D, len(layer_ids) * D, generator=gen),
        "hidden_norm.weight": torch.randn(D, generator=gen),
        "lm_head.weight": torch.randn(VOCAB, D, generator=gen),
    }
    for i in range(layers):
        weights.update(layer_weights(f"layers.{i}.", D, gen))
    if markov_rank:
        weights["markov_head.markov_w1.weight"] = torch.randn(VOCAB, markov_rank, generator=gen)
        weights["markov_head.markov_w2.weight"] = torch.randn(VOCAB, markov_rank, generator=gen)
        if head == "rnn":
            weights["markov_head.joint_proj.weight"] = torch.randn(3 * markov_rank, 2 * markov_rank + D, generator=gen)
            weights["markov_head.joint_proj.bias"] = torch.randn(3 * markov_rank, generator=gen)
    if confidence:
        weights["confidence_head.proj.weight"] = torch.randn(1, D + markov_rank, generator=gen)
        weights["confidence_head.proj.bias"] = torch.randn(1, generator=gen)
    write(folder, qwen3_config(**fields), weights)
    return folder


def deepspec_eagle3_folder(folder, seed=0):
    gen = torch.Generator().manual_seed(seed)
    layer_ids = [0, 1, 2, 3, 4]
    fields = {
        "architectures": ["Qwen3Eagle3Model"],
        "num_hidden_layers": 1,
        "target_layer_ids": layer_ids,
        "ttt_length": 7,
        "step_loss_decay": 0.8,
        "tie_word_embeddings": False,
    }
    weights = {
        "embed_tokens.weight": torch.randn(VOCAB, D, generator=gen),
        "fc.weight": torch.randn(D, 5 * D, generator=gen),
        "norm.weight": torch.randn(D, generator=gen),
        "lm_head.weight": torch.randn(VOCAB, D, generator=gen),
        "layers.0.hidden_norm.weight": torch.randn(D, generator=gen),
        **layer_weights("layers.0.", 2 * D, gen),
    }
    write(folder, qwen3_config(**fields), weights)
    return folder


def assert_weights_in_place(draft, folder, renames=()):
    written = load_file(str(folder / "model.safetensors"))
    state = draft.state_dict()
    for key, value in written.items():
        for old, new in renames:
            key = key.replace(old, new)
        assert state[key].dtype == torch.bfloat16, key
        assert torch.equal(state[key], value), key
    assert len(state) == len(written)


def test_deepspec_dspark_folder_loads_with_every_weight_in_place(tmp_path):
    folder = deepspec_block_folder(tmp_path / "dspark")
    draft = load_draft(folder)
    assert type(draft) is DSparkModel
    assert_weights_in_place(draft, folder)
    cfg = draft.config
    assert cfg.use_qk_norm and cfg.target_model_type == "qwen3" and not cfg.tie_word_embeddings
    assert cfg.rope_parameters["rope_theta"] == 1000000 and cfg.rope_parameters["rope_type"] == "default"
    assert (cfg.block_size, cfg.mask_token_id, cfg.markov_rank, cfg.markov_head_type) == (7, 95, RANK, "vanilla")
    assert cfg.enable_confidence_head and cfg.confidence_head_with_markov
    assert cfg.target_layer_ids == [1, 2, 4] and cfg.num_target_layers == 6
    assert not draft.embed_tokens.weight.requires_grad and not draft.lm_head.weight.requires_grad


def test_loaded_deepspec_draft_runs_the_inference_protocol(tmp_path):
    draft = load_draft(deepspec_block_folder(tmp_path / "dspark"), dtype="float32")
    cache = draft.new_context_cache(2)
    features = torch.randn(2, 5, 3 * D)
    draft.extend_context(cache, features, torch.ones(2, 5, dtype=torch.bool), torch.randint(0, VOCAB, (2, 5)))
    proposal = draft.propose(cache, torch.tensor([3, 4]), sampler=TokenSampler(do_sample=False))
    assert proposal.tokens.shape == (2, 7) and proposal.confidences.shape == (2, 7)
    assert torch.isfinite(proposal.logits).all()


def test_deepspec_dflash_folder_loads_as_dflash(tmp_path):
    folder = deepspec_block_folder(tmp_path / "dflash", markov_rank=0, confidence=False)
    draft = load_draft(folder)
    assert type(draft) is DFlashModel and draft.config.markov_rank == 0
    assert_weights_in_place(draft, folder)


def test_deepspec_rnn_markov_head_is_renamed(tmp_path):
    folder = deepspec_block_folder(tmp_path / "rnn", head="rnn", layers=1)
    draft = load_draft(folder)
    assert draft.config.markov_head_type == "rnn"
    assert_weights_in_place(draft, folder, renames=[("markov_head.joint_proj.", "markov_head.rnn_proj.")])


def test_deepspec_eagle3_folder_loads(tmp_path):
    folder = deepspec_eagle3_folder(tmp_path / "eagle3")
    draft = load_draft(folder)
    assert type(draft) is Eagle3Model
    assert_weights_in_place(draft, folder)
    cfg = draft.config
    assert cfg.target_layer_ids == [0, 1, 2, 3, 4] and cfg.ttt_length == 7 and cfg.step_loss_decay == 0.8
    assert cfg.use_qk_norm and not cfg.norm_before_residual


def test_from_pretrained_still_converts_deepspec_folders_with_a_deprecation(tmp_path):
    """from_pretrained on a foreign layout converts through the hub services the package root binds, and warns
    that load_draft is the entry for foreign layouts."""
    folder = deepspec_block_folder(tmp_path / "dspark")
    with pytest.warns(FutureWarning, match=r"hf_dspark\.load_draft"):
        draft = DSparkModel.from_pretrained(folder, dtype=torch.float32)
    assert type(draft) is DSparkModel and draft.fc.weight.dtype == torch.float32
    assert torch.equal(draft.fc.weight, load_file(str(folder / "model.safetensors"))["fc.weight"].float())
    dflash = deepspec_block_folder(tmp_path / "dflash", markov_rank=0, confidence=False)
    with pytest.warns(FutureWarning):
        assert type(DSparkModel.from_pretrained(dflash)) is DFlashModel  # a DFlash draft is a DSparkModel subclass
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match=r"not a Eagle3Model: load it with hf_dspark"):
        Eagle3Model.from_pretrained(folder)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda w, c: w.pop("hidden_norm.weight"), "missing hidden_norm.weight"),
        (lambda w, c: w.update({"fc.weight": torch.zeros(D, 2 * D)}), r"fc.weight has shape \(32, 64\), expected"),
        (lambda w, c: w.update({"markov_head.extra.weight": torch.zeros(2)}), "unexpected markov_head.extra.weight"),
        (lambda w, c: c.pop("mask_token_id"), "lacks `mask_token_id`"),
        (lambda w, c: c.pop("markov_head_type"), "no `markov_head_type`"),
        (lambda w, c: c.update({"target_layer_ids": [1, 5]}), "final decoder layer"),
    ],
)
def test_damaged_deepspec_folders_are_refused_naming_the_problem(tmp_path, damage, message):
    folder = deepspec_block_folder(tmp_path / "dspark")
    weights = load_file(str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    damage(weights, config)
    write(folder, config, weights)
    with pytest.raises(ValueError, match=message):
        load_draft(folder)


def test_released_style_checkpoint_loads_from_the_hub(fake_hub, tmp_path):  # noqa: F811
    from huggingface_hub import HfApi

    folder = deepspec_block_folder(tmp_path / "dspark")
    api = HfApi()
    api.create_repo("deepseek-ai/dspark_tiny_block7")
    api.upload_folder(repo_id="deepseek-ai/dspark_tiny_block7", folder_path=str(folder))
    draft = load_draft("deepseek-ai/dspark_tiny_block7")
    assert_weights_in_place(draft, folder)
    assert draft.config._name_or_path == "deepseek-ai/dspark_tiny_block7"
