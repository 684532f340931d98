"""`DraftPreTrainedModel`: what DSpark, DFlash and Eagle3 drafts share as Hugging Face models.

- construction from a target (`from_target`): config from the target's facts, frozen copies of its token
  embeddings and lm_head;
- the output head: draft logits `lm_head(h) (+ Markov bias)`, the aligned target logits `lm_head(h_target)`,
  both computable for a slice of the vocabulary so losses can work in chunks;
- the inference protocol the decoding loop calls: `new_context_cache`, `extend_context`, `propose`.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

from ..sampling import TokenSampler
from ..target import (
    TargetSpec,
    default_target_layer_ids,
    target_config_hash,
    target_weights_fingerprint,
    validate_layer_ids,
)
from .backbone import DraftRMSNorm, DraftRotary, check_feature_width, softcap
from .configuration_draft import DraftConfig
from .context_cache import DraftContextCache, pack_left

logger = logging.getLogger(__name__)

DEFAULT_NUM_TARGET_FEATURES = 5

# Functions of higher layers the model methods offer: foreign-checkpoint loading and card-writing push (hub), and
# routing generate(assistant_model=draft) once a draft exists (generation). Those packages sit above this one, so
# the package root binds them here (`bind_services`) instead of this module importing upward
# (docs/ARCHITECTURE.md).
_services: dict[str, Callable] = {}


def bind_services(
    *,
    foreign_format: Callable,
    load_foreign_draft: Callable,
    push_draft: Callable,
    install_generation: Callable | None = None,
) -> None:
    _services.update(foreign_format=foreign_format, load_foreign_draft=load_foreign_draft, push_draft=push_draft)
    if install_generation is not None:
        _services["install_generation"] = install_generation


def _service(name: str) -> Callable:
    service = _services.get(name)
    if service is None:
        raise RuntimeError(f"{name} comes from hf_dspark.hub, which `import hf_dspark` binds: import hf_dspark first")
    return service


@dataclass
class DraftProposal(ModelOutput):
    """One proposed block per request.

    tokens [R, n]; probs [R, n, V]: the exact (processed) distributions the tokens were drawn from (None for a
    greedy proposal: greedy verification compares tokens only); logits [R, n, V]: the raw draft logits (float32;
    None from `propose(return_logits=False)`); confidences / confidence_logits [R, n] (DSpark with a confidence
    head; calibrated by the config's STS temperatures when present).
    """

    tokens: torch.LongTensor | None = None
    probs: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    confidences: torch.FloatTensor | None = None
    confidence_logits: torch.FloatTensor | None = None


def stack_or_none(slots: list[torch.Tensor | None]) -> torch.Tensor | None:
    """Per-slot distributions [R, V] -> [R, n, V]; None when the draws were greedy (`TokenSampler.draw`)."""
    return None if slots[0] is None else torch.stack(slots, dim=1)


def _project_rows(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(hidden [..., d], weight [V, d]) as one matrix product over rows. F.linear on a 3-D input that is not
    a view of rows (a block's first n slots, sliced from its K) does not fold the batch into rows: it runs a batched
    product that reads the weight once per batch entry, for the vocabulary projection the whole lm_head once per row
    (on an H100 such a product for 16 rows of one slot took 0.23 ms, where a batch-16 round's other vocabulary
    projections took about 0.03 ms each)."""
    return F.linear(hidden.reshape(-1, hidden.shape[-1]), weight).view(*hidden.shape[:-1], weight.shape[0])


class DraftPreTrainedModel(PreTrainedModel):
    config_class = DraftConfig
    base_model_prefix = ""
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DraftDecoderLayer"]  # a drafter with its own layer class overrides this
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_flash_attn = False
    _tied_weights_keys = {"lm_head.weight": "embed_tokens.weight"}
    # Methods of each entry of `self.layers` the trainer may compile (`compile_draft_layers`): the element-wise
    # work around the matrix products (norms, rotary, residuals, casts) runs as a few fused kernels.
    compiled_layer_methods: tuple[str, ...] = ("forward",)
    # Whether `_extend` reads the token after each committed position (Eagle3); block drafters ignore it.
    extends_with_next_tokens: bool = False
    # The training forward's attention. "auto": flex_attention with a sparse BlockMask on CUDA (where the drafter
    # takes it by default, `flex_by_default`), the equivalent dense mask elsewhere and for heads narrower than flex's
    # GPU kernel takes (it needs head_dim >= 16: tiny test drafts); "flex" / "dense" force one.
    block_mask_kind: str = "auto"
    flex_by_default: bool = True
    FLEX_MIN_HEAD_DIM = 16

    def _use_flex(self, device: torch.device) -> bool:
        if self.block_mask_kind not in ("auto", "flex", "dense"):
            raise ValueError(f"block_mask_kind must be 'auto', 'flex' or 'dense', got {self.block_mask_kind!r}")
        if self.block_mask_kind == "auto":
            return self.flex_by_default and device.type == "cuda" and self.config.head_dim >= self.FLEX_MIN_HEAD_DIM
        return self.block_mask_kind == "flex"

    # -- construction -----------------------------------------------------------------------------------------

    def _build_io(self, config: DraftConfig, context_norm: bool = True) -> None:
        """Token embeddings and lm_head (copies of the target's, frozen), final norm, RoPE and the context
        projection `fc` (followed by `hidden_norm` for block drafters; Eagle3 normalizes inside its layer)."""
        config.check_buildable()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.norm = DraftRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = DraftRotary(config)
        in_features = config.num_context_features * config.target_hidden_size
        self.fc = nn.Linear(in_features, config.hidden_size, bias=False)
        if context_norm:
            self.hidden_norm = DraftRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False

    def post_init(self):
        super().post_init()
        self.freeze_target_io()
        # A draft exists, so generate(assistant_model=draft) may follow: route it (idempotent; bound by the root).
        install = _services.get("install_generation")
        if install is not None:
            install()

    def save_pretrained(self, save_directory, *args, state_dict=None, **kwargs):
        """As transformers', but the frozen float32 copies of the target's embeddings and lm_head are stored in
        bfloat16 when that is lossless (the target's checkpoint was bf16, as the default target's is), which halves
        their share of the folder. Loading casts them back to the model's dtype."""
        if state_dict is None:
            state_dict = self.state_dict()
            compacted = {}  # by storage: a tied lm_head stays one tensor, so it is still saved once
            for name in ("embed_tokens.weight", "lm_head.weight"):
                weight = state_dict.get(name)
                if weight is None or weight.dtype != torch.float32:
                    continue
                key = weight.untyped_storage().data_ptr()
                if key not in compacted:
                    compact = weight.to(torch.bfloat16)
                    compacted[key] = compact if torch.equal(compact.float(), weight) else weight
                state_dict[name] = compacted[key]
        return super().save_pretrained(save_directory, *args, state_dict=state_dict, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        foreign_format = _services.get("foreign_format")
        fmt = None if args or foreign_format is None else foreign_format(pretrained_model_name_or_path, **kwargs)
        if fmt is not None:
            warnings.warn(
                f"{cls.__name__}.from_pretrained converted a {fmt} checkpoint: load checkpoints written by other "
                "tools with hf_dspark.load_draft(path) (from_pretrained will read hf_dspark folders only in a future "
                "release)",
                FutureWarning,
                stacklevel=2,
            )
            return _service("load_foreign_draft")(pretrained_model_name_or_path, expected_class=cls, **kwargs)
        model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        model.freeze_target_io()  # loading replaces parameters, which resets requires_grad
        return model

    def push_to_hub(self, repo_id: str, **kwargs):
        """Publish weights, config, model card and the remote-code shim (see `hf_dspark.hub.push_draft`)."""
        return _service("push_draft")(self, repo_id, **kwargs)

    def loss_rows_bound_fn(self) -> Callable[[torch.Tensor], int] | None:
        """A picklable function of a collated batch's loss mask (times its attention mask, on the host) giving at
        most how many loss rows that batch's training step has. The trainer's collator adds its value to each
        batch, so the loss sizes its row buffer without reading a count back from the device (a training step
        then never waits for the device). None: unknown, and the loss counts its rows on the device."""
        return None

    def freeze_target_io(self) -> None:
        """Embeddings and lm_head belong to the target: never trained."""
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    @classmethod
    def _from_target_defaults(cls, spec: TargetSpec) -> dict:
        return {}

    @classmethod
    def from_target(
        cls,
        target: nn.Module,
        *,
        target_layer_ids: list[int] | None = None,
        num_hidden_layers: int | None = None,
        block_size: int | None = None,
        dtype: torch.dtype | None = None,
        **overrides,
    ):
        """Build a randomly initialised draft for `target` (any transformers causal LM).

        target_layer_ids defaults to 5 evenly spaced non-final layers. The draft's embeddings and lm_head are
        frozen copies of the target's. `block_size` is the number of draft tokens per round (Eagle3: its
        ttt_length). Any config field can be overridden by keyword, e.g. `use_qk_norm=True` for a Llama/Qwen2
        target (the query/key RMSNorm every serving engine's block-draft layer applies).
        """
        spec = TargetSpec.from_model(target)
        kwargs = spec.draft_config_kwargs()
        kwargs.update(cls._from_target_defaults(spec))
        kwargs["target_layer_ids"] = (
            list(target_layer_ids)
            if target_layer_ids is not None
            else default_target_layer_ids(spec.num_hidden_layers, DEFAULT_NUM_TARGET_FEATURES)
        )
        kwargs["target_name_or_path"] = spec.name_or_path or None
        kwargs["target_config_hash"] = target_config_hash(target.config)
        kwargs["target_weights_fingerprint"] = target_weights_fingerprint(target)
        if num_hidden_layers is not None:
            kwargs["num_hidden_layers"] = num_hidden_layers
        if block_size is not None:
            kwargs[cls._block_size_field()] = block_size
        kwargs.update(overrides)
        config = cls.config_class(**kwargs)
        draft = cls(config)
        draft.copy_target_io(target)
        reference = target.get_input_embeddings().weight
        return draft.to(device=reference.device, dtype=dtype or torch.float32)

    @classmethod
    def _block_size_field(cls) -> str:
        return "block_size"

    @torch.no_grad()
    def copy_target_io(self, target: nn.Module) -> None:
        embed = target.get_input_embeddings().weight
        head = target.get_output_embeddings()
        if embed.shape != self.embed_tokens.weight.shape:
            raise ValueError(
                f"target embeddings are {tuple(embed.shape)} but the draft expects "
                f"{tuple(self.embed_tokens.weight.shape)}: the draft config belongs to another target"
            )
        self.embed_tokens.weight.copy_(embed)
        if head is None:
            raise ValueError(f"{type(target).__name__} has no lm_head: pass a *ForCausalLM target")
        if not self.config.tie_word_embeddings:
            self.lm_head.weight.copy_(head.weight)
        self.freeze_target_io()

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        # The Markov bias starts at zero: a fresh DSpark draft behaves like its parallel backbone.
        if hasattr(module, "markov_w2"):
            nn.init.zeros_(module.markov_w2.weight)

    def check_target(self, target: nn.Module) -> None:
        """Raise a ValueError naming the fix when this draft cannot read `target` (vocabulary, recorded target
        facts, target layers); a different recorded name alone only warns (paths differ between machines)."""
        spec = TargetSpec.from_model(target)
        cfg = self.config
        if cfg.vocab_size != spec.vocab_size:
            raise ValueError(
                f"draft vocab {cfg.vocab_size} != target vocab {spec.vocab_size}: the draft was trained for another "
                "target (load the draft that matches this target, or build one with DraftModel.from_target(target))"
            )
        facts = [
            ("target_model_type", cfg.target_model_type, spec.model_type),
            ("target_hidden_size", cfg.target_hidden_size, spec.hidden_size),
            ("num_target_layers", cfg.num_target_layers, spec.num_hidden_layers),
        ]
        for name, recorded, actual in facts:
            if recorded is not None and recorded != actual:
                raise ValueError(
                    f"draft config {name}={recorded!r} but this target has {actual!r}: the draft was built for "
                    "another target model"
                )
        try:
            validate_layer_ids(cfg.target_layer_ids or [], spec.num_hidden_layers)
        except ValueError as err:
            raise ValueError(f"the draft reads target layers this target cannot provide: {err}") from None
        self._check_target_weights(target)
        recorded_name = getattr(cfg, "target_name_or_path", None)
        if recorded_name and spec.name_or_path and recorded_name != spec.name_or_path:
            logger.warning(
                "draft was built for target %r, used with %r (same architecture and vocabulary; check that this "
                "is the intended model)",
                recorded_name,
                spec.name_or_path,
            )

    def _check_target_weights(self, target: nn.Module) -> None:
        """Warn (once per target) when the target's weights differ from the ones the draft was trained for.

        Same architecture, other weights (base vs fine-tuned, another checkpoint): the draft still decodes
        losslessly but proposes for the wrong model, so acceptance collapses. Costs a hash of three small weight
        slices."""
        recorded = getattr(self.config, "target_weights_fingerprint", None)
        checked = self.__dict__.setdefault("_checked_targets", set())
        if not recorded or id(target) in checked:
            return
        checked.add(id(target))
        actual = target_weights_fingerprint(target)
        if actual is not None and actual != recorded:
            logger.warning(
                "this draft was trained for a target with other weights (fingerprint %s..., this target %s...): "
                "same architecture, different checkpoint (%r), so expect few accepted tokens. Use the draft trained "
                "for this target, or train one with %s.from_target(target).",
                recorded[:12], actual[:12], getattr(target.config, "_name_or_path", ""), type(self).__name__,
            )  # fmt: skip

    # -- shared computations ----------------------------------------------------------------------------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.config.embedding_multiplier != 1.0:
            hidden = hidden * torch.tensor(self.config.embedding_multiplier, dtype=hidden.dtype)
        return hidden

    def project_context(self, context_features: torch.Tensor) -> torch.Tensor:
        """Raw concatenated target features [..., m * d_target] -> H_ctx [..., d]."""
        check_feature_width(self.config, context_features)
        context = self.fc(context_features.to(self.fc.weight.dtype))
        return self.hidden_norm(context) if hasattr(self, "hidden_norm") else context

    def draft_logits(
        self,
        hidden: torch.Tensor,
        markov_features: torch.Tensor | None = None,
        vocab_slice: slice | None = None,
    ) -> torch.Tensor:
        """Logits of the draft for (a slice of) the vocabulary: lm_head(h) + W2 z, soft-capped like the target."""
        return self.finish_logits(self.base_logits(hidden, vocab_slice), markov_features, vocab_slice)

    def base_logits(self, hidden: torch.Tensor, vocab_slice: slice | None = None) -> torch.Tensor:
        """lm_head(h) over [..., d] as one matrix product (`_project_rows`)."""
        return _project_rows(hidden, self.lm_head.weight[vocab_slice or slice(None)])

    def finish_logits(
        self, base_logits: torch.Tensor, markov_features: torch.Tensor | None = None, vocab_slice: slice | None = None
    ) -> torch.Tensor:
        """Base logits lm_head(h) -> draft logits: + W2 z (Markov bias), then the target's soft-capping."""
        if markov_features is not None:
            weight = self.markov_head.markov_w2.weight[vocab_slice or slice(None)]
            base_logits = base_logits + F.linear(markov_features.to(weight.dtype), weight)
        return softcap(base_logits, self.config.final_logit_softcapping)

    def target_logits(self, target_hidden: torch.Tensor, vocab_slice: slice | None = None) -> torch.Tensor:
        """The target's own logits from its final (post-norm) hidden state, through the frozen lm_head copy."""
        weight = self.lm_head.weight[vocab_slice or slice(None)]
        return softcap(_project_rows(target_hidden.to(weight.dtype), weight), self.config.final_logit_softcapping)

    # -- inference protocol -----------------------------------------------------------------------------------

    @property
    def num_draft_tokens(self) -> int:
        return self.config.num_draft_tokens

    def new_context_cache(self, batch_size: int, capacity: int = 256) -> DraftContextCache:
        param = self.fc.weight
        return DraftContextCache(
            self.config.num_hidden_layers,
            batch_size,
            self.config.num_key_value_heads,
            self.config.head_dim,
            device=param.device,
            dtype=param.dtype,
            capacity=capacity,
        )

    @torch.no_grad()
    def extend_context(
        self,
        cache: DraftContextCache,
        context_features: torch.Tensor,
        valid: torch.Tensor | None = None,
        next_token_ids: torch.Tensor | None = None,
        max_committed: int | None = None,
        counts: torch.Tensor | None = None,
    ) -> None:
        """Append newly committed positions to each request's context.

        context_features [R, t, m * d_target]: the target's features of the positions it just processed;
        valid bool [R, t]: which of them are committed (default: all), in order; counts [R] (instead of `valid`):
        the committed positions are each row's first counts[r] (a prefix: already left-packed, so nothing is
        moved); next_token_ids [R, t]: the token that follows each position (Eagle3 needs it; block drafters
        ignore it); max_committed: the host's copy of the most committed positions of a row, when the caller
        knows it (saves a device round trip).
        """
        if valid is not None and counts is not None:
            raise ValueError("extend_context takes valid or counts, not both")
        if valid is None and counts is None:  # every position is committed
            rows, t = context_features.shape[:2]
            counts = torch.full((rows,), t, dtype=torch.long, device=context_features.device)
            max_committed = t
        next_ids = next_token_ids
        if valid is not None:
            context_features, counts = pack_left(context_features, valid)
            next_ids = None if next_token_ids is None else pack_left(next_token_ids, valid)[0]
        if max_committed is not None:
            width = int(max_committed)
        else:
            width = int(counts.max().item()) if counts.numel() else 0
        if width == 0:
            return
        self._extend(cache, context_features[:, :width], counts, None if next_ids is None else next_ids[:, :width])

    def _extend(self, cache, features, counts, next_token_ids) -> None:
        raise NotImplementedError

    def propose(
        self,
        cache: DraftContextCache,
        anchor_ids: torch.Tensor,
        *,
        sampler: TokenSampler | None = None,
        num_tokens: int | None = None,
        input_ids: torch.Tensor | None = None,
        draft_tokens: torch.Tensor | None = None,
        return_logits: bool = True,
    ) -> DraftProposal:
        """Propose `num_tokens` (default: the config's block size / ttt length) tokens after each anchor.

        sampler: how to turn logits into distributions and tokens (default: plain sampling at temperature 1);
        input_ids [R, L]: each request's sequence so far ending with the anchor, for logits processors that read
        it; draft_tokens [R, n]: score these tokens instead of sampling (teacher forcing, for evaluation/tests);
        return_logits: False leaves `logits` None (the decoding loop reads none: it saves their float32 copies).
        """
        n = self.num_draft_tokens if num_tokens is None else num_tokens
        if n < 1:
            raise ValueError(f"num_tokens must be >= 1, got {n}")
        with torch.no_grad():
            sampler = sampler or TokenSampler()
            return self._propose(cache, anchor_ids, sampler, n, input_ids, draft_tokens, return_logits)

    def _propose(self, cache, anchor_ids, sampler, num_tokens, input_ids, draft_tokens, return_logits) -> DraftProposal:
        raise NotImplementedError

    def _draw(self, sampler, logits, input_ids, step_tokens, draft_tokens, k):
        """Shared per-slot draw: (processed distribution, token). A free greedy draw returns no distribution
        (`TokenSampler.draw`); forced tokens (`draft_tokens`, scoring) always get theirs."""
        prefix = None
        if input_ids is not None:
            prefix = torch.cat([input_ids] + ([torch.stack(step_tokens, dim=1)] if step_tokens else []), dim=1)
        if draft_tokens is None:
            return sampler.draw(logits, prefix)
        return sampler.distribution(logits, prefix), draft_tokens[:, k]


__all__ = ["DraftPreTrainedModel", "DraftProposal"]
