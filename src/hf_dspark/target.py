"""What a draft needs to know about its target, and how to read the target's context features.

Everything target-specific lives here, so the draft backbone stays target-agnostic: `TargetSpec` reads the
architecture facts from any causal-LM config (Llama, Qwen2, Qwen3, Gemma3, ...), and `TargetFeatureHooks`
captures the raw outputs of chosen decoder layers plus the final (post-norm) hidden state during any
forward of the target, independently of the transformers version's `output_hidden_states` conventions.

Layer-id convention (used everywhere in hf_dspark): id `l >= 0` is the raw output of decoder layer `l`
(0-based), id `-1` is the embedding output. This equals index `l + 1` of the classic `hidden_states` tuple.
"""

from __future__ import annotations

import hashlib
import json
import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import torch
from torch import nn

# Model types whose attention applies a per-head RMSNorm to queries and keys before RoPE (as Qwen3 does).
_QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen3_next", "gemma3", "gemma3_text", "olmo2", "olmo3")
# Model types that multiply token embeddings by sqrt(hidden_size).
_SCALED_EMBEDDING_MODEL_TYPES = ("gemma", "gemma2", "gemma3", "gemma3_text")


@dataclass(frozen=True)
class TargetSpec:
    """Architecture facts of a target model that its drafts mirror."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    rms_norm_eps: float
    rope_parameters: dict[str, Any]
    max_position_embeddings: int
    attention_bias: bool
    use_qk_norm: bool
    embedding_multiplier: float
    final_logit_softcapping: float | None
    tie_word_embeddings: bool
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    name_or_path: str = field(default="", compare=False)

    @classmethod
    def from_config(cls, config) -> "TargetSpec":
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        model_type = getattr(text, "model_type", "") or getattr(config, "model_type", "")
        heads = int(text.num_attention_heads)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        act = getattr(text, "hidden_act", None) or getattr(text, "hidden_activation", None) or "silu"
        multiplier = math.sqrt(text.hidden_size) if model_type in _SCALED_EMBEDDING_MODEL_TYPES else 1.0
        return cls(
            model_type=model_type,
            vocab_size=int(text.vocab_size),
            hidden_size=int(text.hidden_size),
            intermediate_size=int(text.intermediate_size),
            num_hidden_layers=int(text.num_hidden_layers),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            hidden_act=str(act),
            rms_norm_eps=float(getattr(text, "rms_norm_eps", None) or 1e-6),
            rope_parameters=_full_attention_rope(text),
            max_position_embeddings=int(getattr(text, "max_position_embeddings", None) or 32768),
            attention_bias=bool(getattr(text, "attention_bias", False)),
            use_qk_norm=model_type in _QK_NORM_MODEL_TYPES,
            embedding_multiplier=float(multiplier),
            final_logit_softcapping=getattr(text, "final_logit_softcapping", None),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            pad_token_id=getattr(text, "pad_token_id", None),
            bos_token_id=getattr(text, "bos_token_id", None),
            eos_token_id=getattr(text, "eos_token_id", None),
            name_or_path=str(getattr(config, "_name_or_path", "") or getattr(config, "name_or_path", "") or ""),
        )

    @classmethod
    def from_model(cls, model: nn.Module) -> "TargetSpec":
        spec = cls.from_config(model.config)
        layers = decoder_layers(model)
        attn = getattr(layers[0], "self_attn", None)
        use_qk_norm = attn is not None and hasattr(attn, "q_norm") and hasattr(attn, "k_norm")
        embed = model.get_input_embeddings()
        scale = getattr(embed, "scalar_embed_scale", None)
        fields = asdict(spec)
        fields["use_qk_norm"] = bool(use_qk_norm)
        if scale is not None:
            fields["embedding_multiplier"] = float(scale)
        return cls(**fields)

    def draft_config_kwargs(self) -> dict[str, Any]:
        """The subset of facts that become fields of a draft config."""
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": dict(self.rope_parameters),
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "use_qk_norm": self.use_qk_norm,
            "embedding_multiplier": self.embedding_multiplier,
            "final_logit_softcapping": self.final_logit_softcapping,
            "tie_word_embeddings": self.tie_word_embeddings,
            "target_model_type": self.model_type,
            "target_hidden_size": self.hidden_size,
            "num_target_layers": self.num_hidden_layers,
            "pad_token_id": self.pad_token_id,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }


def _full_attention_rope(text_config) -> dict[str, Any]:
    rope = getattr(text_config, "rope_parameters", None)
    if rope is None:
        theta = getattr(text_config, "rope_theta", 10000.0)
        return {"rope_type": "default", "rope_theta": float(theta)}
    rope = dict(rope)
    # Configs with per-layer-type RoPE (Gemma3) nest the parameters; the draft uses full attention.
    if "rope_type" not in rope and "full_attention" in rope:
        rope = dict(rope["full_attention"])
    rope.setdefault("rope_type", "default")
    return rope


def default_target_layer_ids(num_target_layers: int, num_features: int = 5) -> list[int]:
    """Evenly spaced decoder layers, never the final one (its HF hidden state is post-norm).

    For a 36-layer Qwen3 and 5 features this gives [1, 9, 17, 25, 33], DFlash's and DeepSpec's choice.
    """
    if num_target_layers < 2:
        raise ValueError(
            f"the target has {num_target_layers} decoder layer(s); a draft needs at least one non-final "
            "layer to read context features from"
        )
    last_allowed = num_target_layers - 2
    start, end = 1, num_target_layers - 3
    if end <= start:
        start, end = 0, last_allowed
    num_features = max(1, min(num_features, end - start + 1))
    if num_features == 1:
        return [end]
    span = end - start
    ids = [int(round(start + i * span / (num_features - 1))) for i in range(num_features)]
    return sorted(set(ids))


def _decoder_stack(model: nn.Module) -> nn.Module:
    """The module holding `layers` (and `norm`) of a causal LM: model, model.model, model.language_model, ..."""
    base = model
    for _ in range(4):
        if isinstance(getattr(base, "layers", None), nn.ModuleList):
            return base
        base = next(
            (getattr(base, n) for n in ("model", "language_model", "decoder", "transformer")
             if isinstance(getattr(base, n, None), nn.Module)),
            None,
        )  # fmt: skip
        if base is None:
            break
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}: expected a `.model.layers` list")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The list of decoder layers of a causal LM (works for Llama, Qwen2/3, Gemma3 text, ...)."""
    return _decoder_stack(model).layers


def final_norm(model: nn.Module) -> nn.Module:
    """The final norm module of a causal LM; its output is the last hidden state fed to the lm_head."""
    norm = getattr(_decoder_stack(model), "norm", None)
    if not isinstance(norm, nn.Module):
        raise ValueError(f"cannot find the final norm of {type(model).__name__}: expected `.model.norm`")
    return norm


class TargetFeatureHooks:
    """Forward hooks that record the context features and the final hidden state of every target forward.

    `features` is `[batch, seq, len(layer_ids) * hidden]` (layers concatenated in `layer_ids` order) and
    `last_hidden` is `[batch, seq, hidden]` for the most recent forward. Use as a context manager or call
    `remove()`.
    """

    def __init__(self, target: nn.Module, layer_ids: Sequence[int], capture_last_hidden: bool = True):
        layers = decoder_layers(target)
        num_layers = len(layers)
        validate_layer_ids(layer_ids, num_layers)
        self.layer_ids = list(layer_ids)
        self._captured: dict[int, torch.Tensor] = {}
        self.last_hidden: torch.Tensor | None = None
        self._handles = []
        for lid in sorted(set(self.layer_ids)):
            module = target.get_input_embeddings() if lid == -1 else layers[lid]
            self._handles.append(module.register_forward_hook(self._make_hook(lid)))
        if capture_last_hidden:
            self._handles.append(final_norm(target).register_forward_hook(self._last_hook))

    def _make_hook(self, lid: int):
        def hook(_module, _inputs, output):
            self._captured[lid] = output[0] if isinstance(output, (tuple, list)) else output

        return hook

    def _last_hook(self, _module, _inputs, output):
        self.last_hidden = output[0] if isinstance(output, (tuple, list)) else output

    @property
    def features(self) -> torch.Tensor:
        missing = [lid for lid in self.layer_ids if lid not in self._captured]
        if missing:
            raise RuntimeError(f"no target forward has run since the hooks were installed (layers {missing})")
        return torch.cat([self._captured[lid] for lid in self.layer_ids], dim=-1)

    def clear(self) -> None:
        self._captured.clear()
        self.last_hidden = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> "TargetFeatureHooks":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def validate_layer_ids(layer_ids: Sequence[int], num_target_layers: int) -> None:
    """Raise a ValueError naming the fix when `layer_ids` cannot serve as context features."""
    if not layer_ids:
        raise ValueError("target_layer_ids is empty: give at least one target decoder layer, e.g. [1, 9, 17]")
    if len(set(layer_ids)) != len(layer_ids):
        raise ValueError(f"target_layer_ids {list(layer_ids)} contains duplicates")
    last = num_target_layers - 1
    for lid in layer_ids:
        if lid == last:
            raise ValueError(
                f"target_layer_ids contains {lid}, the target's final decoder layer: Hugging Face exposes only its "
                f"post-norm output, which is not a raw layer feature. Use ids between -1 and {last - 1}, for "
                f"example {default_target_layer_ids(num_target_layers)}."
            )
        if lid < -1 or lid > last:
            raise ValueError(
                f"target_layer_ids contains {lid}, but the target has {num_target_layers} decoder layers: valid ids "
                f"are -1 (embeddings) to {last - 1}"
            )


def target_config_hash(config) -> str:
    """sha256 of the architecture facts of a target config (independent of paths and transformers version)."""
    facts = asdict(TargetSpec.from_config(config))
    facts.pop("name_or_path", None)
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()


@torch.no_grad()
def target_weights_fingerprint(target) -> str | None:
    """sha256 of a small sample of the target's weights (rounded to bf16, so the load dtype does not matter).

    Tells two checkpoints of one architecture apart (e.g. base vs fine-tuned). None when weights are not
    materialized (e.g. sharded by ZeRO-3).
    """
    tensors = [
        target.get_input_embeddings().weight[:16],
        next(decoder_layers(target)[0].parameters())[:16],
        final_norm(target).weight,
    ]
    h = hashlib.sha256()
    for t in tensors:
        if t.numel() == 0 or t.device.type == "meta":
            return None
        h.update(t.detach().to("cpu", torch.bfloat16).view(torch.int16).numpy().tobytes())
    return h.hexdigest()


@contextmanager
def capture_target_features(target: nn.Module, layer_ids: Sequence[int]) -> Iterator[TargetFeatureHooks]:
    hooks = TargetFeatureHooks(target, layer_ids)
    try:
        yield hooks
    finally:
        hooks.remove()


@torch.no_grad()
def target_features(
    target: nn.Module,
    input_ids: torch.Tensor,
    layer_ids: Sequence[int],
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One no-grad target forward returning `(context_features, last_hidden)`.

    The lm_head is skipped (`logits_to_keep=1`), so no `[seq, vocab]` logits are materialized.
    """
    with capture_target_features(target, layer_ids) as hooks:
        target(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=1)
        return hooks.features, hooks.last_hidden


def has_sliding_layers(config) -> bool:
    """Whether any of the target's layers attends within a sliding window (from its config)."""
    layer_types = getattr(config, "layer_types", None) or []
    if layer_types:
        return any(kind != "full_attention" for kind in layer_types)
    return bool(getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True))


def explicit_mask_unsupported(target: nn.Module, sliding: bool | None = None) -> str | None:
    """Why the target cannot take one explicit 4-D attention mask in place of its own masking, or None when it can.

    Training's captured feature forward and generation's verification (static cache, candidate trees, the ready
    verify mask) all pass such a mask. Only sdpa and eager attention take one, and one mask would override
    sliding-window layers' own windows. `sliding`: whether the target has sliding-window layers, where the caller
    knows (generation reads its cache's flags); None reads it from the config."""
    implementation = getattr(target.config, "_attn_implementation", None)
    if implementation not in ("sdpa", "eager"):
        return (f"its attention implementation {implementation!r} takes no explicit mask (load the target with "
                "attn_implementation='sdpa')")  # fmt: skip
    if has_sliding_layers(target.config) if sliding is None else sliding:
        return "the target has sliding-window layers (one explicit mask would override their windows)"
    return None


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean "may attend" mask as the target's attention adds it: 0 where allowed, the dtype's minimum elsewhere.
    eager attention takes only this form, and sdpa turns a boolean mask into it in every layer, so a mask built
    once for all layers (verification, training's captured forward) is built in this form."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def static_cache_length(prompts: Iterable[Sequence[int]], max_new_tokens: int, step: int = 256) -> int:
    """One static-cache length for every generate() call of a run: its longest prompt + max_new_tokens, rounded up
    to `step`, so the compiled decoding step keeps one shape (the speed tools' baseline, `regenerate`)."""
    longest = max((len(p) for p in prompts), default=0)
    if longest == 0 or max_new_tokens < 1:
        raise ValueError(f"need prompts and max_new_tokens >= 1, got longest prompt {longest}, {max_new_tokens}")
    return -(-(longest + int(max_new_tokens)) // step) * step


__all__ = [
    "TargetSpec",
    "TargetFeatureHooks",
    "default_target_layer_ids",
    "decoder_layers",
    "static_cache_length",
    "has_sliding_layers",
    "explicit_mask_unsupported",
    "additive_mask",
    "final_norm",
    "validate_layer_ids",
    "target_config_hash",
    "target_weights_fingerprint",
    "capture_target_features",
    "target_features",
]
