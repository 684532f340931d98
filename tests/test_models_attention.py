"""The anchor-block attention rule and the training/inference agreement of every drafter."""

import pytest
import torch

from hf_dspark import DFlashModel, DSparkModel, Eagle3Model, TokenSampler, target_features
from hf_dspark.models.anchors import dense_block_mask, sample_anchors

from conftest import make_tiny_target

BLOCK = 4


def trained_looking(draft):
    """Random draft weights away from the init (the Markov bias starts at zero)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return draft.eval()


@pytest.fixture(scope="module")
def qwen3():
    return make_tiny_target("qwen3")


def block_draft(cls, target, **kw):
    return trained_looking(cls.from_target(target, num_hidden_layers=2, block_size=BLOCK, **kw))


def inputs(target, layer_ids, seq=24, batch=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, target.config.vocab_size, (batch, seq), generator=g)
    feats, last = target_features(target, ids, layer_ids)
    return ids, feats, last


@pytest.mark.parametrize("cls", [DSparkModel, DFlashModel], ids=lambda c: c.__name__)
def test_block_sees_only_context_before_its_anchor_and_its_own_slots(cls, qwen3):
    draft = block_draft(cls, qwen3)
    ids, feats, last = inputs(qwen3, draft.config.target_layer_ids)
    anchors = torch.tensor([[6, 12, 17]])
    lm = torch.ones_like(ids)
    ref = draft(ids, feats, lm, anchor_positions=anchors).hidden_states[0, 1]  # block anchored at 12

    def block_after(ids2, feats2):
        return draft(ids2, feats2, lm, anchor_positions=anchors).hidden_states[0, 1]

    # Context at or after the anchor: no effect.
    f = feats.clone()
    f[:, 12:] += torch.randn_like(f[:, 12:])
    torch.testing.assert_close(block_after(ids, f), ref)
    # Another block's slots (its anchor token): no effect.
    i2 = ids.clone()
    i2[0, 6] = (i2[0, 6] + 1) % 96
    i2[0, 17] = (i2[0, 17] + 1) % 96
    torch.testing.assert_close(block_after(i2, feats), ref)
    # Context strictly before the anchor: changes the block.
    f = feats.clone()
    f[:, 11] += 1.0
    assert not torch.allclose(block_after(ids, f), ref)
    f = feats.clone()
    f[:, 0] += 1.0
    assert not torch.allclose(block_after(ids, f), ref)
    # Its own anchor token changes it (slots see each other bidirectionally).
    i3 = ids.clone()
    i3[0, 12] = (i3[0, 12] + 1) % 96
    assert not torch.allclose(block_after(i3, feats), ref)


def test_eagle3_step_outputs_are_causal(qwen3):
    draft = trained_looking(Eagle3Model.from_target(qwen3, block_size=3))
    ids, feats, last = inputs(qwen3, draft.config.target_layer_ids)
    lm = torch.ones_like(ids)
    ref = draft(ids, feats, lm).hidden_states[:, 0, 10]  # all steps at position 10
    f = feats.clone()
    f[:, 11:] += torch.randn_like(f[:, 11:])
    i2 = ids.clone()
    i2[0, 11 + 3 :] = 3  # tokens beyond what steps 0..2 at t=10 read (x_{t+1..t+3})
    torch.testing.assert_close(draft(i2, f, lm).hidden_states[:, 0, 10], ref)
    f = feats.clone()
    f[:, 10] += 1.0
    assert not torch.allclose(draft(ids, f, lm).hidden_states[:, 0, 10], ref)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("cls", [DSparkModel, DFlashModel], ids=lambda c: c.__name__)
def test_training_logits_equal_incremental_inference(cls, family):
    """For a given anchor, the training forward and the cached inference path give the same logits."""
    target = make_tiny_target(family)
    draft = block_draft(cls, target)
    ids, feats, last = inputs(target, draft.config.target_layer_ids, batch=2, seed=3)
    anchors = torch.tensor([[9, 3], [14, 5]])
    train = draft(ids, feats, torch.ones_like(ids), target_last_hidden=last, anchor_positions=anchors)
    train_logits = draft.draft_logits(train.hidden_states[:, 0], train.markov_features[:, 0]
                                      if train.markov_features is not None else None)

    # Inference: ragged requests (context lengths 9 and 14), context added in two increments.
    cache = draft.new_context_cache(2, capacity=4)  # forces the cache to grow
    valid = torch.zeros(2, 6, dtype=torch.bool)
    valid[0, :4], valid[1, :6] = True, True
    draft.extend_context(cache, feats[:, :6], valid)
    second = torch.zeros(2, 8, dtype=torch.bool)
    second[0, :5], second[1, :8] = True, True
    rest = torch.stack([feats[0, 4:12], feats[1, 6:14]])
    draft.extend_context(cache, rest, second)
    assert cache.lengths.tolist() == [9, 14]
    forced = torch.stack([ids[0, 10:10 + BLOCK], ids[1, 15:15 + BLOCK]])
    prop = draft.propose(cache, torch.stack([ids[0, 9], ids[1, 14]]), draft_tokens=forced)
    torch.testing.assert_close(prop.logits, train_logits.float(), rtol=1e-4, atol=1e-4)
    if train.confidence_logits is not None:
        torch.testing.assert_close(prop.confidence_logits, train.confidence_logits[:, 0].float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(prop.tokens, forced)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_eagle3_training_steps_equal_incremental_inference(family):
    target = make_tiny_target(family)
    draft = trained_looking(Eagle3Model.from_target(target, block_size=4))
    ids, feats, last = inputs(target, draft.config.target_layer_ids, batch=2, seed=5)
    train = draft(ids, feats, torch.ones_like(ids), target_last_hidden=last)
    anchors = [9, 13]
    cache = draft.new_context_cache(2)
    valid = torch.zeros(2, 13, dtype=torch.bool)
    for r, p in enumerate(anchors):
        valid[r, :p] = True
    # Position t pairs with the token after it: x_{t+1}; the last committed position pairs with the anchor.
    draft.extend_context(cache, feats[:, :13], valid, next_token_ids=ids[:, 1:14])
    forced = torch.stack([ids[r, p + 1 : p + 5] for r, p in enumerate(anchors)])
    prop = draft.propose(cache, torch.tensor([ids[0, 9], ids[1, 13]]), draft_tokens=forced)
    for r, p in enumerate(anchors):
        expected = draft.draft_logits(train.hidden_states[:, r, p - 1])  # steps 0..3 at t = p - 1
        torch.testing.assert_close(prop.logits[r], expected.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_markov_heads_agree_between_teacher_forcing_and_sampling(head, qwen3):
    draft = block_draft(DSparkModel, qwen3, markov_head_type=head, markov_rank=8)
    ids, feats, last = inputs(qwen3, draft.config.target_layer_ids)
    train = draft(ids, feats, torch.ones_like(ids), anchor_positions=torch.tensor([[10]]))
    cache = draft.new_context_cache(1)
    draft.extend_context(cache, feats[:, :10])
    # Sample, then check the sampled tokens' logits against a teacher-forced forward on those tokens.
    sampler = TokenSampler(generator=torch.Generator().manual_seed(0))
    prop = draft.propose(cache, ids[:, 10], sampler=sampler)
    ids2 = ids.clone()
    ids2[0, 11 : 11 + BLOCK] = prop.tokens[0]
    forced = draft(ids2, feats, torch.ones_like(ids), anchor_positions=torch.tensor([[10]]))
    expected = draft.draft_logits(forced.hidden_states[0, 0], forced.markov_features[0, 0])
    torch.testing.assert_close(prop.logits[0], expected.float(), rtol=1e-4, atol=1e-4)
    assert train.markov_features.shape[-1] == 8
    # The distribution a token was drawn from is the softmax of its logits (temperature 1, no warpers).
    torch.testing.assert_close(prop.probs, torch.softmax(prop.logits, -1))


def test_covering_passes_hold_every_candidate_once_in_the_training_shape():
    """Held-out anchor passes: each pass has the training step's anchor count, sorted, dummies last; together they
    hold every candidate of every row exactly once, each pass spread over the whole row."""
    from hf_dspark.models.anchors import (
        anchor_candidates,
        covering_anchor_passes,
        covering_pass_count,
        fixed_anchor_count,
    )

    gen = torch.Generator().manual_seed(0)
    loss_mask = (torch.rand(5, 40, generator=gen) < 0.8).long()
    loss_mask[3] = 0  # a row without an answer
    loss_mask[4, :] = 1  # every position a candidate but the last
    cand = anchor_candidates(loss_mask)
    n = fixed_anchor_count(6, 40)
    passes = covering_anchor_passes(loss_mask, 6)
    assert len(passes) == covering_pass_count(loss_mask, 6) == -(-int(cand.sum(1).max()) // n) == 7  # 39 / 6 a pass
    seen = torch.zeros_like(cand, dtype=torch.long)
    for positions, valid in passes:
        assert positions.shape == valid.shape == (5, n)
        real = torch.where(valid, positions, torch.full_like(positions, 99))
        assert torch.equal(real, real.sort(dim=1).values)  # sorted, dummy anchors last
        assert torch.all(positions[~valid] == 0)
        seen.scatter_add_(1, positions, valid.long())
    assert torch.equal(seen, cand.long())  # every candidate once, nothing else
    first, _ = passes[0]
    assert first[4].tolist() == list(range(0, 39, 7))[:n]  # pass 0 takes every 7th candidate of a full row
    assert len(covering_anchor_passes(loss_mask, 6, passes=9)) == 9  # more passes (other processes need them)
    with pytest.raises(ValueError, match="cannot cover"):
        covering_anchor_passes(loss_mask, 6, passes=2)


def test_anchor_sampling_respects_loss_mask_and_is_sorted():
    lm = torch.zeros(3, 30, dtype=torch.long)
    lm[0, 5:25] = 1
    lm[1, 10:13] = 1  # only 2 candidates (10, 11)
    g = torch.Generator().manual_seed(0)
    pos, valid = sample_anchors(lm, num_anchors=8, generator=g)
    assert pos.shape == (3, 8)
    assert valid[0].all() and valid[1].sum() == 2 and not valid[2].any()
    assert set(pos[1][valid[1]].tolist()) == {10, 11}
    for r in range(3):
        p = pos[r][valid[r]]
        assert torch.all(p[1:] > p[:-1])
        assert torch.all(lm[r, p] == 1) and torch.all(lm[r, p + 1] == 1)


def test_dense_mask_layout():
    mask = dense_block_mask(torch.tensor([[2, 5]]), context_len=6, block_size=2)[0, 0]
    assert mask.shape == (4, 10)
    assert mask[0, :6].tolist() == [True, True, False, False, False, False]
    assert mask[2, :6].tolist() == [True] * 5 + [False]
    assert mask[0, 6:].tolist() == [True, True, False, False]
    assert mask[3, 6:].tolist() == [False, False, True, True]


@pytest.mark.slow
def test_flex_block_mask_matches_dense_mask(qwen3):
    """flex_attention (sparse BlockMask, used on CUDA) and the dense SDPA path give the same outputs.

    flex_attention also runs on CPU (compiled), which is where this test checks it."""
    draft = block_draft(DSparkModel, qwen3)
    ids, feats, last = inputs(qwen3, draft.config.target_layer_ids, batch=2, seq=40)
    anchors = torch.tensor([[3, 11, 20, 33], [0, 8, 9, 30]])
    lm = torch.ones_like(ids)
    with torch.no_grad():  # flex_attention has no CPU backward; the forward is what is compared
        draft.block_mask_kind = "dense"
        dense = draft(ids, feats, lm, anchor_positions=anchors)
        draft.block_mask_kind = "flex"
        flex = draft(ids, feats, lm, anchor_positions=anchors)
    torch.testing.assert_close(flex.hidden_states, dense.hidden_states, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(flex.confidence_logits, dense.confidence_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("padded", [None, False, True])
def test_eagle3_flex_attention_matches_the_explicit_scores(qwen3, padded):
    """Eagle3's TTT steps through flex_attention (`block_mask_kind="flex"`) give the explicit-scores path's states,
    with and without padding in the batch; flex runs on CPU too (compiled, forward only), where this test checks it."""
    draft = trained_looking(Eagle3Model.from_target(qwen3, block_size=3))
    ids, feats, last = inputs(qwen3, draft.config.target_layer_ids, batch=2, seq=150)  # keys over two 128-tiles
    lm = torch.ones_like(ids)
    am = torch.ones_like(ids)
    if padded:
        am[1, 97:] = 0
    mask = None if padded is None else am  # None: no attention mask at all (a tile map for every row at once)
    with torch.no_grad():
        draft.block_mask_kind = "dense"
        dense = draft(ids, feats, lm, attention_mask=mask)
        draft.block_mask_kind = "flex"
        flex = draft(ids, feats, lm, attention_mask=mask)
    real = am.bool()
    torch.testing.assert_close(flex.hidden_states[:, real], dense.hidden_states[:, real], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention's backward runs on CUDA")
def test_eagle3_flex_attention_trains_as_the_explicit_scores_on_cuda(qwen3):
    """On CUDA, the TTT steps' states and every parameter's gradient equal the
    explicit-scores path's, with padding in the batch."""
    draft = trained_looking(Eagle3Model.from_target(qwen3, block_size=3, head_dim=16)).float().cuda().train()
    ids, feats, last = (t.cuda() for t in inputs(qwen3, draft.config.target_layer_ids, batch=2, seq=150))
    lm, am = torch.ones_like(ids), torch.ones_like(ids)
    am[1, 97:] = 0
    results = []
    for kind in ("dense", "flex"):
        draft.block_mask_kind = kind
        out = draft(ids, feats.float(), lm, attention_mask=am)
        states = out.hidden_states[:, am.bool()]
        params = [p for p in draft.parameters() if p.requires_grad]
        # A fixed random readout: the states are RMS-normed, so a loss like their squared sum is nearly constant in
        # every parameter but the norm's weight, and its gradients are round-off that any tolerance would pass.
        readout = torch.randn(states.shape, generator=torch.Generator().manual_seed(0)).cuda()
        results.append((states.detach(), torch.autograd.grad((states * readout).sum(), params)))
    (dense, dense_grads), (flex, flex_grads) = results
    # flex may take TF32 for its fp32 products; a wrong mask is off by far more
    torch.testing.assert_close(flex, dense, rtol=1e-2, atol=1e-2)
    for got, want in zip(flex_grads, dense_grads):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3 * want.abs().max().item())


@pytest.mark.parametrize("seq,total,step", [(40, 3, 0), (40, 3, 2), (150, 4, 1), (256, 7, 6), (300, 2, 1)])
@pytest.mark.parametrize("padded", [False, True])
def test_eagle3_ttt_tiles_match_create_block_mask(seq, total, step, padded):
    """The tile map of a TTT step, built from bounds, equals create_block_mask's from the dense rule: an extra tile
    costs time, a missing or wrongly full one would change the attention."""
    from torch.nn.attention.flex_attention import create_block_mask

    from hf_dspark.models.anchors import FLEX_TILE
    from hf_dspark.models.eagle3.modeling_eagle3 import ttt_tiles

    valid = None
    if padded:
        valid = torch.ones(2, seq, dtype=torch.bool)
        valid[1, seq // 2 :] = False
    kv_len = -(-total * seq // FLEX_TILE) * FLEX_TILE
    q, kv = torch.arange(seq)[:, None], torch.arange(kv_len)[None, :]
    block, k = kv // seq, kv % seq
    rule = ((block == 0) & (k <= q)) | ((block > 0) & (block <= step) & (k == q))  # [T, KV]
    dense = rule[None].expand(2, -1, -1) & (valid[:, None, :].repeat(1, 1, total + 1)[..., :kv_len] | (block > 0)
                                           if valid is not None else True)  # fmt: skip

    def mask_mod(b, h, q_idx, kv_idx):
        return dense[b, q_idx, kv_idx]

    expected = create_block_mask(mask_mod, 2, None, seq, kv_len, device="cpu")
    partial, full = ttt_tiles(valid, seq, step, kv_len, torch.device("cpu"))
    partial, full = (t.expand(2, -1, -1, -1) for t in (partial, full))
    for tiles, num, idx in ((partial, expected.kv_num_blocks, expected.kv_indices),
                            (full, expected.full_kv_num_blocks, expected.full_kv_indices)):  # fmt: skip
        listed = torch.arange(idx.shape[-1]) < num[..., None]
        reference = torch.zeros_like(tiles).scatter_(-1, idx.long(), listed)
        assert torch.equal(tiles, reference)


def test_auto_attention_takes_flex_on_cuda_only_for_heads_its_kernel_takes(qwen3):
    """flex's GPU kernel needs head_dim >= 16: "auto" keeps narrower (tiny) drafts on the dense mask there, where
    flex would stop training with an inductor error."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    narrow = block_draft(DSparkModel, qwen3, head_dim=8)
    assert not narrow._use_flex(cuda)
    wide = block_draft(DSparkModel, qwen3, head_dim=16)
    assert wide._use_flex(cuda) and not wide._use_flex(cpu)
    narrow.block_mask_kind = "flex"  # asked for explicitly: honoured (its error is then torch's, and on the asker)
    assert narrow._use_flex(cuda)
    eagle3 = Eagle3Model.from_target(qwen3, block_size=3, head_dim=16)  # opt-in until its backward ran on a GPU
    assert not eagle3._use_flex(cuda)
    eagle3.block_mask_kind = "flex"
    assert eagle3._use_flex(cuda)


@pytest.mark.parametrize(
    "context,num_blocks,block_size",
    [(40, 4, 7), (1024, 146, 7), (300, 37, 7), (512, 20, 16), (256, 3, 200), (384, 3, 128), (130, 3, 1)],
)
def test_anchor_block_tiles_match_create_block_mask(context, num_blocks, block_size):
    """The tile map built from the anchors equals create_block_mask's from the dense rule: an extra tile would cost
    time, a missing or wrongly full one would change the attention. Random anchors, dummy anchors at 0, lengths
    off the 128 grid, blocks larger than a tile (whole tiles inside one block)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from hf_dspark.models.anchors import FLEX_TILE, anchor_block_tiles, flex_block_mask

    g = torch.Generator().manual_seed(context + num_blocks)
    rows = []
    for r in range(3):
        n_real = num_blocks - r  # row r has r dummy anchors (position 0) at its end
        real = torch.randperm(context - 1, generator=g)[:n_real].sort().values
        rows.append(torch.cat([real, torch.zeros(r, dtype=torch.long)]))
    anchors = torch.stack(rows)
    q_anchor = anchors.repeat_interleave(block_size, dim=1)
    q_len = num_blocks * block_size
    for kv_len in (context + q_len, -(-(context + q_len) // FLEX_TILE) * FLEX_TILE + FLEX_TILE):
        dense = dense_block_mask(anchors, context, block_size)  # [B, 1, Q, context + Q]
        dense = torch.nn.functional.pad(dense, (0, kv_len - dense.shape[-1]))  # padded keys: never attended

        def mask_mod(b, h, q_idx, kv_idx):
            return dense[b, 0, q_idx, kv_idx]

        expected = create_block_mask(mask_mod, anchors.shape[0], None, q_len, kv_len, device="cpu")
        partial, full = anchor_block_tiles(q_anchor, context, block_size, kv_len)
        if context >= 1024 or block_size >= FLEX_TILE:  # whole context tiles; whole tiles inside one block
            assert full.any()
        for tiles, num, idx in ((partial, expected.kv_num_blocks, expected.kv_indices),
                                (full, expected.full_kv_num_blocks, expected.full_kv_indices)):  # fmt: skip
            listed = torch.arange(idx.shape[-1]) < num[..., None]  # the first num[b, h, t] indices count
            reference = torch.zeros_like(tiles).scatter_(-1, idx.long(), listed)
            assert torch.equal(tiles, reference)
    built = flex_block_mask(anchors, context, block_size)
    assert built.seq_lengths == (q_len, -(-(context + q_len) // FLEX_TILE) * FLEX_TILE)  # CPU: keys tile-padded
    assert built.q_num_blocks is not None  # the backward's transposed map is there too


def test_flex_block_mask_falls_back_to_create_block_mask_on_an_older_api(monkeypatch, caplog):
    """A torch whose BlockMask.from_kv_blocks takes other arguments: the mask comes from create_block_mask, the
    same tiles, with a warning (training goes on, only slower to compile)."""
    from torch.nn.attention.flex_attention import BlockMask

    from hf_dspark.models.anchors import flex_block_mask

    anchors = torch.tensor([[3, 11, 20, 33], [0, 8, 9, 30]])
    expected = flex_block_mask(anchors, 40, BLOCK).to_dense()

    original, calls = BlockMask.from_kv_blocks, []

    def old_api(*args, **kwargs):  # refuses flex_block_mask's call; create_block_mask's own call goes through
        calls.append(kwargs)
        if len(calls) == 1:
            raise TypeError("from_kv_blocks() got an unexpected keyword argument 'seq_lengths'")
        return original(*args, **kwargs)

    monkeypatch.setattr(BlockMask, "from_kv_blocks", old_api)
    monkeypatch.setattr("torch.compile", lambda fn, **kw: fn)  # the fallback's tile map, without compiling it on CPU
    with caplog.at_level("WARNING"):
        mask = flex_block_mask(anchors, 40, BLOCK)
    assert len(calls) == 2 and torch.equal(mask.to_dense(), expected) and "using create_block_mask" in caplog.text


def test_flex_attention_reads_no_memory_past_the_keys():
    """The compiled CPU flex kernel over-reads a partial last key tile on some ISAs (AVX2): with NaN stored right
    after the keys, the last batch row turned NaN. The mask pads keys to whole tiles; NaN beyond must not leak."""
    from hf_dspark.models.anchors import flex_block_mask
    from hf_dspark.models.backbone import attend

    batch, heads, kv_heads, head_dim, context = 2, 4, 2, 16, 40
    anchors = torch.tensor([[3, 11, 20, 33], [0, 8, 9, 30]])
    q_len = anchors.shape[1] * BLOCK
    g = torch.Generator().manual_seed(0)

    def nan_tailed(*shape):  # a tensor followed in memory by NaN
        buf = torch.full((torch.Size(shape).numel() + 4096,), float("nan"))
        out = buf[: torch.Size(shape).numel()].view(shape)
        return out.copy_(torch.randn(shape, generator=g))

    query = nan_tailed(batch, heads, q_len, head_dim)
    key = nan_tailed(batch, kv_heads, context + q_len, head_dim)
    value = nan_tailed(batch, kv_heads, context + q_len, head_dim)
    module = torch.nn.Module()
    module.scaling, module.num_key_value_groups = head_dim**-0.5, heads // kv_heads
    with torch.no_grad():
        flex = attend(module, query, key, value, flex_block_mask(anchors, context, BLOCK), "flex")
        dense = attend(module, query, key, value, dense_block_mask(anchors, context, BLOCK), "sdpa")
    assert not flex.isnan().any()
    torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-4)


def test_flex_kernel_options_reach_every_flex_call(monkeypatch):
    """backbone.FLEX_KERNEL_OPTIONS (the production benchmark's --flex_kernel_options) is passed to flex attention,
    through the compiled wrapper and when called inside a compiled graph; None keeps torch's choice."""
    from hf_dspark.models import backbone
    from hf_dspark.models.anchors import flex_block_mask

    seen = []

    def recording(query, key, value, **kwargs):
        seen.append(kwargs["kernel_options"])
        return query  # [B, H, Lq, hd], the shape attend expects back

    monkeypatch.setattr(backbone, "_compiled_flex_attention", lambda: (recording, {}))
    monkeypatch.setattr(backbone, "flex_attention", recording)
    query = key = value = torch.zeros(1, 2, 2 * BLOCK, 8)
    mask = flex_block_mask(torch.tensor([[0, 2]]), 0, BLOCK)
    module = torch.nn.Module()
    module.scaling = 1.0
    options = {"BLOCK_M1": 32, "BLOCK_N1": 64}
    for value_set in (None, options):
        monkeypatch.setattr(backbone, "FLEX_KERNEL_OPTIONS", value_set)
        backbone.attend(module, query, key, value, mask, "flex")
        with monkeypatch.context() as m:  # inside a compiled caller (compile_draft_layers)
            m.setattr(torch.compiler, "is_compiling", lambda: True)
            backbone.attend(module, query, key, value, mask, "flex")
    assert seen == [None, None, options, options]


@pytest.mark.slow
def test_flex_path_serves_several_sequence_lengths(qwen3):
    """Training batches change length; the compiled flex kernel must keep working (and agree with dense)."""
    draft = block_draft(DSparkModel, qwen3)
    with torch.no_grad():
        for seq in (24, 40, 56):
            ids, feats, _ = inputs(qwen3, draft.config.target_layer_ids, seq=seq, seed=seq)
            anchors = torch.tensor([[2, seq // 2, seq - 3]])
            lm = torch.ones_like(ids)
            draft.block_mask_kind = "dense"
            dense = draft(ids, feats, lm, anchor_positions=anchors).hidden_states
            draft.block_mask_kind = "flex"
            flex = draft(ids, feats, lm, anchor_positions=anchors).hidden_states
            torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-4)


def test_compiled_draft_layers_trace_flex_attention_into_their_graph(qwen3):
    """compile_draft_layers compiles each layer's forward: flex attention then runs as part of that graph (no graph
    break at its own compiled wrapper and config patch) and the hidden states equal the uncompiled flex path's.
    Forward only: CPU flex attention has no backward."""
    from torch._dynamo.utils import counters

    from hf_dspark.training.compiled_layers import compiled_draft_layers

    draft = block_draft(DSparkModel, qwen3)
    draft.block_mask_kind = "flex"
    ids, feats, _ = inputs(qwen3, draft.config.target_layer_ids, seq=40, batch=2, seed=5)
    anchors = torch.tensor([[0, 8, 9, 30], [3, 4, 20, 33]])
    layers = compiled_draft_layers(draft)
    with torch.no_grad():
        eager = draft(ids, feats, torch.ones_like(ids), anchor_positions=anchors).hidden_states
        counters.clear()
        with layers:
            compiled = draft(ids, feats, torch.ones_like(ids), anchor_positions=anchors).hidden_states
        assert counters["frames"]["ok"] >= 2 and not counters["graph_break"], dict(counters["graph_break"])
        compilations = counters["frames"]["ok"]
        with layers:  # the next step: other anchors (a new block mask and mask_mod), same shapes, no recompilation
            draft(ids, feats, torch.ones_like(ids), anchor_positions=anchors.flip(0)).hidden_states
        assert counters["frames"]["ok"] == compilations
    assert not any(name in layer.__dict__ for layer in draft.layers for name in draft.compiled_layer_methods)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)


def test_compiled_draft_layers_pass_their_compile_mode_to_torch_compile(qwen3, monkeypatch):
    """`compiled_draft_layers(draft, mode=...)` compiles every layer method in that torch.compile mode (e.g.
    max-autotune-no-cudagraphs, which tunes flex attention's kernels); by default in torch's default mode."""
    from hf_dspark.training.compiled_layers import compiled_draft_layers

    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or fn)
    draft = block_draft(DSparkModel, qwen3)
    compiled_draft_layers(draft)
    compiled_draft_layers(draft, mode="max-autotune-no-cudagraphs")
    per_call = len(draft.layers) * len(draft.compiled_layer_methods)
    assert [kw["mode"] for kw in calls] == [None] * per_call + ["max-autotune-no-cudagraphs"] * per_call
    assert all(kw["dynamic"] is False for kw in calls)


def test_compiled_draft_layers_share_one_graph_in_grad_mode_and_train_as_eager(qwen3):
    """In grad mode the first layer's input (frozen embeddings) does not require grad and the second's does;
    dynamo guards on that, so without `with_input_grad` the two layers compile apart. With it, one forward graph
    serves both, and the parameters' gradients equal the eager ones."""
    from torch._dynamo.utils import counters

    from hf_dspark.training.compiled_layers import compiled_draft_layers

    draft = block_draft(DSparkModel, qwen3)
    draft.block_mask_kind = "dense"  # CPU flex attention has no backward
    ids, feats, _ = inputs(qwen3, draft.config.target_layer_ids, seq=40, batch=2, seed=7)
    anchors = torch.tensor([[0, 8, 9, 30], [3, 4, 20, 33]])

    def grads():
        draft.zero_grad(set_to_none=True)
        states = draft(ids, feats, torch.ones_like(ids), anchor_positions=anchors).hidden_states
        # a fixed random readout (the RMS-normed states' squared mean would leave most gradients near round-off)
        (states * torch.randn(states.shape, generator=torch.Generator().manual_seed(0))).sum().backward()
        return {name: p.grad.clone() for name, p in draft.named_parameters() if p.grad is not None}

    eager = grads()
    torch._dynamo.reset()
    counters.clear()
    with compiled_draft_layers(draft):
        compiled = grads()
    # One graph per compiled method (context_kv, forward), not one more for the first layer's forward.
    assert counters["stats"]["unique_graphs"] == len(draft.compiled_layer_methods), dict(counters["stats"])
    assert compiled.keys() == eager.keys() and compiled
    for name in eager:
        torch.testing.assert_close(compiled[name], eager[name], rtol=1e-4, atol=1e-5, msg=name)
