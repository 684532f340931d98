"""Block verification (rejection.py) is lossless and accepts at least as much as token verification.

A toy target and draft over 3 tokens with next-token tables for every prefix of up to 3 tokens make everything
exact: the law of one round's output (accepted drafts + the next token) follows from the verifier's formulas by
enumeration, and "lossless" means that this output, continued by the target itself to a fixed length, is
distributed as the target's own continuation. `verify_block` is then sampled on many rows at once and compared
with that law (chi-square), with rows that verify fewer slots chosen from their own drafts, as a confidence
scheduler does.

The spare mass S_k (`spare_mass.py`) is checked against its PyTorch expression: on CPU through the fallback, and
through the Triton kernel on CUDA or, without CUDA, under Triton's interpreter in a child pytest process
(TRITON_INTERPRET=1 must be set before the kernel is defined and must not leak into the other tests).
"""

import itertools
import os
import subprocess
import sys

import pytest
import torch
from generation_utils import chi_square_test

from hf_dspark.generation import spare_mass as spare_module
from hf_dspark.generation.rejection import tree_attention, tree_depths, verify_block, verify_candidates
from hf_dspark.sampling import sample_without_replacement
from hf_dspark.generation.spare_mass import spare_mass, torch_spare_mass

V, N = 3, 3  # vocabulary, draft slots per round
ROWS = 200_000
P_MIN = 1e-4
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_RUNNABLE = torch.cuda.is_available() or INTERPRETED
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
kernel = pytest.mark.skipif(not KERNEL_RUNNABLE, reason="no CUDA: run by test_spare_mass_kernel_under_the_interpreter")


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


def _sample_tree_rounds(target, draft, k, method, seed, rows=30_000, wrong_first_q=False, replacement=False,
                        verify_replacement=None):
    """Rounds of `verify_candidates` with k chains drawn from the draft (first tokens without replacement, or
    independently), each round's output (committed tokens) continued by the target itself to N + 1 tokens. Caps
    vary as a token budget cuts them. `verify_replacement`: what the verifier is told (default: the truth)."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.zeros(rows, k, N, dtype=torch.long)
    if not replacement:
        drafts[:, :, 0] = sample_without_replacement(draft[()].float().expand(rows, V), k, generator=g)
    for c in range(k):
        for j in range(N):
            if j == 0 and not replacement:
                continue
            probs = torch.stack([draft[tuple(r[:j])] for r in drafts[:, c].tolist()]) if j else draft[()].expand(rows, V)
            drafts[:, c, j] = torch.multinomial(probs.float(), 1, generator=g).squeeze(1)
    chains = [[tuple(r) for r in drafts[:, c].tolist()] for c in range(k)]
    scores = torch.zeros(rows, 1 + k * N, V)
    scores[:, 0] = torch.log(target[()]).float()
    q = torch.zeros(rows, k, N, V)
    for c in range(k):
        for j in range(N):
            scores[:, 1 + c * N + j] = torch.stack([target[key[: j + 1]] for key in chains[c]]).log().float()
            q[:, c, j] = torch.stack([draft[key[:j]] for key in chains[c]]).float()
    caps = torch.randint(0, N + 1, (rows,), generator=g)
    used_q = q.clone()
    if wrong_first_q:  # a caller that hands over another first-slot distribution than the one drawn from
        used_q[:, :, 0] = target[()].float()
    told = replacement if verify_replacement is None else verify_replacement
    result = verify_candidates(scores, drafts, used_q, caps, do_sample=True, generator=g, method=method,
                               replacement=told)  # fmt: skip
    out = []
    for row, (chain, a, y) in enumerate(zip(result.chain.tolist(), result.num_accepted.tolist(),
                                            result.next_tokens.tolist())):  # fmt: skip
        seq = (chains[chain][row][:a] if chain >= 0 else ()) + (y,)
        while len(seq) < N + 1:
            seq += (int(torch.multinomial(target[seq].float(), 1, generator=g)),)
        out.append(seq)
    return out, result


@pytest.mark.parametrize("replacement", [False, True], ids=["distinct", "independent"])
@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("k", [2, 3])
def test_verify_candidates_is_lossless(k, method, replacement):
    """Recursive rejection sampling over the first slot, then the chosen chain verified: continued by the target,
    each round's output follows the target's own law; every outcome (each chain, none) occurs."""
    target, draft = _tables(0)
    samples, result = _sample_tree_rounds(target, draft, k, method, seed=k, replacement=replacement)
    _, _, p_value = chi_square_test(samples, _target_law(target, (), N + 1))
    assert p_value > P_MIN
    assert set(result.chain.tolist()) == set(range(-1, k))  # (-1 also where a row's cap is 0)
    wrong, _ = _sample_tree_rounds(target, draft, k, method, seed=k, wrong_first_q=True, replacement=replacement)
    assert chi_square_test(wrong, _target_law(target, (), N + 1))[2] < P_MIN  # the statistic sees a wrong q


def _first_slot_rounds(p, q, k, distinct: bool, told_replacement: bool, rows=40_000, seed=0):
    """One-slot chains: the committed token of each row and whether a candidate was accepted."""
    g = torch.Generator().manual_seed(seed)
    vocab = p.shape[0]
    if distinct:
        first = sample_without_replacement(q.expand(rows, vocab), k, generator=g)
    else:
        first = torch.multinomial(q.expand(rows, vocab), k, replacement=True, generator=g)
    scores = torch.zeros(rows, 1 + k, vocab)
    scores[:, 0] = p.log()
    result = verify_candidates(scores, first[:, :, None], q.expand(rows, k, 1, vocab), torch.ones(rows, dtype=torch.long),
                               True, generator=g, replacement=told_replacement)  # fmt: skip
    found = result.chain >= 0
    tokens = torch.where(found, first[torch.arange(rows), result.chain.clamp(min=0)], result.next_tokens)
    return [(t,) for t in tokens.tolist()], found.float().mean().item()


def test_distinct_first_tokens_keep_the_law_and_are_accepted_more_often():
    """A draft sure of the wrong token: independent candidates mostly repeat it (a repeat of a rejected token is
    never accepted), distinct ones try the others. Both keep p when the verifier knows how they were drawn; distinct
    draws verified as independent ones would not (the test can tell)."""
    p = torch.tensor([0.1, 0.45, 0.3, 0.15])
    q = torch.tensor([0.85, 0.05, 0.05, 0.05])
    law = {(v,): float(p[v]) for v in range(4)}
    distinct, distinct_rate = _first_slot_rounds(p, q, 2, distinct=True, told_replacement=False)
    independent, independent_rate = _first_slot_rounds(p, q, 2, distinct=False, told_replacement=True)
    assert chi_square_test(distinct, law)[2] > P_MIN and chi_square_test(independent, law)[2] > P_MIN
    assert distinct_rate > independent_rate + 0.3  # about 0.85 against 0.36 here
    wrong, _ = _first_slot_rounds(p, q, 2, distinct=True, told_replacement=True)
    assert chi_square_test(wrong, law)[2] < P_MIN
    # Fewer tokens in q's support than candidates: the candidates past it were no draw and are never accepted.
    narrow = torch.tensor([0.0, 0.0, 0.7, 0.3])
    samples, _ = _first_slot_rounds(p, narrow, 3, distinct=True, told_replacement=False, rows=20_000)
    assert chi_square_test(samples, law)[2] > P_MIN


def test_verify_candidates_greedy_takes_the_candidate_equal_to_the_argmax():
    scores = torch.full((3, 1 + 2 * 2, 4), -5.0)
    scores[:, 0, 2] = 0  # the target's first token: 2
    scores[:, 1:, 1] = 0  # after any draft: 1
    drafts = torch.tensor([[[2, 1], [3, 1]], [[0, 1], [2, 0]], [[0, 1], [3, 1]]])
    result = verify_candidates(scores, drafts, None, torch.tensor([2, 2, 2]), do_sample=False)
    assert result.chain.tolist() == [0, 1, -1]
    assert result.num_accepted.tolist() == [2, 1, 0] and result.next_tokens.tolist() == [1, 1, 2]


def test_the_tree_layout_lets_each_chain_see_the_anchor_and_itself():
    assert tree_depths(2, 3).tolist() == [0, 1, 2, 3, 1, 2, 3]
    mask = tree_attention(2, 2).int().tolist()
    assert mask == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0], [1, 0, 0, 1, 1]]


def test_an_unknown_verification_method_is_refused():
    scores = torch.zeros(1, 2, V)
    with pytest.raises(ValueError, match="'block', 'token'"):
        drafts, probs, caps = torch.zeros(1, 1, dtype=torch.long), torch.full((1, 1, V), 1 / V), torch.ones(1).long()
        verify_block(scores, drafts, probs, caps, do_sample=True, method="tree")


# -- the spare mass S_k: one fused pass on CUDA, the PyTorch expression elsewhere ---------------------------------


def _spare_inputs(rows=3, slots=4, vocab=300, seed=0, device="cpu"):
    """weight [R, K], p [R, K, V], q [R, K, V] as verify_block slices them: p a slot range of a contiguous
    [R, K+2, V] tensor, q of a [R, K+3, V] one (strided along the slots), weight a column range of [R, K+2]; the
    weights include exact 0 (a token the target never draws) and 1 (no weight lost yet)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(2 * torch.randn(rows, slots + 2, vocab, generator=g), -1)[:, 1 : slots + 1]
    q = torch.softmax(2 * torch.randn(rows, slots + 3, vocab, generator=g), -1)[:, :slots]
    weight = torch.rand(rows, slots + 2, generator=g)[:, 1 : slots + 1]
    weight[0, 0], weight[-1, -1], weight[1, :] = 0.0, 1.0, torch.tensor([1.0, 0.0] * (slots // 2) + [1.0] * (slots % 2))
    return weight.to(device), p.to(device), q.to(device)


def test_spare_mass_on_cpu_is_the_pytorch_expression_bit_for_bit():
    weight, p, q = _spare_inputs()
    assert not q.is_contiguous() and p.shape[-1] % 64
    expected = (weight[:, :, None] * p - q).clamp_min(0).sum(dim=-1)
    for backend in (None, "auto", "torch"):
        assert torch.equal(spare_mass(weight, p, q, backend=backend), expected)
    # w = 0 leaves nothing to spare; w = 1 spares the total variation distance between p and q.
    assert torch.equal(spare_mass(weight, p, q)[0, 0], torch.tensor(0.0))
    tv = (p[-1, -1] - q[-1, -1]).abs().sum() / 2
    torch.testing.assert_close(spare_mass(weight, p, q)[-1, -1], tv)


def test_spare_mass_backends_and_errors_name_the_fix(monkeypatch):
    weight, p, q = _spare_inputs()
    with pytest.raises(ValueError, match="auto, triton, torch"):
        spare_mass(weight, p, q, backend="cuda")
    if not KERNEL_RUNNABLE:
        with pytest.raises(ValueError, match="backend 'torch' or 'auto'"):
            spare_mass(weight, p, q, backend="triton")
    assert spare_module.resolve_backend(weight, p, q) == "torch"  # CPU: auto is torch, interpreted or not
    # The module default decides for callers that name no backend (verify_block; the benchmark switches it).
    monkeypatch.setattr(spare_module, "DEFAULT_BACKEND", "torch")
    assert spare_module.resolve_backend(weight.to(KERNEL_DEVICE), p.to(KERNEL_DEVICE), q.to(KERNEL_DEVICE)) == "torch"


def test_spare_mass_auto_falls_back_to_torch_when_the_kernel_fails(monkeypatch, caplog):
    """Backend "auto" always gives the sums: a kernel failure (a compiler error on a new GPU) switches to torch for
    good; "triton" raises it."""
    pytest.importorskip("triton")
    from hf_dspark.generation import triton_spare_mass

    def broken(*args, **kwargs):
        raise RuntimeError("kernel failed to compile")

    monkeypatch.setattr(spare_module, "resolve_backend", lambda w, p, q, backend: backend.replace("auto", "triton"))
    monkeypatch.setattr(triton_spare_mass, "triton_spare_mass", broken)
    monkeypatch.setattr(spare_module, "_TRITON_FAILED", False)
    weight, p, q = _spare_inputs()
    with pytest.raises(RuntimeError, match="failed to compile"):
        spare_mass(weight, p, q, backend="triton")
    assert not spare_module._TRITON_FAILED
    with caplog.at_level("WARNING"):
        got = spare_mass(weight, p, q)
    assert spare_module._TRITON_FAILED and "failed to compile" in caplog.text
    assert torch.equal(got, torch_spare_mass(weight, p, q))


def test_spare_mass_kernel_under_the_interpreter():
    if KERNEL_RUNNABLE:
        pytest.skip("the kernel cases run in this process")
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("PYTEST_XDIST")}
    cases = "spare_mass_kernel_ and not under_the_interpreter and not cuda_graph"  # the cases a kernel runs in
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-k", cases]
    proc = subprocess.run(cmd, env=env, cwd=os.path.dirname(__file__), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    last = proc.stdout.splitlines()[-1]
    assert "passed" in last and "skipped" not in last, proc.stdout[-2000:]  # every case really ran


@kernel
@pytest.mark.parametrize("splits", [1, 3, None], ids=["one_split", "three_splits", "auto_splits"])
@pytest.mark.parametrize("block_v", [64, None], ids=["block64", "default_block"])
@pytest.mark.parametrize("vocab", [1, 300, 1024])
def test_spare_mass_kernel_matches_the_pytorch_expression(vocab, block_v, splits):
    """V below, above and at a multiple of the block; the vocabulary in one range or split across programs (with
    splits past the blocks there are); q strided along the slots; weights 0, 1 and in between."""
    from hf_dspark.generation.triton_spare_mass import triton_spare_mass

    weight, p, q = _spare_inputs(vocab=vocab, device=KERNEL_DEVICE)
    kw = {"num_splits": splits} if block_v is None else {"num_splits": splits, "block_v": block_v}
    got = triton_spare_mass(weight, p, q, **kw)
    assert got.dtype == torch.float32 and got.shape == weight.shape
    torch.testing.assert_close(got, torch_spare_mass(weight, p, q), rtol=1e-5, atol=1e-6)
    assert torch.equal(got[0, 0], torch.zeros((), device=KERNEL_DEVICE))  # weight 0: exactly nothing to spare


def test_spare_mass_splits_fill_the_gpu_and_leave_none_empty(monkeypatch):
    """Few rows split the vocabulary to give every multiprocessor programs; many rows, or a small vocabulary, don't."""
    module = pytest.importorskip("hf_dspark.generation.triton_spare_mass")
    monkeypatch.setattr(module, "_multiprocessors", lambda device: 132)  # an H100's
    cuda, wanted = torch.device("cuda"), module.PROGRAMS_PER_SM * 132
    splits = module.num_splits_for(6, 151_936, cuda, block_v=1024)  # batch 1, 6 slots
    assert splits * 6 <= wanted < (splits + 1) * 6
    assert module.num_splits_for(6, 3000, cuda, block_v=1024) == 3  # never more splits than blocks
    assert module.num_splits_for(16 * 6, 151_936, cuda) == max(1, wanted // 96)  # batch 16: unsplit at 1 per SM
    assert module.num_splits_for(wanted, 151_936, cuda) == 1  # a program per (row, slot) fills the GPU already


@kernel
def test_spare_mass_kernel_takes_any_layout():
    """Rows strided, a vocabulary that is not unit-stride (copied), empty outputs, and the "triton" backend."""
    weight, p, q = _spare_inputs(rows=4, slots=3, vocab=200, device=KERNEL_DEVICE)
    expected = torch_spare_mass(weight, p, q)
    q_columns = q.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, vocabulary stride K
    assert q_columns.stride(-1) != 1
    torch.testing.assert_close(spare_mass(weight, p, q_columns, backend="triton"), expected, rtol=1e-5, atol=1e-6)
    every_other = spare_mass(weight[::2], p[::2], q[::2], backend="triton")
    torch.testing.assert_close(every_other, expected[::2], rtol=1e-5, atol=1e-6)
    assert spare_mass(weight[:, :0], p[:, :0], q[:, :0], backend="triton").shape == (4, 0)


@kernel
def test_spare_mass_kernel_inside_verify_block_changes_no_outcome(monkeypatch):
    """Block verification with the kernel draws the same prefixes and tokens as with the PyTorch expression (same
    seed): the sums differ by rounding only."""
    rows, n, vocab = 64, 4, 97
    g = torch.Generator().manual_seed(3)
    scores = (2 * torch.randn(rows, n + 1, vocab, generator=g)).to(KERNEL_DEVICE)
    probs = torch.softmax(scores[:, :n] + torch.randn(rows, n, vocab, generator=g).to(KERNEL_DEVICE), -1)
    drafts = torch.multinomial(probs.reshape(-1, vocab), 1).view(rows, n)
    caps = torch.randint(0, n + 1, (rows,), generator=g).to(KERNEL_DEVICE)
    results = []
    for backend in ("triton", "torch"):
        monkeypatch.setattr(spare_module, "DEFAULT_BACKEND", backend)
        gen = torch.Generator(KERNEL_DEVICE).manual_seed(0)
        results.append(verify_block(scores, drafts, probs, caps, do_sample=True, generator=gen))
    assert torch.equal(results[0].num_accepted, results[1].num_accepted)
    assert torch.equal(results[0].next_tokens, results[1].next_tokens)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_spare_mass_kernel_replays_in_a_cuda_graph():
    """The launch captures (no host sync, no allocation but its output) and a replay reads the buffers' new values."""
    from hf_dspark.generation.cuda_graphs import capture

    weight, p, q = _spare_inputs(rows=16, slots=6, vocab=49_152, device="cuda")
    graph, out = capture(lambda: spare_mass(weight, p, q, backend="triton"))
    fresh = _spare_inputs(rows=16, slots=6, vocab=49_152, seed=1, device="cuda")
    for buffer, value in zip((weight, p, q), fresh, strict=True):
        buffer.copy_(value)
    graph.replay()
    torch.testing.assert_close(out, torch_spare_mass(*fresh), rtol=1e-5, atol=1e-6)
