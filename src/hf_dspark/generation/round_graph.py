"""A whole speculative round as one CUDA graph: propose, verify, accept, commit, extend (`dspark_fused_round`).

On the static path (`target_graphs.py`, `draft_graphs.py`) a SmolLM2 round on an H200 took 5.1 ms: the draft's and
the target's graphs, plus ~150 small operators between them (window assembly, logits processing, rejection, the
commit's writes, the caches' bookkeeping), each a launch and some Python. Every one of those is a function of
device state, so the round is captured whole:

    anchors -> draft proposal (n tokens) -> verify forward over [anchor, drafts] -> processed scores ->
    `verify_block` (greedy or rejection sampling) -> tokens cut at EOS and the budget -> token rows, lengths and
    positions advanced -> the verification cache's committed columns -> the draft's context extended

and the host reads one [5, rows] tensor per round (committed counts, finished flags, accepted and verified
lengths, the columns the verification cache kept). What stays on the host: stopping criteria other than EOS (a cut
row is corrected eagerly), statistics, the streamer, and compacting the verification cache when it fills.

Every row of the call keeps its slot; rows that finished are masked by `running` and commit nothing. The buffers
(token rows, the draft's context cache, positions) and the graph are kept per draft for later calls with the same
shape, sampling settings and EOS ids (`fused_round_runner`), as the verification runner is kept per target. The
same function runs eagerly without CUDA (the CPU tests exercise it). Needs position-free logits processors, whole
blocks (schedule "none") and no per-step scores or logits in the output. With k first-slot candidates
(`dspark_candidates`) the captured function is `_tree_round`: k chains in the window, `verify_candidates`, the
accepted path committed.
"""

from __future__ import annotations

import weakref

import torch

from ..sampling import apply_position_free
from .cuda_graphs import capture as capture_graph, capture_or_uncompiled, captured_or_warned, kept_runner
from .draft_graphs import StaticDraftRunner, processors_signature
from .rejection import VerifyResult, block_tokens, cut_at_stop, tree_depths, verify_block, verify_candidates


class FusedRoundRunner:
    """Rounds of a static call through one graph (eager without CUDA)."""

    def __init__(self, draft, target_runner, sampler, processors, do_sample: bool, eos_ids: tuple[int, ...],
                 num_tokens: int, capacity: int, capture: bool, compile_draft: bool = False,
                 verification: str = "block", candidates: int = 1, compile_verify: bool = False):
        rows, device = target_runner.rows, target_runner.key_valid.device
        self.rows, self.n, self.width = rows, int(num_tokens), int(num_tokens) + 1
        self.candidates = int(candidates)  # > 1: rounds verify a tree of k chains (`_tree_round`)
        self.target_runner, self.processors, self.do_sample = target_runner, processors, do_sample
        self.verification = verification
        self.dcache = draft.new_context_cache(rows, capacity=capacity)
        # Its functions (compiled where `compile_draft`) run inside this runner's graph; it captures none itself.
        self.draft_runner = StaticDraftRunner(draft, self.dcache, sampler, num_tokens, capture=False,
                                              compile=compile_draft, candidates=candidates)
        # The draft reads its anchors where the round gathers them, in the verify window: no copy between.
        self.draft_runner.anchor_ids = target_runner.window[:, 0]
        self.copy_next_ids = draft.extends_with_next_tokens  # block drafters ignore them: no copy either
        self.eos = torch.tensor(eos_ids, dtype=torch.long, device=device) if eos_ids else None
        long = dict(dtype=torch.long, device=device)
        # The call's token rows (prompt, then generated tokens; drafts are written past each row's length).
        self.tokens = torch.zeros(rows, capacity + self.width + 2, **long)
        self.last_prompt_col = torch.zeros((), **long)  # prompt length - 1: a row's anchor is here + its length
        self.draft_budget = torch.zeros((), **long)  # token budget - 1 (a row's bonus token is committed too)
        self.lengths = torch.zeros(rows, **long)  # generated tokens per row
        self.real = torch.zeros(rows, **long)  # the target position of each row's next token
        self.running = torch.zeros(rows, dtype=torch.bool, device=device)
        self.slot = torch.arange(self.width, device=device)
        self.ahead = self.slot + 1  # the columns of a window's tokens after its anchor
        self.depth = tree_depths(self.candidates, self.n, device)  # window columns' offsets (a chain: 0..n)
        self.window_cols = torch.arange(target_runner.width, device=device)
        self.out = torch.zeros(5, rows, **long)
        self._verify_plain = self._verify_and_commit_tree if self.candidates > 1 else self._verify_and_commit
        self._verify_fn = self._verify_plain
        self.compiled = bool(compile_verify)
        if compile_verify:  # the draws keep eager's random stream, as the draft's compiled functions do
            self._verify_fn = torch.compile(self._verify_plain, dynamic=False, options={"fallback_random": True})
        self.capture = capture and device.type == "cuda"
        self._graph = None
        self._confidences = None

    # -- a call ---------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Before the draft's prefill: an empty context cache."""
        self.draft_runner.reset()

    def start(self, tokens: torch.Tensor, prompt_length: int, budget: int, lengths: torch.Tensor,
              real: torch.Tensor, running: torch.Tensor) -> torch.Tensor:
        """Load the call's state (after the prefill committed the first token); returns the token rows' view the
        decoder reads as its buffer."""
        width = tokens.shape[1]
        self.tokens[:, :width] = tokens
        self.last_prompt_col.fill_(prompt_length - 1)
        self.draft_budget.fill_(budget - 1)
        self.lengths.copy_(lengths)
        self.real.copy_(real)
        self.running.copy_(running)
        if self.capture and self._graph is None:
            if not captured_or_warned("rounds", self._capture):
                self._graph, self.capture = None, False
            self.running.copy_(running)  # the warm-up ran with every row idle
        return self.tokens[:, :width]

    def _capture(self) -> None:
        compiled = self.draft_runner.compiled or self.target_runner.compiled or self.compiled
        self._graph, _ = capture_or_uncompiled(
            "round functions", lambda: capture_graph(self._tree_round if self.candidates > 1 else self._round,
                                                     before_warmup=self._idle), compiled, self._uncompile
        )

    def _uncompile(self) -> None:
        self.draft_runner._uncompile()
        self.target_runner._uncompile()
        self._verify_fn, self.compiled = self._verify_plain, False

    def _idle(self) -> None:
        """Warm-up state: no row runs, so a round commits nothing and writes only past every row's length."""
        self.running.zero_()

    def step(self) -> list[list]:
        """One round; the host's copy of [counts, finished, accepted, verified, kept columns] per row (the only
        synchronization), plus the proposal's confidences [rows, n] on the host (None without a confidence head)."""
        if self._graph is not None:
            self._graph.replay()
        elif self.candidates > 1:
            self._tree_round()
        else:
            self._round()
        confidences = None
        if self._confidences is not None:
            confidences = self._confidences.to("cpu", non_blocking=True)
        host = self.out.tolist()
        return host, confidences

    def stop_rows(self, rows: list[int]) -> None:
        """Rows the host stopped (a stopping criterion): they commit nothing from now on."""
        self.running[torch.tensor(rows, device=self.running.device)] = False

    def set_lengths(self, rows: list[int], lengths: list[int]) -> None:
        """Rows whose committed tokens the host cut (a stopping criterion)."""
        index = torch.tensor(rows, device=self.lengths.device)
        self.lengths[index] = torch.tensor(lengths, device=self.lengths.device)

    # -- the captured function ------------------------------------------------------------------------------

    def _round(self) -> None:
        n, slot = self.n, self.slot
        draft, target = self.draft_runner, self.target_runner
        anchor_cols = self.last_prompt_col + self.lengths  # each row's last committed token
        # Into the verify window's first column, which is also the draft's anchor buffer (see __init__).
        torch.gather(self.tokens, 1, anchor_cols[:, None], out=target.window[:, :1])
        proposal = draft._propose_fn()
        self._confidences = proposal.confidences
        drafts = proposal.tokens[:, :n]
        target.window[:, 1:] = drafts
        torch.add(self.real[:, None], slot, out=target.positions)
        logits, features = target._run()
        prefix, new_tokens, continuing = self._verify_fn(logits, drafts, proposal.probs, anchor_cols)
        self._advance(prefix, features, new_tokens, continuing)

    def _verify_and_commit(self, logits, drafts, probs, anchor_cols):
        """The round after the verify forward, up to the draft's extension: verification, the tokens and lengths
        committed, the verification cache's columns kept, the host's report written. One region of small
        operators, compiled into few kernels with `compile_verify`."""
        n, slot, target = self.n, self.slot, self.target_runner
        caps = (self.draft_budget - self.lengths).clamp(min=0, max=n)  # whole blocks, cut by the token budget
        # Greedy verification takes an argmax and sampling casts to float32 itself: only processors need a copy.
        scores = apply_position_free(self.processors, logits) if len(self.processors) else logits
        result = verify_block(scores, drafts, probs, caps, self.do_sample, method=self.verification)
        accepted = result.num_accepted
        new_tokens = block_tokens(target.window, result)  # (the window: anchor, drafts)
        prefix, counts, finished, continuing = self._commit_tokens(anchor_cols, new_tokens, accepted)
        # The verification cache keeps the longest committed prefix among continuing rows (else among all).
        keep = torch.where(continuing.any(), prefix * continuing, prefix).amax()
        committed = slot[None, :] < prefix.clamp(max=keep)[:, None]
        target.key_valid.scatter_(1, (target.length_t + slot)[None, :].expand_as(committed), committed)
        target.length_t += keep
        torch.stack([counts, finished.long(), accepted, caps, keep.expand_as(accepted)], out=self.out)
        return prefix, new_tokens, continuing

    def _tree_round(self) -> None:
        """`_round` for k first-slot candidates: k chains in the window (the target runner's tree mask),
        `verify_candidates`, and the accepted path's tokens, features and cache columns committed."""
        n, k, rows = self.n, self.candidates, self.rows
        draft, target = self.draft_runner, self.target_runner
        anchor_cols = self.last_prompt_col + self.lengths
        torch.gather(self.tokens, 1, anchor_cols[:, None], out=target.window[:, :1])
        proposal = draft._propose_fn()
        self._confidences = None
        chains = proposal.tokens.view(rows, k, n)
        probs = None if proposal.probs is None else proposal.probs.view(rows, k, n, -1)
        target.window[:, 1:] = chains.reshape(rows, k * n)
        torch.add(self.real[:, None], self.depth, out=target.positions)
        logits, features = target._run()
        prefix, path_features, new_tokens, continuing = self._verify_fn(logits, chains, probs, anchor_cols, features)
        self._advance(prefix, path_features, new_tokens, continuing)

    def _verify_and_commit_tree(self, logits, chains, probs, anchor_cols, features):
        """`_verify_and_commit` for a tree; also returns the accepted path's features [rows, n + 1, F]."""
        n, rows, running, target = self.n, self.rows, self.running, self.target_runner
        caps = (self.draft_budget - self.lengths).clamp(min=0, max=n)
        scores = apply_position_free(self.processors, logits) if len(self.processors) else logits
        result = verify_candidates(scores, chains, probs, caps, self.do_sample, method=self.verification)
        accepted = result.num_accepted
        picked = result.chain.clamp(min=0)
        path = torch.cat([torch.zeros_like(picked)[:, None], 1 + picked[:, None] * n + self.slot[:n]], dim=1)
        along = torch.cat([target.window[:, :1], chains[torch.arange(rows, device=picked.device), picked]], dim=1)
        new_tokens = block_tokens(along, VerifyResult(accepted, result.next_tokens))
        prefix, counts, finished, continuing = self._commit_tokens(anchor_cols, new_tokens, accepted)
        # Window columns the accepted path spans (the anchor, up to its last accepted slot); none where idle.
        span = (torch.where(accepted > 0, picked * n + accepted, 0) + 1) * running
        keep = torch.where(continuing.any(), span * continuing, span).amax()
        on_path = torch.zeros(rows, target.width, dtype=torch.bool, device=picked.device)
        on_path.scatter_(1, path, self.slot[None, :] < prefix[:, None])
        committed = on_path & (self.window_cols[None, :] < keep)
        target.key_valid.scatter_(1, (target.length_t + self.window_cols)[None, :].expand_as(committed), committed)
        target.length_t += keep
        path_features = features.gather(1, path[..., None].expand(-1, -1, features.shape[-1]))
        torch.stack([counts, finished.long(), accepted, caps, keep.expand_as(accepted)], out=self.out)
        return prefix, path_features, new_tokens, continuing

    # -- the two rounds' shared steps -----------------------------------------------------------------------

    def _commit_tokens(self, anchor_cols: torch.Tensor, new_tokens: torch.Tensor, accepted: torch.Tensor):
        """Write each row's `new_tokens` [rows, n + 1] (its accepted drafts, then the new token) after its anchor and
        advance its length; returns the committed prefixes, the counts kept after EOS, and the rows that finished
        and those that continue."""
        running = self.running
        # Each running row commits a prefix of its window (none where idle): the draft's context extends by these
        # counts whatever EOS cuts, as the target's cache keeps them.
        prefix = torch.mul(accepted + 1, running, out=self.draft_runner.counts)  # (the draft's extension reads them)
        counts = prefix
        if self.eos is not None:
            counts, stopped = cut_at_stop(new_tokens, prefix, self.eos)
        # Every column is written; those past a row's count lie beyond its length, where nothing reads them.
        self.tokens.scatter_(1, anchor_cols[:, None] + self.ahead, new_tokens)
        self.lengths += counts
        finished = self.lengths > self.draft_budget  # the token budget is spent
        if self.eos is not None:
            finished = finished | stopped
        finished = finished & running
        continuing = running ^ finished  # (finished rows are running ones)
        return prefix, counts, finished, continuing

    def _advance(self, prefix: torch.Tensor, features: torch.Tensor, new_tokens: torch.Tensor,
                 continuing: torch.Tensor) -> None:
        """After the verification cache's commit: target positions advance by the committed prefixes, the draft's
        context extends by them (`features` [rows, n + 1, F]: the committed path's), and finished rows stop."""
        draft = self.draft_runner
        self.real += prefix
        draft.features.copy_(features)
        if self.copy_next_ids:
            draft.next_ids.copy_(new_tokens)
        draft._extend_fn()
        self.running.copy_(continuing)


_RUNNERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # draft -> (key, runner)


def fused_round_runner(draft, target_runner, sampler, processors, do_sample: bool, eos_ids: tuple[int, ...],
                       num_tokens: int, capacity: int, capture: bool, compile_draft: bool = False,
                       verification: str = "block", candidates: int = 1,
                       compile_verify: bool = False) -> FusedRoundRunner:
    """The draft's runner for this call: the last one when everything its graph bakes in matches (`kept_runner`;
    it holds the verification runner it was built with, so that one's id cannot be reused meanwhile), else new."""
    # The target's processors and the draft's (its sampler's: they add the proposal temperature) are both baked in.
    key = (id(target_runner), processors_signature(processors), processors_signature(sampler.logits_processor),
           do_sample, verification, tuple(eos_ids), int(num_tokens), capture, bool(compile_draft), int(candidates),
           bool(compile_verify), next(draft.parameters()).data_ptr())  # fmt: skip

    def build(cap: int) -> FusedRoundRunner:
        cap = max(cap, target_runner.capacity)  # calls of one verification shape share the runner
        return FusedRoundRunner(draft, target_runner, sampler, processors, do_sample, eos_ids, num_tokens, cap, capture,
                                compile_draft, verification, candidates, compile_verify)

    return kept_runner(_RUNNERS, draft, key, capacity, lambda r: r.dcache.capacity, build)


__all__ = ["FusedRoundRunner", "fused_round_runner"]
