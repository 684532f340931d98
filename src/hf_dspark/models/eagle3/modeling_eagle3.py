"""Eagle3 draft: one decoder layer over [embed(token); hidden], trained with training-time test (TTT).

Indexing used throughout (position t of a sequence x_0..x_{T-1}):
  step 0:  input (token x_{t+1}, g = fc(target features at t)); output o^0_t predicts x_{t+2}
  step j:  input (token x_{t+1+j}, g = o^{j-1}_t);               output o^j_t predicts x_{t+2+j}
The step-j query at t sits at RoPE position t + j and attends to step-0 entries at positions <= t and to its
own entries from steps 1..j. Step j is distilled from the target's distribution at position t+1+j.
At inference the committed positions are step-0 entries (their "next token" is known once committed; the
last one pairs with the anchor), and draft step j reuses the same rule from the last committed position.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils import ModelOutput

from ..anchors import FLEX_TILE, flex_key_length, tiles_block_mask
from ..backbone import DraftAttention, DraftMLP, DraftRMSNorm, attend
from ..context_cache import DraftContextCache
from ..modeling_draft import DraftPreTrainedModel, DraftProposal, stack_or_none
from .configuration_eagle3 import Eagle3Config


@dataclass
class Eagle3Output(ModelOutput):
    """Training-forward output (J TTT steps, B rows, T positions).

    hidden_states [J, B, T, d]: final-normed draft states per step; labels [J, B, T]; eval_mask bool [J, B, T];
    target_hidden_states [J, B, T, d_target] or None: the target's final hidden state that predicted each label.
    """

    hidden_states: torch.FloatTensor | None = None
    labels: torch.LongTensor | None = None
    eval_mask: torch.BoolTensor | None = None
    target_hidden_states: torch.FloatTensor | None = None


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: Eagle3Config, layer_idx: int = 0):
        super().__init__()
        self.config = config
        self.self_attn = DraftAttention(config, layer_idx, input_size=2 * config.hidden_size)
        self.mlp = DraftMLP(config)
        self.hidden_norm = DraftRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.input_layernorm = DraftRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DraftRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    # The layer is split around its attention, which differs between training (`ttt_attention`, or flex) and
    # decoding (a KV cache): `attention_inputs` before it, `finish` after it.
    def attention_inputs(self, embeds, hidden, cos, sin) -> tuple[torch.Tensor, ...]:
        """embeds, hidden [B, L, d] -> (query [B, H, L, hd], key, value [B, KV, L, hd], residual [B, L, d])."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.config.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        return (self.self_attn.project_q(x, cos, sin), *self.self_attn.project_kv(x, cos, sin), residual)

    def ttt_attention(self, query, keys, values, causal, step: torch.Tensor) -> torch.Tensor:
        """TTT step `step` of training, with explicit scores: a query at t attends the step-0 keys k <= t (`causal`)
        and the step-1..`step` keys at t itself. query [B, H, T, hd]; keys, values [B, KV, S * T, hd]: the S steps'
        one after another (`_ttt_steps_keys`; those after `step` are masked); causal bool [B|1, T, T]; step: a 0-d
        tensor, not an int, so that training compiles one graph for every step -> [B, T, H * hd]."""
        attn = self.self_attn
        batch, _, seq, _ = query.shape
        groups = attn.num_key_value_groups

        def heads(t):  # [B, KV, S * T, hd] -> float [B, H, S, T, hd]
            t = t.float().unflatten(2, (-1, seq))
            return t.repeat_interleave(groups, dim=1) if groups > 1 else t

        k, v = heads(keys), heads(values)
        q = query.float() * attn.scaling
        scores = torch.matmul(q, k[:, :, 0].transpose(-1, -2)).masked_fill(~causal[:, None], float("-inf"))
        own = (q.unsqueeze(2) * k[:, :, 1:]).sum(-1).transpose(-1, -2)  # [B, H, T, S - 1]: each later step's key at t
        later = torch.arange(1, k.shape[2], device=q.device) <= step
        weights = torch.softmax(torch.cat([scores, own.masked_fill(~later, float("-inf"))], dim=-1), dim=-1)
        out = torch.matmul(weights[..., :seq], v[:, :, 0])
        out = out + (weights[..., seq:].transpose(-1, -2).unsqueeze(-1) * v[:, :, 1:]).sum(2)
        return out.to(query.dtype).transpose(1, 2).reshape(batch, seq, -1)

    def finish(self, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """attn_out [B, L, H * hd], the attention's heads before o_proj -> the layer's output [B, L, d]."""
        hidden = residual + self.self_attn.o_proj(attn_out)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Model(DraftPreTrainedModel):
    config_class = Eagle3Config
    _no_split_modules = ["Eagle3DecoderLayer"]
    # Each TTT step runs these three graphs (one per padded length, every step the same shapes) and little else: the
    # training step is host-bound, and each operator left outside them is issued again at every step. The flex
    # path's attention runs instead of ttt_attention (a compiled kernel of its own).
    compiled_layer_methods = ("attention_inputs", "ttt_attention", "finish")
    extends_with_next_tokens = True  # the step-0 entry of a position embeds the token after it
    # The TTT steps through flex_attention (`ttt_block_mask`) are opt-in (block_mask_kind="flex"): they train as the
    # explicit scores do (CUDA test), in less than half the memory, but the compiled explicit path was faster at
    # SmolLM2's shapes (one H100, batch 16 x 1024: 82.5 against 115.2 ms a step; 12.1 against 5.7 GiB).
    flex_by_default = False

    def __init__(self, config: Eagle3Config):
        super().__init__(config)
        self._build_io(config, context_norm=False)
        self.layers = nn.ModuleList([Eagle3DecoderLayer(config, 0)])
        self.post_init()

    @classmethod
    def _block_size_field(cls) -> str:
        return "ttt_length"

    def loss_rows_bound_fn(self):
        return functools.partial(ttt_rows_count, steps=self.config.ttt_length)

    @property
    def layer(self) -> Eagle3DecoderLayer:
        return self.layers[0]

    # -- training ---------------------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.LongTensor,
        context_features: torch.Tensor,
        loss_mask: torch.Tensor,
        target_last_hidden: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        ttt_length: int | None = None,
        **kwargs,
    ) -> Eagle3Output:
        """TTT unroll over all positions at once. Shapes as in [`DSparkModel.forward`]."""
        steps = ttt_length or self.config.ttt_length
        batch, seq = input_ids.shape
        device = input_ids.device
        if attention_mask is not None:
            loss_mask = loss_mask * attention_mask
        attn = self.layer.self_attn
        g = self.project_context(context_features)  # [B, T, d]
        dtype = g.dtype
        positions = torch.arange(seq, device=device).expand(batch, seq)
        flex = self._use_flex(device)
        valid = attention_mask.bool() if attention_mask is not None else None
        causal = None
        if not flex:
            causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()[None]
            causal = causal & valid[:, None, :] if valid is not None else causal
        keys, values, outputs = [], [], []
        step_ids = torch.arange(steps, device=device)
        for j in range(steps):
            tokens = _shift(input_ids, 1 + j)
            cos, sin = self.rotary_emb(positions + j, dtype)
            query, key, value, residual = self.layer.attention_inputs(self.embed(tokens).to(dtype), g, cos, sin)
            keys.append(key)
            values.append(value)
            if j == 0:
                blank = torch.zeros_like(key)  # the steps not yet run, for keys and values alike
            all_keys, all_values = _ttt_steps_keys(keys, steps, blank), _ttt_steps_keys(values, steps, blank)
            if flex:
                mask = ttt_block_mask(valid, seq, steps, j, device, step_id=step_ids[j])
                out = attend(attn, query, all_keys, all_values, mask, "sdpa")
            else:
                out = self.layer.ttt_attention(query, all_keys, all_values, causal, step_ids[j])
            g = self.layer.finish(residual, out)
            outputs.append(g)

        # Labels and masks per step: step j at t predicts x_{t+2+j} from the target state at t+1+j.
        labels, masks, targets = [], [], []
        lm = loss_mask.bool()
        for j in range(steps):
            labels.append(_shift(input_ids, 2 + j))
            masks.append(_shift(lm, 2 + j, fill=False))
            if target_last_hidden is not None:
                targets.append(_shift(target_last_hidden, 1 + j))
        return Eagle3Output(
            hidden_states=self.norm(torch.stack(outputs)),  # once for all steps: fewer operators to issue
            labels=torch.stack(labels),
            eval_mask=torch.stack(masks),
            target_hidden_states=torch.stack(targets) if targets else None,
        )

    # -- inference --------------------------------------------------------------------------------------------

    def _extend(self, cache: DraftContextCache, features, counts, next_token_ids) -> None:
        if next_token_ids is None:
            raise ValueError("Eagle3 needs next_token_ids: the token that follows each committed position")
        attn = self.layer.self_attn
        g = self.project_context(features)
        dtype = g.dtype
        width = features.shape[1]
        positions, real = cache.slots(counts, width)
        cos, sin = self.rotary_emb(positions, dtype)
        query, key, value, residual = self.layer.attention_inputs(self.embed(next_token_ids).to(dtype), g, cos, sin)
        length = cache.max_length
        old_k, old_v = cache.layer_kv(0, length)
        causal = torch.ones(width, width, dtype=torch.bool, device=g.device).tril()
        mask = torch.cat(
            [
                cache.key_mask(length)[:, None, :].expand(-1, width, -1),
                causal[None] & real[:, None, :],
            ],
            dim=-1,
        ).unsqueeze(1)
        out = attend(attn, query, torch.cat([old_k, key], 2), torch.cat([old_v, value], 2), mask, _impl(self))
        out = self.layer.finish(residual, out)
        last = (counts - 1).clamp(min=0)
        new_last = out[torch.arange(out.shape[0], device=out.device), last]
        previous = cache.state.get("last_hidden")
        if previous is not None:
            # In place: a captured propose/extend graph keeps reading this very tensor.
            previous.copy_(torch.where((counts > 0)[:, None], new_last, previous))
        else:
            cache.state["last_hidden"] = new_last
        cache.write(0, key, value, positions)
        cache.advance(counts, width)

    def _propose(self, cache, anchor_ids, sampler, num_tokens, input_ids, draft_tokens, return_logits) -> DraftProposal:
        if "last_hidden" not in cache.state:
            raise RuntimeError("extend_context must run (with the prompt's features) before propose")
        attn = self.layer.self_attn
        hidden = cache.state["last_hidden"]  # o^0 at the last committed position
        rows = hidden.shape[0]
        dtype = hidden.dtype
        length = cache.max_length
        ctx_k, ctx_v = cache.layer_kv(0, length)
        ctx_mask = cache.key_mask(length)
        base = cache.lengths - 1
        draft_k, draft_v = [], []
        tokens, probs, logits = [], [], []
        for j in range(num_tokens):
            if j > 0:
                cos, sin = self.rotary_emb((base + j)[:, None], dtype)
                embeds = self.embed(tokens[-1]).to(dtype)[:, None]
                query, key, value, residual = self.layer.attention_inputs(embeds, hidden[:, None], cos, sin)
                draft_k.append(key)
                draft_v.append(value)
                mask = torch.cat([ctx_mask, ctx_mask.new_ones(rows, j)], dim=-1)[:, None, None, :]
                out = attend(
                    attn,
                    query,
                    torch.cat([ctx_k, *draft_k], 2),
                    torch.cat([ctx_v, *draft_v], 2),
                    mask,
                    _impl(self),
                )
                hidden = self.layer.finish(residual, out)[:, 0]
            step_logits = self.draft_logits(self.norm(hidden))
            if return_logits:  # cast once, and only when returned (see DSpark's block draw)
                step_logits = step_logits.float()
                logits.append(step_logits)
            p_j, x_j = self._draw(sampler, step_logits, input_ids, tokens, draft_tokens, j)
            tokens.append(x_j)
            probs.append(p_j)
        return DraftProposal(
            tokens=torch.stack(tokens, dim=1),
            probs=stack_or_none(probs),
            logits=torch.stack(logits, dim=1) if logits else None,
        )


def _impl(model: nn.Module) -> str:
    return model.config._attn_implementation or "sdpa"


def ttt_rows_count(loss_mask: torch.Tensor, steps: int) -> int:
    """How many loss rows a batch's training step has (step j supervises the loss-mask positions from 2 + j on,
    as `forward` shifts them): `loss_rows_bound_fn`, exact for Eagle3."""
    lm = loss_mask.bool()
    return sum(int(lm[:, 2 + j :].sum()) for j in range(steps))


def _shift(x: torch.Tensor, k: int, fill=0) -> torch.Tensor:
    """out[:, t] = x[:, t + k] (dim 1), `fill` past the end."""
    out = torch.full_like(x, fill)
    if k < x.shape[1]:
        out[:, : x.shape[1] - k] = x[:, k:]
    return out


def _ttt_steps_keys(keys: list[torch.Tensor], total_steps: int, blank: torch.Tensor) -> torch.Tensor:
    """The keys (or values) of the TTT steps run so far, [B, KV, T, hd] each, as every step reads them: the
    `total_steps` steps' one after another along the sequence, [B, KV, total_steps * T, hd], `blank` (zeros of that
    shape) for the steps not yet run (masked out), so that every step has the same shapes."""
    return torch.cat([*keys, *[blank] * (total_steps - len(keys))], dim=2)


def ttt_block_mask(key_valid, seq: int, total_steps: int, step: int, device: torch.device, step_id: torch.Tensor):
    """The flex BlockMask of TTT step `step`: query t sees step-0 keys k <= t (where key_valid) and its own position's
    key of steps 1..step; keys are `total_steps` blocks of `seq` (later steps' blocks masked out). step_id: `step` as
    a 0-d tensor on `device` (the training forward makes them once), not a constant: one compiled kernel for every
    step."""
    kv_len = flex_key_length(total_steps * seq, device)

    def mask_mod(b, h, q_idx, kv_idx):
        block = kv_idx // seq
        k = kv_idx - block * seq
        causal = (block == 0) & (k <= q_idx)
        if key_valid is not None:
            causal = causal & key_valid[b, k]
        return causal | ((block > 0) & (block <= step_id) & (k == q_idx))

    partial, full = ttt_tiles(key_valid, seq, step, kv_len, device)
    return tiles_block_mask(partial, full, mask_mod, seq, kv_len)


def ttt_tiles(key_valid, seq: int, step: int, kv_len: int, device: torch.device):
    """(partial, full) tile maps [B, 1, Q tiles, KV tiles] of `ttt_block_mask`'s rule, from per-tile bounds: the
    causal step-0 tiles (full where every key is before every query and valid) and, for steps 1..step, the tiles
    that hold a query's own-position key (partial)."""
    tile = FLEX_TILE
    q0 = torch.arange(-(-seq // tile), device=device) * tile
    q1 = (q0 + tile).clamp(max=seq)
    k0 = torch.arange(-(-kv_len // tile), device=device) * tile
    k1 = (k0 + tile).clamp(max=kv_len)
    whole = ((q1 - q0) == tile)[:, None] & ((k1 - k0) == tile)[None, :]
    full = (whole & (k1[None, :] <= seq) & (k1[None, :] - 1 <= q0[:, None]))[None]  # every key before every query
    # Step-0 keys k in [k0, min(k1, seq, q1)): some (valid) key at or before some query of the tile. [B, QT, KT]
    hi0 = torch.minimum(k1.clamp(max=seq)[None, :], q1[:, None])
    lo0 = k0.clamp(max=seq)[None, :].expand_as(hi0)
    live = (lo0 < hi0)[None]
    if key_valid is not None:  # valid keys in [a, b) of a row: counts[b] - counts[a]
        counts = torch.nn.functional.pad(key_valid.long().cumsum(-1), (1, 0))  # [B, T + 1]
        at = lambda x: counts.gather(1, x.reshape(1, -1).expand(counts.shape[0], -1)).view(-1, *x.shape)  # noqa: E731
        live = live & (at(hi0) > at(lo0))
        ks0, ks1 = k0.clamp(max=seq), k1.clamp(max=seq)
        full = full & ((at(ks1) - at(ks0)) == (ks1 - ks0))[:, None, :]  # ... and every key valid in this row
    for block in range(1, step + 1):  # the keys of block `block` inside each tile, as positions
        lo, hi = (x.clamp(block * seq, (block + 1) * seq) - block * seq for x in (k0, k1))
        overlap = torch.maximum(lo[None, :], q0[:, None]) < torch.minimum(hi[None, :], q1[:, None])
        live = live | ((lo < hi)[None, :] & overlap)
    partial = live & ~full
    return partial.unsqueeze(1), full.unsqueeze(1)


__all__ = ["Eagle3Model", "Eagle3Output", "Eagle3DecoderLayer", "ttt_block_mask"]
