"""The Llama-Eagle3 layout shared by vLLM, SGLang and speculators (one decoder layer, full vocabulary here).

Weights: `embed_tokens`, `fc` [d, 3 * d_target], one decoder layer under `midlayer.*` (SGLang, EAGLE's original
training code) or `layers.0.*` (vLLM renames midlayer.* to it on load; speculators), `norm`, `lm_head`
[draft_vocab, d], optional `d2t` (int64 offsets: target_id = i + d2t[i]) and `t2d` (bool). The layer's q/k/v
take [input_layernorm(embed); hidden_norm(hidden)] (2d wide), exactly as hf_dspark's Eagle3 layer.

What the layout cannot represent (refused at export): q_norm/k_norm (Qwen3-style drafts: use the deepspec
format), embedding multipliers and logit soft-capping (Gemma), a number of target layers other than three
(these loaders build `fc` as Linear(3 * target_hidden_size, hidden)), and the embedding output (id -1) as a
feature (they capture the residual stream entering a decoder layer).

Vocabulary: hf_dspark drafts predict over the full target vocabulary, so draft_vocab_size = vocab_size and the
d2t/t2d maps, where written, are the identity (d2t = 0, t2d = True). Importing a checkpoint with a reduced
draft vocabulary is refused (an hf_dspark draft has no vocabulary map).

Target-layer ids: vLLM/SGLang/speculators capture the residual stream *entering* decoder layer i, which is the
output of layer i - 1, so they write hf_dspark id l as l + 1.
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

LLAMA_EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
NUM_FC_LAYERS = 3
LAYER_ID_OFFSET = 1
LAYER_CONVENTION = (
    "vLLM/SGLang aux-hidden-state convention: id i = residual stream entering decoder layer i "
    "(= hf_dspark id i - 1)"
)


def llama_eagle3_reasons(cfg, consumer: str, *, norm_before_residual: bool = True) -> list[str]:
    """Why an Eagle3 draft does not fit the Llama-Eagle3 layout of `consumer`."""
    if cfg.model_type != "eagle3":
        return [f"the Llama-Eagle3 layout of {consumer} holds Eagle3 drafts only"]
    reasons = []
    if cfg.use_qk_norm:
        reasons.append(
            f"the Llama layout of {consumer} has no q_norm/k_norm, but this draft (target {cfg.target_model_type}) "
            "uses them; export it with --format deepspec (Qwen3Eagle3Model) instead"
        )
    if cfg.embedding_multiplier != 1.0:
        reasons.append(f"the Llama layout has no embedding multiplier (this draft uses {cfg.embedding_multiplier:g})")
    if cfg.final_logit_softcapping is not None:
        reasons.append("the Llama layout has no logit soft-capping")
    ids = list(cfg.target_layer_ids)
    if len(ids) != NUM_FC_LAYERS:
        reasons.append(
            f"{consumer} builds fc as Linear({NUM_FC_LAYERS} * target_hidden_size, hidden) but this draft reads "
            f"{len(ids)} target layers {ids}; train the Eagle3 draft with exactly {NUM_FC_LAYERS} target layers "
            "(e.g. target_layer_ids=[1, L // 2 - 1, L - 4], vLLM's default capture points)"
        )
    if ids and min(ids) < 0:
        reasons.append(f"{consumer} captures the stream entering a decoder layer; the embedding output (-1) is not one")
    if cfg.norm_before_residual and not norm_before_residual:
        reasons.append(f"the Eagle3 layer of {consumer} has no norm_before_residual option")
    return reasons


def llama_eagle3_config(cfg, architecture: str) -> dict:
    """Llama config fields of the Eagle3 layer (shared by the three consumers)."""
    c = {"architectures": [architecture], "model_type": "llama", **architecture_fields(cfg)}
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


def consumer_layer_ids(cfg) -> list[int]:
    return [i + LAYER_ID_OFFSET for i in cfg.target_layer_ids]


def llama_eagle3_tensors(tensors: dict[str, torch.Tensor], prefix: str, vocab_maps: bool, vocab_size: int):
    out = rename(tensors, [("layers.0.", prefix)])
    if vocab_maps:
        out["d2t"] = torch.zeros(vocab_size, dtype=torch.int64)  # identity: target_id = i + 0
        out["t2d"] = torch.ones(vocab_size, dtype=torch.bool)  # every target token is in the draft vocabulary
    return out


def llama_eagle3_spec(c: dict, prefix: str, *, vocab_maps: bool | None, embed_required: bool = True):
    """Shapes from a Llama-Eagle3 layer config dict. vocab_maps: True = required, None = optional."""
    d, vocab = c["hidden_size"], c["vocab_size"]
    draft_vocab = c.get("draft_vocab_size") or vocab
    target_d = c.get("target_hidden_size") or d
    spec = {
        "embed_tokens.weight": TensorSpec((vocab, d), required=embed_required),
        "fc.weight": TensorSpec((d, NUM_FC_LAYERS * target_d)),
        "norm.weight": TensorSpec((d,)),
        "lm_head.weight": TensorSpec((draft_vocab, d)),
    }
    spec.update(decoder_layer_spec(prefix, c, input_size=2 * d, qk_norm=False, extra_norms=("hidden_norm",)))
    if vocab_maps is not False:
        spec["d2t"] = TensorSpec((draft_vocab,), kind="int64", required=bool(vocab_maps))
        spec["t2d"] = TensorSpec((vocab,), kind="bool", required=bool(vocab_maps))
    return spec


def eagle3_from_llama(c: dict, layer_ids: list[int] | None) -> Eagle3Config:
    """hf_dspark Eagle3Config from the Llama layer fields + the consumer-convention layer ids."""
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
        target_layer_ids=[int(i) - LAYER_ID_OFFSET for i in layer_ids],
        target_hidden_size=c.get("target_hidden_size") or c["hidden_size"],
        norm_before_residual=bool(c.get("norm_before_residual", False)),
        use_qk_norm=False,
        tie_word_embeddings=False,
    )


def read_llama_eagle3(c: dict, tensors: dict[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
    """Check a Llama-Eagle3 state dict against its config and return it under hf_dspark names."""
    prefix = "midlayer." if any(k.startswith("midlayer.") for k in tensors) else "layers.0."
    check_tensors(tensors, llama_eagle3_spec(c, prefix, vocab_maps=None, embed_required=False), what)
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is not None and bool(d2t.any()):
        raise ForeignCheckpointError(f"{what} maps a reduced draft vocabulary (d2t is not the identity)")
    if t2d is not None and not bool(t2d.all()):
        raise ForeignCheckpointError(f"{what} maps a reduced draft vocabulary (t2d is not all true)")
    out = {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}
    return rename(out, [(prefix, "layers.0.")])


__all__ = [
    "LAYER_CONVENTION",
    "LAYER_ID_OFFSET",
    "LLAMA_EAGLE3_ARCHITECTURES",
    "NUM_FC_LAYERS",
    "consumer_layer_ids",
    "eagle3_from_llama",
    "llama_eagle3_config",
    "llama_eagle3_reasons",
    "llama_eagle3_spec",
    "llama_eagle3_tensors",
    "read_llama_eagle3",
]
