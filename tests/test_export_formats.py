"""Export to vLLM / SGLang / speculators / DeepSpec layouts and back: lossless round trips, exact key sets,
layer-id conventions, and refusals that name the reason."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_target
from safetensors.torch import load_file, save_file

from hf_dspark import DFlashModel, DSparkModel, Eagle3Model
from hf_dspark.cli import main as cli_main
from hf_dspark.hub import ExportError, ForeignCheckpointError, export_draft, load_draft

BOOKKEEPING = {"_name_or_path", "dtype", "transformers_version", "architectures"}


def randomize(draft, seed: int = 0):
    """Random values everywhere (norms are ones and W2 is zero at init: equality checks would be weak)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return draft


@pytest.fixture(scope="module")
def targets():
    return {family: make_tiny_target(family) for family in ("qwen3", "llama", "gemma3")}


@pytest.fixture(scope="module")
def drafts(targets):
    q, llama = targets["qwen3"], targets["llama"]
    made = {
        "dspark": DSparkModel.from_target(q, num_hidden_layers=2, markov_rank=8),
        "dspark_gated": DSparkModel.from_target(q, num_hidden_layers=1, markov_rank=8, markov_head_type="gated"),
        "dspark_rnn": DSparkModel.from_target(q, num_hidden_layers=1, markov_rank=8, markov_head_type="rnn"),
        "dflash": DFlashModel.from_target(q, num_hidden_layers=2, block_size=5),
        "eagle3_qwen3": Eagle3Model.from_target(q, target_layer_ids=[0, 1, 2, 3, 4]),
        "eagle3_llama": Eagle3Model.from_target(llama, target_layer_ids=[0, 2, 4]),
        "dspark_llama": DSparkModel.from_target(llama, num_hidden_layers=1, markov_rank=8),
        "eagle3_llama_5": Eagle3Model.from_target(llama, target_layer_ids=[0, 1, 2, 3, 4]),
        "dspark_gemma3": DSparkModel.from_target(targets["gemma3"], num_hidden_layers=1, markov_rank=8),
        "dspark_no_confidence": DSparkModel.from_target(q, num_hidden_layers=1, markov_rank=8,
                                                        enable_confidence_head=False, confidence_head_alpha=0.0),
        "eagle3_embedding_feature": Eagle3Model.from_target(llama, target_layer_ids=[-1, 2, 4]),
        # Llama targets with the q/k norm every block-draft consumer applies.
        "dspark_llama_qk": DSparkModel.from_target(llama, num_hidden_layers=1, markov_rank=8, use_qk_norm=True),
        "eagle3_llama_qk": Eagle3Model.from_target(llama, target_layer_ids=[0, 2, 4], use_qk_norm=True),
        # An MLP wider than the target's (`--intermediate_size`): the layers' shapes come from the draft's config.
        "dspark_wide": DSparkModel.from_target(q, num_hidden_layers=2, markov_rank=8,
                                               intermediate_size=2 * q.config.intermediate_size),
        "eagle3_llama_wide": Eagle3Model.from_target(llama, target_layer_ids=[0, 2, 4],
                                                     intermediate_size=2 * llama.config.intermediate_size),
    }
    for i, draft in enumerate(made.values()):
        randomize(draft, seed=i)
        draft.config.target_name_or_path = "org/tiny-target"
    made["dspark"].config.confidence_temperatures = [1.0, 1.5, 2.0, 2.0, 2.5, 3.0, 3.0]
    return made


def assert_same_draft(back, draft):
    assert type(back) is type(draft)
    ours, theirs = draft.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key].dtype == theirs[key].dtype, key
        assert torch.equal(ours[key], theirs[key]), key
    a = {k: v for k, v in draft.config.to_dict().items() if k not in BOOKKEEPING}
    b = {k: v for k, v in back.config.to_dict().items() if k not in BOOKKEEPING}
    assert a == b
    if draft.config.tie_word_embeddings:
        assert back.lm_head.weight is back.embed_tokens.weight


@pytest.mark.parametrize(
    "name, fmt",
    [
        ("dspark", "vllm"),
        ("dspark", "deepspec"),
        ("dspark_gated", "deepspec"),
        ("dspark_rnn", "deepspec"),
        ("dflash", "vllm"),
        ("dflash", "deepspec"),
        ("eagle3_qwen3", "deepspec"),
        ("eagle3_llama", "vllm"),
        ("eagle3_llama", "sglang"),
        ("eagle3_llama", "speculators"),
        ("eagle3_llama_5", "vllm"),
        ("eagle3_llama_5", "sglang"),
        ("eagle3_llama_5", "speculators"),
        ("eagle3_qwen3", "vllm"),
        ("eagle3_qwen3", "speculators"),
        ("dspark", "sglang"),
        ("dspark_rnn", "sglang"),
        ("dspark", "speculators"),
        ("dspark_llama_qk", "vllm"),
        ("dspark_llama_qk", "sglang"),
        ("dspark_llama_qk", "speculators"),
        ("dspark_llama_qk", "deepspec"),
        ("eagle3_llama_qk", "vllm"),
        ("eagle3_llama_qk", "speculators"),
        *[("dspark_wide", fmt) for fmt in ("vllm", "sglang", "speculators", "deepspec")],
        *[("eagle3_llama_wide", fmt) for fmt in ("vllm", "sglang", "speculators")],
    ],
)
def test_export_then_import_gives_bit_identical_draft(drafts, tmp_path, name, fmt):
    result = export_draft(drafts[name], fmt, tmp_path / "out")
    assert (result.output_dir / "README.md").read_text().count(result.layer_id_convention) == 1
    assert_same_draft(load_draft(tmp_path / "out"), drafts[name])


def test_deepspec_export_keeps_deepspec_key_names_and_fields(drafts, tmp_path):
    export_draft(drafts["dspark_rnn"], "deepspec", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    assert config["tie_word_embeddings"] is False and config["layer_types"] == ["full_attention"]
    for field in ("num_target_layers", "block_size", "mask_token_id", "target_layer_ids", "num_anchors",
                  "markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov"):
        assert field in config, field
    assert config["target_layer_ids"] == list(drafts["dspark_rnn"].config.target_layer_ids)  # same convention
    assert "markov_head.joint_proj.weight" in tensors and not any("rnn_proj" in k for k in tensors)
    assert tensors["markov_head.markov_w1.weight"].shape == (96, 8)
    assert tensors["markov_head.markov_w2.weight"].shape == (96, 8)
    assert tensors["confidence_head.proj.weight"].shape == (1, 32 + 8)


def test_dflash_exports_as_qwen3dspark_with_markov_rank_zero(drafts, tmp_path):
    export_draft(drafts["dflash"], "vllm", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"]
    assert config["markov_rank"] == 0 and config["enable_confidence_head"] is False
    assert "markov_head_type" not in config and "confidence_head_with_markov" not in config
    assert '"method": "dspark"' in (tmp_path / "out" / "README.md").read_text()


def test_vllm_eagle3_writes_aux_layer_ids_in_vllm_convention(drafts, tmp_path):
    draft = drafts["eagle3_llama"]
    export_draft(draft, "vllm", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    expected = [i + 1 for i in draft.config.target_layer_ids]  # vLLM captures the stream entering layer i
    assert config["eagle_aux_hidden_state_layer_ids"] == expected
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": expected, "use_aux_hidden_state": True}
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == config["vocab_size"] == 96
    keys = set(load_file(tmp_path / "out" / "model.safetensors"))
    assert "layers.0.hidden_norm.weight" in keys and "d2t" not in keys and "t2d" not in keys


def test_vllm_eagle3_with_qk_norm_loads_as_vllms_qwen3_eagle3(drafts, tmp_path):
    export_draft(drafts["eagle3_llama_qk"], "vllm", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["Eagle3Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    keys = set(load_file(tmp_path / "out" / "model.safetensors"))
    assert {"layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight"} <= keys


def test_sglang_export_holds_exactly_the_keys_sglang_loads(drafts, tmp_path):
    export_draft(drafts["eagle3_llama"], "sglang", tmp_path / "out")
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    d, vocab = 32, 96
    expected = {
        "embed_tokens.weight": (vocab, d),
        "fc.weight": (d, 3 * d),
        "norm.weight": (d,),
        "lm_head.weight": (vocab, d),
        "midlayer.self_attn.q_proj.weight": (32, 2 * d),
        "midlayer.self_attn.k_proj.weight": (16, 2 * d),
        "midlayer.self_attn.v_proj.weight": (16, 2 * d),
        "midlayer.self_attn.o_proj.weight": (d, 32),
        "midlayer.input_layernorm.weight": (d,),
        "midlayer.hidden_norm.weight": (d,),
        "midlayer.post_attention_layernorm.weight": (d,),
        "midlayer.mlp.gate_proj.weight": (64, d),
        "midlayer.mlp.up_proj.weight": (64, d),
        "midlayer.mlp.down_proj.weight": (d, 64),
    }
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 1
    # SGLang adds 1 itself: a configured id k is the output of layer k, hf_dspark's own convention.
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]


def test_speculators_config_names_algorithm_and_verifier(drafts, tmp_path):
    export_draft(drafts["eagle3_llama"], "speculators", tmp_path / "out", num_speculative_tokens=5)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["transformer_layer_config"]["model_type"] == "llama"
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [
        {"proposal_type": "greedy", "speculative_tokens": 5, "verifier_accept_k": 1, "accept_tolerance": 0.0}
    ]
    assert spec["verifier"] == {"name_or_path": "org/tiny-target", "architectures": ["LlamaForCausalLM"]}


def test_speculators_export_needs_the_target_hub_id(targets, tmp_path):
    draft = Eagle3Model.from_target(targets["llama"], target_layer_ids=[0, 2, 4])  # target recorded as ""
    with pytest.raises(ExportError, match="verifier='org/name'"):
        export_draft(draft, "speculators", tmp_path / "out")
    export_draft(draft, "speculators", tmp_path / "out", verifier="org/llama")
    assert load_draft(tmp_path / "out").config.target_name_or_path == "org/llama"


@pytest.mark.parametrize(
    "name, fmt, reason",
    [
        ("eagle3_qwen3", "sglang", "--format vllm"),
        ("eagle3_embedding_feature", "vllm", "target_layer_ids >= 0"),
        ("eagle3_embedding_feature", "sglang", "target_layer_ids >= 0"),
        ("eagle3_llama", "deepspec", "exactly 5"),
        ("dspark_llama", "vllm", "use_qk_norm=True"),
        ("dspark_llama", "deepspec", "always applies q_norm/k_norm"),
        ("dspark_llama", "sglang", "use_qk_norm=True"),
        ("dspark_no_confidence", "sglang", "enable_confidence_head=True"),
        ("dflash", "speculators", "z-lab"),
        ("dspark_rnn", "speculators", "vanilla"),
        ("dspark_gemma3", "deepspec", "embedding multiplier"),
        ("dspark_gemma3", "deepspec", "soft-capping"),
        ("dspark_gemma3", "vllm", "Gemma4DSparkModel"),
        ("dspark_rnn", "vllm", "vanilla"),
        ("dspark_gated", "vllm", "--format deepspec"),
        ("dflash", "sglang", "own position"),
        ("dflash", "dflash", "own position"),
        ("dspark", "dflash", "cannot be converted"),
    ],
)
def test_export_refuses_what_the_format_cannot_represent(drafts, tmp_path, name, fmt, reason):
    with pytest.raises(ExportError, match=reason):
        export_draft(drafts[name], fmt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_sglang_refuses_norm_before_residual(targets, tmp_path):
    draft = Eagle3Model.from_target(targets["llama"], target_layer_ids=[0, 2, 4], norm_before_residual=True)
    with pytest.raises(ExportError, match="norm_before_residual"):
        export_draft(draft, "sglang", tmp_path / "out")
    export_draft(draft, "vllm", tmp_path / "ok")  # vLLM reads the flag
    assert json.loads((tmp_path / "ok" / "config.json").read_text())["norm_before_residual"] is True


def test_exporter_checks_every_key_the_consumer_needs(drafts, tmp_path, monkeypatch):
    import hf_dspark.hub.formats.deepspec as deepspec

    real = deepspec.draft_tensors
    without = lambda d: {k: v for k, v in real(d).items() if k != "hidden_norm.weight"}  # noqa: E731
    monkeypatch.setattr(deepspec, "draft_tensors", without)
    with pytest.raises(ExportError, match="missing hidden_norm.weight"):
        export_draft(drafts["dspark"], "deepspec", tmp_path / "out")
    monkeypatch.setattr(deepspec, "draft_tensors", lambda d: {**real(d), "extra.weight": torch.zeros(1)})
    with pytest.raises(ExportError, match="unexpected extra.weight"):
        export_draft(drafts["dspark"], "deepspec", tmp_path / "out")


def test_export_casts_weights_when_asked(drafts, tmp_path):
    draft = drafts["dspark"]
    export_draft(draft, "vllm", tmp_path / "out", dtype="bf16")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = load_draft(tmp_path / "out")
    assert back.fc.weight.dtype == torch.bfloat16
    assert torch.equal(back.fc.weight, draft.fc.weight.to(torch.bfloat16))


def test_export_never_overwrites_a_folder_unless_asked(drafts, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_draft(drafts["dspark"], "deepspec", out)
    assert (out / "notes.txt").read_text() == "keep me"
    export_draft(drafts["dspark"], "deepspec", out, overwrite=True)
    assert not (out / "notes.txt").exists() and (out / "model.safetensors").exists()


# -- imports of foreign folders -------------------------------------------------------------------------------


def test_import_without_embeddings_takes_them_from_the_target(drafts, targets, tmp_path):
    export_draft(drafts["eagle3_llama"], "sglang", tmp_path / "out")
    file = tmp_path / "out" / "model.safetensors"
    tensors = load_file(file)
    del tensors["embed_tokens.weight"]  # SGLang/vLLM borrow it from the target when absent
    save_file(tensors, file)
    with pytest.raises(ForeignCheckpointError, match="target="):
        load_draft(tmp_path / "out")
    back = load_draft(tmp_path / "out", target=targets["llama"])
    assert torch.equal(back.embed_tokens.weight, targets["llama"].get_input_embeddings().weight)


def test_import_refuses_a_reduced_draft_vocabulary(drafts, tmp_path):
    export_draft(drafts["eagle3_llama"], "sglang", tmp_path / "out")
    file = tmp_path / "out" / "model.safetensors"
    tensors = load_file(file)
    tensors["d2t"] = torch.zeros(96, dtype=torch.int64)
    tensors["d2t"][5] = 3
    save_file(tensors, file)
    with pytest.raises(ForeignCheckpointError, match="reduced draft vocabulary"):
        load_draft(tmp_path / "out")


def test_import_refuses_eagle3_without_recorded_layers(drafts, tmp_path):
    export_draft(drafts["eagle3_llama"], "vllm", tmp_path / "out")
    path = tmp_path / "out" / "config.json"
    config = json.loads(path.read_text())
    del config["eagle_config"], config["eagle_aux_hidden_state_layer_ids"]
    path.write_text(json.dumps(config))
    with pytest.raises(ForeignCheckpointError, match="eagle_aux_hidden_state_layer_ids"):
        load_draft(tmp_path / "out")


def test_zlab_dflash_checkpoints_are_refused_with_the_reason(tmp_path):
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16, "hidden_size": 32,
              "dflash_config": {"mask_token_id": 95, "target_layer_ids": [1, 3]}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"fc.weight": torch.zeros(32, 64)}, tmp_path / "model.safetensors")
    with pytest.raises(ForeignCheckpointError, match="own position"):
        load_draft(tmp_path)


# -- CLI ----------------------------------------------------------------------------------------------------------


def test_cli_export_and_import(drafts, tmp_path, capsys):
    drafts["eagle3_llama"].save_pretrained(tmp_path / "draft")
    assert cli_main(["export", "--draft", str(tmp_path / "draft"), "--format", "vllm", "--output_dir",
                     str(tmp_path / "vllm"), "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLMEagle3" in out and "vLLM aux-hidden-state convention" in out and "vllm serve" in out
    assert cli_main(["import", "--checkpoint", str(tmp_path / "vllm"), "--output_dir", str(tmp_path / "back")]) == 0
    back = Eagle3Model.from_pretrained(tmp_path / "back")
    assert torch.equal(back.fc.weight, drafts["eagle3_llama"].fc.weight.to(torch.bfloat16))
    code = cli_main(["export", "--draft", str(tmp_path / "draft"), "--format", "deepspec", "--output_dir",
                     str(tmp_path / "refused")])
    assert code == 2 and "q_norm/k_norm" in capsys.readouterr().err


@pytest.mark.real_model
def test_smollm2_eagle3_draft_round_trips_through_vllm_layout(smollm2, tmp_path):
    target, _ = smollm2
    draft = randomize(Eagle3Model.from_target(target, target_layer_ids=[1, 14, 26]))
    result = export_draft(draft, "vllm", tmp_path / "out", dtype="bf16")
    assert result.serve_command.startswith("vllm serve HuggingFaceTB/SmolLM2-135M-Instruct")
    back = load_draft(tmp_path / "out")
    for key, value in draft.state_dict().items():
        assert torch.equal(back.state_dict()[key], value.to(torch.bfloat16)), key
