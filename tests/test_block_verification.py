"""Block verification (rejection.py) is lossless and accepts at least as much as token verification.

A toy target and draft over 3 tokens with next-token tables for every prefix of up to 3 tokens make everything
exact: the law of one round's output (accepted drafts + the next token) follows from the verifier's formulas by
enumeration, and "lossless" means that this output, continued by the target itself to a fixed length, is
distributed as the target's own continuation. `verify_block` is then sampled on many rows at once and compared
with that law (chi-square), with rows that verify fewer slots chosen from their own drafts, as a confidence
scheduler does.
"""

import itertools

import pytest
import torch
from generation_utils import chi_square_test

from hf_dspark.generation.rejection import verify_block

V, N = 3, 3  # vocabulary, draft slots per round
ROWS = 200_000
P_MIN = 1e-4


def _tables(seed, sharp=2.0):
    """Next-token distributions of a target and a draft after every prefix of length 0..N."""
    g = torch.Generator().manual_seed(seed)
    prefixes = [p for k in range(N + 1) for p in itertools.product(range(V), repeat=k)]
    target = {p: torch.softmax(sharp * torch.randn(V, generator=g, dtype=torch.float64), 0) for p in prefixes}
    draft = {p: torch.softmax(sharp * torch.randn(V, generator=g, dtype=torch.float64), 0) for p in prefixes}
    return target, draft


def _target_law(target, prefix, length):
    """P(the target continues `prefix` with each sequence of `length` tokens)."""
    law = {(): 1.0}
    for _ in range(length):
        law = {s + (x,): pr * float(target[prefix + s][x]) for s, pr in law.items() for x in range(V)}
    return law


def _round_law(target, draft, method, cap=lambda drafts: N):
    """Exact law of one round's output tuple (accepted drafts + the next token) under `method`."""
    law = {}
    for drafts in itertools.product(range(V), repeat=N):
        q_block = 1.0
        for k in range(N):
            q_block *= float(draft[drafts[:k]][drafts[k]])
        n = cap(drafts)
        p = [target[drafts[:k]] for k in range(N + 1)]
        q = [draft[drafts[:k]] for k in range(N)]
        ratio = [float(p[k][drafts[k]] / q[k][drafts[k]]) for k in range(n)]
        if method == "token":
            weight, ends = [1.0] * (n + 1), [0.0] * (n + 1)
            keep = 1.0
            for a in range(n + 1):  # P(exactly a accepted)
                ends[a] = keep * (1 - min(1.0, ratio[a])) if a < n else keep
                keep *= min(1.0, ratio[a]) if a < n else 1.0
        else:
            weight = [1.0]
            for k in range(n):
                weight.append(min(1.0, weight[-1] * ratio[k]))
            stop = [1.0]  # slot 0 always "ends"; the prefix is the last slot whose coin came up
            for k in range(1, n + 1):
                if k == n:
                    stop.append(weight[n])
                else:
                    spare = float((weight[k] * p[k] - q[k]).clamp_min(0).sum())
                    den = spare + 1 - weight[k]
                    stop.append(spare / den if den > 1e-15 else 1.0)
            ends = []
            for a in range(n + 1):
                later = 1.0
                for k in range(a + 1, n + 1):
                    later *= 1 - stop[k]
                ends.append(stop[a] * later)
        for a in range(n + 1):
            if ends[a] == 0:
                continue
            if a == n:
                nxt = p[a]
            else:
                residual = (weight[a] * p[a] - q[a]).clamp_min(0)
                nxt = residual / residual.sum()
            for y in range(V):
                key = drafts[:a] + (y,)
                law[key] = law.get(key, 0.0) + q_block * ends[a] * float(nxt[y])
    return law


def _completed(target, round_law):
    """The round's output continued by the target to N + 1 tokens."""
    out = {}
    for s, pr in round_law.items():
        for rest, pr_rest in _target_law(target, s, N + 1 - len(s)).items():
            out[s + rest] = out.get(s + rest, 0.0) + pr * pr_rest
    return out


def _stop_after_a_zero(drafts):
    """A scheduler's cut from the row's own drafts: verify up to and including the first token 0."""
    return next((k + 1 for k, x in enumerate(drafts) if x == 0), N)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("cap", [lambda d: N, _stop_after_a_zero], ids=["whole", "scheduled"])
def test_the_verifier_formulas_are_lossless(seed, method, cap):
    target, draft = _tables(seed)
    completed = _completed(target, _round_law(target, draft, method, cap))
    expected = _target_law(target, (), N + 1)
    assert completed.keys() == expected.keys()
    assert max(abs(completed[s] - expected[s]) for s in expected) < 1e-12


@pytest.mark.parametrize("seed", range(6))
def test_block_verification_accepts_at_least_as_much_as_token_verification(seed):
    target, draft = _tables(seed)
    mean = {m: sum((len(s) - 1) * pr for s, pr in _round_law(target, draft, m).items()) for m in ("token", "block")}
    assert mean["block"] >= mean["token"] - 1e-12
    if seed == 0:
        assert mean["block"] > mean["token"] + 0.01  # a strict gain where the draft over-weights some tokens


def _sample_rounds(target, draft, method, cap, seed):
    g = torch.Generator().manual_seed(seed)
    drafts = torch.zeros(ROWS, N, dtype=torch.long)
    for k in range(N):
        probs = torch.stack([draft[tuple(row[:k])] for row in drafts.tolist()]) if k else draft[()].expand(ROWS, V)
        drafts[:, k] = torch.multinomial(probs.float(), 1, generator=g).squeeze(1)
    keys = [tuple(row) for row in drafts.tolist()]
    p = torch.stack([torch.stack([target[key[:k]] for k in range(N + 1)]) for key in keys]).float()
    q = torch.stack([torch.stack([draft[key[:k]] for k in range(N)]) for key in keys]).float()
    caps = torch.tensor([cap(key) for key in keys])
    result = verify_block(torch.log(p), drafts, q, caps, do_sample=True, generator=g, method=method)
    return [key[:a] + (y,) for key, a, y in zip(keys, result.num_accepted.tolist(), result.next_tokens.tolist())]


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("cap", [lambda d: N, _stop_after_a_zero], ids=["whole", "scheduled"])
def test_verify_block_samples_the_exact_round_law(method, cap):
    target, draft = _tables(0)
    samples = _sample_rounds(target, draft, method, cap, seed=1)
    _, _, p_value = chi_square_test(samples, _round_law(target, draft, method, cap))
    assert p_value > P_MIN
    if method == "block":  # and the statistic tells the two verifiers apart
        _, _, p_wrong = chi_square_test(samples, _round_law(target, draft, "token", cap))
        assert p_wrong < P_MIN


def test_an_unknown_verification_method_is_refused():
    scores = torch.zeros(1, 2, V)
    with pytest.raises(ValueError, match="'block', 'token'"):
        drafts, probs, caps = torch.zeros(1, 1, dtype=torch.long), torch.full((1, 1, V), 1 / V), torch.ones(1).long()
        verify_block(scores, drafts, probs, caps, do_sample=True, method="tree")
