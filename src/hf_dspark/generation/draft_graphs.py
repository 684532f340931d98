"""The draft's per-round work on fixed shapes, replayed as CUDA graphs.

Profiled at batch 1 on an H200 (SmolLM2-135M target, 2-layer DSpark draft), the draft's eager proposal and
context extension cost ~13 ms of host time per round, half a target decode step, although its GPU work is a
fraction of a millisecond: the round was dispatch-bound. Both are pure functions of fixed-size state, so they are
captured once (after a call's prefill) and replayed (one launch each); the runner, its context cache and graphs
are kept per draft for later calls with the same rows, sampling settings and a fitting capacity
(`static_draft_runner`), since capturing costs a few eager rounds:

- every row of the run keeps its slot (rows that finished keep running, unread: shapes never change);
- the draft's context cache has a fixed capacity (`DraftContextCache.fixed`, reset per call) and attention
  reads all of it under the key mask;
- propose always drafts the configured number of tokens (the decoding loop uses a prefix near the token
  budget; slots are drawn left to right, so a prefix has the same law);
- extend always takes `num_tokens + 1` positions, of which each row commits a prefix (its count).

Inputs are copied into static buffers before a replay and outputs read from the captured tensors. The same
code runs eagerly where there is no CUDA (the CPU tests exercise it), so the captured and the eager runs compute
one function. Graphs need position-free logits processors (the draft reads no sequence) and a non-sliding target.
"""

from __future__ import annotations

import logging
import weakref

import torch

from ..models.modeling_draft import DraftProposal
from .cuda_graphs import capture, capture_or_uncompiled, captured_or_warned, kept_runner

logger = logging.getLogger(__name__)


class StaticDraftRunner:
    """Propose / extend for all `rows` of a run through static buffers (CUDA graphs on CUDA when `capture`)."""

    def __init__(self, draft, cache, sampler, num_tokens: int, capture: bool, compile: bool = False,
                 candidates: int = 1):
        self._draft = weakref.ref(draft)  # runners are kept per draft (static_draft_runner): no cycle through it
        self.cache, self.sampler = cache, sampler
        self.num_tokens = int(num_tokens)
        self.candidates = int(candidates)  # > 1: k chains a round (`propose_chains`), for a tree round
        self.width = self.num_tokens + 1  # committed positions per round: accepted drafts + the new token
        rows, device = cache.batch_size, cache.device
        feature_width = draft.config.num_context_features * draft.config.target_hidden_size
        self.anchor_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.features = torch.zeros(rows, self.width, feature_width, dtype=cache.keys[0].dtype, device=device)
        self.counts = torch.zeros(rows, dtype=torch.long, device=device)  # committed positions per row (a prefix)
        self.next_ids = torch.zeros(rows, self.width, dtype=torch.long, device=device)
        cache.fixed = True
        self.capture = capture and device.type == "cuda"
        self._propose_graph = self._extend_graph = None
        self._proposal: DraftProposal | None = None
        # What runs (and is captured): the two functions, or their compiled versions (dspark_compile_draft).
        self.compiled = bool(compile)
        self._propose_fn, self._extend_fn = self._run_propose, self._run_extend
        if compile:
            # fallback_random: the draws stay eager ATen random calls on the sampler's generator, so a compiled
            # proposal samples exactly what the uncompiled one does (inductor would make its own random numbers).
            self._propose_fn = torch.compile(self._run_propose, dynamic=False, options={"fallback_random": True})
            self._extend_fn = torch.compile(self._run_extend, dynamic=False)

    def reset(self) -> None:
        """Before a call's prefill: an empty context cache (buffers and graphs stay)."""
        self.cache.lengths.zero_()
        self.cache.bound = 0

    def ready(self) -> bool:
        """After the prefill (Eagle3's propose reads state the prefill creates): capture once if asked; whether the
        rounds replay graphs."""
        if self.capture and self._propose_graph is None and not captured_or_warned("drafting", self._capture):
            self._propose_graph = self._extend_graph = None
            self.capture = False
        return self.captured

    @property
    def draft(self):
        return self._draft()

    # -- the two functions ------------------------------------------------------------------------------------

    def _run_propose(self) -> DraftProposal:
        if self.candidates > 1:
            return self.draft.propose_chains(self.cache, self.anchor_ids, sampler=self.sampler,
                                             num_tokens=self.num_tokens, candidates=self.candidates)  # fmt: skip
        # No caller reads the raw logits: not building them saves a cast per slot and their stack.
        return self.draft.propose(
            self.cache, self.anchor_ids, sampler=self.sampler, num_tokens=self.num_tokens, return_logits=False
        )

    def _run_extend(self) -> None:
        self.draft.extend_context(
            self.cache, self.features, counts=self.counts, next_token_ids=self.next_ids, max_committed=self.width
        )

    def _capture(self) -> None:
        # Extension warms up with no committed position: it writes only past every row's length, advances nothing.
        def both():
            pool = torch.cuda.graph_pool_handle()
            self._propose_graph, self._proposal = capture(self._propose_fn, pool=pool)
            self._extend_graph, _ = capture(self._extend_fn, before_warmup=self.counts.zero_, pool=pool)

        capture_or_uncompiled("draft functions", both, self.compiled, self._uncompile)

    def _uncompile(self) -> None:
        self._propose_fn, self._extend_fn, self.compiled = self._run_propose, self._run_extend, False

    @property
    def captured(self) -> bool:
        return self._propose_graph is not None

    # -- what the decoding loop calls -----------------------------------------------------------------------

    def propose(self, local_rows: torch.Tensor, anchors: torch.Tensor, num_tokens: int) -> DraftProposal:
        """Proposals for the running rows (`local_rows`: their slots in this run) after `anchors` [R]."""
        full = self._propose_all(local_rows, anchors)
        pick = lambda t: None if t is None else t[local_rows, :num_tokens]  # noqa: E731
        return DraftProposal(
            tokens=pick(full.tokens),
            probs=pick(full.probs),
            confidences=pick(full.confidences),
            confidence_logits=pick(full.confidence_logits),
        )

    def propose_chains(self, local_rows: torch.Tensor, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The running rows' k chains after `anchors` [R]: tokens [R, k, n] and, when sampling, probs [R, k, n, V]."""
        full = self._propose_all(local_rows, anchors)
        rows, k = self.anchor_ids.shape[0], self.candidates
        tokens = full.tokens.view(rows, k, self.num_tokens)[local_rows]
        return tokens, None if full.probs is None else full.probs.view(rows, k, self.num_tokens, -1)[local_rows]

    def _propose_all(self, local_rows: torch.Tensor, anchors: torch.Tensor) -> DraftProposal:
        """The proposal for every slot of the run (the captured one's buffers when replayed), after loading the
        running rows' anchors."""
        self.anchor_ids[local_rows] = anchors
        if self._propose_graph is not None:
            self._propose_graph.replay()
            return self._proposal
        return self._eager(self._propose_fn, self._run_propose)

    def extend(self, local_rows: torch.Tensor, features: torch.Tensor, counts: torch.Tensor, next_ids: torch.Tensor):
        """Append the first `counts` [R] of the positions `features` [R, w] (w <= num_tokens + 1) of the running
        rows."""
        width = features.shape[1]
        self.counts.zero_()
        self.counts[local_rows] = counts
        self.features[local_rows, :width] = features.to(self.features.dtype)
        self.next_ids[local_rows, :width] = next_ids
        if self._extend_graph is not None:
            self._extend_graph.replay()
        else:
            self._eager(self._extend_fn, self._run_extend)

    def _eager(self, fn, plain):
        """A call without graphs (CPU, or capture off): the compiled function, or the plain one where it fails."""
        if fn is plain:
            return plain()
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - same fallback as the capture's
            logger.warning("compiled draft functions failed (%s: %s); running them uncompiled", type(err).__name__, err)
            self._uncompile()
            return plain()


def processors_signature(processors) -> tuple:
    """What a captured proposal bakes in of the logits processors: their classes and settings."""
    return tuple((type(p).__name__, tuple(sorted((k, repr(v)) for k, v in vars(p).items()))) for p in processors)


_RUNNERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # draft -> (key, runner)


def static_draft_runner(draft, rows: int, capacity: int, sampler, do_sample: bool, num_tokens: int,
                        capture: bool, compile: bool = False, candidates: int = 1) -> StaticDraftRunner:
    """The draft's runner for this call, reset: the last one when its shape, sampling settings (the draft's
    processors: generate()'s and the proposal temperature) and capacity fit (its graphs are replayed again:
    capturing costs a few eager rounds, a large share of a short generation), else a new one with a fresh context
    cache."""
    key = (rows, int(num_tokens), processors_signature(sampler.logits_processor), do_sample, capture, bool(compile),
           int(candidates), next(draft.parameters()).data_ptr())  # fmt: skip
    build = lambda cap: StaticDraftRunner(  # noqa: E731
        draft, draft.new_context_cache(rows, capacity=cap), sampler, num_tokens, capture, compile, candidates
    )
    runner = kept_runner(_RUNNERS, draft, key, capacity, lambda r: r.cache.capacity, build)
    runner.reset()
    return runner


def graphs_supported(position_free: bool, sliding_target: bool) -> str | None:
    """Why the static path cannot serve this call (None when it can)."""
    if not position_free:
        return "a logits processor reads the sequence (the draft would need per-round inputs)"
    if sliding_target:
        return "a sliding-window target is decoded row by row"
    return None


__all__ = ["StaticDraftRunner", "graphs_supported", "processors_signature", "static_draft_runner"]
