"""Sampling through a draft is lossless: continuations follow the target's own sampling distribution exactly.

A tiny target with vocabulary 8 makes the exact joint distribution of a 5-token continuation computable by
enumeration (EOS absorbing, then padding). Thousands of continuations are sampled as rows of one batched
generate() call and compared with it by a chi-square goodness-of-fit test. The same statistic rejects a
deliberately biased acceptance rule, so it has the power to catch a broken verification.
"""

import functools

import pytest
import torch
from conftest import make_tiny_target
from generation_utils import PATHS, chi_square_test, continuation_distribution, make_draft, processors

import hf_dspark.generation.speculative as speculative
from hf_dspark.generation.rejection import VerifyResult, verify_block

VOCAB, NEW_TOKENS, ROWS = 8, 5, 3000
PROMPT = [1, 5, 3]
SETTINGS = {"t1": (1.0, None), "t0.8-top_p0.95": (0.8, 0.95), "t0.5": (0.5, None)}
LOSSLESS_SETTINGS = ["t1", "t0.8-top_p0.95"]
P_MIN = 1e-4  # fixed seeds make each p-value deterministic; a correct loop sits far above this


@pytest.fixture(scope="module")
def target():
    model = make_tiny_target("qwen2", vocab_size=VOCAB, num_layers=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)  # peaked next-token distributions: acceptance varies, EOS happens
    return model


@functools.lru_cache(maxsize=None)
def _expected(setting):
    temperature, top_p = SETTINGS[setting]
    model = make_tiny_target("qwen2", vocab_size=VOCAB, num_layers=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)
    return continuation_distribution(model, PROMPT, NEW_TOKENS, processors(temperature, top_p), eos=2, pad=0)


def _sample(target, setting, draft=None, seed=0, **kwargs):
    temperature, top_p = SETTINGS[setting]
    torch.manual_seed(seed)
    out = target.generate(
        torch.tensor([PROMPT] * ROWS),
        do_sample=True,
        temperature=temperature,
        top_p=top_p,
        top_k=0,
        max_new_tokens=NEW_TOKENS,
        assistant_model=draft,
        **kwargs,
    )
    assert out.shape[1] == len(PROMPT) + NEW_TOKENS
    return [tuple(row) for row in out[:, len(PROMPT) :].tolist()]


def _draft(name, target):
    draft = make_draft(name, target, block_size=4)
    if name == "dspark":
        with torch.no_grad():  # spread the (random) confidences so schedules cut blocks at varied lengths
            draft.confidence_head.proj.weight.mul_(40.0)
            draft.markov_head.markov_w2.weight.normal_(0, 0.5)  # a live Markov head: q_k depends on x_{k-1}
    return draft


def test_the_statistic_accepts_plain_target_sampling(target):
    _, _, p_value = chi_square_test(_sample(target, "t0.8-top_p0.95"), _expected("t0.8-top_p0.95"))
    assert p_value > P_MIN


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("setting", LOSSLESS_SETTINGS)
@pytest.mark.parametrize("drafter", ["dspark", "dflash", "eagle3"])
def test_sampling_is_lossless(target, drafter, setting, path):
    """Every decoding path (PATHS)."""
    draft = _draft(drafter, target)
    samples = _sample(target, setting, draft, **PATHS[path])
    stat, dof, p_value = chi_square_test(samples, _expected(setting))
    assert p_value > P_MIN, (stat, dof)
    stats = draft.last_generation_stats
    assert 0.05 < stats.accept_rate_by_position[0] < 0.95  # both acceptance and rejection paths ran


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("setting", LOSSLESS_SETTINGS)
@pytest.mark.parametrize("candidates", [2, 3])
@pytest.mark.parametrize("drafter", ["dspark", "dflash"])
def test_sampling_with_first_slot_candidates_is_lossless(target, drafter, candidates, setting, path):
    """A tree of chains (dspark_candidates) verified by recursive rejection sampling keeps the target's law, and
    its first slot is accepted more often than a single chain's on the same prompts."""
    draft = _draft(drafter, target)
    samples = _sample(target, setting, draft, dspark_candidates=candidates, **PATHS[path])
    stat, dof, p_value = chi_square_test(samples, _expected(setting))
    assert p_value > P_MIN, (stat, dof)
    several = draft.last_generation_stats.accept_rate_by_position[0]
    _sample(target, setting, draft)
    single = draft.last_generation_stats.accept_rate_by_position[0]
    assert 0.05 < single < several < 0.99, (single, several)


@pytest.mark.parametrize("path", [p for p in PATHS if p != "fused"])  # the fused round verifies whole blocks
@pytest.mark.parametrize("setting", LOSSLESS_SETTINGS)
@pytest.mark.parametrize("schedule", ["threshold", "prefix"])
def test_sampling_is_lossless_with_confidence_scheduling(target, schedule, setting, path):
    draft = _draft("dspark", target)
    # A cost table that makes verification expensive enough to cut blocks: Algorithm 1 admits a mix of lengths.
    table = {ROWS: 1000.0, 2 * ROWS: 700.0, 4 * ROWS: 300.0}
    samples = _sample(target, setting, draft, dspark_schedule=schedule, dspark_threshold=0.5, dspark_sps_table=table,
                      **PATHS[path])  # fmt: skip
    stat, dof, p_value = chi_square_test(samples, _expected(setting))
    assert p_value > P_MIN, (stat, dof)
    acc = draft.last_generation_stats.acceptance
    full_blocks = acc.rounds * 3  # round 1 may verify 3 slots (budget), later rounds fewer
    assert 0 < acc.proposed_total < full_blocks  # the schedule cut blocks, and not to nothing


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("drafter", ["dspark", "dflash", "eagle3"])
def test_sampling_is_lossless_with_a_draft_temperature(target, drafter, path):
    """dspark_draft_temperature sharpens the proposals (after top-p here): still the target's distribution."""
    draft = _draft(drafter, target)
    samples = _sample(target, "t0.8-top_p0.95", draft, dspark_draft_temperature=0.5, **PATHS[path])
    stat, dof, p_value = chi_square_test(samples, _expected("t0.8-top_p0.95"))
    assert p_value > P_MIN, (stat, dof)


def _first_proposal_entropy(target, draft, **kwargs) -> float:
    """Mean entropy of the distributions the draft drew its first proposal from."""
    seen = []
    original = draft.propose

    def propose(*args, **kw):
        proposal = original(*args, **kw)
        seen.append(proposal.probs.float())
        return proposal

    draft.propose = propose
    try:
        torch.manual_seed(0)
        target.generate(torch.tensor([PROMPT] * 8), do_sample=True, top_k=0, max_new_tokens=3, assistant_model=draft,
                        **kwargs)  # fmt: skip
    finally:
        del draft.propose
    q = seen[0]
    return float(-(q * q.clamp_min(1e-30).log()).sum(-1).mean())


@pytest.mark.parametrize("path", list(PATHS))
def test_the_draft_temperature_reaches_the_proposals(target, path):
    """On every path, and from one call to the next: static runners kept from a call at another draft temperature
    (their captured proposal bakes the temperature in) are not reused."""
    draft = _draft("dflash", target)
    own = _first_proposal_entropy(target, draft, **PATHS[path])
    assert _first_proposal_entropy(target, draft, dspark_draft_temperature=0.5, **PATHS[path]) < 0.8 * own
    assert _first_proposal_entropy(target, draft, dspark_draft_temperature=2.0, **PATHS[path]) > 1.1 * own


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_a_draft_temperature_that_is_not_positive_is_refused(target, value):
    with pytest.raises(ValueError, match="dspark_draft_temperature must be a positive number"):
        target.generate(torch.tensor([PROMPT]), do_sample=True, max_new_tokens=2, assistant_model=_draft("dflash", target),
                        dspark_draft_temperature=value)  # fmt: skip


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("drafter", ["dspark", "eagle3"])
def test_token_verification_is_lossless_too(target, drafter, path):
    """The classic slot-by-slot rule, kept beside block verification (the default) for comparison."""
    draft = _draft(drafter, target)
    samples = _sample(target, "t0.8-top_p0.95", draft, dspark_verification="token", **PATHS[path])
    stat, dof, p_value = chi_square_test(samples, _expected("t0.8-top_p0.95"))
    assert p_value > P_MIN, (stat, dof)


@pytest.mark.parametrize("path", list(PATHS))
def test_the_verification_method_reaches_every_path(target, path, monkeypatch):
    """Call after call: a fused round kept from a call with the other method (it bakes the method in) is not
    reused."""
    from hf_dspark.generation import round_graph

    seen = []

    def recording(*args, method="block", **kwargs):
        seen.append(method)
        return verify_block(*args, method=method, **kwargs)

    monkeypatch.setattr(speculative, "verify_block", recording)
    monkeypatch.setattr(round_graph, "verify_block", recording)
    draft = _draft("dflash", target)
    for method in ("block", "token", "block"):
        seen.clear()
        torch.manual_seed(0)
        target.generate(torch.tensor([PROMPT] * 4), do_sample=True, max_new_tokens=4, assistant_model=draft,
                        dspark_verification=method, **PATHS[path])  # fmt: skip
        assert seen and set(seen) == {method}


def test_an_unknown_verification_method_is_refused(target):
    with pytest.raises(ValueError, match="dspark_verification='tree' is not one of 'block', 'token'"):
        target.generate(torch.tensor([PROMPT]), do_sample=True, max_new_tokens=2, assistant_model=_draft("dflash", target),
                        dspark_verification="tree")  # fmt: skip


def _accept_always(target_scores, draft_tokens, draft_probs, num_proposed, do_sample, generator=None, method="block"):
    honest = verify_block(target_scores, draft_tokens, draft_probs, num_proposed, do_sample, generator, method)
    return VerifyResult(num_proposed.clone(), honest.next_tokens)


@pytest.mark.parametrize("path", ["dynamic", "fused"])
@pytest.mark.parametrize("drafter", ["dspark", "eagle3"])
def test_a_biased_acceptance_rule_is_detected(target, drafter, path, monkeypatch):
    """Accepting every proposed token (no min(1, p/q) test) must fail the same statistic, on the dynamic path and
    inside the fused round."""
    from hf_dspark.generation import round_graph

    monkeypatch.setattr(speculative, "verify_block", _accept_always)
    monkeypatch.setattr(round_graph, "verify_block", _accept_always)
    draft = _draft(drafter, target)
    _, _, p_value = chi_square_test(_sample(target, "t1", draft, **PATHS[path]), _expected("t1"))
    assert p_value < 1e-8


def test_using_the_unprocessed_draft_distribution_is_detected(target):
    """Tokens drawn from the warped q but verified against softmax(raw logits): the ratio test is then biased.
    (Temperature 0.5 makes warped and raw draft distributions differ a lot, so the bias is large.)"""
    draft = _draft("dflash", target)
    original = draft.propose

    def propose(*args, **kwargs):
        proposal = original(*args, **kwargs)
        proposal.probs = torch.softmax(proposal.logits.float(), dim=-1)
        return proposal

    draft.propose = propose
    _, _, p_value = chi_square_test(_sample(target, "t0.5", draft), _expected("t0.5"))
    assert p_value < 1e-8
