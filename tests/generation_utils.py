"""Helpers shared by the generation tests: drafts for tiny targets, an oracle proposer, exact target distributions,
a chi-square goodness-of-fit test and an operator counter."""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from hf_dspark import DFlashModel, DSparkModel, Eagle3Model
from hf_dspark.data.prompts import left_pad
from hf_dspark.models.modeling_draft import DraftProposal

DRAFTERS = {"dspark": DSparkModel, "dflash": DFlashModel, "eagle3": Eagle3Model}

# Operators that launch no work (views, allocations): left out of operator counts.
NO_WORK = {"view", "_unsafe_view", "select", "slice", "unsqueeze", "squeeze", "expand", "t", "transpose", "permute",
           "reshape", "alias", "as_strided", "detach", "empty", "empty_like", "empty_strided", "new_empty", "split",
           "chunk", "unbind", "lift_fresh", "_reshape_alias"}  # fmt: skip


class OperatorCount(TorchDispatchMode):
    """Aten operators that do work, by name, and the float casts of vocabulary-wide tensors (last dim `vocab`);
    nothing is counted while `paused` (e.g. inside the target's forward)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.names: collections.Counter = collections.Counter()
        self.vocab_casts = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name not in NO_WORK and not self.paused:
            self.names[name] += 1
            source = args[0] if args else None
            if name == "_to_copy" and isinstance(source, torch.Tensor) and source.shape[-1] == self.vocab:
                self.vocab_casts += 1
        return func(*args, **(kwargs or {}))


# generate() options of each decoding path the tests run: the dynamic one; the static draft (CUDA graphs on GPU,
# eager here); the static draft with the static verification cache (cache_implementation="static",
# target_graphs.py); whole rounds as one graph (round_graph.py).
PATHS = {
    "dynamic": {"dspark_draft_graphs": False},
    "static": {"dspark_draft_graphs": True},
    "static-target": {"dspark_draft_graphs": True, "cache_implementation": "static"},
    "fused": {"dspark_target_graphs": True, "dspark_fused_round": True},
}


def make_draft(name: str, target, block_size: int = 4, seed: int = 1, **overrides):
    """A randomly initialised draft of drafter `name` for `target` (one layer, small block)."""
    torch.manual_seed(seed)
    # block_size is Eagle3's ttt_length (from_target maps it).
    return DRAFTERS[name].from_target(target, num_hidden_layers=1, block_size=block_size, **overrides).eval()


def left_padded(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return left_pad(rows, pad)


class OracleProposer:
    """Replaces `draft.propose` with the target's own greedy continuation, corrupted at random slots.

    Rows then accept long and different numbers of tokens per round, which exercises the batched loop's cache
    holes, EOS and budget cuts inside accepted blocks. `reference` [B, P + T] is target.generate(do_sample=False)
    output for the same (left-padded) prompts; only greedy decoding may use it (no real q distributions).
    """

    def __init__(self, draft, reference: torch.Tensor, attention_mask: torch.Tensor, corrupt: float = 0.25, seed=0):
        self.draft = draft
        self.reference = reference
        self.prompt_length = attention_mask.shape[1]
        self.real_prompt = attention_mask.sum(-1)
        self.corrupt = corrupt
        self.generator = torch.Generator().manual_seed(seed)
        self.offset = 0
        self._new_cache = draft.new_context_cache
        draft.new_context_cache = self.new_context_cache
        draft.propose = self.propose
        if hasattr(draft, "propose_chains"):
            draft.propose_chains = self.propose_chains

    def new_context_cache(self, batch_size, capacity=256):
        cache = self._new_cache(batch_size, capacity)
        # Row identities survive `cache.select` (it filters tensors in `state`); row-by-row runs come in order.
        cache.state["row_ids"] = torch.arange(self.offset, self.offset + batch_size, device=cache.lengths.device)
        self.offset += batch_size
        return cache

    def propose(self, cache, anchor_ids, *, sampler=None, num_tokens=None, input_ids=None, draft_tokens=None,
                return_logits=True):
        rows = cache.state["row_ids"].cpu()  # (the reference lives on the CPU; the draft may be on a GPU)
        generated = cache.lengths.cpu() - self.real_prompt[rows] + 1  # tokens generated so far, incl. the anchor
        cols = self.prompt_length + generated[:, None] + torch.arange(num_tokens)
        cols = cols.clamp(max=self.reference.shape[1] - 1)
        tokens = self.reference[rows[:, None], cols].clone()
        vocab = self.draft.config.vocab_size
        flip = torch.rand(tokens.shape, generator=self.generator) < self.corrupt
        tokens[flip] = torch.randint(0, vocab, (int(flip.sum()),), generator=self.generator)
        tokens = tokens.to(anchor_ids.device)
        probs = torch.nn.functional.one_hot(tokens, vocab).float()
        conf = torch.full(tokens.shape, 0.9, device=tokens.device)
        return DraftProposal(tokens=tokens, probs=probs, logits=probs.log(), confidences=conf, confidence_logits=conf)

    def propose_chains(self, cache, anchor_ids, *, sampler=None, num_tokens, candidates):
        """k chains, each the reference corrupted on its own: a round's right first token is often a later chain's."""
        chains = [self.propose(cache, anchor_ids, num_tokens=num_tokens).tokens for _ in range(candidates)]
        return DraftProposal(tokens=torch.stack(chains, dim=1).reshape(-1, num_tokens), probs=None)


def processors(temperature: float = 1.0, top_p: float | None = None) -> LogitsProcessorList:
    """The warpers generate() builds for (temperature, top_p) with top_k=0, in generate()'s order."""
    lp = LogitsProcessorList()
    if temperature != 1.0:
        lp.append(TemperatureLogitsWarper(temperature))
    if top_p is not None and top_p < 1.0:
        lp.append(TopPLogitsWarper(top_p))
    return lp


@torch.no_grad()
def continuation_distribution(target, prompt: list[int], new_tokens: int, lp: LogitsProcessorList, eos: int, pad: int):
    """Exact joint distribution {(y_1..y_n): prob} of the target's sampled continuation, by enumeration.

    EOS is absorbing: after it, generate() emits pad tokens.
    """
    vocab = target.config.vocab_size
    frontier = {(): 1.0}
    for _ in range(new_tokens):
        live = [s for s in frontier if eos not in s]
        nxt = {s + (pad,): p for s, p in frontier.items() if eos in s}
        if live:
            ids = torch.tensor([list(prompt) + list(s) for s in live])
            scores = lp(ids, target(ids).logits[:, -1].float())
            probs = torch.softmax(scores, dim=-1).double()
            for i, s in enumerate(live):
                for v in range(vocab):
                    pv = float(probs[i, v])
                    if pv > 0:
                        nxt[s + (v,)] = frontier[s] * pv
        frontier = nxt
    return frontier


def chi_square_test(samples: list[tuple], expected: dict[tuple, float], min_expected: float = 5.0):
    """Pearson chi-square goodness of fit of `samples` against `expected` probabilities.

    Cells expected fewer than `min_expected` times are pooled into one bin (with any sample outside the support).
    Returns (statistic, degrees of freedom, p-value).
    """
    n = len(samples)
    counts: dict[tuple, int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    observed, predicted = [], []
    pooled_e, pooled_o = 0.0, 0
    for cell, prob in expected.items():
        e = prob * n
        if e >= min_expected:
            predicted.append(e)
            observed.append(counts.get(cell, 0))
        else:
            pooled_e += e
            pooled_o += counts.get(cell, 0)
    outside = sum(c for cell, c in counts.items() if cell not in expected)
    if outside:
        return float("inf"), len(predicted), 0.0
    if pooled_e > 0:
        predicted.append(pooled_e)
        observed.append(pooled_o)
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, predicted))
    dof = len(predicted) - 1
    p_value = float(
        torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )
    return stat, dof, p_value
