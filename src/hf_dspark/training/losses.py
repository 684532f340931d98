"""Training objectives of the drafters (docs/ALGORITHMS.md, "DSpark / DFlash loss" and "Eagle3").

Block drafters (DSpark, DFlash), per valid slot k of a block, w_k = exp(-(k-1)/loss_decay_gamma):
    CE  = -log p_d(x*_k)                  p_d = softmax(softcap(lm_head(h_k) + W2 z_k))  (teacher forced)
    L1  = sum_v |p_d(v) - p_t(v)|         p_t = softmax(softcap(lm_head(target_hidden_k)))
    BCE = BCE(c_k, c*_k),  c*_k = clamp(1 - L1/2, 0, 1), detached
    SCE = -sum_v p_t(v) log p_d(v)       (soft_ce_loss_alpha: DSpark's default term with L1, in place of CE)
    L   = ce_loss_alpha * CE + l1_loss_alpha * L1 + soft_ce_loss_alpha * SCE + confidence_head_alpha * BCE
Eagle3, TTT step j (0-based), weight step_loss_decay ** j, masked by the step's eval_mask:
    SCE = -sum_v p_t(v) log p_d(v)        against the target distribution of that step
Each term is  sum(w * term over valid slots) / sum(w over valid slots),  numerators and denominators summed
over all data-parallel ranks ("token" normalization, the default). Eagle3 uses the same normalization with
w = step_loss_decay ** j over every valid (step, position) pair. normalization="sequence" instead averages each
sequence's normalized term over the sequences of the global batch (`_normalized`). anchor_weighting="walk"
(block drafters with a confidence head) first scales each anchor block's w by 1 / τ̂, the draft's own expected
tokens a round from that anchor (`walk_block_weights`), so the loss weighs blocks as decoding visits them.

Memory. The [slots, V] logits dominate (3584 x 151,936 at DeepSpec's shapes). `fused_head_loss` walks the
slots in row chunks sized so that one chunk's [rows, V] fp32 tensors stay within a fixed element budget, and
in each chunk does everything in one pass over the full vocabulary: draft and target logits, log-sum-exp,
CE / L1 / soft-CE / argmax agreement, and the gradient with respect to the hidden states, the Markov
features and W2 (the loss is linear in the per-slot terms with weights known up front, so the gradient can be
formed while the logits are live). Every logit is computed exactly once; backward only rescales the stored
gradients. Peak extra memory: about five [rows, V] fp32 buffers, independent of the number of slots.

Backends. `backend="torch"` is the row-chunked path above (matmuls + [rows, V] elementwise math, optionally
compiled). `backend="triton"` (`triton_head_loss.py`) computes the same function in rows x vocabulary tiles that
never leave the chip: up to three passes over the vocabulary recompute the logit tiles (log-sum-exps and
argmaxes; the L1 / soft-CE sums; the gradient tile and its products), so no [rows, V] tensor exists at all.
`backend="auto"` takes Triton for CUDA tensors when triton imports and the inputs are supported, else torch
(and torch for the rest of the process if the kernels ever fail).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .loss_buffers import DEFAULT_CHUNK_ELEMENTS, _addmm_acc_, _mm_acc, chunk_rows
from .loss_graphs import ROWS as graphs_rows, LossGraphs

from ..kernel_backends import KERNEL_BACKENDS, choose_kernel_backend
from ..metrics import training_acceptance_estimates

logger = logging.getLogger(__name__)

# -- the fused, row-chunked head loss ---------------------------------------------------------------------------


@dataclass
class HeadStats:
    """Per-row statistics of `fused_head_loss` (no gradient). Shapes [S]."""

    ce: torch.Tensor  # -log p_d(label)
    l1: torch.Tensor | None = None  # sum_v |p_d - p_t|
    soft_ce: torch.Tensor | None = None  # -sum_v p_t log p_d
    greedy_match: torch.Tensor | None = None  # argmax p_d == argmax p_t


def _logsumexp(x: torch.Tensor) -> torch.Tensor:
    """log sum_v exp(x_v) over the last dim, [n, 1]: written out so that inductor's online softmax folds the max
    and the sum of exponentials into one sweep (torch.logsumexp's decomposition is not matched)."""
    m = x.amax(-1, keepdim=True)
    return m + (x - m).exp_().sum(-1, keepdim=True).log_()


def _softcap_(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    if cap is not None:
        logits.div_(cap).tanh_().mul_(cap)
    return logits


def _chunk_math(u, ut, labels, w_ce, w_l1, w_soft, cap, grad_dtype):
    """Everything that touches [rows, V] after the matmuls, in place; the eager and the compiled path run this.

    u / ut: draft / target logits before soft-capping, fp32 [n, V], consumed in eager. Returns per-row (ce, l1,
    soft_ce, match) and g = d(sum_i w_ce ce_i + w_l1 l1_i + w_soft sce_i)/d(pre-softcap draft logits) [n, V] in
    grad_dtype (None: no gradient). Compiled, inductor makes this one kernel of up to three sweeps per row (max /
    sum-exp / argmax, then the row sums, then g, cast in the same pass); only p - q is stored in between.
    """
    if torch.compiler.is_compiling():
        # A mutated graph input is copied back after the kernel (a full pass each, read by nobody); the clones
        # cost nothing, inductor folds them into the kernel's loads.
        u, ut = u.clone(), None if ut is None else ut.clone()
    _softcap_(u, cap)
    capgrad = torch.div(u, cap).square_().neg_().add_(1.0) if cap is not None and grad_dtype is not None else None
    lse = _logsumexp(u)  # [n, 1]
    ce = (lse - u.gather(1, labels[:, None])).squeeze(1)
    l1 = soft_ce = match = diff = None
    if ut is not None:
        _softcap_(ut, cap)
        match = u.argmax(-1) == ut.argmax(-1)
        q = ut.sub_(_logsumexp(ut)).exp_()  # target probs, in place
        if w_soft is not None:
            # Row dot products as product-sums, which inductor fuses into its reductions (a bmm stays a gemv call);
            # eager, each holds one more [n, V] temporary than a bmm would.
            soft_ce = (lse - (q * u).sum(-1, keepdim=True)).squeeze(1)  # lse - sum_v q u
    p = u.sub_(lse).exp_()  # draft probs, in place
    if ut is not None:
        diff = q.neg_().add_(p)  # p - q, in place
        l1 = torch.linalg.vector_norm(diff, ord=1, dim=-1)
    if grad_dtype is None:
        return ce, l1, soft_ce, match, None
    # d CE/du = p - onehot;  d L1/du_v = p_v (sign_v - sum_w sign_w p_w);  d SCE/du = p - q.
    if w_l1 is not None:
        g = diff.sign()
        g.sub_((g * p).sum(-1, keepdim=True)).mul_(w_l1[:, None]).add_(w_ce[:, None]).mul_(p)
    else:
        g = p.mul_(w_ce[:, None])
    if w_soft is not None:
        g.addcmul_(diff, w_soft[:, None])
    if torch.compiler.is_compiling():  # a compare fuses into the elementwise pass; a scatter would split it in two
        g = g - torch.where(torch.arange(g.shape[1], device=g.device) == labels[:, None], w_ce[:, None], 0.0)
    else:  # eager: n elements, not [n, V]
        g.scatter_add_(1, labels[:, None], -w_ce[:, None])
    if capgrad is not None:
        g.mul_(capgrad)
    return ce, l1, soft_ce, match, g.to(grad_dtype)


_COMPILED_CHUNK_MATH = None
_TRITON_FAILED = False  # set when backend="auto" saw the Triton kernels fail: later calls go straight to torch
def _get_chunk_math(compile: bool):
    """torch.compile fuses the elementwise passes over [rows, V]; any compile failure falls back to eager."""
    global _COMPILED_CHUNK_MATH
    if not compile:
        return _chunk_math
    if _COMPILED_CHUNK_MATH is None:
        _COMPILED_CHUNK_MATH = torch.compile(_chunk_math, dynamic=False)
    return _COMPILED_CHUNK_MATH


def _triton_forward(hidden, markov, target_hidden, lm_weight, markov_weight, labels, w_ce, w_l1, w_soft, opts, need):
    """The same outputs as the chunked loop, from the Triton kernels: (loss, grads, per-row stats)."""
    from .triton_head_loss import triton_head_loss

    dtype = opts["dtype"]
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    res = triton_head_loss(
        cast(hidden), cast(lm_weight), labels, w_ce, target_hidden=cast(target_hidden), markov=cast(markov),
        markov_weight=cast(markov_weight), w_l1=w_l1, w_soft=w_soft, softcap=opts["softcap"],
        grads=(need[0], need[1], need[4]), chunk_elements=opts["chunk_elements"],
    )  # fmt: skip
    grad_h = res.grad_hidden.to(hidden.dtype) if res.grad_hidden is not None else None
    grad_z = res.grad_markov.to(markov.dtype) if res.grad_markov is not None else None
    return res.loss, (grad_h, grad_z, res.grad_markov_weight), (res.ce, res.l1, res.soft_ce, res.greedy_match)


def _pad_rows(t: torch.Tensor, pad: int) -> torch.Tensor:
    """t [n, ...] -> [n + pad, ...] with zero rows appended."""
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


class _FusedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, markov, target_hidden, lm_weight, markov_weight, labels, w_ce, w_l1, w_soft, opts):
        global _TRITON_FAILED
        need = ctx.needs_input_grad
        if opts["backend"] == "triton":
            try:
                loss, grads, per_row = _triton_forward(
                    hidden, markov, target_hidden, lm_weight, markov_weight, labels, w_ce, w_l1, w_soft, opts, need
                )
                return _FusedHeadLoss._finish(ctx, grads, markov_weight, loss, per_row, hidden.device)
            except Exception as err:  # noqa: BLE001 - "auto" promises a working loss: the torch path is exact
                if not opts["auto"]:
                    raise
                logger.warning("Triton loss failed (%s: %s); using the PyTorch path", type(err).__name__, err)
                _TRITON_FAILED = True
        loss, grads, per_row = _chunked_head_loss(hidden, markov, target_hidden, lm_weight, markov_weight, labels, w_ce,
                                                  w_l1, w_soft, opts, tuple(need[:5]))  # fmt: skip
        return _FusedHeadLoss._finish(ctx, grads, markov_weight, loss, per_row, hidden.device)

    @staticmethod
    def _finish(ctx, grads, markov_weight, loss, per_row, device):
        """Keep the gradients for backward; return (loss, ce, l1, soft_ce, match) with empty tensors for None."""
        ctx.save_for_backward(*(t if t is not None else torch.empty(0) for t in grads))
        ctx.has = tuple(t is not None for t in grads)
        ctx.w2_dtype = markov_weight.dtype if markov_weight is not None else None
        outs = [t if t is not None else torch.empty(0, device=device) for t in per_row]
        ctx.mark_non_differentiable(*outs)
        return (loss, *outs)

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        # The loss is linear in the stored per-row gradients: backward only rescales them.
        grad_h, grad_z, grad_w2 = (
            (t * grad_loss.to(t.dtype)) if has else None for has, t in zip(ctx.has, ctx.saved_tensors)
        )
        if grad_w2 is not None:
            grad_w2 = grad_w2.to(ctx.w2_dtype)  # accumulated in fp32
        return grad_h, grad_z, None, None, grad_w2, None, None, None, None, None


def _chunked_head_loss(hidden, markov, target_hidden, lm_weight, markov_weight, labels, w_ce, w_l1, w_soft, opts,
                       need) -> tuple:  # fmt: skip
    """The PyTorch backend of `_FusedHeadLoss.forward`, row chunk by row chunk: (loss, (grad_hidden, grad_markov,
    grad_markov_weight), per-row (ce, l1, soft_ce, match)). `need`: which of the first five inputs want a gradient.
    With `opts["graphs"]` (`loss_graphs.LossGraphs`) on CUDA the chunks replay from CUDA graphs where it serves."""
    global _COMPILED_CHUNK_MATH
    cap, rows, dtype = opts["softcap"], opts["rows"], opts["dtype"]
    acc = torch.promote_types(dtype, torch.float32)  # fp32 (fp64 in exactness tests)
    grad_dtype = dtype if any(need) else None
    math_fn = _get_chunk_math(opts["compile"])
    width = hidden.shape[1]
    graphs = opts.get("graphs")
    out = None
    if graphs is not None and graphs.serves(hidden):
        out = _replayed_chunks(graphs, hidden, markov, target_hidden, lm_weight, markov_weight, labels, w_ce, w_l1,
                               w_soft, opts, need, acc, grad_dtype, math_fn)  # fmt: skip
    if out is not None:
        grad_in, grad_w2, per_row = out["grad"], out["grad_w2"], [out[k] for k in ("ce", "l1", "soft_ce", "match")]
    else:
        W = lm_weight.to(dtype)  # [V, d]
        W2 = markov_weight.to(dtype) if markov is not None else None  # [V, r]
        cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731 - once, not per chunk
        hidden_c, markov_c, target_c = cast(hidden), cast(markov), cast(target_hidden)
        # The draft's logits in one product, [h, z] @ [W, W2]^T: the Markov bias accumulates inside the GEMM. Added
        # by a second GEMM it read and wrote the whole fp32 [rows, V] buffer again, a memory-bound pass slower than
        # the product itself (the concatenated weight is one copy of [V, d + r] a call).
        draft_in, draft_w = hidden_c, W
        if markov is not None:
            draft_in, draft_w = torch.cat([hidden_c, markov_c], 1), torch.cat([W, W2], 1)  # [S, d + r], [V, d + r]
        # Both input gradients in one buffer, [S, d (+ r)] in the compute dtype: each chunk's `g @ [W, W2]` is
        # written into its rows (cast to the inputs' dtypes once, after the loop, where they differ).
        grad_in = draft_in.new_empty(draft_in.shape) if need[0] or need[1] else None
        grad_w2 = torch.zeros(markov_weight.shape, dtype=acc, device=W.device) if need[4] else None
        stats = {"ce": [], "l1": [], "soft_ce": [], "match": []}
        for start in range(0, hidden.shape[0], rows):
            sl = slice(start, start + rows)
            n = min(rows, hidden.shape[0] - start)
            # The compiled math sees one shape only: the last, shorter chunk is padded with zero-weight rows
            # (one compilation instead of one per distinct chunk length; the padding is < one chunk per step).
            pad = rows - n if math_fn is not _chunk_math else 0
            padded = lambda t: None if t is None else _pad_rows(t[sl], pad)  # noqa: E731
            chunk = (padded(draft_in), padded(markov_c), padded(target_c), padded(labels), padded(w_ce),
                     padded(w_l1), padded(w_soft))  # fmt: skip
            dest = None if grad_in is None else grad_in[sl]
            try:
                terms = _chunk(math_fn, *chunk, draft_w, W, acc, cap, grad_dtype, dest, grad_w2, n)
            except Exception as err:  # noqa: BLE001 - whatever the compiler raises, eager is correct
                if math_fn is _chunk_math:
                    raise
                logger.warning("compiled loss math failed (%s: %s); using eager", type(err).__name__, err)
                _COMPILED_CHUNK_MATH = math_fn = _chunk_math
                terms = _chunk(math_fn, *chunk, draft_w, W, acc, cap, grad_dtype, dest, grad_w2, n)
            for key, value in zip(stats, terms):
                stats[key].append(value)
        per_row = [torch.cat(v) if v and v[0] is not None else None for v in stats.values()]
    # The weighted sums once over all rows: a few small kernels a call instead of a few a chunk.
    loss = torch.zeros((), dtype=acc, device=hidden.device)
    for w, term in zip((w_ce, w_l1, w_soft), per_row):
        if w is not None and term is not None:
            loss += (w * term).sum()
    grad_h = grad_in[:, :width].to(hidden.dtype) if need[0] else None
    grad_z = grad_in[:, width:].to(markov.dtype) if need[1] else None
    return loss, (grad_h, grad_z, grad_w2), per_row


def _chunk(math_fn, h, z, th, labels, a, b, c, draft_w, W, acc, cap, grad_dtype, grad_out, grad_w2, n=None):
    """One row chunk: the draft's logits ([h, z] @ draft_w^T, h holding z's columns too when there is a Markov
    head) and the target's (th @ W^T), the vocabulary-wide math, and the gradient products: `g @ draft_w` into
    grad_out (the chunk's rows of the input gradients) and `g^T z` added into grad_w2. `n`: the real rows of a
    chunk padded with zero-weight ones (None: all). Returns the per-row (ce, l1, soft_ce, match)."""
    u = _mm_acc(h, draft_w.T, acc)
    ut = _mm_acc(th, W.T, acc) if th is not None else None
    ce, l1, soft_ce, match, g = math_fn(u, ut, labels, a, b, c, cap, grad_dtype)
    if n is not None and n < h.shape[0]:
        ce, l1, soft_ce, match = (None if t is None else t[:n] for t in (ce, l1, soft_ce, match))
        g = None if g is None else g[:n]
        z = None if z is None else z[:n]
    if g is not None:  # [n, V], already in the compute dtype
        if grad_out is not None:  # one read of g for both input gradients: g @ [W, W2]
            torch.mm(g, draft_w, out=grad_out)
        if grad_w2 is not None:
            _addmm_acc_(grad_w2, g.T, z)
    return ce, l1, soft_ce, match


def _replayed_chunks(graphs, hidden, markov, target_hidden, lm_weight, markov_weight, labels, w_ce, w_l1, w_soft,
                     opts, need, acc, grad_dtype, math_fn) -> dict | None:  # fmt: skip
    """`_chunked_head_loss`'s chunks through `graphs` (one CUDA graph per chunk index over static buffers):
    the outputs by name, or None where the graphs do not serve the call."""
    dtype, width = opts["dtype"], hidden.shape[1]
    rank = 0 if markov is None else markov.shape[1]
    vocab = lm_weight.shape[0]
    # What the graphs read besides their static buffers: the weights at these addresses (their values may change
    # in place, as the optimizer changes W2) and the settings.
    weights = tuple(None if w is None else (w.data_ptr(), tuple(w.shape), w.dtype) for w in (lm_weight, markov_weight))
    key = (opts["softcap"], opts["rows"], dtype, need, opts["compile"], weights, width, rank,
           None if target_hidden is None else target_hidden.shape[1], tuple(w is None for w in (w_l1, w_soft)))
    has_target = target_hidden is not None
    per_row = lambda held, present=True: ((graphs_rows, ), held) if present else None  # noqa: E731
    out_shapes = {
        "grad": ((graphs_rows, width + rank), dtype) if need[0] or need[1] else None,
        "ce": per_row(acc), "l1": per_row(acc, has_target), "soft_ce": per_row(acc, has_target and w_soft is not None),
        "match": per_row(torch.bool, has_target), "grad_w2": ((vocab, rank), acc) if need[4] else None,
    }  # fmt: skip

    def prepare(work, outputs):  # chunk 0: the products' weights, the W2 gradient's accumulator
        work["w"][:, :width].copy_(lm_weight)
        if markov is not None:
            work["w"][:, width:].copy_(markov_weight)
        if outputs["grad_w2"] is not None:
            outputs["grad_w2"].zero_()

    def chunk(work, h, z, th, labels, a, b, c, grad_out, grad_w2):
        w = work["w"]
        return _chunk(math_fn, h, z, th, labels, a, b, c, w, w[:, :width], acc, opts["softcap"], grad_dtype,
                      grad_out, grad_w2)  # fmt: skip

    inputs = {"h": hidden if markov is None else (hidden, markov), "th": target_hidden, "labels": labels,
              "a": w_ce, "b": w_l1, "c": w_soft}  # fmt: skip
    return graphs.run(key, inputs, dtype, opts["rows"], out_shapes, {"w": ((vocab, width + rank), dtype)}, prepare,
                      chunk)


def _compute_dtype(tensor: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    device_type = tensor.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


BACKENDS = KERNEL_BACKENDS


def resolve_backend(backend: str, hidden: torch.Tensor, lm_weight: torch.Tensor, target_hidden, dtype) -> str:
    """"triton" or "torch" for these inputs (see the module docstring); errors name the fix."""
    return choose_kernel_backend("loss", backend, f"{__package__}.triton_head_loss",
                                 (hidden, lm_weight, target_hidden, dtype),
                                 prefer_torch=not hidden.is_cuda or _TRITON_FAILED)  # fmt: skip


def fused_head_loss(
    hidden: torch.Tensor,
    lm_weight: torch.Tensor,
    labels: torch.Tensor,
    ce_weight: torch.Tensor,
    *,
    target_hidden: torch.Tensor | None = None,
    markov_features: torch.Tensor | None = None,
    markov_weight: torch.Tensor | None = None,
    l1_weight: torch.Tensor | None = None,
    soft_ce_weight: torch.Tensor | None = None,
    softcap: float | None = None,
    chunk_elements: int | None = None,
    compile: bool = False,
    backend: str = "auto",
    row_mask: torch.Tensor | None = None,
    max_rows: int | None = None,
    graphs: LossGraphs | None = None,
) -> tuple[torch.Tensor, HeadStats]:
    """sum_i ce_weight_i CE_i + l1_weight_i L1_i + soft_ce_weight_i SCE_i over rows, without [S, V] tensors.

    hidden [S, d] (final-normed draft states), lm_weight [V, d], labels [S]; per-row weights [S] (no gradient);
    target_hidden [S, d_t] (the target's final hidden state; needed for L1 / SCE / argmax agreement);
    markov_features [S, r] and markov_weight [V, r] (W2) add the Markov bias before soft-capping.
    Gradients flow to hidden, markov_features and markov_weight; lm_weight must be frozen.
    backend: "auto" | "triton" | "torch" (module docstring). compile applies to "torch" only; chunk_elements
    bounds the [rows, V] buffers of "torch" (and of the Triton kernels' "chunked" gradient mode).
    row_mask [S] (bool): rows whose weights are all zero may be listed as False; only the True rows reach the
    vocabulary-wide kernels and the others get zero statistics and zero gradient. Training batches are up to ~40%
    such rows (dummy anchors of short sequences, slots past the end), and the loss is most of a step. Counting
    the True rows makes the host wait for the device, unless `max_rows` (an int the host knows, at least their
    number: `DraftPreTrainedModel.loss_rows_bound_fn`) sizes the buffer: then the True rows in order, and past
    their number rows with zero weights.
    graphs (`loss_graphs.LossGraphs`, the trainer's `loss_cuda_graphs`): the PyTorch backend's chunks on CUDA
    replayed from one CUDA graph per chunk index, so the host issues a launch a chunk instead of its kernels.
    Returns (scalar fp32 loss, HeadStats with per-row ce / l1 / soft_ce / greedy_match).
    """
    if row_mask is not None:
        return _masked_rows_loss(
            row_mask, hidden, lm_weight, labels, ce_weight, target_hidden=target_hidden,
            markov_features=markov_features, markov_weight=markov_weight, l1_weight=l1_weight,
            soft_ce_weight=soft_ce_weight, softcap=softcap, chunk_elements=chunk_elements, compile=compile,
            backend=backend, max_rows=max_rows, graphs=graphs,
        )
    if (l1_weight is not None or soft_ce_weight is not None) and target_hidden is None:
        raise ValueError("the L1 and soft cross-entropy terms need target_hidden (the target's final hidden states)")
    if (markov_features is None) != (markov_weight is None):
        raise ValueError("markov_features and markov_weight (W2) go together")
    if lm_weight.requires_grad:
        raise ValueError(
            "lm_weight requires grad, but the draft's lm_head is the target's and stays frozen: call "
            "draft.freeze_target_io() (fused_head_loss computes no lm_head gradient)"
        )
    dtype = _compute_dtype(hidden, lm_weight)
    opts = {
        "softcap": softcap,
        "rows": chunk_rows(lm_weight.shape[0], chunk_elements),
        "chunk_elements": chunk_elements,
        "compile": compile,
        "dtype": dtype,
        "backend": resolve_backend(backend, hidden, lm_weight, target_hidden, dtype),
        "auto": backend == "auto",
        "graphs": graphs,
    }
    acc_dtype = torch.promote_types(dtype, torch.float32)
    detach = lambda t: None if t is None else t.detach().to(acc_dtype)  # noqa: E731
    with torch.autocast(hidden.device.type, enabled=False):
        loss, ce, l1, soft_ce, match = _FusedHeadLoss.apply(
            hidden,
            markov_features,
            target_hidden,
            lm_weight,
            markov_weight,
            labels,
            detach(ce_weight),
            detach(l1_weight),
            detach(soft_ce_weight),
            opts,
        )
    has_target = target_hidden is not None
    return loss, HeadStats(
        ce=ce,
        l1=l1 if has_target else None,
        soft_ce=soft_ce if soft_ce_weight is not None else None,
        greedy_match=match if has_target else None,
    )


def _masked_rows_loss(
    row_mask, hidden, lm_weight, labels, ce_weight, max_rows=None, **kwargs
) -> tuple[torch.Tensor, HeadStats]:
    """`fused_head_loss` over the rows where row_mask is True; zero statistics (and gradient) for the others."""
    if row_mask.shape != labels.shape:
        raise ValueError(f"row_mask has shape {tuple(row_mask.shape)}, expected one entry per row {tuple(labels.shape)}")
    rows = labels.shape[0]
    row_mask = row_mask.reshape(-1).bool()
    if max_rows is None:
        keep = row_mask.nonzero().squeeze(1)  # the host waits for the device to count the rows
        if keep.numel() == rows:
            return fused_head_loss(hidden, lm_weight, labels, ce_weight, **kwargs)
        real = None
        size = keep.numel()
    else:
        size = min(max(int(max_rows), 0), rows)
        # The True rows first, in their order, then False ones: their weights are zeroed below. No read-back.
        keep = torch.argsort((~row_mask).to(torch.uint8), stable=True)[:size]
        real = row_mask.index_select(0, keep)
        # a bound below the count would drop rows silently: fail instead (on CUDA without waiting for it)
        torch._assert_async(row_mask.sum() <= size, "max_rows is below the number of loss rows")
    if size == 0:
        return _no_rows_loss(rows, hidden, lm_weight, **kwargs)
    if kwargs.get("graphs") is not None:  # static buffers for every row this batch shape can have
        kwargs["graphs"].reserve(rows)
    pick = lambda t: None if t is None else t.index_select(0, keep)  # noqa: E731
    # padding rows (max_rows above the count): zero weights, a valid label, statistics dropped when spread back
    only_real = lambda t: t if real is None or t is None else torch.where(real, t, torch.zeros_like(t))  # noqa: E731
    for key in ("target_hidden", "markov_features"):
        kwargs[key] = pick(kwargs.get(key))
    for key in ("l1_weight", "soft_ce_weight"):
        kwargs[key] = only_real(pick(kwargs.get(key)))
    labels, ce_weight = only_real(pick(labels)), only_real(pick(ce_weight))
    loss, stats = fused_head_loss(pick(hidden), lm_weight, labels, ce_weight, **kwargs)

    def spread(t):  # [kept] -> [rows], zeros elsewhere
        return None if t is None else t.new_zeros(rows).index_copy_(0, keep, only_real(t))

    return loss, HeadStats(*(spread(getattr(stats, f)) for f in ("ce", "l1", "soft_ce", "greedy_match")))


def _no_rows_loss(rows, hidden, lm_weight, **kwargs) -> tuple[torch.Tensor, HeadStats]:
    """Nothing to learn from: a zero loss that still reaches every input (DDP), zero statistics."""
    zero = hidden.sum() * 0.0
    if kwargs.get("markov_features") is not None:
        zero = zero + kwargs["markov_features"].sum() * 0.0
    if kwargs.get("markov_weight") is not None and kwargs["markov_weight"].requires_grad:
        zero = zero + kwargs["markov_weight"].sum() * 0.0
    has_target = kwargs.get("target_hidden") is not None
    acc = torch.promote_types(_compute_dtype(hidden, lm_weight), torch.float32)
    stat = hidden.new_zeros(rows, dtype=acc)
    return zero.to(acc), HeadStats(
        ce=stat, l1=stat if has_target else None,
        soft_ce=stat if kwargs.get("soft_ce_weight") is not None else None,
        greedy_match=torch.zeros(rows, dtype=torch.bool, device=hidden.device) if has_target else None,
    )


# -- objectives ---------------------------------------------------------------------------------------------------


@dataclass
class DraftLossOutput:
    """What one training batch contributes.

    loss: the scalar to backpropagate. It is `world_size * (this rank's numerator) / (global denominator)`, so
    the average over ranks (what DDP/DeepSpeed do to gradients and Trainer does to the logged loss) equals the
    global formula. terms: detached, this rank's share of each loss term (their sum over ranks is the global
    term). estimates: detached local sums for the training-time acceptance estimates (sum over ranks, then
    divide: tau_prob = tau_prob_sum / blocks, accept@k = accept_sum[k] / accept_count[k]). blocks: detached
    per-block tensors [B, N, K] (accept_rate, greedy_match, eval_mask) for estimates that need every block, such
    as the evaluation's decoding walk (`metrics.decoding_walk_estimates`).
    """

    loss: torch.Tensor
    terms: dict[str, torch.Tensor] = field(default_factory=dict)
    estimates: dict[str, torch.Tensor] = field(default_factory=dict)
    blocks: dict[str, torch.Tensor] = field(default_factory=dict)


def global_sum(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(sum of `tensor` over all data-parallel ranks, world size); a no-op outside torch.distributed."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensor, 1
    tensor = tensor.detach().clone()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor, dist.get_world_size()


def slot_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for k = 1..K (gamma = 0 keeps the first slot only)."""
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    if gamma == 0:
        return (k == 0).float()
    return torch.exp(-k / gamma)


NORMALIZATIONS = ("token", "sequence")


def _normalized(weight: torch.Tensor, normalization: str, sequence_dim: int) -> tuple[torch.Tensor, int]:
    """(w_norm, world): per-slot weights whose sum over all ranks is 1, and the data-parallel world size.

    "token": every supervised slot counts alike, w / sum(w) over all ranks (long answers weigh more).
    "sequence": each sequence's slots share one unit, then sequences are averaged over all ranks (as the reference
    implementation normalizes), w / sum(w of its sequence) / number of sequences with a supervised slot.
    """
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"loss normalization must be one of {', '.join(NORMALIZATIONS)}, got {normalization!r}")
    tiny = torch.finfo(torch.float32).tiny
    if normalization == "token":
        denom, world = global_sum(weight.sum())
        return weight / denom.clamp_min(tiny), world
    dims = [d for d in range(weight.dim()) if d != sequence_dim]
    per_sequence = weight.sum(dim=dims, keepdim=True)  # [1.., B, ..1]
    count, world = global_sum((per_sequence > 0).sum().float())
    return weight / per_sequence.clamp_min(tiny) / count.clamp_min(1.0), world


ANCHOR_WEIGHTINGS = ("uniform", "walk")


def walk_block_weights(confidence_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, N]: 1 / (1 + expected accepted slots) of each anchor block, from the confidence head's c_k = P(slot k
    accepted | slots < k accepted), detached. Decoding starts a round where the last one ended, so it visits an
    anchor about once every τ tokens: blocks the draft finds hard are visited (and cost rounds) more often than
    their share of uniformly sampled anchors. Weighting blocks by 1 / τ̂ trains on the decoding walk's mix."""
    accept = torch.sigmoid(confidence_logits.detach().float()) * mask  # an unsupervised slot ends the product
    return 1.0 / (1.0 + accept.cumprod(dim=-1).sum(dim=-1))


def block_draft_loss(
    draft, outputs, *, chunk_elements: int | None = None, compile: bool = False, backend: str = "auto",
    normalization: str = "token", max_rows: int | None = None, anchor_weighting: str = "uniform",
    graphs: LossGraphs | None = None,
) -> DraftLossOutput:
    """DSpark / DFlash objective from a `BlockDraftOutput` (see the module docstring; `normalization`: `_normalized`).

    anchor_weighting: "uniform" (every anchor block alike) or "walk" (each block weighted by `walk_block_weights`,
    before normalization; needs the confidence head, i.e. DSpark)."""
    cfg = draft.config
    hidden = outputs.hidden_states  # [B, N, K, d]
    K, d = hidden.shape[-2], hidden.shape[-1]
    mask = outputs.eval_mask.float()  # [B, N, K]
    slot_weight = mask * slot_weights(K, cfg.loss_decay_gamma, hidden.device)
    if anchor_weighting not in ANCHOR_WEIGHTINGS:
        raise ValueError(f"anchor_weighting must be one of {', '.join(ANCHOR_WEIGHTINGS)}, got {anchor_weighting!r}")
    if anchor_weighting == "walk":
        if outputs.confidence_logits is None:
            raise ValueError(
                "anchor_weighting='walk' reads the draft's confidence head, and this draft has none: use it with "
                "DSpark (enable_confidence_head=True), or keep anchor_weighting='uniform'"
            )
        slot_weight = slot_weight * walk_block_weights(outputs.confidence_logits, mask)[..., None]
    weight, world = _normalized(slot_weight, normalization, 0)
    row_w = (weight * world).reshape(-1)

    target_hidden = outputs.target_hidden_states
    soft = getattr(cfg, "soft_ce_loss_alpha", 0.0)
    needs_target = (cfg.l1_loss_alpha > 0 or soft > 0
                    or (cfg.confidence_head_alpha > 0 and outputs.confidence_logits is not None))  # fmt: skip
    if target_hidden is None and needs_target:
        raise ValueError(
            "the L1, soft cross-entropy and confidence terms need the target's final hidden states: pass "
            "target_last_hidden to the draft's forward (a target cache stores them; online training computes them)"
        )
    markov = outputs.markov_features
    loss, stats = fused_head_loss(
        hidden.reshape(-1, d),
        draft.lm_head.weight,
        outputs.labels.reshape(-1),
        cfg.ce_loss_alpha * row_w,
        target_hidden=None if target_hidden is None else target_hidden.reshape(-1, target_hidden.shape[-1]),
        markov_features=None if markov is None else markov.reshape(-1, markov.shape[-1]),
        markov_weight=None if markov is None else draft.markov_head.markov_w2.weight,
        l1_weight=cfg.l1_loss_alpha * row_w if cfg.l1_loss_alpha > 0 else None,
        soft_ce_weight=soft * row_w if soft > 0 else None,
        softcap=cfg.final_logit_softcapping,
        chunk_elements=chunk_elements,
        compile=compile,
        backend=backend,
        row_mask=(mask > 0).reshape(-1),
        max_rows=max_rows,
        graphs=graphs,
    )
    shape = weight.shape
    terms = {"loss_ce": (weight * stats.ce.view(shape)).sum()}
    if stats.soft_ce is not None:
        terms["loss_soft_ce"] = (weight * stats.soft_ce.view(shape)).sum()
    estimates = {"supervised_tokens": mask.sum()}
    blocks = {}
    if stats.l1 is not None:
        l1 = stats.l1.view(shape)
        accept = (1 - 0.5 * l1).clamp(0, 1)  # c*_k: the acceptance probability of slot k
        terms["loss_l1"] = (weight * l1).sum()
        if outputs.confidence_logits is not None:
            bce = F.binary_cross_entropy_with_logits(outputs.confidence_logits.float(), accept, reduction="none")
            # Added even when confidence_head_alpha is 0, so DDP sees a gradient for every parameter.
            loss = loss + cfg.confidence_head_alpha * (weight * world * bce).sum()
            terms["loss_conf"] = (weight * bce).sum().detach()
        match = stats.greedy_match.view(shape)
        estimates.update(training_acceptance_estimates(accept, match, outputs.eval_mask))
        blocks = {"accept_rate": accept.detach(), "greedy_match": match.detach(), "eval_mask": outputs.eval_mask}
    return DraftLossOutput(loss=loss, terms=terms, estimates=estimates, blocks=blocks)


def eagle3_loss(
    draft, outputs, *, chunk_elements: int | None = None, compile: bool = False, backend: str = "auto",
    normalization: str = "token", max_rows: int | None = None, anchor_weighting: str = "uniform",
    graphs: LossGraphs | None = None,
) -> DraftLossOutput:
    """Eagle3 training-time-test objective from an `Eagle3Output` (see the module docstring)."""
    if anchor_weighting != "uniform":
        raise ValueError(
            f"anchor_weighting={anchor_weighting!r} weights anchor blocks, and Eagle3 trains on every position: "
            "keep anchor_weighting='uniform' for Eagle3"
        )
    cfg = draft.config
    hidden = outputs.hidden_states  # [J, B, T, d]
    J, d = hidden.shape[0], hidden.shape[-1]
    if outputs.target_hidden_states is None:
        raise ValueError(
            "Eagle3 is trained against the target's distribution: pass target_last_hidden to the draft's forward"
        )
    mask = outputs.eval_mask.float()  # [J, B, T]
    decay = cfg.step_loss_decay ** torch.arange(J, dtype=torch.float32, device=hidden.device)
    weight, world = _normalized(mask * decay[:, None, None], normalization, 1)
    row_w = (weight * world).reshape(-1)
    target_hidden = outputs.target_hidden_states
    loss, stats = fused_head_loss(
        hidden.reshape(-1, d),
        draft.lm_head.weight,
        outputs.labels.reshape(-1),
        torch.zeros_like(row_w),
        target_hidden=target_hidden.reshape(-1, target_hidden.shape[-1]),
        soft_ce_weight=row_w,
        softcap=cfg.final_logit_softcapping,
        chunk_elements=chunk_elements,
        compile=compile,
        backend=backend,
        row_mask=(mask > 0).reshape(-1),
        max_rows=max_rows,
        graphs=graphs,
    )
    shape = weight.shape
    terms = {"loss_soft_ce": (weight * stats.soft_ce.view(shape)).sum()}
    # Position t drafts steps 0..J-1 in one round: estimates treat [B, T] as blocks of J slots.
    to_blocks = lambda x: x.view(shape).permute(1, 2, 0)  # noqa: E731
    accept = (1 - 0.5 * to_blocks(stats.l1)).clamp(0, 1)
    estimates = {"supervised_tokens": mask.sum()}
    match, eval_mask = to_blocks(stats.greedy_match), to_blocks(outputs.eval_mask)
    estimates.update(training_acceptance_estimates(accept, match, eval_mask))
    blocks = {"accept_rate": accept.detach(), "greedy_match": match.detach(), "eval_mask": eval_mask}
    return DraftLossOutput(loss=loss, terms=terms, estimates=estimates, blocks=blocks)


# Training objectives by the name a drafter's registry entry gives (DrafterSpec.objective).
OBJECTIVES = {"block": block_draft_loss, "eagle3": eagle3_loss}


def draft_loss(draft, outputs, **kwargs) -> DraftLossOutput:
    """The objective the draft's registry entry names (block drafters or Eagle3)."""
    from ..models import drafter_spec

    return OBJECTIVES[drafter_spec(draft.config.model_type).objective](draft, outputs, **kwargs)


__all__ = [
    "ANCHOR_WEIGHTINGS",
    "DEFAULT_CHUNK_ELEMENTS",
    "DraftLossOutput",
    "BACKENDS",
    "HeadStats",
    "OBJECTIVES",
    "block_draft_loss",
    "chunk_rows",
    "draft_loss",
    "eagle3_loss",
    "fused_head_loss",
    "global_sum",
    "slot_weights",
    "walk_block_weights",
]
