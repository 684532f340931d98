"""Turning logits into the exact distribution a token is drawn from; shared by drafts and the target.

Lossless speculative sampling needs the draft's q and the target's p to be processed identically
(temperature, top-k, top-p, repetition penalty, ...). `TokenSampler` is that one place: it applies a
transformers `LogitsProcessorList` (the one `generate()` builds, warpers included) or, standalone, builds the
same warpers from temperature/top-k/top-p.
"""

from __future__ import annotations

import inspect

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper


_EXTRA_ARGUMENTS: dict[type, bool] = {}  # processor type -> whether __call__ takes more than (input_ids, scores)


def _takes_extra_arguments(processor_type: type) -> bool:
    # A plain dict rather than functools.lru_cache: torch.compile (dspark_compile_draft) traces through it quietly.
    if processor_type not in _EXTRA_ARGUMENTS:
        _EXTRA_ARGUMENTS[processor_type] = len(inspect.signature(processor_type.__call__).parameters) > 3
    return _EXTRA_ARGUMENTS[processor_type]


def apply_logits_processors(processors, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
    """`LogitsProcessorList.__call__` without re-reading every processor's signature on every call.

    transformers inspects each processor's signature per call, which costs more than the processing itself in a
    speculative round (a call per draft slot and per verified position); the check is cached per type here.
    """
    for processor in processors:
        if _takes_extra_arguments(type(processor)):
            scores = LogitsProcessorList([processor])(input_ids, scores, **kwargs)
        else:
            scores = processor(input_ids, scores)
    return scores


def apply_position_free(processors, scores: torch.Tensor) -> torch.Tensor:
    """Processors that read no sequence (temperature, top-k, top-p, ...) on scores [..., V] of any leading shape,
    as float32 (one copy, which processors may write in place, also casts)."""
    flat = scores.reshape(-1, scores.shape[-1])
    no_ids = torch.zeros(flat.shape[0], 0, dtype=torch.long, device=flat.device)
    return apply_logits_processors(processors, no_ids, flat.to(torch.float32, copy=True)).view(scores.shape)


class TokenSampler:
    def __init__(
        self,
        do_sample: bool = True,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        logits_processor: LogitsProcessorList | None = None,
        generator: torch.Generator | None = None,
    ):
        if logits_processor is None:
            logits_processor = LogitsProcessorList()
            if do_sample:
                if temperature is not None and temperature != 1.0:
                    if temperature <= 0:
                        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}; use do_sample=False")
                    logits_processor.append(TemperatureLogitsWarper(temperature))
                if top_k:
                    logits_processor.append(TopKLogitsWarper(top_k))
                if top_p is not None and top_p < 1.0:
                    logits_processor.append(TopPLogitsWarper(top_p))
        self.do_sample = do_sample
        self.logits_processor = logits_processor
        self.generator = generator

    def process(self, logits: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Raw logits [R, V] -> processed float32 logits [R, V] (`input_ids` [R, L]: the sequence so far)."""
        logits = logits.float()
        if len(self.logits_processor) == 0:
            return logits
        if input_ids is None:
            input_ids = torch.zeros(logits.shape[0], 0, dtype=torch.long, device=logits.device)
        return apply_logits_processors(self.logits_processor, input_ids, logits)

    def distribution(self, logits: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        return torch.softmax(self.process(logits, input_ids), dim=-1)

    def select(self, probs: torch.Tensor) -> torch.Tensor:
        """Draw one token per row from probs [R, V] (argmax when greedy)."""
        if not self.do_sample:
            return probs.argmax(dim=-1)
        return sample_from(probs, self.generator)

    def select_distinct(self, probs: torch.Tensor, k: int) -> torch.Tensor:
        """k distinct tokens per row of probs [R, V] -> [R, k]: draws without replacement, in order, when sampling
        (`sample_without_replacement`); the k most likely when greedy."""
        if not self.do_sample:
            return probs.topk(k, dim=-1).indices
        return sample_without_replacement(probs, k, self.generator)

    def draw(self, logits: torch.Tensor, input_ids: torch.Tensor | None = None):
        """One token per row from raw logits [R, V] -> (probs [R, V] it was drawn from, or None when greedy; token).

        Greedy draws take the argmax of the (processed) logits: no softmax, since greedy verification compares
        tokens only. argmax(softmax(x)) = argmax(x); a bf16 tensor is argmax-ed as is (its float cast is exact)."""
        if not self.do_sample:
            scores = logits if len(self.logits_processor) == 0 else self.process(logits, input_ids)
            return None, scores.argmax(dim=-1)
        probs = self.distribution(logits, input_ids)
        return probs, self.select(probs)

    __call__ = draw


def sample_from(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of probs [R, V]: the same draws as `torch.multinomial(probs, 1, generator=generator)`.

    This is torch's own algorithm for one sample (argmax of p / E with E ~ Exp(1), the exponential race), without
    the input checks multinomial runs first (min, max, row sums and two device asserts: ~10 kernels a call on CUDA,
    once per draft slot in a speculative round). The inputs here are distributions this package built (softmax
    outputs, normalized rejection residuals), which those checks cannot fail.
    """
    race = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / race).argmax(dim=-1)


def sample_without_replacement(probs: torch.Tensor, k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """k distinct draws per row of probs [R, V], in order: [R, k]. The first follows probs, each later one probs
    with the earlier draws removed and renormalized (successive sampling without replacement).

    The exponential race again: of p_v / E_v, the largest is a draw from p, and the rest of the race, given it, is
    the same race over the remaining tokens; so the k largest in order are k successive draws without replacement.
    Rows with fewer than k tokens of positive mass fill their last places with zero-mass tokens, which callers
    treat as no draw (`verify_candidates` never accepts them)."""
    if not 1 <= k <= probs.shape[-1]:
        raise ValueError(f"k must be between 1 and the vocabulary ({probs.shape[-1]}), got {k}")
    race = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / race).topk(k, dim=-1).indices


def rejection_step(residual: torch.Tensor, q_left: torch.Tensor, drawn: torch.LongTensor, replacement: bool = False):
    """One candidate of recursive rejection sampling (docs/ALGORITHMS.md, "Several candidates a slot"), for rows of
    distributions [R, V] and one drawn token per row `drawn` [R, 1].

    residual: r_i, what the target's distribution p is left as after the earlier candidates' rejections (r_1 = p);
    q_left: the draft's q less the earlier candidates (q itself when drawn with replacement). The candidate came
    from q_i, q_left renormalized (q_left itself with replacement), and is accepted with chance
    min(1, r_i(x) / q_i(x)); on rejection the residual becomes r_{i+1} (`residual_after_rejection`).

    Returns (q_i(x), r_i(x), r_{i+1}, q_left without x) per row. The caller decides acceptance (a coin in decoding,
    the exact chance in `metrics`) and where r_{i+1} replaces r_i. q_i(x) = 0 means no draw was left for this
    candidate (fewer tokens of positive mass than candidates), never accepted."""
    q_i = q_left if replacement else q_left / q_left.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    q_x = q_i.gather(1, drawn).squeeze(1)
    r_x = residual.gather(1, drawn).squeeze(1)
    return q_x, r_x, residual_after_rejection(residual, q_i), (q_left if replacement else q_left.scatter(1, drawn, 0.0))


def residual_after_rejection(residual: torch.Tensor, q_i: torch.Tensor) -> torch.Tensor:
    """r_{i+1} = normalize(max(0, r_i - q_i)) over the last dimension: what the target's distribution is left as once
    a candidate drawn from q_i is rejected. Where r_i equals q_i up to rounding a rejection is (almost) impossible,
    and r_i is kept rather than divide by ~0."""
    left = (residual - q_i).clamp_min(0)
    mass = left.sum(-1, keepdim=True)
    return torch.where(mass > 1e-12, left / mass.clamp_min(1e-30), residual)


__all__ = ["TokenSampler", "sample_from", "sample_without_replacement", "rejection_step", "residual_after_rejection",
           "apply_logits_processors", "apply_position_free"]
