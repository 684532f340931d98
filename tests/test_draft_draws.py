"""A draft's block draw spends no kernels on what its verification never reads.

On a GPU a speculative round is bound by how many kernels it launches, not by their arithmetic, and DSpark's
Markov head draws its block slot by slot. So: a greedy draw builds no softmax (greedy verification compares
tokens only), a sampled draw skips `torch.multinomial`'s input checks (about ten kernels a call on CUDA) while
drawing exactly what multinomial draws, and each slot's vocabulary-wide logits are cast to float32 once.
"""

import pytest
import torch
from conftest import make_tiny_target
from generation_utils import OperatorCount, make_draft
from torch.utils._python_dispatch import TorchDispatchMode

from hf_dspark import TokenSampler, target_features
from hf_dspark.sampling import sample_from

ROWS, BLOCK = 16, 5


def test_sample_from_draws_what_torch_multinomial_draws():
    torch.manual_seed(0)
    for seed in range(40):
        logits = torch.randn(ROWS, 37) * 3
        logits[:, seed % 37] = float("-inf")  # zero-probability tokens are never drawn
        probs = torch.softmax(logits, dim=-1)
        ours = sample_from(probs, torch.Generator().manual_seed(seed))
        torch_draws = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed)).squeeze(-1)
        assert torch.equal(ours, torch_draws)
        assert (probs.gather(1, ours[:, None]) > 0).all()


def test_sample_without_replacement_draws_in_order_from_what_is_left():
    """The law of ordered pairs drawn without replacement: P(a, b) = p_a p_b / (1 - p_a), b != a."""
    from generation_utils import chi_square_test

    from hf_dspark.sampling import sample_without_replacement

    p = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    pairs = sample_without_replacement(p.expand(30_000, 5), 2, torch.Generator().manual_seed(0))
    law = {(a, b): float(p[a] * p[b] / (1 - p[a])) for a in range(5) for b in range(5) if a != b and p[a] * p[b] > 0}
    assert chi_square_test([tuple(r) for r in pairs.tolist()], law)[2] > 1e-4
    assert (pairs[:, 0] != pairs[:, 1]).all()
    with pytest.raises(ValueError, match="between 1 and the vocabulary"):
        sample_without_replacement(p[None], 6)


def test_rejection_step_by_hand():
    """One recursive-rejection step on numbers worked by hand: the candidate's q_i, the target's residual mass
    there, the next residual normalize((r - q_i)+), and q less the candidate; with replacement q stays whole."""
    from hf_dspark.sampling import rejection_step

    r = torch.tensor([[0.2, 0.5, 0.3, 0.0]])
    q_left = torch.tensor([[0.0, 0.3, 0.2, 0.1]])  # q = (0.4, 0.3, 0.2, 0.1) after candidate 0 was drawn
    q_x, r_x, after, rest = rejection_step(r, q_left, torch.tensor([[1]]))
    assert torch.allclose(q_x, torch.tensor([0.5])) and torch.allclose(r_x, torch.tensor([0.5]))
    # q_i = (0, 0.5, 1/3, 1/6): r - q_i = (0.2, 0, -1/30, -1/6) -> (1, 0, 0, 0)
    assert torch.allclose(after, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    assert torch.equal(rest, torch.tensor([[0.0, 0.0, 0.2, 0.1]]))
    q = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    q_x, r_x, after, rest = rejection_step(r, q, torch.tensor([[2]]), replacement=True)
    assert torch.allclose(q_x, torch.tensor([0.2])) and torch.allclose(r_x, torch.tensor([0.3]))
    assert torch.allclose(after, torch.tensor([[0.0, 0.2, 0.1, 0.0]]) / 0.3) and rest is q
    # r equal to q: nothing is left to reject into, so the residual stays r.
    assert torch.equal(rejection_step(q, q, torch.tensor([[0]]), replacement=True)[2], q)


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("llama", vocab_size=96)


def _propose(target, drafter, sampler):
    draft = make_draft(drafter, target, block_size=BLOCK).to(torch.bfloat16)
    ids = torch.randint(3, 96, (ROWS, 12), generator=torch.Generator().manual_seed(0))
    feats, _ = target_features(target, ids, draft.config.target_layer_ids)
    cache = draft.new_context_cache(ROWS)
    draft.extend_context(cache, feats[:, :-1].to(torch.bfloat16), next_token_ids=ids[:, 1:])
    ops = OperatorCount(vocab=96)
    with ops:
        proposal = draft.propose(cache, ids[:, -1], sampler=sampler)
    return proposal, ops


@pytest.mark.parametrize("drafter", ["dspark", "dflash", "eagle3"])
def test_a_greedy_draw_builds_no_distribution(target, drafter):
    proposal, ops = _propose(target, drafter, TokenSampler(do_sample=False))
    assert proposal.probs is None and ops.names["_softmax"] == 0
    # Each slot's token is the argmax of its logits (DSpark's logits: given the slot before it).
    assert torch.equal(proposal.tokens, proposal.logits.argmax(-1))
    assert ops.vocab_casts <= BLOCK  # one float cast per slot (Eagle3, DSpark) or one for the block (DFlash)


@pytest.mark.parametrize("drafter", ["dspark", "dflash", "eagle3"])
def test_a_sampled_draw_skips_multinomials_checks_and_casts_once(target, drafter):
    proposal, ops = _propose(target, drafter, TokenSampler(generator=torch.Generator().manual_seed(0)))
    assert ops.names["multinomial"] == 0 and ops.names["exponential_"] == (1 if drafter == "dflash" else BLOCK)
    assert ops.vocab_casts <= BLOCK
    # The distribution each token was drawn from is the softmax of its logits (temperature 1, no warpers).
    torch.testing.assert_close(proposal.probs, torch.softmax(proposal.logits, -1))
    assert (proposal.probs.gather(-1, proposal.tokens[..., None]) > 0).all()


def _context(target, draft, rows=4):
    ids = torch.randint(3, 96, (rows, 12), generator=torch.Generator().manual_seed(0))
    feats, _ = target_features(target, ids, draft.config.target_layer_ids)
    cache = draft.new_context_cache(rows)
    draft.extend_context(cache, feats[:, :-1], next_token_ids=ids[:, 1:])
    return cache, ids[:, -1]


@pytest.mark.parametrize("drafter", ["dspark", "dflash"])
def test_chains_share_the_first_slot_distribution_and_each_follows_its_own_first_token(target, drafter):
    """propose_chains: sampled chains start at distinct draws from the block's own q_1 (without replacement, as
    `verify_candidates` expects) and are drawn onward independently; greedy chains start at the k best first tokens and continue as a
    single proposal would from there (teacher-forced scoring of each chain gives back its tokens)."""
    draft = make_draft(drafter, target, block_size=BLOCK)
    if drafter == "dspark":
        with torch.no_grad():
            draft.markov_head.markov_w2.weight.normal_(0, 0.5)  # later slots depend on the first token
    cache, anchors = _context(target, draft)
    k = 3
    single = draft.propose(cache, anchors, sampler=TokenSampler(do_sample=False))
    greedy = draft.propose_chains(cache, anchors, sampler=TokenSampler(do_sample=False), num_tokens=BLOCK,
                                  candidates=k).tokens.view(4, k, BLOCK)  # fmt: skip
    assert torch.equal(greedy[:, :, 0], single.logits[:, 0].topk(k, dim=-1).indices)
    assert torch.equal(greedy[:, 0], single.tokens)  # the best first token's chain is the single proposal
    for c in range(k):
        forced = draft.propose(cache, anchors, sampler=TokenSampler(do_sample=False), draft_tokens=greedy[:, c])
        assert torch.equal(forced.logits[:, 1:].argmax(-1), greedy[:, c, 1:])
    torch.manual_seed(0)
    sampled = draft.propose_chains(cache, anchors, sampler=TokenSampler(), num_tokens=BLOCK, candidates=k)
    probs = sampled.probs.view(4, k, BLOCK, -1)
    torch.testing.assert_close(probs[:, :, 0], torch.softmax(single.logits[:, 0], -1)[:, None].expand_as(probs[:, :, 0]))
    tokens = sampled.tokens.view(4, k, BLOCK)
    first = tokens[:, :, 0]
    assert (first[:, :, None] != first[:, None, :]).sum() == 4 * k * (k - 1)  # k distinct first tokens a row
    assert (tokens[:, 0, 1:] != tokens[:, 1, 1:]).any()  # later slots drawn apart, not copies
    assert sampled.confidences is None


class _LmHeadProducts(TorchDispatchMode):
    """The matrix products that read a given weight: (operator, rows of the output)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.ptr, self.seen = weight.data_ptr(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name in ("mm", "bmm", "addmm", "matmul") and any(
            isinstance(a, torch.Tensor) and a.data_ptr() == self.ptr for a in args
        ):
            self.seen.append((name, out.numel() // out.shape[-1]))
        return out


@pytest.mark.parametrize("drafter", ["dspark", "dflash"])
def test_a_block_projects_the_vocabulary_once_as_one_product(target, drafter):
    """lm_head over a block's first n < K slots (a strided slice of the block) runs as one matrix product, not as a
    batched one that reads the whole weight once per row (what F.linear does with such a 3-D input); k chains
    share the block's projection (only their draws and Markov biases differ)."""
    draft = make_draft(drafter, target, block_size=BLOCK)
    cache, anchors = _context(target, draft)
    n = BLOCK - 1
    calls = {
        "propose": lambda: draft.propose(cache, anchors, sampler=TokenSampler(do_sample=False), num_tokens=n),
        "chains": lambda: draft.propose_chains(cache, anchors, sampler=TokenSampler(), num_tokens=n, candidates=3),
    }
    for name, call in calls.items():
        with _LmHeadProducts(draft.lm_head.weight) as products:
            call()
        assert products.seen == [("mm", 4 * n)], name
