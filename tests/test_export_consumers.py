"""Exports checked against the consumers' own released code, not against our reading of their docs.

Run on CPU where the consumer's code allows it:
- vLLM 0.33.0: its speculators-config translation (vllm/transformers_utils/configs/speculators/algos.py, a
  self-contained module) is executed on our speculators exports;
- speculators 0.9.0: its config classes parse our speculators exports and its draft models are built from them;
  their state dicts must match our files key for key and shape for shape;
- DeepSpec: its own `Qwen3DSparkModel` / `Qwen3Eagle3Model.from_pretrained` load our deepspec exports with no
  missing or unexpected key.
vLLM's and SGLang's model classes need their GPU kernels, so their loader rules are encoded below, each citing
the consumer's file; when that file is available the test first checks that it still says what the rule assumes.
Every test skips (naming scripts/check_exports.sh) when the consumer is absent.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_target
from consumer_code import assert_source_says, import_consumer, run_module_file
from safetensors.torch import load_file

from hf_dspark import DFlashModel, DSparkModel, Eagle3Model
from hf_dspark.hub import ExportError, export_draft


def randomize(draft, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    draft.config.target_name_or_path = "org/tiny-target"
    return draft


@pytest.fixture(scope="module")
def drafts():
    q, llama = make_tiny_target("qwen3"), make_tiny_target("llama")
    made = {
        "dspark": DSparkModel.from_target(q, num_hidden_layers=2, markov_rank=8),
        "dspark_rnn": DSparkModel.from_target(q, num_hidden_layers=1, markov_rank=8, markov_head_type="rnn"),
        "dspark_gated": DSparkModel.from_target(q, num_hidden_layers=1, markov_rank=8, markov_head_type="gated"),
        "dflash": DFlashModel.from_target(q, num_hidden_layers=2),
        "eagle3_qwen3": Eagle3Model.from_target(q, target_layer_ids=[0, 1, 2, 3, 4]),
        "eagle3_llama": Eagle3Model.from_target(llama, target_layer_ids=[0, 2, 4]),
        "eagle3_llama_5": Eagle3Model.from_target(llama, target_layer_ids=[0, 1, 2, 3, 4]),
        "dspark_llama_qk": DSparkModel.from_target(llama, num_hidden_layers=1, markov_rank=8, use_qk_norm=True),
        # An MLP wider than the target's (`--intermediate_size`).
        "dspark_wide": DSparkModel.from_target(q, num_hidden_layers=2, markov_rank=8,
                                               intermediate_size=2 * q.config.intermediate_size),
    }
    return {name: randomize(draft, i) for i, (name, draft) in enumerate(made.items())}


def exported(drafts, name, fmt, tmp_path):
    out = tmp_path / f"{name}-{fmt}"
    export_draft(drafts[name], fmt, out)
    return json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors"), out


# -- vLLM 0.33.0: the speculators translation, run ------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, architecture",
    [("eagle3_llama", "Eagle3LlamaForCausalLM"), ("eagle3_qwen3", "Eagle3Qwen3ForCausalLM"),
     ("eagle3_llama_5", "Eagle3LlamaForCausalLM"), ("dspark", "Qwen3DSparkModel"),
     ("dspark_llama_qk", "Qwen3DSparkModel")],
)
def test_vllm_translates_our_speculators_configs_to_the_right_model(drafts, tmp_path, name, architecture):
    algos = run_module_file("vllm", "transformers_utils/configs/speculators/algos.py")
    config, tensors, _ = exported(drafts, name, "speculators", tmp_path)
    # What SpeculatorsConfig.validate_speculators_config requires (speculators/base.py).
    method = config["speculators_config"]["proposal_methods"][0]
    assert method["speculative_tokens"] >= 1 and config["speculators_config"]["verifier"]["name_or_path"]
    # What SpeculatorsConfig.extract_transformers_pre_trained_config does (speculators/base.py).
    model_config = dict(config["transformer_layer_config"])
    algos.SUPPORTED_SPECULATORS_TYPES[config["speculators_model_type"]](config_dict=config, pre_trained_config=model_config)
    draft = drafts[name]
    ours = list(draft.config.target_layer_ids)
    assert model_config["architectures"] == [architecture]
    assert model_config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in ours]  # gpu_model_runner capture ids
    assert model_config["draft_vocab_size"] == model_config["vocab_size"]  # so no draft_id_to_target_id
    assert "d2t" not in tensors and "t2d" not in tensors
    if draft.config.model_type == "dspark":
        assert model_config["target_layer_ids"] == ours  # update_dspark: aux id - 1
        assert model_config["dspark_bonus_anchor"] is False  # every slot proposes, the anchor's included
        for key in ("markov_rank", "block_size", "mask_token_id", "enable_confidence_head"):
            assert model_config[key] == getattr(draft.config, key), key
    else:
        # Eagle3{Llama,Qwen3}ForCausalLM size fc from num_aux_hidden_states (llama_eagle3.py / qwen3_eagle3.py).
        width = model_config["num_aux_hidden_states"] * model_config["target_hidden_size"]
        assert tensors["fc.weight"].shape == (model_config["hidden_size"], width)
        assert model_config["norm_before_residual"] == draft.config.norm_before_residual


# -- speculators 0.9.0: its config classes and draft models, run ----------------------------------------------------


@pytest.mark.parametrize("name", ["eagle3_llama", "eagle3_qwen3", "dspark", "dspark_llama_qk", "dspark_wide"])
def test_speculators_builds_its_own_draft_model_with_exactly_our_tensors(drafts, tmp_path, monkeypatch, name):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the verifier id is made up; speculators then assumes a plain norm
    speculators = import_consumer("speculators", "speculators")
    import_consumer("speculators", "speculators.models")
    _, tensors, out = exported(drafts, name, "speculators", tmp_path)
    config = speculators.SpeculatorModelConfig.from_pretrained(str(out))
    assert config.speculators_model_type == drafts[name].config.model_type
    model = speculators.SpeculatorModel.registered_model_class_from_config(config)(config=config)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("verifier_")}  # from the verifier
    assert {k: tuple(v.shape) for k, v in state.items()} == {k: tuple(v.shape) for k, v in tensors.items()}


# -- DeepSpec: its own from_pretrained, run -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["dspark", "dspark_rnn", "dspark_gated", "dflash", "eagle3_qwen3", "dspark_llama_qk", "dspark_wide"]
)
def test_deepspec_loads_our_deepspec_exports_with_every_key_in_place(drafts, tmp_path, name):
    module = "eagle3" if name.startswith("eagle3") else "dspark"
    modeling = import_consumer("deepspec", f"deepspec.modeling.{module}.qwen3.modeling")
    cls = modeling.Qwen3Eagle3Model if module == "eagle3" else modeling.Qwen3DSparkModel
    _, tensors, out = exported(drafts, name, "deepspec", tmp_path)
    model, info = cls.from_pretrained(str(out), output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    state = model.state_dict()
    for key, value in tensors.items():
        assert torch.equal(state[key].to(value.dtype), value), key
    if module == "eagle3":
        assert model.config.draft_num_hidden_layers == 1  # deepspec/eval/eagle3/evaluator.py asserts it


def test_deepspec_serve_command_names_the_target(drafts, tmp_path):
    result = export_draft(drafts["eagle3_qwen3"], "deepspec", tmp_path / "out")
    assert "--target_name_or_path org/tiny-target" in result.serve_command  # eval.py: required=True
    assert f"--draft_name_or_path {tmp_path / 'out'}" in result.serve_command


# -- vLLM 0.33.0 loader rules (its model classes need CUDA kernels) -------------------------------------------------


def test_vllm_source_states_the_rules_below():
    assert_source_says(
        "vllm", "model_executor/models/llama_eagle3.py",
        "if self.config.draft_vocab_size != target_vocab_size:",  # only then a draft_id_to_target_id parameter
        'name = name.replace("d2t", "draft_id_to_target_id")',  # ... yet a d2t is always renamed to it
        'layer_ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")',  # fc width from eagle_config
    )
    assert_source_says(
        "vllm", "model_executor/models/registry.py",
        '"LlamaForCausalLMEagle3": ("llama_eagle3", "Eagle3LlamaForCausalLM")',
        '"Eagle3Qwen3ForCausalLM": ("qwen3_eagle3", "Eagle3Qwen3ForCausalLM")',
        '"Qwen3DSparkModel": ("qwen3_dspark", "Qwen3DSparkForCausalLM")',
    )
    # Capture id i = output of layer i - 1: llama.py adds the state after layer idx under id idx + 1.
    assert_source_says("vllm", "model_executor/models/llama.py", "aux_hidden_states, idx + 1, hidden_states, residual")


def test_vllm_eagle3_rules(drafts, tmp_path):
    """vllm/model_executor/models/{llama_eagle3,qwen3_eagle3,registry}.py and v1/worker/gpu_model_runner.py, 0.33.0."""
    for name in ("eagle3_llama", "eagle3_llama_5", "eagle3_qwen3"):
        config, tensors, _ = exported(drafts, name, "vllm", tmp_path)
        ids = [i + 1 for i in drafts[name].config.target_layer_ids]
        assert config["eagle_aux_hidden_state_layer_ids"] == config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ids
        assert config["draft_vocab_size"] == config["vocab_size"] and "d2t" not in tensors
        assert tensors["fc.weight"].shape[1] == len(ids) * config["target_hidden_size"]
        assert ("layers.0.self_attn.q_norm.weight" in tensors) == (config["architectures"] == ["Eagle3Qwen3ForCausalLM"])


# -- SGLang 0.5.23 loader rules (its model classes need its CUDA kernels) -------------------------------------------


def test_sglang_source_states_the_rules_below():
    # set_eagle3_layers_to_capture adds 1 and captures the stream entering that layer: id k = output of layer k.
    assert_source_says("sglang", "srt/models/llama.py", "self.model.layers_to_capture = [val + 1 for val in layer_ids]")
    assert_source_says(
        "sglang", "srt/models/llama_eagle3.py",
        "            bias=False,\n",  # q/k/v without bias, whatever the config says
        "self.num_aux_hidden_states = len(layer_ids) if layer_ids else 3",
        "residual = hidden_states\n            hidden_states = self.hidden_norm(hidden_states)",  # no norm_before_residual
    )
    assert_source_says(
        "sglang", "srt/models/dspark.py",
        "DSpark requires markov_rank > 0",
        "DSpark confidence head is enabled but the checkpoint is missing",
        '_DSPARK_SKIPPED_WEIGHT_PREFIXES = ("lm_head.", "rotary_emb.")',
        "EntryClass = [Qwen3DSparkModel",
    )
    assert_source_says("sglang", "srt/speculative/dflash_utils.py", "if val < 0 or val >= target_num_layers:")
    assert_source_says("sglang", "srt/models/qwen3.py", "self.model.layers_to_capture = [val + 1 for val in layer_ids]")


def test_sglang_eagle3_rules(drafts, tmp_path):
    """sglang/srt/models/{llama,llama_eagle3}.py, 0.5.23."""
    for name in ("eagle3_llama", "eagle3_llama_5"):
        config, tensors, _ = exported(drafts, name, "sglang", tmp_path)
        ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        assert ids == list(drafts[name].config.target_layer_ids)
        assert tensors["fc.weight"].shape[1] == len(ids) * config["target_hidden_size"]
        assert not any(k.endswith(".bias") or "q_norm" in k for k in tensors)
        assert {"midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight"} <= set(tensors)
    biased = Eagle3Model.from_target(make_tiny_target("llama"), target_layer_ids=[0, 2, 4], attention_bias=True)
    with pytest.raises(ExportError, match="bias=False"):
        export_draft(biased, "sglang", tmp_path / "biased")
    with pytest.raises(ExportError, match="--format vllm"):
        export_draft(drafts["eagle3_qwen3"], "sglang", tmp_path / "qk")


def test_sglang_dspark_rules(drafts, tmp_path):
    """sglang/srt/models/dspark.py, srt/speculative/dflash_utils.py, srt/models/qwen3.py, 0.5.23."""
    for name in ("dspark", "dspark_rnn", "dspark_gated", "dspark_llama_qk"):
        config, tensors, _ = exported(drafts, name, "sglang", tmp_path)
        draft = drafts[name]
        assert config["architectures"] == ["Qwen3DSparkModel"] and config["markov_rank"] > 0
        assert config["target_layer_ids"] == list(draft.config.target_layer_ids) and min(config["target_layer_ids"]) >= 0
        assert {"confidence_head.proj.weight", "confidence_head.proj.bias"} <= set(tensors)
        assert config["confidence_head_with_markov"] == draft.config.confidence_head_with_markov
        # SGLang serves with the target's embeddings and lm_head: the draft's are frozen copies of them.
        assert not draft.embed_tokens.weight.requires_grad and not draft.lm_head.weight.requires_grad
    with pytest.raises(ExportError, match="requires markov_rank > 0|own position"):
        export_draft(drafts["dflash"], "sglang", tmp_path / "dflash")
