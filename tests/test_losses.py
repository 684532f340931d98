"""The training objectives: exact against a naive full-vocabulary reference, globally normalized across ranks."""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_target

from hf_dspark import DFlashModel, DSparkModel, Eagle3Model
from hf_dspark.target import target_features
from hf_dspark.training.losses import (
    block_draft_loss,
    chunk_rows,
    draft_loss,
    eagle3_loss,
    fused_head_loss,
    slot_weights,
    walk_block_weights,
)

SEQ = 24


# -- naive references: full [.., V] tensors, plain autograd -----------------------------------------------------


def naive_block_loss(draft, out, block_weight=None):
    """`block_weight` [B, N]: scales every slot weight of its anchor block (anchor_weighting="walk")."""
    cfg = draft.config
    logp = draft.draft_logits(out.hidden_states, out.markov_features).log_softmax(-1)  # [B, N, K, V]
    p = logp.exp()
    q = draft.target_logits(out.target_hidden_states).softmax(-1)
    ce = -logp.gather(-1, out.labels[..., None]).squeeze(-1)
    l1 = (p - q).abs().sum(-1)
    w = out.eval_mask.to(p.dtype) * torch.exp(-torch.arange(cfg.block_size, dtype=p.dtype) / cfg.loss_decay_gamma)
    if block_weight is not None:
        w = w * block_weight[..., None]
    total = cfg.ce_loss_alpha * (w * ce).sum() + cfg.l1_loss_alpha * (w * l1).sum()
    total = total + cfg.soft_ce_loss_alpha * (w * -(q * logp).sum(-1)).sum()
    if out.confidence_logits is not None:
        target = (1 - l1 / 2).clamp(0, 1).detach()
        bce = F.binary_cross_entropy_with_logits(out.confidence_logits, target, reduction="none")
        total = total + cfg.confidence_head_alpha * (w * bce).sum()
    return total / w.sum()


def naive_eagle3_loss(draft, out):
    logp = draft.draft_logits(out.hidden_states).log_softmax(-1)  # [J, B, T, V]
    q = draft.target_logits(out.target_hidden_states).softmax(-1)
    sce = -(q * logp).sum(-1)
    steps = out.hidden_states.shape[0]
    decay = draft.config.step_loss_decay ** torch.arange(steps, dtype=logp.dtype)
    w = out.eval_mask.to(logp.dtype) * decay[:, None, None]
    return (w * sce).sum() / w.sum()


def batch_for(target, rows=2, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size
    input_ids = torch.randint(3, vocab, (rows, SEQ), generator=gen)
    loss_mask = torch.zeros(rows, SEQ, dtype=torch.long)
    for r in range(rows):  # different prompt lengths, so rows hold different numbers of supervised slots
        loss_mask[r, 4 + 5 * r :] = 1
    return input_ids, loss_mask


def features(target, draft, input_ids, dtype=torch.float64):
    ctx, last = target_features(target, input_ids, draft.config.target_layer_ids)
    return ctx.to(dtype), last.to(dtype)


def grads_of(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params, retain_graph=True)


def tiny_dspark(target, **kw):
    kw = {"num_hidden_layers": 1, "block_size": 4, "markov_rank": 8, "num_anchors": 6, **kw}
    return DSparkModel.from_target(target, dtype=torch.float64, **kw)


# -- the fused kernel ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_fused_head_loss_matches_full_vocab_autograd(softcap):
    torch.manual_seed(0)
    S, d, r, V = 13, 8, 4, 50
    h = torch.randn(S, d, dtype=torch.float64, requires_grad=True)
    z = torch.randn(S, r, dtype=torch.float64, requires_grad=True)
    t = torch.randn(S, d, dtype=torch.float64)
    W = torch.randn(V, d, dtype=torch.float64)
    W2 = torch.randn(V, r, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (S,))
    a, b, c = (torch.rand(S, dtype=torch.float64) for _ in range(3))
    # 4 rows per chunk: the 13 rows take four chunks, the last one partial.
    loss, stats = fused_head_loss(
        h, W, labels, a, target_hidden=t, markov_features=z, markov_weight=W2, l1_weight=b,
        soft_ce_weight=c, softcap=softcap, chunk_elements=4 * V,
    )  # fmt: skip
    cap = (lambda x: softcap * torch.tanh(x / softcap)) if softcap else (lambda x: x)
    logp = cap(h @ W.T + z @ W2.T).log_softmax(-1)
    q = cap(t @ W.T).softmax(-1)
    ce = -logp.gather(1, labels[:, None]).squeeze(1)
    l1 = (logp.exp() - q).abs().sum(-1)
    sce = -(q * logp).sum(-1)
    reference = (a * ce + b * l1 + c * sce).sum()
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(stats.ce, ce.detach())
    torch.testing.assert_close(stats.l1, l1.detach())
    torch.testing.assert_close(stats.soft_ce, sce.detach())
    assert torch.equal(stats.greedy_match, logp.argmax(-1) == q.argmax(-1))
    for got, want in zip(torch.autograd.grad(3 * loss, [h, z, W2]), torch.autograd.grad(3 * reference, [h, z, W2])):
        torch.testing.assert_close(got, want)


def test_each_chunk_runs_two_vocabulary_products_forward_and_two_backward():
    """Per row chunk: the draft's logits (Markov bias included, [h, z] @ [W, W2]^T) and the target's, then
    g @ [W, W2] for both input gradients and g^T z for W2's. A separate GEMM adding the Markov bias into the fp32
    [rows, V] logits re-read and re-wrote that buffer, a memory-bound pass that cost more than the product."""
    from torch.utils._python_dispatch import TorchDispatchMode

    products = {torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.default, torch.ops.aten.addmm_.default}

    class Products(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in products:
                self.shapes.append((tuple(args[-2].shape), tuple(args[-1].shape)))
            return out

    torch.manual_seed(0)
    S, d, r, V, rows = 12, 8, 4, 50, 4
    h = torch.randn(S, d, requires_grad=True)
    z = torch.randn(S, r, requires_grad=True)
    W2 = torch.randn(V, r, requires_grad=True)
    t, W, labels = torch.randn(S, d), torch.randn(V, d), torch.randint(0, V, (S,))
    a, b = torch.rand(S), torch.rand(S)
    with Products() as counted:
        fused_head_loss(h, W, labels, a, target_hidden=t, markov_features=z, markov_weight=W2, l1_weight=b,
                        chunk_elements=rows * V)  # fmt: skip
    per_chunk = [((rows, d + r), (d + r, V)), ((rows, d), (d, V)), ((rows, V), (V, d + r)), ((V, rows), (rows, r))]
    assert counted.shapes == per_chunk * (S // rows)


def _graph_loss_call(graphs, seed, rows_kept, weights, device="cpu", compile=False, max_rows=None):
    """One DSpark-like fused loss with a row mask and a host-known row bound: (loss, stats, input gradients).
    weights: (lm_weight [50, 8], markov_weight [50, 4]), the same tensors at every call, as a model's are."""
    W, markov_weight = weights
    gen = torch.Generator().manual_seed(seed)
    S, d, r, V = 40, 8, 4, 50
    h = torch.randn(S, d, generator=gen).to(device).requires_grad_()
    z = torch.randn(S, r, generator=gen).to(device).requires_grad_()
    t = torch.randn(S, d, generator=gen).to(device)
    labels = torch.randint(0, V, (S,), generator=gen).to(device)
    a, b, c = (torch.rand(S, generator=gen).to(device) for _ in range(3))
    row_mask = torch.zeros(S, dtype=torch.bool, device=device)
    row_mask[torch.randperm(S, generator=gen)[:rows_kept].to(device)] = True
    loss, stats = fused_head_loss(
        h, W, labels, a, target_hidden=t, markov_features=z, markov_weight=markov_weight, l1_weight=b,
        soft_ce_weight=c, chunk_elements=8 * V, compile=compile, row_mask=row_mask,
        max_rows=rows_kept if max_rows is None else max_rows, graphs=graphs,
    )  # fmt: skip
    grads = torch.autograd.grad(loss, [h, z, markov_weight])
    return loss, stats, grads


def test_the_loss_chunks_replayed_from_graphs_equal_the_plain_ones():
    """`loss_cuda_graphs`' bookkeeping, with a CPU stand-in for the graphs (a 'capture' runs the chunk twice, as the
    warm-ups do, a 'replay' once more): a setting's first call runs plain; then one graph per chunk index over
    static buffers sized for the batch's rows, captured as calls first need them, replayed for any row count (rows
    past it weigh zero); W2 changed in place between calls is read; every call equals the plain loss."""
    from conftest import replaying_on_cpu

    from hf_dspark.training.loss_graphs import LossGraphs

    graphs = replaying_on_cpu(LossGraphs)()
    W2 = torch.randn(50, 4, generator=torch.Generator().manual_seed(3)).requires_grad_()
    weights = (torch.randn(50, 8, generator=torch.Generator().manual_seed(9)), W2)
    for call, (seed, kept) in enumerate([(0, 20), (1, 17), (2, 23), (3, 33), (4, 9)]):
        with torch.no_grad():
            W2.mul_(0.9)  # the optimizer changes the weights in place between steps: the replay reads them
        got = _graph_loss_call(graphs, seed, kept, weights)
        want = _graph_loss_call(None, seed, kept, weights)
        torch.testing.assert_close(got[0], want[0])
        for field in ("ce", "l1", "soft_ce", "greedy_match"):
            torch.testing.assert_close(getattr(got[1], field), getattr(want[1], field))
        for g, w in zip(got[2], want[2]):
            torch.testing.assert_close(g, w)
        # chunks of 8 rows, buffers for the batch's 40: 17 and 23 rows take 3 chunks, 33 the other 2
        assert graphs.captures == [0, 3, 3, 5, 5][call] and len(graphs.states) == min(call, 1)
    assert next(iter(graphs.states.values())).capacity == 40


def test_a_failed_capture_falls_back_to_the_plain_loss_for_good(caplog):
    from hf_dspark.training.loss_graphs import LossGraphs

    class Failing(LossGraphs):
        def serves(self, tensor):
            return self.failed is None

        def _capture(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing")

    graphs = Failing()
    weights = (torch.randn(50, 8), torch.randn(50, 4).requires_grad_())
    with caplog.at_level("WARNING"):
        results = [_graph_loss_call(graphs, 0, 20, weights) for _ in range(3)]
    want = _graph_loss_call(None, 0, 20, weights)
    for got in results:
        torch.testing.assert_close(got[0], want[0])
    assert graphs.failed.startswith("RuntimeError") and "loss_cuda_graphs=False" in caplog.text
    assert caplog.text.count("without CUDA graphs") == 1 and not graphs.states


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_graph_of_the_loss_forward_equals_the_plain_loss(compile):
    from hf_dspark.training.loss_graphs import LossGraphs

    graphs = LossGraphs()
    W2 = torch.randn(50, 4, device="cuda").requires_grad_()
    weights = (torch.randn(50, 8, device="cuda"), W2)
    for seed, kept in enumerate([20, 17, 23, 33, 9, 20]):
        with torch.no_grad():
            W2.mul_(0.9)
        got = _graph_loss_call(graphs, seed, kept, weights, device="cuda", compile=compile)
        want = _graph_loss_call(None, seed, kept, weights, device="cuda", compile=compile)
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1].l1, want[1].l1)
        for g, w in zip(got[2], want[2]):
            torch.testing.assert_close(g, w)
    assert graphs.failed is None and graphs.captures == 5


def test_a_failing_compiled_math_falls_back_to_eager_with_the_same_result(monkeypatch, caplog):
    from hf_dspark.training import losses

    def broken(*args, **kwargs):
        raise RuntimeError("inductor could not lower this op")

    monkeypatch.setattr(losses, "_COMPILED_CHUNK_MATH", broken)
    weights = (torch.randn(50, 8, generator=torch.Generator().manual_seed(9)), torch.randn(50, 4).requires_grad_())
    with caplog.at_level("WARNING"):
        got = _graph_loss_call(None, 0, 20, weights, compile=True)
    assert losses._COMPILED_CHUNK_MATH is losses._chunk_math and "compiled loss math failed" in caplog.text
    want = _graph_loss_call(None, 0, 20, weights)
    torch.testing.assert_close(got[0], want[0])
    for g, w in zip(got[2], want[2]):
        torch.testing.assert_close(g, w)


def test_chunk_size_does_not_change_the_result():
    torch.manual_seed(1)
    S, d, V = 40, 16, 96
    h = torch.randn(S, d, requires_grad=True)
    t, W = torch.randn(S, d), torch.randn(V, d)
    labels, a, b = torch.randint(0, V, (S,)), torch.rand(S), torch.rand(S)
    results = []
    for elements in (V, 7 * V, 10**9):
        loss, stats = fused_head_loss(h, W, labels, a, target_hidden=t, l1_weight=b, chunk_elements=elements)
        (grad,) = torch.autograd.grad(loss, h)
        results.append((loss, stats.l1, grad))
    for loss, l1, grad in results[1:]:
        torch.testing.assert_close(loss, results[0][0])
        torch.testing.assert_close(l1, results[0][1])
        torch.testing.assert_close(grad, results[0][2])


@pytest.mark.parametrize("bound", [None, "exact", "above", "every row"])
@pytest.mark.parametrize("kept", ["some", "all", "none"])
def test_row_mask_skips_zero_weight_rows_exactly(kept, bound):
    """Masked-out rows never reach the vocabulary-wide math: same loss and gradients as weighting them by zero,
    zero statistics and gradient on those rows. The same with a host-known bound on the kept rows (`max_rows`,
    no read-back), whatever its slack; a bound below the count is an error, not a silently smaller loss."""
    torch.manual_seed(2)
    S, d, r, V = 11, 8, 3, 40
    h = torch.randn(S, d, dtype=torch.float64, requires_grad=True)
    z = torch.randn(S, r, dtype=torch.float64, requires_grad=True)
    t, W = torch.randn(S, d, dtype=torch.float64), torch.randn(V, d, dtype=torch.float64)
    W2 = torch.randn(V, r, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (S,))
    mask = {"some": torch.rand(S) < 0.5, "all": torch.ones(S, dtype=torch.bool), "none": torch.zeros(S, dtype=torch.bool)}[kept]
    a, b = (torch.rand(S, dtype=torch.float64) * mask for _ in range(2))
    kwargs = dict(target_hidden=t, markov_features=z, markov_weight=W2, l1_weight=b, chunk_elements=3 * V)
    count = int(mask.sum())
    max_rows = {None: None, "exact": count, "above": min(count + 3, S), "every row": S}[bound]
    full, full_stats = fused_head_loss(h, W, labels, a, **kwargs)
    masked, stats = fused_head_loss(h, W, labels, a, row_mask=mask, max_rows=max_rows, **kwargs)
    torch.testing.assert_close(masked, full)
    for got, want in zip(torch.autograd.grad(masked, [h, z, W2]), torch.autograd.grad(full, [h, z, W2])):
        torch.testing.assert_close(got, want)
    for name in ("ce", "l1"):
        got, want = getattr(stats, name), getattr(full_stats, name)
        torch.testing.assert_close(got[mask], want[mask])
        assert not got[~mask].any()
    assert torch.equal(stats.greedy_match[mask], full_stats.greedy_match[mask])
    with pytest.raises(ValueError, match="one entry per row"):
        fused_head_loss(h, W, labels, a, row_mask=mask[:-1], **kwargs)
    if count:
        with pytest.raises(RuntimeError, match="max_rows is below the number of loss rows"):
            fused_head_loss(h, W, labels, a, row_mask=mask, max_rows=count - 1, **kwargs)


def test_chunk_rows_bound_the_fp32_buffer():
    assert chunk_rows(151_936, 2**26) == 384  # 384 x 151,936 fp32 = 223 MiB per buffer
    assert chunk_rows(151_936, 2**26) * 151_936 <= 2**26
    assert chunk_rows(96, 10) == 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_addmm_acc_adds_the_product_into_the_accumulator_in_place(dtype):
    """The Markov logits and the W2 gradient accumulate through this: c += a @ b, in c itself, c in fp32/fp64."""
    from hf_dspark.training.loss_buffers import _addmm_acc_

    gen = torch.Generator().manual_seed(4)
    acc = torch.promote_types(dtype, torch.float32)
    c = torch.randn(5, 7, generator=gen, dtype=acc)
    a, b = torch.randn(5, 3, generator=gen).to(dtype), torch.randn(7, 3, generator=gen).to(dtype).T
    want = c + a.to(acc) @ b.to(acc)
    assert _addmm_acc_(c, a, b) is c
    torch.testing.assert_close(c, want, **({} if dtype == torch.float64 else dict(rtol=1e-2, atol=1e-2)))


@pytest.mark.parametrize("fault", ["wrong result", "unsupported"])
def test_the_fused_addmm_is_checked_once_and_dropped_when_it_fails(fault, monkeypatch):
    """The GEMM that adds bf16 products into an fp32 accumulator (CUDA) is compared with the plain product on its
    first use: a kernel that errs or disagrees is never used, and that first result is still right."""
    from hf_dspark.training import loss_buffers

    def fake_addmm(c, a, b, out_dtype=None, out=None):
        if fault == "unsupported":
            raise TypeError("addmm() got an unexpected keyword argument 'out_dtype'")
        return out.add_(1.0)  # a wrong result

    monkeypatch.setattr(loss_buffers, "_ADDMM_OUT_DTYPE_OK", None)
    monkeypatch.setattr(loss_buffers, "_gemm_accumulates", lambda a, acc_dtype: True)
    monkeypatch.setattr(loss_buffers, "_MM_OUT_DTYPE_OK", False)  # the plain product, as the reference
    monkeypatch.setattr(loss_buffers.torch, "addmm", fake_addmm)
    gen = torch.Generator().manual_seed(5)
    c = torch.randn(4, 6, generator=gen)
    a, b = torch.randn(4, 3, generator=gen).bfloat16(), torch.randn(6, 3, generator=gen).bfloat16().T
    want = c + (a @ b).float()
    assert loss_buffers._addmm_acc_(c, a, b) is c
    torch.testing.assert_close(c, want)
    assert loss_buffers._ADDMM_OUT_DTYPE_OK is False
    torch.testing.assert_close(loss_buffers._addmm_acc_(c, a, b), want + (a @ b).float())  # the plain path now


def test_a_dispatch_mode_does_not_switch_the_fused_products_off(monkeypatch):
    """FlopCounterMode (the production-shapes benchmark counts a step's FLOPs before timing) rejects addmm's `out=`
    after the kernel ran; a failure under such a mode must neither add the product twice nor switch the fused
    kernels off for the rest of the process. Here the fused kernels do not exist (CPU): under the mode the plain
    path runs, counted and right, and both verdicts stay where they were."""
    from torch.utils.flop_counter import FlopCounterMode

    from hf_dspark.training import loss_buffers

    monkeypatch.setattr(loss_buffers, "_ADDMM_OUT_DTYPE_OK", None)
    monkeypatch.setattr(loss_buffers, "_MM_OUT_DTYPE_OK", True)
    monkeypatch.setattr(loss_buffers, "_gemm_accumulates", lambda a, acc_dtype: True)
    gen = torch.Generator().manual_seed(6)
    c = torch.randn(4, 6, generator=gen)
    a, b = torch.randn(4, 3, generator=gen).bfloat16(), torch.randn(6, 3, generator=gen).bfloat16().T
    want = c + a.float() @ b.float()
    with FlopCounterMode(display=False) as counter:
        loss_buffers._addmm_acc_(c, a, b)
        product = loss_buffers._mm_acc(a, b, torch.float32)
    torch.testing.assert_close(c, want, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(product, a.float() @ b.float(), rtol=1e-2, atol=1e-2)
    assert counter.get_total_flops() == 2 * (2 * 4 * 6 * 3)
    assert loss_buffers._ADDMM_OUT_DTYPE_OK is None and loss_buffers._MM_OUT_DTYPE_OK is True


def test_fused_head_loss_refuses_a_trainable_lm_head():
    W = torch.randn(10, 4, requires_grad=True)
    with pytest.raises(ValueError, match="freeze_target_io"):
        fused_head_loss(torch.randn(3, 4), W, torch.zeros(3, dtype=torch.long), torch.ones(3))


def test_bf16_autocast_matches_fp32_closely():
    torch.manual_seed(2)
    S, d, V = 16, 32, 64
    h, t, W = torch.randn(S, d), torch.randn(S, d), torch.randn(V, d) / 4
    labels, a, b = torch.randint(0, V, (S,)), torch.full((S,), 1 / S), torch.full((S,), 1 / S)
    exact, _ = fused_head_loss(h, W, labels, a, target_hidden=t, l1_weight=b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        approx, _ = fused_head_loss(h, W, labels, a, target_hidden=t, l1_weight=b)
    assert approx.dtype == torch.float32
    torch.testing.assert_close(approx, exact, rtol=3e-2, atol=3e-2)


# -- objectives against the naive reference ------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3: soft-capped logits, scaled embeddings
@pytest.mark.parametrize("markov", ["vanilla", "rnn"])
def test_dspark_loss_and_gradients_match_naive_reference(family, markov):
    target = make_tiny_target(family).double()
    # The default mix (soft CE + L1) plus a label CE, so every term's gradient is checked against the reference.
    draft = tiny_dspark(target, markov_head_type=markov, ce_loss_alpha=0.3)
    input_ids, loss_mask = batch_for(target)
    ctx, last = features(target, draft, input_ids)
    out = draft(input_ids, ctx, loss_mask, target_last_hidden=last, generator=torch.Generator().manual_seed(0))
    assert out.eval_mask.any() and not out.eval_mask.all()
    fused = block_draft_loss(draft, out, chunk_elements=3 * draft.config.vocab_size)
    reference = naive_block_loss(draft, out)
    torch.testing.assert_close(fused.loss, reference)
    for got, want in zip(grads_of(draft, fused.loss), grads_of(draft, reference)):
        torch.testing.assert_close(got, want)
    assert set(fused.terms) == {"loss_ce", "loss_l1", "loss_soft_ce", "loss_conf"}
    cfg = draft.config
    combined = cfg.ce_loss_alpha * fused.terms["loss_ce"] + cfg.l1_loss_alpha * fused.terms["loss_l1"]
    combined = combined + cfg.soft_ce_loss_alpha * fused.terms["loss_soft_ce"]
    combined = combined + cfg.confidence_head_alpha * fused.terms["loss_conf"]
    torch.testing.assert_close(combined, fused.loss.detach())


@pytest.mark.parametrize("algorithm", ["dspark", "dflash"])
def test_block_loss_with_soft_cross_entropy_matches_naive_reference(algorithm):
    """soft_ce_loss_alpha adds -sum_v p_t log p_d per slot, weighted as the other terms, gradients included; the
    term is logged; a config that trains no distribution term at all is refused."""
    target = make_tiny_target("llama").double()
    if algorithm == "dspark":
        draft = tiny_dspark(target, ce_loss_alpha=0.2, soft_ce_loss_alpha=0.7)
    else:
        draft = DFlashModel.from_target(target, num_hidden_layers=1, block_size=4, num_anchors=6,
                                        dtype=torch.float64, ce_loss_alpha=0.0, soft_ce_loss_alpha=1.0)  # fmt: skip
    input_ids, loss_mask = batch_for(target)
    ctx, last = features(target, draft, input_ids)
    out = draft(input_ids, ctx, loss_mask, target_last_hidden=last, generator=torch.Generator().manual_seed(0))
    fused = block_draft_loss(draft, out, chunk_elements=3 * draft.config.vocab_size)
    reference = naive_block_loss(draft, out)
    torch.testing.assert_close(fused.loss, reference)
    for got, want in zip(grads_of(draft, fused.loss), grads_of(draft, reference)):
        torch.testing.assert_close(got, want)
    assert "loss_soft_ce" in fused.terms
    if algorithm == "dflash":  # soft CE alone
        torch.testing.assert_close(fused.loss.detach(), draft.config.soft_ce_loss_alpha * fused.terms["loss_soft_ce"])
    with pytest.raises(ValueError, match="soft_ce_loss_alpha are all 0"):
        DFlashModel.from_target(target, num_hidden_layers=1, ce_loss_alpha=0.0, soft_ce_loss_alpha=0.0)
    with pytest.raises(ValueError, match="soft_ce_loss_alpha must be >= 0"):
        tiny_dspark(target, soft_ce_loss_alpha=-1.0)


def test_dflash_loss_is_weighted_cross_entropy_only():
    target = make_tiny_target("qwen3").double()
    draft = DFlashModel.from_target(target, num_hidden_layers=1, block_size=4, num_anchors=6, dtype=torch.float64)
    input_ids, loss_mask = batch_for(target)
    ctx, last = features(target, draft, input_ids)
    out = draft(input_ids, ctx, loss_mask, target_last_hidden=last, generator=torch.Generator().manual_seed(0))
    fused = draft_loss(draft, out)
    torch.testing.assert_close(fused.loss, naive_block_loss(draft, out))
    torch.testing.assert_close(fused.loss.detach(), fused.terms["loss_ce"])
    assert "loss_conf" not in fused.terms and "tau_prob_sum" in fused.estimates  # estimates still logged


def test_eagle3_loss_and_gradients_match_naive_reference():
    target = make_tiny_target("qwen2").double()
    draft = Eagle3Model.from_target(target, block_size=3, dtype=torch.float64)
    input_ids, loss_mask = batch_for(target)
    ctx, last = features(target, draft, input_ids)
    out = draft(input_ids, ctx, loss_mask, target_last_hidden=last)
    fused = eagle3_loss(draft, out, chunk_elements=5 * draft.config.vocab_size)
    reference = naive_eagle3_loss(draft, out)
    torch.testing.assert_close(fused.loss, reference)
    for got, want in zip(grads_of(draft, fused.loss), grads_of(draft, reference)):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(fused.terms["loss_soft_ce"], reference.detach())


def test_slot_weights_follow_the_paper():
    torch.testing.assert_close(slot_weights(3, 4.0), torch.tensor([1.0, torch.e**-0.25, torch.e**-0.5]))
    assert slot_weights(3, 0.0).tolist() == [1.0, 0.0, 0.0]


def test_a_perfect_draft_gets_full_acceptance_estimates():
    """Draft states equal to the target's: L1 = 0, c*_k = 1, tau = 1 + valid prefix length."""
    torch.manual_seed(3)
    d, V, K = 8, 30, 4
    W = torch.randn(V, d, dtype=torch.float64)
    hidden = torch.randn(2, 3, K, d, dtype=torch.float64)
    eval_mask = torch.ones(2, 3, K, dtype=torch.bool)
    eval_mask[1, 2, 2:] = False  # one block with only 2 valid slots

    class Draft(torch.nn.Module):
        config = type("C", (), {"ce_loss_alpha": 0.1, "l1_loss_alpha": 0.9, "confidence_head_alpha": 1.0,
                                "loss_decay_gamma": 4.0, "final_logit_softcapping": None})()  # fmt: skip
        lm_head = torch.nn.Linear(d, V, bias=False).double().requires_grad_(False)

    draft = Draft()
    draft.lm_head.weight.copy_(W)
    from hf_dspark.models import BlockDraftOutput

    out = BlockDraftOutput(
        hidden_states=hidden,
        labels=torch.zeros(2, 3, K, dtype=torch.long),
        eval_mask=eval_mask,
        target_hidden_states=hidden.clone(),
        confidence_logits=torch.zeros(2, 3, K, dtype=torch.float64),
    )
    est = block_draft_loss(draft, out).estimates
    assert est["blocks"] == 6
    torch.testing.assert_close(est["tau_prob_sum"] / est["blocks"], torch.tensor((5 * 5 + 3) / 6))
    torch.testing.assert_close(est["tau_greedy_sum"], est["tau_prob_sum"])
    torch.testing.assert_close(est["accept_sum"], est["accept_count"])
    assert est["supervised_tokens"] == 22


# -- global normalization across data-parallel ranks ----------------------------------------------------------------


def _ddp_worker(rank, world, init_file, result_file):
    """Each rank: the full-batch single-process gradient, then its own half of the batch under gloo, DDP-averaged."""
    import torch.distributed as dist

    torch.manual_seed(0)
    target = make_tiny_target("llama").double()
    draft = tiny_dspark(target)
    input_ids, loss_mask = batch_for(target, rows=2)
    ctx, last = features(target, draft, input_ids)
    anchors = torch.tensor([[4, 8, 12, 16, 19, 21], [9, 12, 13, 17, 20, 21]])

    def run(rows):
        out = draft(input_ids[rows], ctx[rows], loss_mask[rows], target_last_hidden=last[rows],
                    anchor_positions=anchors[rows])  # fmt: skip
        result = block_draft_loss(draft, out)
        return result, grads_of(draft, result.loss)

    full, full_grads = run(slice(0, 2))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mine, my_grads = run(slice(rank, rank + 1))
    averaged = []
    for g in my_grads:  # what DDP does: average gradients over ranks
        g = g.clone()
        dist.all_reduce(g)
        averaged.append(g / world)
    loss = mine.loss.detach().clone()
    dist.all_reduce(loss)
    terms = {k: v.clone() for k, v in mine.terms.items()}
    for v in terms.values():
        dist.all_reduce(v)
    dist.destroy_process_group()
    torch.save(
        {
            "loss_ok": torch.allclose(loss / world, full.loss.detach()),
            "grads_ok": all(torch.allclose(a, b) for a, b in zip(averaged, full_grads)),
            "terms_ok": all(torch.allclose(terms[k], full.terms[k]) for k in terms),
        },
        f"{result_file}.{rank}",
    )


def test_loss_is_normalized_globally_across_two_gloo_ranks():
    """Rows with different numbers of valid slots on two ranks: DDP-averaged gradients equal the global formula."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init_file, result_file = os.path.join(tmp, "init"), os.path.join(tmp, "result")
        mp.spawn(_ddp_worker, args=(2, init_file, result_file), nprocs=2, join=True)
        for rank in range(2):
            result = torch.load(f"{result_file}.{rank}")
            assert result == {"loss_ok": True, "grads_ok": True, "terms_ok": True}, (rank, result)


@pytest.mark.parametrize("extra", [[], ["--compile_draft_layers"]], ids=["eager-layers", "compiled-layers"])
def test_production_shapes_benchmark_runs_its_smoke_configuration(tmp_path, extra):
    """benchmarks/train_production_shapes.py --smoke: the GPU benchmark's code path, on CPU with tiny shapes."""
    import json

    from conftest import load_script

    bench = load_script("benchmarks/train_production_shapes.py")
    out = tmp_path / "result.json"
    result = bench.main(["--device", "cpu", "--smoke", "--steps", "2", "--warmup", "1", "--output", str(out), *extra])
    assert json.loads(out.read_text())["step_ms_median"] == result["step_ms_median"] > 0
    assert result["step_ms_pipelined"] > 0
    assert result["compile_draft_layers"] == bool(extra)
    assert result["supervised_block_tokens_per_step"] > 0 and math.isfinite(result["final_loss"])
    assert result["flops"]["matmul"] > 0 and result["floor"]["matmul_ms"] > 0


def test_production_shapes_flop_count_equals_the_shape_formula():
    """The benchmark's FLOP count (torch's FlopCounterMode on an eager step) equals `product_flops`, the products
    written out from the shapes, for 1- and 2-layer drafts; so does the attention count. The README's production
    figures come from that formula (`--flops_only`)."""
    from conftest import load_script

    bench = load_script("benchmarks/train_production_shapes.py")
    counts = {}
    for layers in (1, 2):
        argv = ["--device", "cpu", "--smoke", "--steps", "1", "--warmup", "1", "--num_layers", str(layers)]
        result = bench.main(argv)
        counts[layers] = result["flops"]
        assert result["floor"]["best_gemm_tflops"] > 0 and result["floor"]["matmul_ms"] > 0
        formula = bench.main([*argv, "--flops_only"])["product_flops"]
        assert counts[layers]["matmul"] == formula["total"] > 0, (counts[layers]["by_operator"], formula)
        assert formula["decoder_layers"] > 0 and formula["vocabulary"] > 0 and formula["confidence_head"] > 0
    shapes = result["shapes"]
    rows = shapes["anchors"] * shapes["block"]  # every anchor slot (fixed count, shorter than the sequence)
    per_layer = 12 * shapes["heads"] * rows * (shapes["seq_len"] + rows) * shapes["head_dim"]  # QK^T, PV; x3 backward
    assert counts[1]["attention_dense"] == per_layer and counts[2]["attention_dense"] == 2 * per_layer
    assert 0 < counts[2]["attention_live_fraction"] < 1
    assert counts[2]["attention_live"] == pytest.approx(2 * per_layer * counts[2]["attention_live_fraction"])


@pytest.mark.slow
def test_compiled_loss_math_equals_eager_on_every_chunk_length():
    """The compiled path pads the last, shorter chunk with zero-weight rows (one compilation for every batch):
    losses, statistics and gradients equal the eager path for slot counts that are and are not multiples of it."""
    torch.manual_seed(0)
    vocab, d, r = 64, 8, 4
    lm_weight = torch.randn(vocab, d)
    markov_weight = torch.randn(vocab, r, requires_grad=True)
    for slots in (16, 23, 5):  # chunk_elements=8*64 -> 8 rows per chunk
        hidden = torch.randn(slots, d, requires_grad=True)
        markov = torch.randn(slots, r, requires_grad=True)
        target_hidden = torch.randn(slots, d)
        labels = torch.randint(0, vocab, (slots,))
        weights = torch.rand(slots)
        results = []
        for compile_ in (False, True):
            markov_weight.grad = None
            hidden.grad = markov.grad = None
            loss, stats = fused_head_loss(
                hidden, lm_weight, labels, weights, target_hidden=target_hidden, markov_features=markov,
                markov_weight=markov_weight, l1_weight=weights * 0.5, softcap=20.0, chunk_elements=8 * vocab,
                compile=compile_,
            )  # fmt: skip
            loss.backward()
            results.append((loss.detach(), stats.ce, stats.l1, hidden.grad.clone(), markov.grad.clone(),
                            markov_weight.grad.clone()))  # fmt: skip
        for eager, compiled in zip(*results):
            torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)
    from hf_dspark.training import losses

    assert losses._COMPILED_CHUNK_MATH is not losses._chunk_math, "compilation failed: the eager fallback ran"


def _chunk_inputs(rows=6, vocab=40, dtype=torch.float32, seed=3):
    gen = torch.Generator().manual_seed(seed)
    u, ut = (4 * torch.randn(rows, vocab, generator=gen, dtype=dtype) for _ in range(2))
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    w_ce, w_l1, w_soft = (torch.rand(rows, generator=gen, dtype=dtype) for _ in range(3))
    return u, ut, labels, w_ce, w_l1, w_soft


def test_compiled_chunk_math_graph_writes_no_input_and_has_no_matmul():
    """What torch.compile sees of the per-chunk math: the logits are only read (a graph input mutated in place is
    copied back after the kernel, a full pass each), the row-wise dot products are elementwise products summed
    (a bmm stays an extern gemv call on CUDA instead of fusing into the reductions), and g leaves the graph in
    the compute dtype (no separate cast pass)."""
    from torch._dynamo.backends.common import aot_autograd

    from hf_dspark.training import losses

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm

    u, ut, labels, w_ce, w_l1, w_soft = _chunk_inputs()
    before = u.clone(), ut.clone()  # a mutated input is also what makes inductor copy it back
    torch._dynamo.reset()
    fn = torch.compile(losses._chunk_math, backend=aot_autograd(fw_compiler=record), dynamic=False)
    *_, g = fn(u, ut, labels, w_ce, w_l1, w_soft, 5.0, torch.bfloat16)
    assert len(graphs) == 1 and g.dtype == torch.bfloat16
    assert torch.equal(u, before[0]) and torch.equal(ut, before[1])
    aten = torch.ops.aten
    matmuls = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default, aten.mv.default}
    assert not [n for n in graphs[0].graph.nodes if n.op == "call_function" and n.target in matmuls]
    torch._dynamo.reset()


@pytest.mark.parametrize("terms", ["ce+l1+soft_ce, softcap", "ce"])
def test_compiled_chunk_math_equals_eager(terms):
    """Inductor's kernels for the per-chunk math against the same function run eagerly (which consumes the logits
    in place): statistics and the gradient (cast to bf16 inside the compiled code); the compiled call leaves its
    inputs as they were."""
    from hf_dspark.training import losses

    u, ut, labels, w_ce, w_l1, w_soft = _chunk_inputs()
    args = (u, ut, labels, w_ce, w_l1, w_soft, 5.0) if terms != "ce" else (u, None, labels, w_ce, None, None, None)
    before = u.clone(), ut.clone()
    torch._dynamo.reset()
    compiled = torch.compile(losses._chunk_math, dynamic=False)(*args, torch.bfloat16)
    assert torch.equal(u, before[0]) and torch.equal(ut, before[1])
    eager = losses._chunk_math(*(a.clone() if isinstance(a, torch.Tensor) else a for a in args), torch.bfloat16)
    for got, want in zip(compiled, eager):
        if want is None:
            assert got is None
        elif want.dtype == torch.bool:
            assert torch.equal(got, want)
        else:
            assert got.dtype == want.dtype
            tol = dict(rtol=1.6e-2, atol=1e-5) if want.dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got, want, **tol)
    torch._dynamo.reset()


# -- backend selection (the Triton kernels themselves: test_triton_head_loss.py) ---------------------------------


def test_backend_choice_and_errors_name_the_fix():
    h, W = torch.randn(5, 8), torch.randn(20, 8)
    labels, w = torch.randint(0, 20, (5,)), torch.ones(5)
    with pytest.raises(ValueError, match="auto, triton, torch"):
        fused_head_loss(h, W, labels, w, backend="cuda")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="backend 'torch' or 'auto'"):
            fused_head_loss(h, W, labels, w, backend="triton")
    with pytest.raises(ValueError, match="fp32 inputs, got torch.float64"):
        fused_head_loss(h.double().cuda() if torch.cuda.is_available() else h.double(), W.double(), labels, w,
                        backend="triton")  # fmt: skip
    # "auto" on CPU is the PyTorch path, bit for bit.
    auto, _ = fused_head_loss(h, W, labels, w, backend="auto")
    torch_path, _ = fused_head_loss(h, W, labels, w, backend="torch")
    assert torch.equal(auto, torch_path)


def test_auto_backend_falls_back_to_torch_when_the_kernels_fail(monkeypatch):
    """"auto" must always give a loss: a Triton failure (e.g. a compiler error on a new GPU) switches to torch."""
    from hf_dspark.training import losses, triton_head_loss

    def broken(*args, **kwargs):
        raise RuntimeError("kernel failed to compile")

    monkeypatch.setattr(losses, "resolve_backend", lambda backend, *args: "torch" if backend == "torch" else "triton")
    monkeypatch.setattr(triton_head_loss, "triton_head_loss", broken)
    monkeypatch.setattr(losses, "_TRITON_FAILED", False)
    h, W = torch.randn(5, 8, requires_grad=True), torch.randn(20, 8)
    labels, w = torch.randint(0, 20, (5,)), torch.ones(5)
    with pytest.raises(RuntimeError, match="failed to compile"):
        fused_head_loss(h, W, labels, w, backend="triton")
    assert not losses._TRITON_FAILED
    loss, _ = fused_head_loss(h, W, labels, w, backend="auto")
    expected, _ = fused_head_loss(h, W, labels, w, backend="torch")
    assert losses._TRITON_FAILED and torch.equal(loss, expected)
    torch.testing.assert_close(torch.autograd.grad(loss, h)[0], torch.autograd.grad(expected, h)[0])


def _row(outputs, b: int, dim: int):
    """The outputs of one batch row (`dim`: the batch dimension of the per-slot tensors)."""
    sliced = {}
    for key, value in outputs.items():
        d = dim if value.dim() > dim and key not in ("anchor_positions", "anchor_mask") else 0
        sliced[key] = value.narrow(d, b, 1)
    return type(outputs)(**sliced)


@pytest.mark.parametrize("drafter", ["dspark", "eagle3"])
def test_sequence_normalization_averages_each_sequences_own_loss(drafter):
    """normalization="sequence": the mean over rows of each row's token-normalized loss (gradients included), and
    unlike the default it does not let the longer row dominate."""
    target = make_tiny_target("llama").double()
    if drafter == "dspark":
        draft, objective, dim = tiny_dspark(target), block_draft_loss, 0
    else:
        draft, objective, dim = Eagle3Model.from_target(target, block_size=3, dtype=torch.float64), eagle3_loss, 1
    input_ids, loss_mask = batch_for(target)
    ctx, last = features(target, draft, input_ids)
    kwargs = {"generator": torch.Generator().manual_seed(0)} if drafter == "dspark" else {}
    out = draft(input_ids, ctx, loss_mask, target_last_hidden=last, **kwargs)
    rows = input_ids.shape[0]
    per_row = [objective(draft, _row(out, b, dim)) for b in range(rows)]
    seq = objective(draft, out, normalization="sequence")
    torch.testing.assert_close(seq.loss, sum(r.loss for r in per_row) / rows)
    for name, value in seq.terms.items():
        torch.testing.assert_close(value, sum(r.terms[name] for r in per_row) / rows)
    token = objective(draft, out)
    assert not torch.allclose(token.loss, seq.loss)  # the rows have different numbers of supervised slots
    with pytest.raises(ValueError, match="normalization must be one of token, sequence"):
        objective(draft, out, normalization="batch")


# -- anchor weighting -----------------------------------------------------------------------------------------------


def test_walk_block_weights_are_one_over_the_expected_round_length():
    logits = torch.zeros(1, 2, 3)  # c = 0.5 at every slot
    mask = torch.tensor([[[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]])
    # 1 + 0.5 + 0.25 + 0.125 = 1.875; the unsupervised third slot ends the second block's walk: 1 + 0.5 + 0.25
    torch.testing.assert_close(walk_block_weights(logits, mask), torch.tensor([[1 / 1.875, 1 / 1.75]]))
    sure = torch.full((1, 1, 3), 30.0)  # a block the draft expects to pass whole weighs 1 / (K + 1)
    torch.testing.assert_close(walk_block_weights(sure, torch.ones(1, 1, 3)), torch.tensor([[0.25]]))
    logits = torch.randn(2, 3, 4, requires_grad=True)
    assert not walk_block_weights(logits, torch.ones(2, 3, 4)).requires_grad  # a weight, not a training signal


@pytest.mark.parametrize("normalization", ["token", "sequence"])
def test_walk_weighting_scales_each_anchor_block_by_its_expected_visits(normalization):
    """anchor_weighting="walk" is the plain objective with every block's slot weights scaled by 1 / τ̂ of that
    block (values and gradients, against the naive reference), and it changes the loss."""
    target = make_tiny_target("llama").double()
    draft = tiny_dspark(target, num_anchors=4)
    input_ids, loss_mask = batch_for(target, rows=3)
    ctx, last = features(target, draft, input_ids)
    out = draft(input_ids, ctx, loss_mask, target_last_hidden=last, generator=torch.Generator().manual_seed(0))
    mask = out.eval_mask.double()
    tau_hat = 1 + torch.sigmoid(out.confidence_logits.detach()).mul(mask).cumprod(-1).sum(-1)
    walk = block_draft_loss(draft, out, anchor_weighting="walk", normalization=normalization)
    if normalization == "token":
        reference = naive_block_loss(draft, out, block_weight=1 / tau_hat)
    else:  # each row's own walk-weighted loss, averaged over the rows
        rows = [naive_block_loss(draft, _row(out, b, 0), block_weight=1 / tau_hat[b : b + 1]) for b in range(3)]
        reference = sum(rows) / 3
    torch.testing.assert_close(walk.loss, reference)
    for got, want in zip(grads_of(draft, walk.loss), grads_of(draft, reference)):
        torch.testing.assert_close(got, want)
    uniform = block_draft_loss(draft, out, normalization=normalization)
    assert not torch.allclose(walk.loss, uniform.loss)


def test_walk_weighting_needs_a_confidence_head_and_errors_name_the_fix():
    from hf_dspark.training import DraftTrainer, DraftTrainingArguments

    target = make_tiny_target("llama").double()
    dflash = DFlashModel.from_target(target, num_hidden_layers=1, block_size=4, num_anchors=4, dtype=torch.float64)
    input_ids, loss_mask = batch_for(target)
    ctx, last = features(target, dflash, input_ids)
    out = dflash(input_ids, ctx, loss_mask, target_last_hidden=last, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="use it with DSpark"):
        block_draft_loss(dflash, out, anchor_weighting="walk")
    with pytest.raises(ValueError, match="anchor_weighting must be one of uniform, walk"):
        block_draft_loss(dflash, out, anchor_weighting="visits")
    eagle = Eagle3Model.from_target(target, block_size=3, dtype=torch.float64)
    eagle_ctx, eagle_last = features(target, eagle, input_ids)
    eagle_out = eagle(input_ids, eagle_ctx, loss_mask, target_last_hidden=eagle_last)
    with pytest.raises(ValueError, match="keep anchor_weighting='uniform' for Eagle3"):
        eagle3_loss(eagle, eagle_out, anchor_weighting="walk")
    with tempfile.TemporaryDirectory() as out_dir:
        with pytest.raises(ValueError, match="anchor_weighting must be one of uniform, walk"):
            DraftTrainingArguments(output_dir=out_dir, anchor_weighting="visits", use_cpu=True, report_to=[])
        with pytest.raises(ValueError, match="loss_normalization must be one of token, sequence"):
            DraftTrainingArguments(output_dir=out_dir, loss_normalization="batch", use_cpu=True, report_to=[])
        args = DraftTrainingArguments(output_dir=out_dir, anchor_weighting="walk", use_cpu=True, report_to=[])
        with pytest.raises(ValueError, match="dflash draft has none: train DSpark"):
            DraftTrainer(model=dflash.float(), args=args, target_model=target.float(), train_dataset=[])
