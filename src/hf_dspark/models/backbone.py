"""The draft backbone, written once for every drafter and every target family.

A draft decoder layer is a Llama/Qwen3-style pre-norm block whose attention takes queries from the draft
tokens only and keys/values from `[context; draft tokens]`: the context part comes from the target's
projected features (KV injection, DFlash/DSpark) or from earlier positions (Eagle3). Layers receive the
context keys/values precomputed, so training (context computed in the same forward) and inference (context
read from a per-request cache) run the same code.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..target import additive_mask
from .configuration_draft import DraftConfig

try:  # flex_attention exists on every torch this package supports, but keep CPU-only installs importable.
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover
    BlockMask, flex_attention = None, None


class DraftRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(dtype)


class DraftRotary(nn.Module):
    """RoPE with the target's parameters (default, linear, llama3, yarn, ... via transformers' init functions).

    The inverse frequencies are derived from the config on first use instead of living in a buffer, so models
    created on the meta device by `from_pretrained` need no special re-initialization.
    """

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.config = config
        self._inv_freq: torch.Tensor | None = None
        self._scaling = 1.0

    def _frequencies(self, device: torch.device) -> torch.Tensor:
        if self._inv_freq is None or self._inv_freq.device != device:
            rope = self.config.rope_parameters
            rope_type = rope.get("rope_type", "default")
            if rope_type == "default":
                dim = self.config.head_dim
                base = float(rope["rope_theta"])
                inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
                scaling = 1.0
            else:
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](self.config, device)
            self._inv_freq, self._scaling = inv_freq.to(device=device, dtype=torch.float32), float(scaling)
        return self._inv_freq

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`position_ids` [..., L] -> (cos, sin) [..., L, head_dim]."""
        inv_freq = self._frequencies(position_ids.device)
        freqs = position_ids[..., None].to(torch.float32) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self._scaling).to(dtype), (emb.sin() * self._scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, L, hd]; cos/sin [B, L, hd]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class DraftMLP(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        d, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, i, bias=config.mlp_bias)
        self.up_proj = nn.Linear(d, i, bias=config.mlp_bias)
        self.down_proj = nn.Linear(i, d, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def attend(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | "BlockMask" | None,
    implementation: str,
) -> torch.Tensor:
    """query [B, H, Lq, hd], key/value [B, KV, Lk, hd], mask bool [B, 1, Lq, Lk] (True = attend) or a flex
    BlockMask -> [B, Lq, H * hd]."""
    if BlockMask is not None and isinstance(mask, BlockMask):
        pad = mask.seq_lengths[1] - key.shape[2]
        if pad > 0:  # keys padded to whole tiles on CPU (see anchors.flex_block_mask); the mask hides them
            key, value = (nn.functional.pad(t, (0, 0, 0, pad)) for t in (key, value))
        if torch.compiler.is_compiling():  # inside a compiled caller (compile_draft_layers): part of its graph
            out = flex_attention(query, key, value, block_mask=mask, scale=module.scaling, enable_gqa=True,
                                 kernel_options=FLEX_KERNEL_OPTIONS)  # fmt: skip
        else:
            # Variable-length training compiles once per padded length: allow more recompiles than dynamo's
            # default of 8 (past it, flex silently falls back to an unfused, memory-hungry path), for this call.
            compiled, limits = _compiled_flex_attention()
            with torch._dynamo.config.patch(**limits):
                out = compiled(query, key, value, block_mask=mask, scale=module.scaling, enable_gqa=True,
                               kernel_options=FLEX_KERNEL_OPTIONS)  # fmt: skip
        out = out.transpose(1, 2)
    else:
        if implementation == "eager" and mask is not None:
            # transformers' eager attention adds the mask: turn "may attend" into 0 / -inf.
            mask = additive_mask(mask, query.dtype)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, ALL_ATTENTION_FUNCTIONS["sdpa"])
        out, _ = interface(module, query, key, value, mask, dropout=0.0, scaling=module.scaling, is_causal=False)
    return out.reshape(out.shape[0], out.shape[1], -1)


_FLEX = None

# Triton tile sizes for flex_attention's kernels (forward BLOCK_M / BLOCK_N; backward BLOCK_M1, BLOCK_N1, BLOCK_M2,
# BLOCK_N2; num_warps, num_stages): None keeps torch's choice for the device. A tuning knob for benchmarks
# (`train_production_shapes.py --flex_kernel_options`); kernels read it when they compile, so set it before the first
# step.
FLEX_KERNEL_OPTIONS: dict | None = None


def _compiled_flex_attention():
    """(compiled flex_attention, dynamo config overrides to call it under)."""
    global _FLEX
    if _FLEX is None:
        # Static shapes: the path validated on CPU and CUDA (CPU inductor cannot compile flex with symbolic
        # lengths). `pad_to_multiple_of` in the training arguments keeps the number of lengths small.
        config = torch._dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        _FLEX = torch.compile(flex_attention, dynamic=False), {name: max(getattr(config, name), 64)}
    return _FLEX


class DraftAttention(nn.Module):
    """Multi-head attention whose keys/values are `[context; own tokens]` (GQA, optional Qwen3 q/k norm).

    `input_size` is the width of the token stream (hidden_size, or 2 * hidden_size for Eagle3).
    """

    def __init__(self, config: DraftConfig, layer_idx: int, input_size: int | None = None):
        super().__init__()
        input_size = input_size or config.hidden_size
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = False
        bias = config.attention_bias
        self.q_proj = nn.Linear(input_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(input_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(input_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        if config.use_qk_norm:
            self.q_norm = DraftRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = DraftRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, proj: nn.Linear, heads: int) -> torch.Tensor:
        return proj(x).view(*x.shape[:-1], heads, self.head_dim).transpose(1, 2)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, L, input] -> (key, value) [B, KV, L, hd], RoPE applied to the key."""
        key = self._heads(x, self.k_proj, self.num_key_value_heads)
        if self.config.use_qk_norm:
            key = self.k_norm(key)
        value = self._heads(x, self.v_proj, self.num_key_value_heads)
        return apply_rotary(key, cos, sin), value

    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        query = self._heads(x, self.q_proj, self.num_heads)
        if self.config.use_qk_norm:
            query = self.q_norm(query)
        return apply_rotary(query, cos, sin)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_kv: tuple[torch.Tensor, torch.Tensor] | None,
        mask,
    ) -> torch.Tensor:
        """x [B, Lq, input]; context_kv ([B, KV, Lc, hd] x 2) or None; mask over keys `[context; x]`."""
        query = self.project_q(x, cos, sin)
        key, value = self.project_kv(x, cos, sin)
        if context_kv is not None:
            key = torch.cat([context_kv[0], key], dim=2)
            value = torch.cat([context_kv[1], value], dim=2)
        out = attend(self, query, key, value, mask, self.config._attn_implementation or "sdpa")
        return self.o_proj(out)


class DraftDecoderLayer(nn.Module):
    """Pre-norm decoder layer with KV injection (DFlash / DSpark draft layer)."""

    def __init__(self, config: DraftConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DraftAttention(config, layer_idx)
        self.mlp = DraftMLP(config)
        self.input_layernorm = DraftRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DraftRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def context_kv(self, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Keys/values of the injected context (the target's projected features; no layer norm, as DFlash)."""
        return self.self_attn.project_kv(context, cos, sin)

    def forward(self, hidden: torch.Tensor, cos, sin, context_kv, mask) -> torch.Tensor:
        residual = hidden
        hidden = self.self_attn(self.input_layernorm(hidden), cos, sin, context_kv, mask)
        hidden = residual + hidden
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


def check_feature_width(config: DraftConfig, features: torch.Tensor) -> None:
    expected = config.num_context_features * config.target_hidden_size
    if features.shape[-1] != expected:
        raise ValueError(
            f"context features are {features.shape[-1]} wide, but this draft expects {expected} "
            f"({config.num_context_features} target layers {config.target_layer_ids} x hidden "
            f"{config.target_hidden_size}): the features were extracted with other target layers or another target"
        )


__all__ = [
    "DraftRMSNorm",
    "DraftRotary",
    "DraftMLP",
    "DraftAttention",
    "DraftDecoderLayer",
    "apply_rotary",
    "attend",
    "softcap",
    "check_feature_width",
]
