"""DSpark draft: parallel anchor-block backbone (KV injection) + Markov head + confidence head.

Training (`forward`): for sampled anchors p, the block input is [x_p, MASK x (K-1)] at positions p..p+K-1;
slot j predicts x_{p+j+1} and sees context positions < p plus its own block. The Markov head is teacher forced
(x_{k-1} is the ground truth). The output carries what the loss needs (normed hidden states, Markov features,
confidence logits, labels, masks, the aligned target hidden states); full-vocabulary logits are left to the loss
so it can build them chunk by chunk.

Inference (`extend_context` / `propose`): the same layers read the context keys/values from a per-request
cache; the Markov head samples left to right.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils import ModelOutput

from ..anchors import anchor_slots_bound, block_positions, dense_block_mask, flex_block_mask, sample_anchors
from ..backbone import DraftDecoderLayer
from ..context_cache import DraftContextCache
from ..heads import MARKOV_HEADS, ConfidenceHead
from ..modeling_draft import DraftPreTrainedModel, DraftProposal, stack_or_none
from ...target import TargetSpec
from .configuration_dspark import DSparkConfig


@dataclass
class BlockDraftOutput(ModelOutput):
    """Training-forward output of DSpark/DFlash (B rows, N anchors, K slots).

    hidden_states [B, N, K, d]: final-normed draft states (draft logits = `draft_logits(hidden, markov)`);
    markov_features [B, N, K, r] or None; confidence_logits [B, N, K] or None; labels [B, N, K];
    eval_mask bool [B, N, K]: label inside the sequence and supervised, as a contiguous prefix per block;
    target_hidden_states [B, N, K, d_target] or None: the target's final hidden state that predicted each label;
    anchor_positions / anchor_mask [B, N].
    """

    hidden_states: torch.FloatTensor | None = None
    markov_features: torch.FloatTensor | None = None
    confidence_logits: torch.FloatTensor | None = None
    labels: torch.LongTensor | None = None
    eval_mask: torch.BoolTensor | None = None
    target_hidden_states: torch.FloatTensor | None = None
    anchor_positions: torch.LongTensor | None = None
    anchor_mask: torch.BoolTensor | None = None


class DSparkModel(DraftPreTrainedModel):
    config_class = DSparkConfig
    compiled_layer_methods = ("context_kv", "forward")

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        if config.mask_token_id is None:
            raise ValueError(
                "mask_token_id is not set: pass the token id whose embedding fills the block's mask slots "
                "(from_target picks the pad token, or the last vocabulary id)"
            )
        self._build_io(config)
        self.layers = nn.ModuleList([DraftDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        if config.has_markov_head:
            self.markov_head = MARKOV_HEADS[config.markov_head_type](
                config.vocab_size, config.hidden_size, config.markov_rank
            )
        if config.enable_confidence_head:
            rank = config.markov_rank if config.confidence_head_with_markov else 0
            self.confidence_head = ConfidenceHead(config.hidden_size, rank)
        self.post_init()

    def loss_rows_bound_fn(self):
        return functools.partial(anchor_slots_bound, num_anchors=self.config.num_anchors,
                                 block_size=self.config.block_size)  # fmt: skip

    @classmethod
    def _from_target_defaults(cls, spec: TargetSpec) -> dict:
        mask = spec.pad_token_id if spec.pad_token_id is not None else spec.vocab_size - 1
        return {"mask_token_id": int(mask)}

    # -- backbone ---------------------------------------------------------------------------------------------

    def _run_layers(self, hidden, cos, sin, context_kvs, mask) -> torch.Tensor:
        for layer, context_kv in zip(self.layers, context_kvs):
            if self.gradient_checkpointing and self.training:
                hidden = self._gradient_checkpointing_func(layer.__call__, hidden, cos, sin, context_kv, mask)
            else:
                hidden = layer(hidden, cos, sin, context_kv, mask)
        return self.norm(hidden)

    def forward(
        self,
        input_ids: torch.LongTensor,
        context_features: torch.Tensor,
        loss_mask: torch.Tensor,
        target_last_hidden: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        anchor_positions: torch.LongTensor | None = None,
        anchor_mask: torch.BoolTensor | None = None,
        generator: torch.Generator | None = None,
        **kwargs,
    ) -> BlockDraftOutput:
        """Anchor-block training forward.

        input_ids [B, T]; context_features [B, T, m * d_target] (raw target layer outputs, concatenated);
        loss_mask [B, T] (1 on supervised tokens; padding must be 0); target_last_hidden [B, T, d_target]
        (optional: the target's final hidden states, for the distillation terms); attention_mask [B, T]
        (optional; padding is also excluded through loss_mask). Anchors are sampled unless given.
        """
        cfg = self.config
        K = cfg.block_size
        if attention_mask is not None:
            loss_mask = loss_mask * attention_mask
        if anchor_positions is None:
            anchor_positions, anchor_mask = sample_anchors(loss_mask, cfg.num_anchors, generator)
        elif anchor_mask is None:
            anchor_mask = torch.ones_like(anchor_positions, dtype=torch.bool)
        batch, seq = input_ids.shape
        num_anchors = anchor_positions.shape[1]
        device = input_ids.device

        context = self.project_context(context_features)  # [B, T, d]
        block_ids = torch.full((batch, num_anchors, K), cfg.mask_token_id, dtype=torch.long, device=device)
        block_ids[:, :, 0] = input_ids.gather(1, anchor_positions)
        hidden = self.embed(block_ids.flatten(1)).to(context.dtype)  # [B, N*K, d]

        ctx_cos, ctx_sin = self.rotary_emb(torch.arange(seq, device=device).expand(batch, seq), context.dtype)
        cos, sin = self.rotary_emb(block_positions(anchor_positions, K), context.dtype)
        if self._use_flex(device):
            mask = flex_block_mask(anchor_positions, seq, K)
        else:
            mask = dense_block_mask(anchor_positions, seq, K)
        context_kvs = [layer.context_kv(context, ctx_cos, ctx_sin) for layer in self.layers]
        hidden = self._run_layers(hidden, cos, sin, context_kvs, mask).view(batch, num_anchors, K, -1)

        # Slot j of anchor p: label x_{p+j+1}; previous token x_{p+j}; target state at p+j predicted the label.
        offsets = torch.arange(K, device=device)
        slot_pos = anchor_positions[:, :, None] + offsets  # [B, N, K]
        label_pos = slot_pos + 1
        in_range = label_pos < seq
        flat = lambda pos: pos.clamp(max=seq - 1).flatten(1)  # noqa: E731
        labels = input_ids.gather(1, flat(label_pos)).view_as(label_pos)
        prev_tokens = input_ids.gather(1, flat(slot_pos)).view_as(slot_pos)
        supervised = loss_mask.bool().gather(1, flat(label_pos)).view_as(label_pos)
        eval_mask = (in_range & supervised & anchor_mask[:, :, None]).long().cumprod(dim=-1).bool()

        target_hidden = None
        if target_last_hidden is not None:
            index = flat(slot_pos)[:, :, None].expand(-1, -1, target_last_hidden.shape[-1])
            target_hidden = target_last_hidden.gather(1, index).view(*slot_pos.shape, -1)

        markov_features, confidence_logits = self._heads(hidden, prev_tokens)
        return BlockDraftOutput(
            hidden_states=hidden,
            markov_features=markov_features,
            confidence_logits=confidence_logits,
            labels=labels,
            eval_mask=eval_mask,
            target_hidden_states=target_hidden,
            anchor_positions=anchor_positions,
            anchor_mask=anchor_mask,
        )

    def _heads(self, hidden: torch.Tensor, prev_tokens: torch.Tensor):
        """Teacher-forced Markov features and confidence logits for whole blocks."""
        markov_features = confidence_logits = None
        prev_embed = None
        if self.config.has_markov_head:
            prev_embed = self.markov_head.embed(prev_tokens).to(hidden.dtype)
            markov_features = self.markov_head._block_features(hidden, prev_embed)
        if self.config.enable_confidence_head:
            confidence_logits = self.confidence_head(
                hidden, prev_embed if self.config.confidence_head_with_markov else None
            )
        return markov_features, confidence_logits

    # -- inference --------------------------------------------------------------------------------------------

    def _extend(self, cache: DraftContextCache, features, counts, next_token_ids) -> None:
        context = self.project_context(features)
        positions = cache.positions(features.shape[1])
        cos, sin = self.rotary_emb(positions, context.dtype)
        for i, layer in enumerate(self.layers):
            key, value = layer.context_kv(context, cos, sin)
            cache.write(i, key, value, positions)
        cache.advance(counts, features.shape[1])

    def _propose(self, cache, anchor_ids, sampler, num_tokens, input_ids, draft_tokens, return_logits) -> DraftProposal:
        hidden = self._block_hidden(cache, anchor_ids, num_tokens)
        return self._sample_block(hidden, anchor_ids, sampler, input_ids, draft_tokens, return_logits)

    def _block_hidden(self, cache, anchor_ids, num_tokens) -> torch.Tensor:
        """The draft layers' output for the first `num_tokens` slots of a block after each anchor: [R, n, d]."""
        cfg = self.config
        K = cfg.block_size
        if num_tokens > K:
            raise ValueError(f"num_tokens must be between 1 and block_size={K}, got {num_tokens}")
        rows = anchor_ids.shape[0]
        device = anchor_ids.device
        block_ids = torch.full((rows, K), cfg.mask_token_id, dtype=torch.long, device=device)
        block_ids[:, 0] = anchor_ids
        dtype = self.fc.weight.dtype
        hidden = self.embed(block_ids).to(dtype)
        positions = cache.positions(K)
        cos, sin = self.rotary_emb(positions, dtype)
        length = cache.max_length
        mask = torch.cat(
            [cache.key_mask(length)[:, None, :].expand(rows, K, length), hidden.new_ones(rows, K, K, dtype=torch.bool)],
            dim=-1,
        ).unsqueeze(1)
        context_kvs = [cache.layer_kv(i, length) for i in range(len(self.layers))]
        return self._run_layers(hidden, cos, sin, context_kvs, mask)[:, :num_tokens]

    @torch.no_grad()
    def propose_chains(self, cache, anchor_ids, *, sampler, num_tokens: int, candidates: int) -> DraftProposal:
        """`candidates` chains of `num_tokens` drafts after each anchor, for a round verified as a tree that
        branches at the first slot (`generation.rejection.verify_candidates`). The block's layers run once; only
        the draws repeat. Sampling: the first tokens are k draws from the block's q_1 without replacement
        (`verify_candidates` accounts for it), and each chain is drawn onward from its own first token; greedy:
        the k highest-scoring first tokens, each continued greedily. tokens [R * k, n] and probs [R * k, n, V]
        (sampling; every chain's first slot holds q_1), row r's chain c at r * k + c; no confidences (confidence
        schedules do not apply to trees)."""
        if not 1 <= candidates:
            raise ValueError(f"candidates must be >= 1, got {candidates}")
        hidden = self._block_hidden(cache, anchor_ids, num_tokens)
        if candidates == 1:
            proposal = self._sample_block(hidden, anchor_ids, sampler, None, None, return_logits=False)
            proposal.confidences = proposal.confidence_logits = None
            return proposal
        # The chains share the block's layers, so their lm_head logits too: one projection for all k (only the
        # Markov bias, which reads each chain's previous token, differs between them).
        base_logits = self.base_logits(hidden)
        # The first slot's distribution does not depend on the chain either: scored and drawn from once.
        one = self._sample_block(hidden[:, :1], anchor_ids, sampler, None, None, return_logits=True,
                                 base_logits=base_logits[:, :1])  # fmt: skip
        if candidates > one.logits.shape[-1]:
            raise ValueError(f"candidates={candidates} exceeds the vocabulary ({one.logits.shape[-1]} tokens)")
        # Sampling: the distribution the slot's own draw used; greedy: top-k of the processed scores.
        first_probs = one.probs[:, 0] if sampler.do_sample else sampler.process(one.logits[:, 0])
        first_tokens = sampler.select_distinct(first_probs, candidates).reshape(-1)
        repeat = lambda t: t.repeat_interleave(candidates, dim=0)  # noqa: E731  (row r's chain c at r * k + c)
        first = (first_tokens, repeat(first_probs) if sampler.do_sample else None)
        proposal = self._sample_block(repeat(hidden), repeat(anchor_ids), sampler, None, None, return_logits=False,
                                      first=first, base_logits=repeat(base_logits))  # fmt: skip
        proposal.confidences = proposal.confidence_logits = None
        return proposal

    def _sample_block(self, hidden, anchor_ids, sampler, input_ids, draft_tokens, return_logits,
                      first=None, base_logits=None) -> DraftProposal:
        """Left-to-right sampling through the Markov head; without one (DFlash) and with processors that do not
        read the sequence (`input_ids` is None), every slot is drawn in one batched call. Logits are cast to
        float32 here only when returned: otherwise the sampler casts what it processes, and a greedy draw without
        processors argmaxes them as they are (`TokenSampler.draw`). `first` (tokens [R], probs [R, V] or None when
        greedy): the first slot's draw, made by the caller (`propose_chains`) from this slot's distribution; the
        slot is then not scored or drawn again (no logits are returned). `base_logits` [R, n, V]: lm_head(hidden),
        when the caller has it."""
        cfg = self.config
        rows, n, _ = hidden.shape
        if first is not None and return_logits:
            raise ValueError("a block with its first slot given returns no logits")
        if base_logits is None:
            base_logits = self.base_logits(hidden)  # [R, n, V], once for the whole block
        if not cfg.has_markov_head and input_ids is None:
            # Every slot at once, as the rows of one draw (after a given first slot: the later slots do not read it).
            skip = 0 if first is None else 1
            logits = self.finish_logits(base_logits[:, skip:])
            logits = logits.float() if return_logits else logits
            forced = None if draft_tokens is None else draft_tokens[:, skip:].reshape(rows * (n - skip), 1)
            if n > skip:
                probs, tokens = self._draw(sampler, logits.reshape(rows * (n - skip), -1), None, [], forced, 0)
                probs = None if probs is None else probs.view(rows, n - skip, -1)
                tokens = tokens.view(rows, n - skip)
            else:  # a one-slot block whose slot was given
                tokens = base_logits.new_zeros(rows, 0, dtype=torch.long)
                probs = None if first[1] is None else first[1].new_zeros(rows, 0, first[1].shape[-1])
            if first is not None:
                tokens = torch.cat([first[0][:, None], tokens], dim=1)
                probs = None if probs is None else torch.cat([first[1][:, None].to(probs.dtype), probs], dim=1)
            confidence_logits = self.confidence_head(hidden).float() if cfg.enable_confidence_head else None
            return self._proposal(tokens, probs, logits if return_logits else None, confidence_logits)
        prev = anchor_ids
        state = self.markov_head.init_state(hidden[:, 0]) if cfg.has_markov_head else None
        tokens, probs, logits, prev_embeds = [], [], [], []
        for k in range(n):
            h_k = hidden[:, k]
            prev_embed = z = None
            if cfg.has_markov_head:
                prev_embed = self.markov_head.embed(prev).to(h_k.dtype)
                z, state = self.markov_head.step(h_k, prev_embed, state)
                prev_embeds.append(prev_embed)
            if k == 0 and first is not None:  # drawn by the caller: only the Markov state steps through the slot
                x_k, p_k = first
                tokens.append(x_k)
                probs.append(p_k)
                prev = x_k
                continue
            step_logits = self.finish_logits(base_logits[:, k], z)
            if return_logits:  # cast once: the sampler's own cast is then a no-op, the stored logits this tensor
                step_logits = step_logits.float()
                logits.append(step_logits)
            p_k, x_k = self._draw(sampler, step_logits, input_ids, tokens, draft_tokens, k)
            tokens.append(x_k)
            probs.append(p_k)
            prev = x_k
        confidence_logits = None
        if cfg.enable_confidence_head:  # after the loop, all slots at once: no slot's draw depends on it
            with_markov = cfg.confidence_head_with_markov and prev_embeds
            prev_all = torch.stack(prev_embeds, dim=1) if with_markov else None
            confidence_logits = self.confidence_head(hidden, prev_all).float()
        return self._proposal(
            torch.stack(tokens, dim=1), stack_or_none(probs), torch.stack(logits, dim=1) if logits else None,
            confidence_logits,
        )

    def _sts_temperatures(self, device: torch.device) -> torch.Tensor | None:
        """The config's STS temperatures as a device tensor, made once (no host-to-device copy per round, which a
        captured CUDA graph could not contain)."""
        temps = self.config.confidence_temperatures
        if temps is None:
            return None
        key = (tuple(float(t) for t in temps), str(device))
        cached = getattr(self, "_sts_cache", None)
        if cached is None or cached[0] != key:
            self._sts_cache = cached = (key, torch.tensor(key[0], device=device))
        return cached[1]

    def _proposal(self, tokens, probs, logits, confidence_logits) -> DraftProposal:
        confidences = None
        if confidence_logits is not None:
            confidences = calibrated_confidence(confidence_logits, self._sts_temperatures(confidence_logits.device))
        return DraftProposal(
            tokens=tokens, probs=probs, logits=logits, confidences=confidences, confidence_logits=confidence_logits
        )


def calibrated_confidence(
    confidence_logits: torch.Tensor, temperatures: list[float] | torch.Tensor | None
) -> torch.Tensor:
    """c_k = sigmoid(logit_k / T_k) with the draft's STS temperatures (T = 1 when uncalibrated)."""
    if temperatures is not None:
        temps = torch.as_tensor(temperatures, device=confidence_logits.device)
        confidence_logits = confidence_logits / temps[: confidence_logits.shape[-1]]
    return torch.sigmoid(confidence_logits)


__all__ = ["DSparkModel", "BlockDraftOutput", "calibrated_confidence"]
