"""The one-layer Eagle3 layout shared by vLLM, SGLang and speculators (full vocabulary here).

Weights: `embed_tokens`, `fc` [d, m * d_target] (m = number of target layers), one decoder layer under
`midlayer.*` (SGLang, EAGLE's original training code) or `layers.0.*` (vLLM renames midlayer.* to it on load;
speculators), `norm`, `lm_head` [draft_vocab, d], optional `d2t` (int64 offsets: target_id = i + d2t[i]) and
`t2d` (bool). The layer's q/k/v take [input_layernorm(embed); hidden_norm(hidden)] (2d wide), exactly as
hf_dspark's Eagle3 layer. Two layer flavours:

- Llama (`model_type: "llama"`): no q_norm/k_norm. vLLM `Eagle3LlamaForCausalLM`, SGLang `LlamaForCausalLMEagle3`.
- Qwen3 (`model_type: "qwen3"`, q_norm/k_norm per head): vLLM `Eagle3Qwen3ForCausalLM`
  (vllm/model_executor/models/qwen3_eagle3.py, 0.33.0). SGLang 0.5.23 has no Qwen3 Eagle3 layer.

m is read by every consumer from `eagle_config.eagle_aux_hidden_state_layer_ids` (or `num_aux_hidden_states`),
default 3 (vllm llama_eagle3.py / qwen3_eagle3.py `LlamaModel.__init__`, sglang llama_eagle3.py), so the
exporters always write it.

Vocabulary: hf_dspark drafts predict over the full target vocabulary: `draft_vocab_size = vocab_size` and no
d2t/t2d. vLLM 0.33.0 creates `draft_id_to_target_id` only when the two sizes differ, yet renames a `d2t` it
finds to that name, so an identity d2t makes loading fail ("no module or parameter named
'draft_id_to_target_id'"); SGLang treats d2t as optional. Importing a reduced draft vocabulary is refused.

Target-layer ids differ by consumer (see `LAYER_ID_OFFSETS`).
"""

from __future__ import annotations

import torch

from ...models import Eagle3Config
from .base import (
    ForeignCheckpointError,
    TensorSpec,
    architecture_fields,
    architecture_kwargs,
    check_tensors,
    decoder_layer_spec,
    rename,
)

LLAMA_EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Qwen3ForCausalLM")
DEFAULT_NUM_AUX_LAYERS = 3  # what the consumers assume when the config names no layer ids

# id written = hf_dspark id + offset. hf_dspark id l = output of decoder layer l.
# - vLLM (and speculators, which vLLM reads): id i = the residual stream *entering* layer i, i.e. the output of
#   layer i - 1 (vllm/model_executor/models/llama.py, qwen3.py: `if idx in self.aux_hidden_state_layers`
#   before calling layer idx) -> offset +1.
# - SGLang: `set_eagle3_layers_to_capture` adds 1 itself and captures the stream entering that layer
#   (sglang/srt/models/llama.py, qwen3.py, 0.5.23: "for the ith layer, it takes the output of the (i-1)th
#   layer"), so a configured id k already means "output of layer k" -> offset 0.
LAYER_ID_OFFSETS = {"vllm": 1, "speculators": 1, "sglang": 0}
LAYER_CONVENTIONS = {
    "vllm": "vLLM aux-hidden-state convention: id i = residual stream entering decoder layer i (= hf_dspark id i - 1)",
    "speculators": "vLLM aux-hidden-state convention: id i = residual stream entering decoder layer i "
    "(= hf_dspark id i - 1)",
    "sglang": "SGLang convention: id k = output of decoder layer k (SGLang adds 1 and captures the stream entering "
    "layer k + 1); the same ids as hf_dspark",
}


def layer_model_type(cfg) -> str:
    """The decoder-layer flavour an Eagle3 draft needs: "qwen3" with q/k norm, else "llama"."""
    return "qwen3" if cfg.use_qk_norm else "llama"


def llama_eagle3_reasons(
    cfg,
    consumer: str,
    *,
    norm_before_residual: bool = True,
    qk_norm: bool = True,
    biases: bool = True,
) -> list[str]:
    """Why an Eagle3 draft does not fit the one-layer Eagle3 layout of `consumer`.

    norm_before_residual / qk_norm / biases: whether the consumer's layer has that option.
    """
    if cfg.model_type != "eagle3":
        return [f"the Eagle3 layout of {consumer} holds Eagle3 drafts only"]
    reasons = []
    if cfg.use_qk_norm and not qk_norm:
        reasons.append(
            f"the Eagle3 layer of {consumer} is Llama-style, without q_norm/k_norm, but this draft (target "
            f"{cfg.target_model_type}) uses them; export it with --format vllm, --format speculators or "
            "--format deepspec instead"
        )
    if (cfg.attention_bias or cfg.mlp_bias) and not biases:
        reasons.append(
            f"the Eagle3 layer of {consumer} has no attention/MLP biases (hard-coded bias=False) but this draft "
            "has them; export it with --format vllm instead"
        )
    if cfg.use_qk_norm and cfg.attention_bias:
        reasons.append(f"the Qwen3 Eagle3 layer of {consumer} has no o_proj bias but this draft has one")
    if cfg.embedding_multiplier != 1.0:
        reasons.append(f"the layout has no embedding multiplier (this draft uses {cfg.embedding_multiplier:g})")
    if cfg.final_logit_softcapping is not None:
        reasons.append("the layout has no logit soft-capping")
    ids = list(cfg.target_layer_ids)
    if ids and min(ids) < 0:
        reasons.append(
            f"{consumer} captures the output of a decoder layer; the embedding output (-1) is not one: train the "
            "draft with target_layer_ids >= 0"
        )
    if cfg.norm_before_residual and not norm_before_residual:
        reasons.append(f"the Eagle3 layer of {consumer} has no norm_before_residual option")
    return reasons


def llama_eagle3_config(cfg, architecture: str) -> dict:
    """Config fields of the Eagle3 layer (shared by the three consumers)."""
    c = {"architectures": [architecture], "model_type": layer_model_type(cfg), **architecture_fields(cfg)}
    c.update(
        {
            "num_hidden_layers": 1,
            "mlp_bias": cfg.mlp_bias,
            "draft_vocab_size": cfg.vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            "norm_before_residual": bool(cfg.norm_before_residual),
        }
    )
    return c


def consumer_layer_ids(cfg, consumer: str) -> list[int]:
    return [i + LAYER_ID_OFFSETS[consumer] for i in cfg.target_layer_ids]


def llama_eagle3_tensors(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return rename(tensors, [("layers.0.", prefix)])


def aux_layer_ids(c: dict) -> list[int] | None:
    """The consumer-convention layer ids of a config dict (eagle_config first, as vLLM and SGLang read them)."""
    eagle = c.get("eagle_config") or {}
    return eagle.get("eagle_aux_hidden_state_layer_ids") or c.get("eagle_aux_hidden_state_layer_ids")


def llama_eagle3_spec(c: dict, prefix: str, *, embed_required: bool = True) -> dict[str, TensorSpec]:
    """Shapes from an Eagle3 layer config dict (d2t/t2d optional; their presence is checked on import)."""
    d, vocab = c["hidden_size"], c["vocab_size"]
    draft_vocab = c.get("draft_vocab_size") or vocab
    target_d = c.get("target_hidden_size") or d
    ids = aux_layer_ids(c)
    m = c.get("num_aux_hidden_states") or (len(ids) if ids else DEFAULT_NUM_AUX_LAYERS)
    spec = {
        "embed_tokens.weight": TensorSpec((vocab, d), required=embed_required),
        "fc.weight": TensorSpec((d, m * target_d)),
        "norm.weight": TensorSpec((d,)),
        "lm_head.weight": TensorSpec((draft_vocab, d)),
    }
    qk_norm = c.get("model_type") == "qwen3"
    spec.update(decoder_layer_spec(prefix, c, input_size=2 * d, qk_norm=qk_norm, extra_norms=("hidden_norm",)))
    spec["d2t"] = TensorSpec((draft_vocab,), kind="int64", required=False)
    spec["t2d"] = TensorSpec((vocab,), kind="bool", required=False)
    return spec


def eagle3_from_llama(c: dict, layer_ids: list[int] | None, offset: int = LAYER_ID_OFFSETS["vllm"]) -> Eagle3Config:
    """hf_dspark Eagle3Config from the layer fields + the consumer-convention layer ids (id - offset = ours)."""
    if not layer_ids:
        raise ForeignCheckpointError(
            "the checkpoint does not record its target layers (eagle_aux_hidden_state_layer_ids, top level or in "
            "eagle_config); vLLM would silently fall back to its defaults. Add the ids the draft was trained with "
            "to config.json"
        )
    vocab = c["vocab_size"]
    if (c.get("draft_vocab_size") or vocab) != vocab:
        raise ForeignCheckpointError(
            f"the draft has a reduced vocabulary (draft_vocab_size={c['draft_vocab_size']} < vocab_size={vocab}, "
            "mapped with d2t); hf_dspark drafts predict over the full target vocabulary"
        )
    kwargs = architecture_kwargs(c)
    return Eagle3Config(
        **kwargs,
        num_hidden_layers=1,
        target_layer_ids=[int(i) - offset for i in layer_ids],
        target_hidden_size=c.get("target_hidden_size") or c["hidden_size"],
        norm_before_residual=bool(c.get("norm_before_residual", False)),
        use_qk_norm=c.get("model_type") == "qwen3",
        tie_word_embeddings=False,
    )


def read_llama_eagle3(c: dict, tensors: dict[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
    """Check an Eagle3-layer state dict against its config and return it under hf_dspark names."""
    prefix = "midlayer." if any(k.startswith("midlayer.") for k in tensors) else "layers.0."
    check_tensors(tensors, llama_eagle3_spec(c, prefix, embed_required=False), what)
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is not None and bool(d2t.any()):
        raise ForeignCheckpointError(f"{what} maps a reduced draft vocabulary (d2t is not the identity)")
    if t2d is not None and not bool(t2d.all()):
        raise ForeignCheckpointError(f"{what} maps a reduced draft vocabulary (t2d is not all true)")
    out = {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}
    return rename(out, [(prefix, "layers.0.")])


__all__ = [
    "DEFAULT_NUM_AUX_LAYERS",
    "LAYER_CONVENTIONS",
    "LAYER_ID_OFFSETS",
    "LLAMA_EAGLE3_ARCHITECTURES",
    "aux_layer_ids",
    "consumer_layer_ids",
    "eagle3_from_llama",
    "layer_model_type",
    "llama_eagle3_config",
    "llama_eagle3_reasons",
    "llama_eagle3_spec",
    "llama_eagle3_tensors",
    "read_llama_eagle3",
]
