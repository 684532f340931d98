"""DSpark's sequential (Markov) heads and its confidence head.

Every Markov head turns (backbone hidden h_k, previous token x_{k-1}) into an r-dimensional feature z_k and
adds the bias B_k = W2 z_k to the base logits. Keeping z_k (r wide) instead of B_k (vocabulary wide) lets the
loss build `lm_head(h) + W2 z` chunk by chunk over the vocabulary.

  vanilla: z_k = W1[x_{k-1}]                                            (paper eq. 5)
  gated:   z_k = sigmoid(Wg [h_k; W1[x_{k-1}]]) * W1[x_{k-1}]
  rnn:     [g, c, o] = W [s_{k-1}; W1[x_{k-1}]; h_k];  s_k = sig(g) s_{k-1} + (1 - sig(g)) tanh(c);  z_k = tanh(o)
"""

from __future__ import annotations

import torch
from torch import nn


class MarkovHead(nn.Module):
    """Vanilla first-order transition bias B(x_{k-1}, .) = W1[x_{k-1}] W2 (low rank r)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int):
        super().__init__()
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def embed(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev_tokens)

    def init_state(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return None

    def step(self, hidden: torch.Tensor, prev_embed: torch.Tensor, state):
        """One slot: hidden [..., d], prev_embed [..., r] -> (z [..., r], new state)."""
        return prev_embed, state

    def features(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced features for whole blocks: hidden [..., K, d], prev_tokens [..., K] -> z [..., K, r]."""
        prev_embed = self.embed(prev_tokens).to(hidden.dtype)
        return self._block_features(hidden, prev_embed)

    def _block_features(self, hidden: torch.Tensor, prev_embed: torch.Tensor) -> torch.Tensor:
        return prev_embed

    def bias(self, z: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(z)


class GatedMarkovHead(MarkovHead):
    """Markov bias gated by the backbone hidden state."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int):
        super().__init__(vocab_size, hidden_size, rank)
        self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def step(self, hidden, prev_embed, state):
        return self._block_features(hidden, prev_embed), state

    def _block_features(self, hidden, prev_embed):
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, prev_embed], dim=-1)))
        return gate * prev_embed


class RNNMarkovHead(MarkovHead):
    """Recurrent head: a gated state accumulates the whole in-block prefix (paper eq. 6)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int):
        super().__init__(vocab_size, hidden_size, rank)
        self.rnn_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def init_state(self, hidden):
        return hidden.new_zeros(*hidden.shape[:-1], self.rank)

    def step(self, hidden, prev_embed, state):
        gate, cand, out = self.rnn_proj(torch.cat([state, prev_embed, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1 - gate) * torch.tanh(cand)
        return torch.tanh(out), state

    def _block_features(self, hidden, prev_embed):
        state = self.init_state(hidden[..., 0, :])
        zs = []
        for k in range(hidden.shape[-2]):
            z, state = self.step(hidden[..., k, :], prev_embed[..., k, :], state)
            zs.append(z)
        return torch.stack(zs, dim=-2)


MARKOV_HEADS = {"vanilla": MarkovHead, "gated": GatedMarkovHead, "rnn": RNNMarkovHead}


class ConfidenceHead(nn.Module):
    """c_k = sigmoid(w . [h_k; W1[x_{k-1}]] + b): P(slot k accepted | slots < k accepted). Returns logits."""

    def __init__(self, hidden_size: int, markov_rank: int = 0):
        super().__init__()
        self.proj = nn.Linear(hidden_size + markov_rank, 1)

    def forward(self, hidden: torch.Tensor, prev_embed: torch.Tensor | None = None) -> torch.Tensor:
        features = hidden if prev_embed is None else torch.cat([hidden, prev_embed.to(hidden.dtype)], dim=-1)
        return self.proj(features).squeeze(-1)


__all__ = ["MarkovHead", "GatedMarkovHead", "RNNMarkovHead", "MARKOV_HEADS", "ConfidenceHead"]
