"""Fields shared by every draft config: the target facts the draft mirrors and the target-feature wiring.

Drafter-specific fields (block size, Markov head, TTT length, loss weights) live in each drafter's own
configuration module; this base only checks what all of them need.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedConfig

from ..target import validate_layer_ids


class DraftConfig(PreTrainedConfig):
    r"""
    Base configuration of a speculative-decoding draft model.

    Architecture fields mirror the target model (`from_target` fills them): the draft's hidden size equals the
    target's, because embeddings and lm_head are copied from it.

    Args:
        num_hidden_layers (`int`): decoder layers of the draft itself.
        target_layer_ids (`list[int]`): target decoder layers whose raw outputs feed the draft (`-1` = embeddings;
            never the target's final layer).
        num_target_layers (`int`): number of decoder layers of the target model.
        target_hidden_size (`int`): hidden size of the target (width of each context feature).
        use_qk_norm (`bool`): per-head RMSNorm on queries and keys before RoPE (Qwen3-style attention).
        embedding_multiplier (`float`): factor applied to token embeddings (sqrt(hidden) for Gemma targets).
        final_logit_softcapping (`float`, *optional*): tanh soft-capping of logits, as in the target.
        target_model_type / target_name_or_path (`str`): identity of the target the draft was built for.
        target_config_hash / target_weights_fingerprint (`str`): sha256 of the target's architecture facts and of a
            sample of its weights (filled by `from_target`; caches and decoding refuse a different target).
    """

    model_type = "hf_dspark_draft"

    vocab_size: int = 32000
    hidden_size: int = 1024
    intermediate_size: int = 2816
    num_hidden_layers: int = 1
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_parameters: dict | None = None
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    attention_dropout: float = 0.0
    mlp_bias: bool = False
    use_qk_norm: bool = False
    embedding_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    target_model_type: str | None = None
    target_name_or_path: str | None = None
    target_config_hash: str | None = None
    target_weights_fingerprint: str | None = None
    target_hidden_size: int | None = None
    num_target_layers: int | None = None
    target_layer_ids: list[int] | None = None

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.rope_parameters is None:
            theta = kwargs.pop("rope_theta", 10000.0)
            self.rope_parameters = {"rope_type": "default", "rope_theta": theta}
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.target_layer_ids is not None:
            self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        super().__post_init__(**kwargs)
        self.check_draft_fields()

    @property
    def num_context_features(self) -> int:
        return len(self.target_layer_ids or [])

    def card_rows(self) -> list[tuple[str, str]]:
        """(label, value) rows of the settings that set this drafter apart, for its model card."""
        return []

    def check_draft_fields(self) -> None:
        """Raise a ValueError that names the fix for any inconsistent field."""
        if self.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers must be >= 1, got {self.num_hidden_layers}")
        if self.intermediate_size < 1:
            raise ValueError(f"intermediate_size must be >= 1, got {self.intermediate_size}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})"
            )
        # A bare default config (transformers builds one to diff against) has no target yet: nothing to check.
        if self.target_layer_ids is not None:
            if self.num_target_layers is not None:
                validate_layer_ids(self.target_layer_ids, self.num_target_layers)
            elif len(set(self.target_layer_ids)) != len(self.target_layer_ids):
                raise ValueError(f"target_layer_ids {self.target_layer_ids} contains duplicates")
        self._check_token_id("mask_token_id", getattr(self, "mask_token_id", None))

    def check_buildable(self) -> None:
        """Fields a model needs that a bare config may lack (called when a draft model is constructed)."""
        if not self.target_layer_ids:
            raise ValueError(
                "target_layer_ids is not set: pass the target decoder layers that feed the draft, or build the "
                "draft with `from_target(target)`, which picks evenly spaced layers"
            )

    def _check_token_id(self, name: str, value: int | None) -> None:
        if value is not None and not 0 <= value < self.vocab_size:
            raise ValueError(f"{name}={value} is outside the vocabulary [0, {self.vocab_size})")

    @staticmethod
    def _check_choice(name: str, value: Any, choices: tuple) -> None:
        if value not in choices:
            raise ValueError(f"{name}={value!r} is not one of {', '.join(repr(c) for c in choices)}")
