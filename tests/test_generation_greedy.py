"""Greedy speculative decoding through target.generate(..., assistant_model=draft) equals target.generate()."""

import pytest
import torch
from conftest import make_tiny_target
from generation_utils import PATHS, OracleProposer, left_padded, make_draft
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import hf_dspark  # noqa: F401  (installs the generate() routing)

PROMPTS = [[5, 6, 7, 8], [3, 4, 5, 6, 7, 9], [11, 12]]


def _batch():
    return left_padded(PROMPTS)


def _target(family: str, attention: str):
    """A tiny target with the given attention implementation (the verification mask is built per implementation)."""
    target = make_tiny_target(family)
    if attention != "eager":
        target.set_attn_implementation(attention)
    return target


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("drafter", ["dspark", "dflash", "eagle3"])
def test_greedy_matches_target_generate(family, drafter, attention, path):
    """Every decoding path: both attention masks (eager additive, sdpa boolean) and the dynamic, static-draft and
    static-target paths (CUDA graphs replay the static ones on GPU; they run eagerly here)."""
    target = _target(family, attention)
    draft = make_draft(drafter, target)
    ids, mask = _batch()
    kw = dict(max_new_tokens=24, do_sample=False)
    expected = target.generate(ids, attention_mask=mask, **kw)
    out = target.generate(ids, attention_mask=mask, assistant_model=draft, **PATHS[path], **kw)
    assert torch.equal(out, expected)
    single = ids[1:2]
    assert torch.equal(
        target.generate(single, assistant_model=draft, **PATHS[path], **kw),
        target.generate(single, **kw),
    )
    stats = draft.last_generation_stats
    assert stats.acceptance.rounds > 0 and stats.tau >= 1.0


def test_sliding_window_target_is_decoded_row_by_row_and_matches():
    target = make_tiny_target("gemma3")  # sliding_window=16 < prompt + 24 new tokens
    draft = make_draft("dspark", target)
    ids, mask = _batch()
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, assistant_model=draft)
    assert torch.equal(out, expected)


@pytest.mark.parametrize(
    "family,attention,path",
    [("llama", "eager", "dynamic"), ("llama", "sdpa", "dynamic"), ("llama", "sdpa", "static"),
     ("llama", "eager", "static-target"), ("llama", "sdpa", "static-target"), ("llama", "sdpa", "fused"),
     ("gemma3", "eager", "dynamic")],
)
def test_long_accepted_blocks_with_rows_accepting_different_lengths(family, attention, path, monkeypatch):
    """Rows accept different lengths, so the verification cache gets holes; the static one fills up with them and
    compacts (moves each row's keys to the front) during the call."""
    from hf_dspark.generation import cuda_graphs
    from hf_dspark.generation.target_graphs import StaticTargetRunner

    monkeypatch.setattr(cuda_graphs, "CAPACITY_STEP", 1)  # capacity exactly as asked: the holes fill it up
    compactions = []
    compact = StaticTargetRunner._compact
    monkeypatch.setattr(StaticTargetRunner, "_compact", lambda self: (compactions.append(1), compact(self)))
    target = _target(family, attention)
    draft = make_draft("dflash", target, block_size=6)
    ids, mask = _batch()
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    OracleProposer(draft, expected, mask, corrupt=0.2)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, assistant_model=draft,
                          **PATHS[path])  # fmt: skip
    assert torch.equal(out, expected)
    stats = draft.last_generation_stats
    assert stats.tau > 2.5  # blocks were mostly accepted, and partly rejected
    assert 0 < stats.accept_rate_by_position[0] < 1
    assert bool(compactions) == (path in ("static-target", "fused"))


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("candidates", [2, 3])
@pytest.mark.parametrize("drafter", ["dspark", "dflash"])
def test_greedy_with_first_slot_candidates_matches_target_generate(drafter, candidates, attention, path, monkeypatch):
    """A tree of chains (dspark_candidates): the draft's own top-k chains, then oracle chains corrupted apart, so
    rounds accept later chains and leave the earlier ones' columns as holes in the cache; rows end at EOS."""
    from hf_dspark.generation import cuda_graphs, round_graph, speculative
    from hf_dspark.generation.target_graphs import StaticTargetRunner

    monkeypatch.setattr(cuda_graphs, "CAPACITY_STEP", 1)  # capacity exactly as asked: the holes fill it up
    verified, compacted = [], []
    for name, log in (("verify", verified), ("_compact", compacted)):
        method = getattr(StaticTargetRunner, name)
        monkeypatch.setattr(StaticTargetRunner, name, lambda self, *a, _m=method, _l=log: (_l.append(1), _m(self, *a))[1])
    target = _target("llama", attention)
    draft = make_draft(drafter, target, block_size=5)
    ids, mask = _batch()
    kw = dict(attention_mask=mask, max_new_tokens=24, do_sample=False)
    free = target.generate(ids, **kw)
    eos = int(free[1, ids.shape[1] + 9])  # a token row 1 generates mid-answer ends rows at different rounds
    expected = target.generate(ids, eos_token_id=eos, **kw)
    out = target.generate(ids, eos_token_id=eos, assistant_model=draft, dspark_candidates=candidates, **PATHS[path], **kw)
    assert torch.equal(out, expected)
    chains = []
    verify = speculative.verify_candidates
    for module in (speculative, round_graph):  # the fused round calls it from its own module
        monkeypatch.setattr(module, "verify_candidates",
                            lambda *a, **k: (lambda r: (chains.append(r.chain), r)[1])(verify(*a, **k)))  # fmt: skip
    draft = make_draft(drafter, target, block_size=5)  # (a fresh one: the static runners kept are the draft's own)
    OracleProposer(draft, free, mask, corrupt=0.5)
    out = target.generate(ids, eos_token_id=eos, assistant_model=draft, dspark_candidates=candidates, **PATHS[path], **kw)
    assert torch.equal(out, expected)
    picked = torch.cat(chains)
    assert (picked > 0).any() and (picked == 0).any() and (picked < 0).any()  # every outcome of the first slot
    stats = draft.last_generation_stats
    assert stats.acceptance.fed > stats.acceptance.rounds + stats.acceptance.proposed_total  # k chains were fed
    # The static paths verified every round over their fixed-capacity cache, compacting the chains' holes away.
    assert bool(verified) == (path == "static-target") and bool(compacted) == (path in ("static-target", "fused"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA (on CPU every path runs eagerly)")
@pytest.mark.parametrize("path", list(PATHS))
def test_first_slot_candidates_under_cuda_graphs_match_target_generate(path):
    """On a GPU the static draft runner, the static verification cache and the fused round are captured graphs:
    trees of chains replayed through them still commit the target's greedy tokens (the draft's own chains and
    oracle chains that accept long, different paths)."""
    target = _target("llama", "sdpa").cuda()
    ids, mask = (t.cuda() for t in _batch())
    kw = dict(attention_mask=mask, max_new_tokens=24, do_sample=False)
    expected = target.generate(ids, **kw)
    for oracle in (False, True):
        draft = make_draft("dspark", target, block_size=5).cuda()
        if oracle:
            OracleProposer(draft, expected.cpu(), mask.cpu(), corrupt=0.4)
        out = target.generate(ids, assistant_model=draft, dspark_candidates=3, **PATHS[path], **kw)
        assert torch.equal(out, expected), (path, oracle)
    assert draft.last_generation_stats.tau > 1.5


def test_first_slot_candidates_return_the_scores_and_logits_of_the_committed_path():
    target = make_tiny_target("qwen3")
    draft = make_draft("dspark", target, block_size=4)
    ids = torch.tensor([PROMPTS[1]])
    kwargs = dict(max_new_tokens=16, do_sample=False, return_dict_in_generate=True, output_scores=True,
                  output_logits=True)  # fmt: skip
    expected = target.generate(ids, **kwargs)
    OracleProposer(draft, expected.sequences, torch.ones_like(ids), corrupt=0.5)
    out = target.generate(ids, assistant_model=draft, dspark_candidates=3, **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    for mine, theirs in zip(out.scores + out.logits, expected.scores + expected.logits, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    assert out.speculative_stats.tau > 1.5  # the oracle's chains were accepted


@pytest.mark.parametrize("path", ["dynamic", "fused"])
def test_eos_inside_an_accepted_block_ends_the_row_there(path):
    target = make_tiny_target("llama")
    draft = make_draft("dspark", target, block_size=6)
    ids, mask = _batch()
    free = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    prompt_length = ids.shape[1]
    row, eos = _token_first_generated_mid_block(free[:, prompt_length:])  # call it EOS
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=eos)
    OracleProposer(draft, free, mask, corrupt=0.0)  # every block is accepted whole, EOS falls inside one
    out = target.generate(
        ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=eos, assistant_model=draft,
        **PATHS[path],
    )
    assert torch.equal(out, expected)
    generated = out[row, prompt_length:].tolist()
    first = generated.index(eos)
    assert first >= 2 and all(t == target.generation_config.pad_token_id for t in generated[first + 1 :])
    acc = draft.last_generation_stats.acceptance
    assert acc.committed < int(acc.hit.sum()) + acc.rounds  # some accepted tokens were cut after EOS


def _token_first_generated_mid_block(generated, block_size=6):
    """(row, token) of a token no row generates before index 2 and some row first generates at index 2..block_size:
    with every draft accepted, round 1 commits indices 1..block_size+1, so it lands inside the accepted drafts."""
    early = set(generated[:, :2].reshape(-1).tolist())
    for row in range(generated.shape[0]):
        for j in range(2, block_size + 1):
            token = int(generated[row, j])
            if token not in early and token not in generated[row, :j].tolist():
                return row, token
    raise AssertionError("no suitable token in the reference continuation")


@pytest.mark.parametrize("path", ["dynamic", "fused"])
@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 8, 13])
def test_max_new_tokens_is_exact_and_never_overshot(max_new_tokens, path):
    target = make_tiny_target("qwen3")
    draft = make_draft("eagle3", target, block_size=4)
    ids, mask = _batch()
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False)
    OracleProposer(draft, target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False), mask, 0.0)
    kwargs = dict(attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False)
    out = target.generate(ids, assistant_model=draft, **kwargs, **PATHS[path])
    assert torch.equal(out, expected)
    stats = draft.last_generation_stats
    # Verification never spends target compute on tokens past the budget: committed == verified prefix + 1.
    assert stats.acceptance.committed == stats.new_tokens - len(ids)
    assert stats.new_tokens == max_new_tokens * len(ids)
    # Each request's rounds and tokens are recorded apart (τ's interval resamples requests): the first token of
    # each comes from the prefill, the rest from rounds.
    rounds, committed = stats.acceptance.per_request()
    assert committed.tolist() == ([max_new_tokens - 1] * len(ids) if max_new_tokens > 1 else [])
    assert rounds.sum() == stats.acceptance.rounds and (rounds >= 1).all()


@pytest.mark.parametrize("static_target", [False, True], ids=["dynamic", "static-target"])
@pytest.mark.parametrize("drafter", ["dspark", "eagle3"])
def test_logits_processors_that_read_the_sequence_match(drafter, static_target):
    """Repetition penalty, n-gram bans and min length depend on each row's exact sequence and length (the draft then
    runs its dynamic path; the verification may still be static, as "auto" chooses on CUDA)."""
    target = make_tiny_target("llama")
    draft = make_draft(drafter, target, block_size=5)
    ids, mask = _batch()
    kwargs = dict(max_new_tokens=20, do_sample=False, repetition_penalty=1.5, no_repeat_ngram_size=2, min_new_tokens=6,
                  dspark_target_graphs=static_target)
    expected = target.generate(ids, attention_mask=mask, **{k: v for k, v in kwargs.items() if not k.startswith("dspark")})
    assert torch.equal(target.generate(ids, attention_mask=mask, assistant_model=draft, **kwargs), expected)
    OracleProposer(draft, expected, mask, corrupt=0.2)
    assert torch.equal(target.generate(ids, attention_mask=mask, assistant_model=draft, **kwargs), expected)
    assert draft.last_generation_stats.tau > 2


class StopAfterToken(StoppingCriteria):
    """Stops a row once `token` appears among its last `window` tokens (a criterion that reads input_ids)."""

    def __init__(self, token: int, prompt_length: int):
        self.token = token
        self.prompt_length = prompt_length

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, self.prompt_length :] == self.token).any(-1)


@pytest.mark.parametrize("path", ["dynamic", "fused"])
def test_stopping_criteria_are_checked_after_every_committed_token(path):
    target = make_tiny_target("llama")
    draft = make_draft("dspark", target, block_size=6)
    ids, mask = _batch()
    free = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    token = int(free[1, ids.shape[1] + 7])
    criteria = StoppingCriteriaList([StopAfterToken(token, ids.shape[1])])
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, stopping_criteria=criteria)
    OracleProposer(draft, free, mask, corrupt=0.0)
    out = target.generate(
        ids, attention_mask=mask, max_new_tokens=20, do_sample=False, stopping_criteria=criteria, assistant_model=draft,
        **PATHS[path],
    )
    assert torch.equal(out, expected)


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], 0

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended += 1


@pytest.mark.parametrize("path", ["dynamic", "fused"])
def test_streamer_gets_the_prompt_then_every_committed_token_once(path):
    target = make_tiny_target("llama")
    draft = make_draft("dspark", target, block_size=5)
    ids = torch.tensor([PROMPTS[1]])
    reference = target.generate(ids, max_new_tokens=18, do_sample=False)
    OracleProposer(draft, reference, torch.ones_like(ids), corrupt=0.2)
    streamer = Collect()
    out = target.generate(ids, max_new_tokens=18, do_sample=False, assistant_model=draft, streamer=streamer,
                          **PATHS[path])
    assert streamer.chunks[0] == PROMPTS[1]
    assert sum(streamer.chunks[1:], []) == out[0, ids.shape[1] :].tolist()
    assert max(len(c) for c in streamer.chunks[1:]) > 1  # whole accepted blocks arrive at once
    assert streamer.ended == 1


def test_return_dict_in_generate_keeps_the_transformers_output_and_adds_stats():
    target = make_tiny_target("qwen3")
    draft = make_draft("dspark", target)
    ids = torch.tensor([PROMPTS[0]])
    kwargs = dict(max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
    kwargs.update(output_scores=True, output_logits=True)
    expected = target.generate(ids, **kwargs)
    out = target.generate(ids, assistant_model=draft, **kwargs)
    assert type(out) is type(expected)
    assert torch.equal(out.sequences, expected.sequences)
    assert len(out.scores) == len(expected.scores) == 10
    for mine, theirs in zip(out.scores, expected.scores):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    for mine, theirs in zip(out.logits, expected.logits):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    assert out.speculative_stats is draft.last_generation_stats
    assert out_cache(out).get_seq_length() == out.sequences.shape[1] - 1 == out_cache(expected).get_seq_length()
    summary = out.speculative_stats.to_dict()
    assert summary["new_tokens"] == 10 and summary["rounds"] >= 1
    assert summary["verified_tokens"] == summary["proposed_tokens"] + summary["rounds"]
    assert summary["draft_time"] > 0 and summary["verify_time"] > 0


def out_cache(output):
    return output.cache if hasattr(output, "cache") else output.past_key_values


def test_batched_sampling_with_num_return_sequences():
    target = make_tiny_target("llama")
    draft = make_draft("eagle3", target)
    ids, mask = _batch()
    torch.manual_seed(0)
    out = target.generate(
        ids, attention_mask=mask, max_new_tokens=6, do_sample=True, num_return_sequences=2, assistant_model=draft
    )
    assert out.shape == (2 * len(PROMPTS), ids.shape[1] + 6)
    assert torch.equal(out[::2, : ids.shape[1]], ids) and torch.equal(out[1::2, : ids.shape[1]], ids)


def test_generate_without_a_draft_is_untouched():
    from transformers.generation.utils import GenerationMixin

    from hf_dspark.generation import integration

    target = make_tiny_target("llama")
    ids = torch.tensor([PROMPTS[0]])
    routed = target.generate(ids, max_new_tokens=5, do_sample=False)
    integration.uninstall()
    try:
        assert not integration.is_installed()
        plain = GenerationMixin.generate(target, ids, max_new_tokens=5, do_sample=False)
    finally:
        integration.install()
    assert integration.is_installed()
    assert torch.equal(routed, plain)


# -- the real SmolLM2-135M-Instruct ---------------------------------------------------------------------------

CHAT = ["What is the capital of France?", "Write a haiku about rain.", "List three prime numbers."]


def _chat_batch(tokenizer):
    rows = [
        tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True)
        for c in CHAT
    ]
    rows = [r["input_ids"] if hasattr(r, "keys") else r for r in rows]
    return left_padded(rows, tokenizer.pad_token_id)


@pytest.mark.real_model
@pytest.mark.slow
def test_greedy_matches_target_generate_on_smollm2(smollm2):
    target, tokenizer = smollm2
    ids, mask = _chat_batch(tokenizer)  # left-padded; the first answer ends (EOS) before the others
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False)
    draft = make_draft("dspark", target, block_size=5)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False, assistant_model=draft)
    assert torch.equal(out, expected)
    # A draft that is mostly right: long accepted blocks, rows accepting different lengths, on the real model.
    draft = make_draft("dflash", target, block_size=5)
    OracleProposer(draft, expected, mask, corrupt=0.2)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False, assistant_model=draft)
    assert torch.equal(out, expected)
    assert draft.last_generation_stats.tau > 2
    single = ids[1:2, (mask[1] == 0).sum() :]
    assert torch.equal(
        target.generate(single, max_new_tokens=10, do_sample=False, assistant_model=make_draft("eagle3", target)),
        target.generate(single, max_new_tokens=10, do_sample=False),
    )


@pytest.mark.real_model
def test_stop_strings_cut_an_accepted_block_on_smollm2(smollm2):
    target, tokenizer = smollm2
    ids, mask = _chat_batch(tokenizer)
    single = ids[:1, (mask[0] == 0).sum() :]  # "What is the capital of France?" -> "The capital of France is Paris."
    free = target.generate(single, max_new_tokens=10, do_sample=False)
    kwargs = dict(max_new_tokens=10, do_sample=False, stop_strings=["capital"], tokenizer=tokenizer)
    expected = target.generate(single, **kwargs)
    draft = make_draft("dspark", target, block_size=4)
    OracleProposer(draft, free, torch.ones_like(single), corrupt=0.0)
    out = target.generate(single, assistant_model=draft, **kwargs)
    assert torch.equal(out, expected)
    assert tokenizer.decode(out[0, single.shape[1] :]).endswith("capital")
    assert draft.last_generation_stats.accept_rate_by_position[0] == 1.0  # the block was accepted, then cut


@pytest.mark.parametrize("path", ["static", "static-target", "fused"])
def test_static_buffers_are_reused_across_calls_without_carrying_state(path):
    """The static draft's, the static verification's and the fused round's buffers (and on CUDA their graphs)
    serve later calls of the same shape; each call starts from its own prompt only."""
    from hf_dspark.generation import draft_graphs, round_graph, target_graphs

    registry, owner = {
        "static": (draft_graphs._RUNNERS, "draft"),
        "static-target": (target_graphs._RUNNERS, "target"),
        "fused": (round_graph._RUNNERS, "draft"),
    }[path]
    target = _target("llama", "sdpa")
    draft = make_draft("dspark", target)
    held = lambda: registry[target if owner == "target" else draft][1]  # noqa: E731
    ids, mask = _batch()
    kw = dict(max_new_tokens=12, do_sample=False)
    static = dict(assistant_model=draft, **PATHS[path], **kw)
    first = target.generate(ids, attention_mask=mask, **static)
    runner = held()
    other = torch.tensor([[9, 8, 7, 6, 5, 4], [1, 2, 3, 4, 5, 6], [7, 7, 7, 7, 7, 7]])
    assert torch.equal(target.generate(other, **static), target.generate(other, **kw))
    assert held() is runner  # same shape: reused
    assert torch.equal(target.generate(ids, attention_mask=mask, **static), first)
    assert torch.equal(first, target.generate(ids, attention_mask=mask, **kw))
    target.generate(ids[:1], attention_mask=mask[:1], **static)  # another batch size: new buffers
    assert held() is not runner


def test_compiled_draft_functions_decode_like_the_uncompiled_ones():
    """dspark_compile_draft: the static draft path's proposal and extension through torch.compile give the
    target's greedy output, and sampled output identical to the uncompiled draft's under the same seed (the draws
    stay the same ATen calls on the same generator); it needs the static draft path."""
    from torch._dynamo.utils import counters

    target = _target("llama", "sdpa")
    draft = make_draft("dspark", target)
    ids, mask = _batch()
    greedy = dict(assistant_model=draft, dspark_draft_graphs=True, max_new_tokens=12, do_sample=False)
    counters.clear()
    out = target.generate(ids, attention_mask=mask, dspark_compile_draft=True, **greedy)
    assert torch.equal(out, target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False))
    assert counters["frames"]["ok"] >= 1  # it did compile
    sampled = dict(greedy, do_sample=True, top_k=20)
    torch.manual_seed(3)
    plain = target.generate(ids, attention_mask=mask, **sampled)
    torch.manual_seed(3)
    assert torch.equal(target.generate(ids, attention_mask=mask, dspark_compile_draft=True, **sampled), plain)
    from hf_dspark.generation.draft_graphs import _RUNNERS

    assert _RUNNERS[draft][1].compiled  # the compiled functions ran: no fallback to the plain ones
    with pytest.raises(ValueError, match="dspark_compile_draft=True compiles the static draft path"):
        target.generate(ids, attention_mask=mask, assistant_model=draft, dspark_draft_graphs=False,
                        dspark_compile_draft=True, max_new_tokens=4)  # fmt: skip


def test_compiled_draft_functions_inside_the_fused_round():
    """dspark_compile_draft with dspark_fused_round: the round calls the draft's compiled proposal and extension;
    greedy output equals the target's, and sampled output equals the uncompiled fused round's under one seed."""
    from hf_dspark.generation.round_graph import _RUNNERS

    target = _target("llama", "sdpa")
    draft = make_draft("dspark", target)
    ids, mask = _batch()
    fused = dict(assistant_model=draft, dspark_target_graphs=True, dspark_fused_round=True, max_new_tokens=12)
    out = target.generate(ids, attention_mask=mask, dspark_compile_draft=True, do_sample=False, **fused)
    assert torch.equal(out, target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False))
    runner = _RUNNERS[draft][1].draft_runner  # the round called its compiled functions, with no fallback
    assert runner.compiled and runner._propose_fn is not runner._run_propose
    sampled = dict(fused, do_sample=True, top_k=20)
    torch.manual_seed(5)
    plain = target.generate(ids, attention_mask=mask, **sampled)
    torch.manual_seed(5)
    assert torch.equal(target.generate(ids, attention_mask=mask, dspark_compile_draft=True, **sampled), plain)


@pytest.mark.parametrize("candidates", [1, 2])
def test_compiled_verification_inside_the_fused_round(candidates):
    """dspark_compile_verify: the fused round's verification and commit through torch.compile (few fused kernels
    instead of a chain of small ones); greedy output equals the target's, sampled output equals the uncompiled
    round's under one seed (the draws stay eager's on the same generator), for a chain and for a tree."""
    from torch._dynamo.utils import counters

    from hf_dspark.generation.round_graph import _RUNNERS

    target = _target("llama", "sdpa")
    draft = make_draft("dspark", target)
    ids, mask = _batch()
    fused = dict(assistant_model=draft, dspark_target_graphs=True, dspark_fused_round=True, max_new_tokens=12,
                 dspark_candidates=candidates)  # fmt: skip
    counters.clear()
    out = target.generate(ids, attention_mask=mask, dspark_compile_verify=True, do_sample=False, **fused)
    assert torch.equal(out, target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False))
    runner = _RUNNERS[draft][1]  # the round called the compiled function, with no fallback
    assert runner.compiled and runner._verify_fn is not runner._verify_plain and counters["frames"]["ok"] >= 1
    sampled = dict(fused, do_sample=True, top_k=20)
    torch.manual_seed(5)
    plain = target.generate(ids, attention_mask=mask, **sampled)
    torch.manual_seed(5)
    assert torch.equal(target.generate(ids, attention_mask=mask, dspark_compile_verify=True, **sampled), plain)
    with pytest.raises(ValueError, match="dspark_compile_verify=True compiles the fused round's verification"):
        target.generate(ids, attention_mask=mask, assistant_model=draft, dspark_fused_round=False,
                        dspark_compile_verify=True, max_new_tokens=4)  # fmt: skip


def test_compile_defaults_to_cuda_only():
    """dspark_compile="auto" (the default) compiles only where the static path runs on CUDA: a static path forced
    on CPU stays uncompiled (nothing goes through dynamo), and a value outside True/False/"auto" names the choices;
    the same for dspark_compile_verify in a fused round."""
    from torch._dynamo.utils import counters

    target = _target("llama", "sdpa")
    draft = make_draft("dspark", target)
    ids, mask = _batch()
    kw = dict(max_new_tokens=8, do_sample=False)
    counters.clear()
    out = target.generate(ids, attention_mask=mask, assistant_model=draft, dspark_target_graphs=True, **kw)
    assert torch.equal(out, target.generate(ids, attention_mask=mask, **kw))
    assert counters["frames"]["ok"] == 0
    with pytest.raises(ValueError, match="dspark_compile must be True, False or 'auto'"):
        target.generate(ids, attention_mask=mask, assistant_model=draft, dspark_compile="yes", **kw)
    # dspark_compile_verify="auto" likewise: a fused round forced on CPU keeps its verification uncompiled.
    from hf_dspark.generation.round_graph import _RUNNERS

    fused = dict(assistant_model=draft, dspark_target_graphs=True, dspark_fused_round=True, **kw)
    assert torch.equal(target.generate(ids, attention_mask=mask, **fused), out)
    assert not _RUNNERS[draft][1].compiled and counters["frames"]["ok"] == 0
    with pytest.raises(ValueError, match="dspark_compile_verify must be True, False or 'auto'"):
        target.generate(ids, attention_mask=mask, dspark_compile_verify="yes", **fused)


def test_compiled_verify_forward_matches_and_serves_later_calls():
    """dspark_compile: the static path's verify forward through torch.compile (inductor; on CUDA it is then
    captured) is greedy-equal, alone and inside the fused round, and the kept runner's compiled function serves
    later calls without compiling again."""
    from torch._dynamo.utils import counters

    target = _target("llama", "sdpa")
    draft = make_draft("dspark", target)
    ids, mask = _batch()
    kw = dict(max_new_tokens=12, do_sample=False)
    expected = target.generate(ids, attention_mask=mask, **kw)
    compiled = dict(assistant_model=draft, dspark_target_graphs=True, dspark_compile=True, **kw)
    counters.clear()
    assert torch.equal(target.generate(ids, attention_mask=mask, **compiled), expected)
    frames = counters["frames"]["ok"]
    assert frames >= 1  # it did compile
    assert torch.equal(target.generate(ids, attention_mask=mask, dspark_fused_round=True, **compiled), expected)
    other = torch.tensor([[9, 8, 7, 6, 5, 4], [1, 2, 3, 4, 5, 6], [7, 7, 7, 7, 7, 7]])
    assert torch.equal(target.generate(other, **compiled), target.generate(other, **kw))
    assert counters["frames"]["ok"] == frames  # no recompilation for later calls of the same shape
    with pytest.raises(ValueError, match="dspark_compile=True compiles the static verification path"):
        target.generate(ids, attention_mask=mask, assistant_model=draft, dspark_compile=True, **kw)


def test_a_target_with_layers_offloaded_to_disk_decodes_as_without_the_draft(tmp_path):
    """A target too large for its device, loaded with accelerate's device_map and half its layers offloaded to disk
    (weights brought in by hooks at each layer's forward): the verification forward and the feature hooks run through
    those hooks, and greedy decoding with a draft equals the target's own, with long accepted blocks."""
    from transformers import AutoModelForCausalLM

    make_tiny_target("llama").save_pretrained(tmp_path / "target")
    layers = {f"model.layers.{i}": "cpu" if i < 3 else "disk" for i in range(6)}
    kept = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    device_map = {**kept, **layers}
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "target", device_map=device_map,
                                                  offload_folder=str(tmp_path / "offload")).eval()  # fmt: skip
    assert set(target.hf_device_map.values()) == {"cpu", "disk"}
    draft = make_draft("dspark", target)
    ids, mask = _batch()
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    OracleProposer(draft, expected, mask, corrupt=0.2)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, assistant_model=draft)
    assert torch.equal(out, expected) and draft.last_generation_stats.tau > 2.0
