"""The fused round (round_graph.py) spends no operators on what nothing reads, and still decodes the same tokens.

At batch 16 on a GPU a round is bound by kernel launches, so its bookkeeping is trimmed: masks are built once, the
draft's context grows by per-row counts (its committed positions are a prefix: no left-packing), the cache's write
positions are computed once for all layers, the proposal builds no logits, and a greedy round without processors
argmaxes the target's logits as they are (no float32 copy). These tests pin the savings, and compare the round
with a plain reference (the round as written before) token for token under a seed, greedy and sampled.
"""

import pytest
import torch
from conftest import make_tiny_target
from generation_utils import PATHS, OperatorCount, left_padded, make_draft

import hf_dspark.models.modeling_draft as modeling_draft
from hf_dspark.generation import round_graph
from hf_dspark.generation.rejection import block_tokens, cut_at_stop, verify_block
from hf_dspark.sampling import apply_position_free

# Operators of one DSpark greedy round outside the target's forward (the setup below; 216 before the trimming).
DSPARK_GREEDY_OPS = 171


def _reference_round(self):
    """`FusedRoundRunner._round` as written before its operators were trimmed: float32 scores, proposal logits,
    masks rebuilt where used, the draft's context extended through `valid` (left-packed)."""
    n, slot, running = self.n, self.slot, self.running
    runner, target = self.draft_runner, self.target_runner
    anchors = self.tokens.gather(1, (self.last_prompt_col + self.lengths)[:, None]).squeeze(1)
    runner.anchor_ids.copy_(anchors)
    proposal = runner.draft.propose(runner.cache, runner.anchor_ids, sampler=runner.sampler, num_tokens=n)
    self._confidences = proposal.confidences
    drafts = proposal.tokens[:, :n]
    caps = (self.draft_budget - self.lengths).clamp(min=0, max=n)
    window = torch.cat([anchors[:, None], drafts], dim=1)
    target.window.copy_(window)
    target.positions.copy_(self.real[:, None] + slot)
    logits, features = target._run()
    scores = logits.float()
    if len(self.processors):
        scores = apply_position_free(self.processors, scores)
    result = verify_block(scores, drafts, proposal.probs, caps, self.do_sample)
    accepted = result.num_accepted
    new_tokens = block_tokens(window, result)
    counts = accepted + 1
    finished = torch.zeros_like(running)
    if self.eos is not None:
        counts, finished = cut_at_stop(new_tokens, counts, self.eos)
    counts = counts * running
    self.tokens.scatter_(1, self.last_prompt_col + 1 + self.lengths[:, None] + slot, new_tokens)
    self.lengths += counts
    finished = (finished | (self.lengths > self.draft_budget)) & running
    continuing = running & ~finished
    taken = accepted + 1
    keep = torch.where(continuing.any(), (taken * continuing).amax(), (taken * running).amax())
    valid = (slot[None, :] <= accepted[:, None]) & running[:, None]
    committed = (slot[None, :] < keep) & valid
    target.key_valid.scatter_(1, (target.length_t + slot)[None, :].expand_as(committed), committed)
    target.length_t += keep
    self.real += taken * running
    runner.draft.extend_context(runner.cache, features.to(runner.features.dtype), valid=valid,
                                next_token_ids=new_tokens, max_committed=self.width)  # fmt: skip
    running &= ~finished
    self.out.copy_(torch.stack([counts, finished.long(), accepted, caps, keep.expand_as(accepted)]))


SETTINGS = {"greedy": dict(do_sample=False), "t1": dict(do_sample=True, top_k=0),
            "t0.7-top_p0.9": dict(do_sample=True, temperature=0.7, top_p=0.9, top_k=0)}  # fmt: skip


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("drafter", ["dspark", "dflash", "eagle3"])
def test_the_fused_round_decodes_what_the_reference_round_decodes(drafter, setting, monkeypatch):
    """bf16 target and draft, vocabulary 8 with peaked distributions: blocks are accepted in part and whole, EOS
    cuts rows mid-block, and the same seed must give the same tokens bit for bit."""
    target = make_tiny_target("qwen2", vocab_size=8, num_layers=2)
    with torch.no_grad():
        target.lm_head.weight.mul_(12.0)
    target = target.to(torch.bfloat16)
    draft = make_draft(drafter, target).to(torch.bfloat16)
    ids, mask = left_padded([[1, 5, 3], [4, 6], [3, 3, 7, 5], [6], [5, 4, 1], [7, 7]] * 2)
    kw = dict(attention_mask=mask, assistant_model=draft, max_new_tokens=16, **SETTINGS[setting], **PATHS["fused"])
    torch.manual_seed(0)
    out = target.generate(ids, **kw)
    stats = draft.last_generation_stats
    assert stats.fused_round and 0 < stats.accept_rate_by_position[0] < 1
    assert (out[:, ids.shape[1]:] == 2).any()  # some row stopped at EOS
    monkeypatch.setattr(round_graph.FusedRoundRunner, "_round", _reference_round)
    torch.manual_seed(0)
    assert torch.equal(target.generate(ids, **kw), out)


def _round_operators(drafter: str, sampling: dict, monkeypatch) -> OperatorCount:
    """The operators of the second fused round of a bf16 call (4 rows, blocks of 4)."""
    target = make_tiny_target("llama", attn_implementation="sdpa").to(torch.bfloat16)
    draft = make_draft(drafter, target).to(torch.bfloat16)
    ops = OperatorCount(target.config.vocab_size)
    rounds = []
    plain = round_graph.FusedRoundRunner._round

    def counted(self):
        rounds.append(self)
        if len(rounds) != 2:
            return plain(self)
        forward = self.target_runner._run

        def target_forward():
            ops.paused = True
            try:
                return forward()
            finally:
                ops.paused = False

        self.target_runner._run = target_forward
        try:
            with ops:
                plain(self)
        finally:
            self.target_runner._run = forward

    monkeypatch.setattr(round_graph.FusedRoundRunner, "_round", counted)
    packed = []
    pack_left = modeling_draft.pack_left
    monkeypatch.setattr(modeling_draft, "pack_left", lambda *a: packed.append(len(rounds)) or pack_left(*a))
    ids = torch.randint(3, 96, (4, 6), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    target.generate(ids, assistant_model=draft, max_new_tokens=12, **sampling, **PATHS["fused"])
    assert len(rounds) >= 2 and set(packed) == {0}  # only the prompt's extension packs (the prefill)
    return ops


@pytest.mark.parametrize("drafter", ["dspark", "dflash", "eagle3"])
def test_a_greedy_round_casts_no_vocabulary_wide_tensor_and_packs_nothing(drafter, monkeypatch):
    ops = _round_operators(drafter, dict(do_sample=False), monkeypatch)
    # Neither the target's logits (argmax needs no float32) nor the draft's (no caller reads proposal logits).
    assert ops.vocab_casts == 0
    # No left-packing (its sort) and one scatter per cache buffer for the context's writes (no index_put).
    assert ops.names["sort"] == 0 and ops.names["index_put_"] == 0
    if drafter == "dspark":
        assert sum(ops.names.values()) <= DSPARK_GREEDY_OPS + 3, ops.names


def test_a_sampled_round_casts_each_vocabulary_wide_tensor_once(monkeypatch):
    """Temperature 1, no processors: the draft's draws cast their slots' logits (4), verification the target's."""
    ops = _round_operators("dspark", dict(do_sample=True, top_k=0), monkeypatch)
    assert ops.vocab_casts == 4 + 1 and ops.names["sort"] == 0


def test_cut_at_stop_matches_its_definition():
    generator = torch.Generator().manual_seed(0)
    stop_ids = torch.tensor([2, 3])
    for _ in range(200):
        tokens = torch.randint(0, 6, (8, 5), generator=generator)
        counts = torch.randint(0, 6, (8,), generator=generator)
        cut, stopped = cut_at_stop(tokens, counts, stop_ids)
        for row, count in enumerate(counts.tolist()):
            first = next((k for k in range(count) if tokens[row, k] in (2, 3)), None)
            assert bool(stopped[row]) == (first is not None)
            assert int(cut[row]) == (count if first is None else first + 1)
