"""The speculative decoding loop behind `target.generate(..., assistant_model=draft)`.

One loop serves every batch size. Batch 1 is simply R = 1; we do not hand batch 1 to transformers'
`_assisted_decoding` because (a) one rejection-sampling routine (`rejection.verify_block`) must serve every
path, and HF's loop brings its own; (b) transformers 5.17's loop lets an
accepted block run past EOS and checks stopping criteria only at block ends, so its output can differ from
`target.generate()`; (c) the confidence schedulers, per-round statistics and Eagle3's "next token" feature
wiring would be spread over callbacks whose signatures changed between 5.17 and 5.23. generate() still does
all input preparation (generation config, logits processors and warpers, stopping criteria, the cache, input
expansion for `num_return_sequences`), see `integration.py`, so the HF-facing behaviour is the same.

A round, for the R requests still running (docs/ALGORITHMS.md, "Speculative decoding"):
1. the draft proposes n tokens after each request's anchor (its last committed token, not yet seen by the
   target) with the exact distributions q it sampled from, processed by generate()'s own logits processors;
2. the scheduler picks each row's verified prefix l_r (whole block, threshold, or Algorithm 1), never more
   than the row's remaining token budget allows;
3. one target forward over [anchor, x_1..x_L] (L = max_r l_r, shorter rows padded and masked) gives p_1..p_{L+1}
   after the same logits processing `_sample` applies, and the target's context features (forward hooks:
   independent of the 5.17/5.23 `output_hidden_states` index change);
4. `verify_block` accepts a prefix and draws the correction/bonus token;
5. tokens are committed up to the first stop (EOS inside an accepted block, max length, any stopping
   criterion evaluated on every prefix, as `_sample` would), the target cache is cropped, and only the
   committed positions' features go back to the draft (`extend_context`, with the following token for Eagle3).

Target cache layout (batched rows accept different numbers of tokens). The DynamicCache stays rectangular:
after each round it is cropped to the longest committed prefix among the rows that continue; a row that
committed fewer tokens keeps "holes" there, masked out through the 2-D attention mask, and its position ids
count real tokens only. Attention masking is elementwise, so full-attention targets see exactly the sequence
they would see in `target.generate()`. Holes would shrink a sliding window (Gemma 2/3, Mistral-style
`sliding_window`), so targets with sliding-window cache layers are decoded one row at a time, where no holes
arise; recurrent/linear-attention layers cannot be rolled back and are rejected. Finished rows leave the
batch (`batch_select_indices`), so late rounds only pay for the requests still running.

Logits processors read `input_ids` in general (repetition penalty, min length, n-gram bans): for the target
they run per position on each row's exact sequence (rows grouped by length; always called on the whole
batch in its original order, since processors may hold per-row state such as the repetition penalty's
prompt padding). Position-independent warpers
(temperature, top-k, top-p, min-p, typical, epsilon, eta, ...) take a vectorized fast path. The draft's
distributions use the same processors on left-padded sequences; any difference there only costs acceptance,
never correctness, since q is exactly what the draft sampled from.

Greedy equality with `target.generate(do_sample=False)` is exact when the target's logits do not depend on how many
tokens one forward processes (float32; tested on every path). In bf16/fp16 a verification forward over several
tokens rounds differently from a one-token decode step, so a near-tied argmax can flip; transformers' prompt lookup
decoding diverges at the same positions (README, "Use"). Sampling is exact with respect to the logits the
verification forward computes, which differ from one-token decode logits only by that rounding.

Output: what generate() returns. Sequences are padded with pad_token_id after a row's end (as `_sample` pads
rows finished by EOS); with `output_scores` / `output_logits` the per-step tuples hold zeros for rows that had
already finished (transformers computes throw-away logits there). A row stopped early by a custom stopping
criterion is padded as well (`_sample` keeps sampling such a row when no EOS criterion is configured).
`num_return_sequences > 1` works when sampling (generate() expands the rows). `output_attentions` /
`output_hidden_states` are not supported; the returned cache is the target's DynamicCache for batch 1 (every
token but the last, as after `_sample`) and None otherwise (a batched cache contains holes) or on the static
verification path (`dspark_target_graphs`, `target_graphs.py`).

Bad input raises a ValueError that names the fix: a draft for another vocabulary, target architecture or
target layers (`check_draft_for_target`; a different `target_name_or_path` with matching facts only warns,
since paths differ between machines), a draft on another device (move it: we do not move user models behind
their back), beam search, quantized or pre-filled caches, use_cache=False, a confidence schedule
without a confidence head, a block override beyond a block drafter's block size (Eagle3 may go beyond its
ttt_length: it drafts autoregressively), a streamer with batch > 1. A draft in another dtype is fine: target
features are cast to the draft's dtype.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, fields
from typing import Any

import torch
from transformers import DynamicCache
from transformers.generation import logits_process
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from ..sampling import TokenSampler, apply_logits_processors, apply_position_free, sample_from
from ..target import TargetFeatureHooks, additive_mask, explicit_mask_unsupported
from .draft_graphs import graphs_supported, static_draft_runner
from .round_graph import fused_round_runner
from .target_graphs import static_target_runner
from .rejection import (
    VERIFICATIONS, VerifyResult, block_tokens, cut_at_stop, tree_attention, tree_depths, verify_block,
    verify_candidates,
)
from .scheduler import (
    SCHEDULES,
    SPSTable,
    cache_kwarg_name,
    fixed_schedule,
    load_or_profile_sps,
    prefix_schedule,
    threshold_schedule,
    verify_cost_is_flat,
)
from .stats import SpeculativeStats

PHASES = ("propose", "verify_forward", "accept", "commit", "rollback", "extend")
# torch's own check whether a profiler is recording (private; where a build lacks it, ranges are always opened).
_profiler_enabled = getattr(torch._C._autograd, "_profiler_enabled", lambda: True)


def phase(name: str):
    """A torch.profiler range "hf_dspark::NAME" around one part of a round (PHASES), so a profile of generate()
    attributes operators and time to them (`benchmarks/generation_speed.py --profile` counts them per round).
    Without a profiler running, nothing: a range costs ~7 us of host time, 6 a round."""
    if not _profiler_enabled():
        return contextlib.nullcontext()
    return torch.profiler.record_function(f"hf_dspark::{name}")


# Processors that ignore input_ids: applied once to every [row, position] at the same time.
_POSITION_FREE = tuple(
    cls
    for cls in (
        getattr(logits_process, name, None)
        for name in (
            "TemperatureLogitsWarper",
            "TopKLogitsWarper",
            "TopPLogitsWarper",
            "TopHLogitsWarper",
            "MinPLogitsWarper",
            "TypicalLogitsWarper",
            "EpsilonLogitsWarper",
            "EtaLogitsWarper",
            "LogitNormalization",
            "InfNanRemoveLogitsProcessor",
            "SuppressTokensLogitsProcessor",
        )
    )
    if cls is not None
)

_MODEL_KWARGS = {"attention_mask", "position_ids", "use_cache", "logits_to_keep", "cache_position"}


# -- settings -----------------------------------------------------------------------------------------------


@dataclass
class SpeculativeConfig:
    r"""
    Speculative-decoding settings, read from generate() keywords or generation-config attributes
    (keyword > the `generation_config` passed to generate() > the target's `generation_config` > default).

    Args:
        schedule (`str`, generation field `dspark_schedule`, defaults to "none"): "none" verifies whole blocks;
            "threshold" the prefix before the first slot with confidence < `dspark_threshold`; "prefix" the
            hardware-aware prefix scheduler (paper Algorithm 1). Confidence schedules need a DSpark draft with a
            confidence head.
        threshold (`float`, field `dspark_threshold`, defaults to 0.5): confidence threshold of "threshold".
        sps_table (field `dspark_sps_table`, defaults to None): cost table of "prefix": an `SPSTable`, a
            {tokens: steps_per_second} dict, (tokens, sps) pairs or a JSON path; None profiles the target on the
            current device for the batch size at hand and caches the table (`~/.cache/hf_dspark/sps/`).
        block_size (`int`, field `dspark_block_size` or generate()'s `num_assistant_tokens`, defaults to None):
            draft tokens per round; None uses the draft's block size (Eagle3: `ttt_length`). At most the block
            size for DSpark/DFlash.
        draft_graphs (`bool` or "auto", field `dspark_draft_graphs`, defaults to "auto"): run the draft's
            proposal and context extension on static shapes, replayed as CUDA graphs ("auto": on CUDA when the
            logits processors do not read the sequence and the target has no sliding-window layers; True also
            runs the static path eagerly on CPU; False: the dynamic path). See `draft_graphs.py`.
        target_graphs (`bool` or "auto", field `dspark_target_graphs`, defaults to "auto"): verify over a
            fixed-capacity cache with the target's verify forward replayed as a CUDA graph (`target_graphs.py`).
            "auto": on CUDA for targets with sdpa/eager attention and no sliding-window layers, with schedule
            "none", or "prefix" / "threshold" where the SPS table is flat (`verify_cost_is_flat`: a whole block per
            row costs about one token per row); the path returns no cache in `return_dict_in_generate` outputs. True (or
            generate()'s `cache_implementation="static"`): always, eagerly on CPU, an error where unsupported;
            False: the dynamic cache. On this path "prefix" verifies whole blocks (its cost does not depend on
            the prefix); "threshold" keeps its cut.
        fused_round (`bool` or "auto", field `dspark_fused_round`, defaults to "auto"): on the static path, run each
            whole round (propose, verify, accept, commit, extend) as one CUDA graph with one host read
            (`round_graph.py`); needs position-free logits processors, schedule "none" (or "prefix", whole blocks
            there) and no output_scores / output_logits. "auto": on CUDA wherever those hold (measured on an H200
            with SmolLM2 at batch 1: 3.04 ms a round against 3.32 for the static path's separate graphs, greedy);
            True: also eagerly on CPU, an error where unsupported; False: separate graphs for the draft and the
            verify forward.
        compile (`bool` or "auto", field `dspark_compile`, defaults to "auto"): on the static path, `torch.compile`
            the target's verify forward before it is captured: fused kernels, fewer launches per round (the eager
            forward is a few dozen small kernels per layer; measured on an H200 with SmolLM2 at batch 1: 3.9 ms a
            round instead of 5.1). "auto": whenever the static path runs on CUDA; True: also eagerly on CPU (an
            error where the static path is not used); False: never. The first call of a shape compiles (tens of
            seconds, as transformers' own static-cache generate() does); later calls of that shape replay the kept
            graph. Where compilation fails, the uncompiled forward is captured (with a warning).
        compile_draft (`bool` or "auto", field `dspark_compile_draft`, defaults to "auto"): on the static draft
            path (`draft_graphs`, the fused round included), `torch.compile` the draft's proposal and context
            extension before they are captured: the proposal is a chain of small kernels per slot (logits,
            processors, softmax, the draw). "auto": inside the fused round on CUDA (measured on an H200 with
            SmolLM2 at batch 1, greedy: 2.83 ms a round against 3.34 uncompiled, 569 against 483 tokens/s; in
            separate graphs it gained 1-10%, so it stays off there); True: wherever the static draft path runs
            (eagerly on CPU too); False: never. The first call of a shape compiles (about 20 s on that machine).
            Where compilation fails, the uncompiled functions are captured.
        compile_verify (`bool` or "auto", field `dspark_compile_verify`, defaults to "auto"): in the fused round,
            `torch.compile` the part after the verify forward (verification, the commit of tokens, lengths and the
            verification cache's columns) before it is captured. On a GPU a batch-16 round is bound by how many
            kernels it launches, and this part is a chain of small ones (133 aten operators of a sampled SmolLM2
            round's 595, 221 in a round with two first-slot candidates; `benchmarks/draft_draw_ops.py --round`);
            compiled they fuse into few. "auto": inside the fused round on CUDA (measured on an H100 with SmolLM2 at
            batch 16, T = 1: 0.298 ms a row-round against 0.311 with the same tokens from the same seed, 4% faster;
            with four first-slot candidates 0.350 against 0.395, 11%); True: also eagerly on CPU; False: never.
            The first call of a shape compiles; where compilation fails, the uncompiled function is captured (with a
            warning).
        draft_temperature (`float`, field `dspark_draft_temperature`, defaults to 1.0): when sampling, the draft
            draws from softmax(processed draft scores / draft_temperature) instead of softmax(processed scores).
            Lossless for any value > 0: verification reads the exact distribution the draft drew from. Below 1 it
            sharpens the proposals, which raises acceptance where the draft is less confident than the target
            (and lowers it where it is not); greedy decoding ignores it.
        verification (`str`, field `dspark_verification`, defaults to "block"): how sampled blocks are verified.
            "block" judges each block jointly (Sun et al. 2024): lossless, and its expected accepted prefix is at
            least that of "token", the classic slot-by-slot rejection sampling (kept for comparison). Greedy
            decoding verifies the same way under both. See `rejection.py`.
        candidates (`int`, field `dspark_candidates`, defaults to 1): first-slot candidates per round. Above 1 the
            draft proposes that many chains (DSpark / DFlash: the block's layers run once, the draws repeat), the
            target verifies them in one forward as a tree that branches at the first slot, and recursive rejection
            sampling picks at most one (greedy: the draft's top k first tokens; `rejection.verify_candidates`):
            lossless, more accepted tokens a round, a verify forward of 1 + k n tokens instead of 1 + n. Every path
            serves it (dynamic, static draft and target, the fused round: the runners hold the tree's shape). Needs
            whole blocks, position-free logits processors and a target whose attention takes a 4D mask (sdpa,
            eager; no sliding windows); returns no cache.
    """

    schedule: str = "none"
    threshold: float = 0.5
    sps_table: Any = None
    block_size: int | None = None
    draft_graphs: bool | str = "auto"
    target_graphs: bool | str = "auto"
    fused_round: bool | str = "auto"
    compile: bool | str = "auto"
    compile_draft: bool | str = "auto"
    compile_verify: bool | str = "auto"
    draft_temperature: float = 1.0
    verification: str = "block"
    candidates: int = 1

    FIELDS = {
        "dspark_schedule": "schedule",
        "dspark_threshold": "threshold",
        "dspark_sps_table": "sps_table",
        "dspark_block_size": "block_size",
        "dspark_draft_graphs": "draft_graphs",
        "dspark_target_graphs": "target_graphs",
        "dspark_fused_round": "fused_round",
        "dspark_compile": "compile",
        "dspark_compile_draft": "compile_draft",
        "dspark_compile_verify": "compile_verify",
        "dspark_draft_temperature": "draft_temperature",
        "dspark_verification": "verification",
        "dspark_candidates": "candidates",
    }

    @classmethod
    def pop_from(cls, kwargs: dict, generation_config=None, model_generation_config=None) -> "SpeculativeConfig":
        """Remove the speculative keywords from generate()'s kwargs and resolve every field."""
        values = {}
        for key, name in cls.FIELDS.items():
            for source in (model_generation_config, generation_config):
                if source is not None and getattr(source, key, None) is not None:
                    values[name] = getattr(source, key)
            if key in kwargs:
                value = kwargs.pop(key)
                if value is not None:
                    values[name] = value
        if kwargs.get("num_assistant_tokens") is not None:
            values.setdefault("block_size", kwargs.pop("num_assistant_tokens"))
        kwargs.pop("num_assistant_tokens", None)
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"dspark_schedule={self.schedule!r} is not one of {', '.join(map(repr, SCHEDULES))}")
        if not 0.0 <= float(self.threshold) <= 1.0:
            raise ValueError(f"dspark_threshold must be in [0, 1], got {self.threshold}")
        for name in ("draft_graphs", "target_graphs", "fused_round", "compile", "compile_draft", "compile_verify"):
            value = getattr(self, name)
            if value not in (True, False, "auto"):
                raise ValueError(f"dspark_{name} must be True, False or 'auto', got {value!r}")
        if not 0.0 < float(self.draft_temperature) < float("inf"):
            raise ValueError(
                f"dspark_draft_temperature must be a positive number, got {self.draft_temperature} (1.0: the draft's "
                "own distribution)"
            )
        if self.verification not in VERIFICATIONS:
            raise ValueError(
                f"dspark_verification={self.verification!r} is not one of {', '.join(map(repr, VERIFICATIONS))}"
            )
        if isinstance(self.candidates, bool) or not isinstance(self.candidates, int) or self.candidates < 1:
            raise ValueError(f"dspark_candidates must be a whole number >= 1, got {self.candidates!r} (1: one chain)")
        if self.block_size is not None and int(self.block_size) < 1:
            raise ValueError(f"dspark_block_size / num_assistant_tokens must be >= 1, got {self.block_size}")


# -- validation ---------------------------------------------------------------------------------------------


def check_draft_for_target(target, draft) -> None:
    """Raise a ValueError naming the fix when `draft` cannot serve `target` (vocabulary, target identity and
    layers, device). Dtypes may differ: target features are cast to the draft's dtype."""
    if getattr(target.config, "is_encoder_decoder", False):
        raise ValueError("hf_dspark drafts accelerate decoder-only targets; this target is an encoder-decoder model")
    draft.check_target(target)
    target_device = next(target.parameters()).device
    draft_device = next(draft.parameters()).device
    if target_device != draft_device:
        raise ValueError(
            f"the draft is on {draft_device} but the target is on {target_device}: move it with "
            f"draft.to('{target_device}') before generate()"
        )


def _use_static_target(model, config: SpeculativeConfig, sliding: bool, forced: bool, rows: int, width: int) -> bool:
    """Whether this call verifies over the static cache (`SpeculativeConfig.target_graphs`)."""
    why_not = explicit_mask_unsupported(model, sliding)
    if forced or config.target_graphs is True:
        if why_not:
            setting = "cache_implementation='static'" if forced else "dspark_target_graphs=True"
            raise ValueError(f"{setting} cannot be used with this target: {why_not}")
        return True
    if config.target_graphs is False or why_not:
        return False
    on_cuda = next(model.parameters()).device.type == "cuda"
    return on_cuda and _static_suits_schedule(model, config, rows, width)


def _static_suits_schedule(model, config: SpeculativeConfig, rows: int, width: int) -> bool:
    """"auto": whole blocks always suit the static path; "prefix" and "threshold" do where the target's profiled
    verify cost is flat (there the static path verifies whole blocks for "prefix": what Algorithm 1 would pick,
    without its per-round host sync; "threshold" keeps its cut, which on a flat cost saves nothing the dynamic
    cache could: at batch 1 on an H200 the dynamic cache made a SmolLM2 round 20x slower)."""
    if config.schedule == "none":
        return True
    return verify_cost_is_flat(_sps_cost_table(model, config, rows), rows, width)


def _sps_cost_table(model, config: SpeculativeConfig, rows: int) -> SPSTable:
    """The SPS table of the confidence schedules (the prefix scheduler's costs; where it is flat, "auto" verifies
    "prefix" and "threshold" on the static path): the one given, else the target's profiled one for `rows` rows
    (cached)."""
    if config.sps_table is not None:
        return SPSTable.from_any(config.sps_table)
    return load_or_profile_sps(model, batch_size=rows)


def _num_draft_tokens(draft, config: SpeculativeConfig) -> int:
    from ..models import drafter_spec

    block = draft.config.num_draft_tokens
    if config.block_size is None:
        return int(block)
    n = int(config.block_size)
    if not drafter_spec(draft.config.model_type).autoregressive and n > block:
        raise ValueError(
            f"dspark_block_size / num_assistant_tokens = {n} exceeds the draft's block_size {block}: a block drafter "
            f"proposes at most block_size tokens per round (use <= {block}, or a draft trained with a larger block)"
        )
    return n


def _check_generation_config(generation_config, draft, config: SpeculativeConfig) -> None:
    if generation_config.num_beams > 1:
        raise ValueError(
            "beam search (num_beams > 1) cannot be combined with a draft assistant: use num_beams=1 (greedy or "
            "sampling), or drop assistant_model"
        )
    if generation_config.return_dict_in_generate and (
        generation_config.output_attentions or generation_config.output_hidden_states
    ):
        raise ValueError(
            "output_attentions / output_hidden_states are not supported with a draft assistant; drop them or run "
            "generate() without assistant_model"
        )
    if generation_config.cache_implementation not in (None, "dynamic", "offloaded", "static"):
        raise ValueError(
            f"cache_implementation={generation_config.cache_implementation!r}: speculative decoding rolls the target "
            "cache back after every round; use the default dynamic cache, or 'static' (fixed shapes, CUDA graphs)"
        )
    if getattr(generation_config, "prompt_lookup_num_tokens", None) or getattr(
        generation_config, "assistant_early_exit", None
    ):
        raise ValueError("prompt lookup / early-exit assistance cannot be combined with a draft assistant_model")
    if config.schedule != "none":
        has_head = getattr(draft.config, "enable_confidence_head", False)
        if not has_head:
            raise ValueError(
                f"dspark_schedule={config.schedule!r} needs per-slot confidences, which only DSpark drafts with a "
                f"confidence head produce ({type(draft).__name__} has none): use dspark_schedule='none'"
            )


def _candidates_unsupported(draft, config: SpeculativeConfig, position_free: bool, no_mask: str | None) -> str | None:
    """Why several first-slot candidates (a tree of chains) cannot run with these settings, or None."""
    if not hasattr(draft, "propose_chains"):
        return (f"{type(draft).__name__} drafts one token at a time; a tree of chains needs a block drafter "
                "(DSpark, DFlash)")  # fmt: skip
    if config.schedule != "none":
        return "confidence schedules cut a single chain: use dspark_schedule='none'"
    if not position_free:
        return ("logits processors that read the sequence (repetition penalty, n-gram bans, ...) would see a "
                "different sequence on each branch: keep to position-free ones (temperature, top-k, top-p, ...)")
    if no_mask:
        return f"the tree's verify forward needs a 4D attention mask, and {no_mask}"
    return None


# -- the loop -----------------------------------------------------------------------------------------------


@torch.no_grad()
def speculative_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor=None,
    stopping_criteria=None,
    generation_config=None,
    *,
    draft,
    speculative_config: SpeculativeConfig | None = None,
    streamer=None,
    **model_kwargs,
):
    """Decoding method handed to generate() as `custom_generate` (see `integration.py`)."""
    start = time.perf_counter()
    config = speculative_config or SpeculativeConfig()
    _check_generation_config(generation_config, draft, config)
    check_draft_for_target(model, draft)
    cache_key = next((k for k in ("cache", "past_key_values") if k in model_kwargs), None)
    cache = model_kwargs.pop(cache_key, None) if cache_key else None
    if cache is None or not model_kwargs.get("use_cache", True):
        raise ValueError("speculative decoding needs the target's KV cache: call generate() with use_cache=True")
    asked_static = generation_config.cache_implementation == "static"
    if asked_static and config.target_graphs is False:
        raise ValueError(
            "cache_implementation='static' asks for the static verification path and dspark_target_graphs=False "
            "forbids it: drop one of them"
        )
    if asked_static:  # generate() made a StaticCache; the prompt is prefilled into a dynamic one, then copied
        cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    if not isinstance(cache, DynamicCache):
        raise ValueError(
            f"speculative decoding needs a DynamicCache (got {type(cache).__name__}): static and quantized caches "
            "cannot be rolled back per round; pass no cache or a DynamicCache"
        )
    if cache.get_seq_length() > 0:
        raise ValueError(
            "a pre-filled cache cannot be continued with a draft (its positions have no draft context): pass the "
            "full prompt without past_key_values/cache"
        )
    unknown = sorted(k for k, v in model_kwargs.items() if k not in _MODEL_KWARGS and v is not None)
    if unknown:
        raise ValueError(f"model inputs {unknown} are not supported by speculative decoding with a draft")
    if input_ids.dim() != 2:
        raise ValueError("speculative decoding needs input_ids of shape [batch, length] (inputs_embeds unsupported)")
    batch = input_ids.shape[0]
    if streamer is not None and batch > 1:
        raise ValueError("streamer supports batch size 1 only (as in transformers); stream one prompt at a time")
    if batch > 1 and generation_config._pad_token_tensor is None:
        raise ValueError(
            "batched speculative generation pads finished rows: set pad_token_id (or eos_token_id) in generate()"
        )
    input_ids = input_ids.to(next(model.parameters()).device)  # generate() accepts CPU inputs for a GPU model
    attention_mask = model_kwargs.get("attention_mask")
    attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.device)

    if any(getattr(cache, "is_linear", ()) or ()):
        raise ValueError(f"{type(model).__name__} has recurrent/linear-attention layers, which cannot be rolled back")
    sliding = any(getattr(cache, "is_sliding", ()) or ())
    static = _use_static_target(
        model, config, sliding, forced=asked_static, rows=batch, width=_num_draft_tokens(draft, config) + 1
    )
    row_by_row = batch > 1 and sliding
    decoder = _Decoder(
        model, draft, logits_processor, stopping_criteria, generation_config, config, streamer, sliding=sliding,
        static_target=static,
    )
    try:
        if row_by_row:
            for row in range(batch):
                fresh = DynamicCache(config=model.config.get_text_config(decoder=True))
                decoder.run(input_ids, attention_mask, fresh, rows=[row])
        else:
            decoder.run(input_ids, attention_mask, cache, rows=list(range(batch)))
    finally:
        if streamer is not None:
            streamer.end()
    decoder.stats.total_time = time.perf_counter() - start
    draft.last_generation_stats = decoder.stats
    if static:  # the verification cache lived inside the call
        return decoder.output(None, cache_key)
    whole = batch == 1 and decoder.candidates == 1  # (batched rows and tree rounds leave holes in the cache)
    if whole and not row_by_row:
        # As after _sample: the cache holds every token but the last one (drop tokens accepted past a stop).
        extra = cache.get_seq_length() - (input_ids.shape[1] + decoder.lengths[0] - 1)
        if extra > 0:
            cache.crop(-extra)
    return decoder.output(cache if whole else None, cache_key)


def _draft_processors(processors, config: SpeculativeConfig, do_sample: bool) -> list:
    """generate()'s processors for the draft's scores, then the proposal temperature (sampling only: any q the
    draft really drew from keeps verification exact; position-free, so every static path takes it as well)."""
    if not do_sample or float(config.draft_temperature) == 1.0:
        return list(processors)
    return [*processors, logits_process.TemperatureLogitsWarper(float(config.draft_temperature))]


class _FullBatchProcessors(logits_process.LogitsProcessorList):
    """generate()'s processors applied to a subset of its rows (`rows`, original indices): inputs are scattered
    into the full batch first, since processors may hold per-row state sized to it."""

    def __init__(self, processors):
        super().__init__(processors)
        self.rows = None
        self.batch_size = 0
        self.position_free = all(isinstance(p, _POSITION_FREE) for p in processors)

    def __call__(self, input_ids, scores, **kwargs):
        if self.position_free or self.rows is None:
            return apply_logits_processors(self, input_ids, scores, **kwargs)
        full_ids = input_ids.new_zeros(self.batch_size, input_ids.shape[1])
        full_ids[self.rows] = input_ids
        full_scores = scores.new_zeros(self.batch_size, scores.shape[-1])
        full_scores[self.rows] = scores
        return apply_logits_processors(self, full_ids, full_scores, **kwargs)[self.rows]


class _Decoder:
    """State of one generate() call: the output buffer and per-row lengths shared by every run()."""

    def __init__(self, model, draft, logits_processor, stopping_criteria, generation_config, config, streamer,
                 sliding: bool = False, static_target: bool = False):
        self.model = model
        self.draft = draft
        self.config = config
        self.generation_config = generation_config
        self.streamer = streamer
        self.do_sample = bool(generation_config.do_sample)
        if logits_processor is None:
            logits_processor = logits_process.LogitsProcessorList()
        self.logits_processor = logits_processor
        self.position_free = all(isinstance(p, _POSITION_FREE) for p in self.logits_processor)
        stopping_criteria = stopping_criteria if stopping_criteria is not None else StoppingCriteriaList()
        eos = [c.eos_token_id for c in stopping_criteria if isinstance(c, EosTokenCriteria)]
        self.eos_ids = torch.cat([e.reshape(-1) for e in eos]) if eos else None
        self.other_criteria = StoppingCriteriaList(
            [c for c in stopping_criteria if not isinstance(c, (EosTokenCriteria, MaxLengthCriteria))]
        )
        self.max_length = int(generation_config.max_length)
        pad = generation_config._pad_token_tensor
        self.pad_id = int(pad.reshape(-1)[0]) if pad is not None else 0
        self.num_tokens = _num_draft_tokens(draft, config)
        self.draft_processors = _FullBatchProcessors(_draft_processors(self.logits_processor, config, self.do_sample))
        self.sampler = TokenSampler(do_sample=self.do_sample, logits_processor=self.draft_processors)
        self.cache_kwarg = cache_kwarg_name(model)
        self.want_scores = bool(generation_config.return_dict_in_generate and generation_config.output_scores)
        self.want_logits = bool(generation_config.return_dict_in_generate and generation_config.output_logits)
        self.sps_table = None
        no_mask = explicit_mask_unsupported(model, sliding)
        self.candidates = int(config.candidates)
        if self.candidates > 1:
            reason = _candidates_unsupported(draft, config, self.position_free, no_mask)
            if reason:
                raise ValueError(f"dspark_candidates={self.candidates} cannot be used here: {reason}")
        # The draft's per-round work on static shapes, captured as CUDA graphs (draft_graphs.py).
        why_not = graphs_supported(self.position_free, sliding_target=sliding)
        if config.draft_graphs is True and why_not:
            raise ValueError(f"dspark_draft_graphs=True cannot be used here: {why_not}; use dspark_draft_graphs='auto'")
        on_cuda = next(model.parameters()).device.type == "cuda"
        self.static_draft = config.draft_graphs is True or (config.draft_graphs == "auto" and on_cuda and not why_not)
        self.capture_graphs = self.static_draft and on_cuda
        # A ready 4D verification mask where the attention implementation takes one (see _verify_mask).
        # (Not with sliding-window layers: one 4D mask would override their own windows.)
        # Additive, not boolean: SDPA turns a boolean mask into an additive one in every layer (about 90 nested
        # operators a round for a SmolLM2-depth target on CPU, a kernel a layer on a GPU).
        self.mask_4d = no_mask is None
        self.mask_dtype = next(model.parameters()).dtype
        # The verify forward on fixed shapes (target_graphs.py): cache_implementation="static".
        self.static_target = static_target
        # The static path's verify forward costs the same for any prefix of the block: "prefix" verifies whole
        # blocks there (see _static_suits_schedule).
        self.whole_blocks = config.schedule == "none" or (static_target and config.schedule == "prefix")
        # Whole rounds as one graph (round_graph.py): by default wherever it applies on CUDA.
        fused_why_not = why_not
        if not static_target:
            fused_why_not = "the static verification path is not in use (dspark_target_graphs / cache_implementation)"
        elif not fused_why_not and not self.whole_blocks:
            fused_why_not = "it verifies whole blocks only (dspark_schedule='none' or 'prefix')"
        elif not fused_why_not and (self.want_scores or self.want_logits):
            fused_why_not = "output_scores / output_logits need each step's scores"
        if config.fused_round is True and fused_why_not:
            raise ValueError(f"dspark_fused_round=True cannot be used here: {fused_why_not}")
        self.fused = config.fused_round is True or (
            config.fused_round == "auto" and on_cuda and not fused_why_not and config.draft_graphs is not False
        )
        if self.fused:
            self.static_draft = True
        # The verify forward compiled before capture: by default wherever the static path runs on CUDA.
        self.compile = config.compile is True or (config.compile == "auto" and static_target and on_cuda)
        if config.compile is True and not static_target:
            raise ValueError(
                "dspark_compile=True compiles the static verification path's forward, which this call does not use: "
                "add dspark_target_graphs=True (or cache_implementation='static')"
            )
        # The draft's functions compiled before capture: by default inside the fused round on CUDA.
        self.compile_draft = config.compile_draft is True or (config.compile_draft == "auto" and self.fused and on_cuda)
        if config.compile_draft is True and not self.static_draft:
            raise ValueError("dspark_compile_draft=True compiles the static draft path's functions, but the static "
                             "draft path is not in use (dspark_draft_graphs)")
        # The fused round's verification and commit compiled too: by default inside the fused round on CUDA.
        self.compile_verify = config.compile_verify is True or (config.compile_verify == "auto" and self.fused
                                                                and on_cuda)  # fmt: skip
        if config.compile_verify is True and not self.fused:
            raise ValueError("dspark_compile_verify=True compiles the fused round's verification, but this call does "
                             f"not run fused rounds{': ' + fused_why_not if fused_why_not else ''} (add "
                             "dspark_fused_round=True where it can run)")
        self.stats = SpeculativeStats(
            drafter=getattr(draft.config, "model_type", type(draft).__name__),
            schedule=config.schedule,
            block_size=self.num_tokens,
        )
        self.buffer = None
        self.prompt_length = 0
        self.lengths: list[int] = []
        self.row_scores: list[list] = []
        self.row_logits: list[list] = []

    # -- bookkeeping ---------------------------------------------------------------------------------------

    def _init_buffer(self, input_ids: torch.Tensor) -> None:
        if self.buffer is not None:
            return
        batch, prompt = input_ids.shape
        self.prompt_length = prompt
        budget = max(self.max_length - prompt, 0)
        self.budget = budget
        width = prompt + budget + self.num_tokens + 2  # room for tentative drafts past the budget
        self.buffer = torch.full((batch, width), self.pad_id, dtype=torch.long, device=input_ids.device)
        self.buffer[:, :prompt] = input_ids
        self.lengths = [0] * batch
        # Device mirror of `lengths`, advanced by the commit on the device: no host-to-device copy per round.
        self.lengths_t = torch.zeros(batch, dtype=torch.long, device=input_ids.device)
        self.row_scores = [[] for _ in range(batch)]
        self.row_logits = [[] for _ in range(batch)]
        self.stats.batch_size = batch

    # -- logits processing ---------------------------------------------------------------------------------

    def _process(self, logits: torch.Tensor, rows: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Target logits [R, W, V] at positions lengths[r] + k of each row -> processed float scores."""
        if len(self.logits_processor) == 0:
            return logits.float()
        if self.position_free:
            return apply_position_free(self.logits_processor, logits)  # (casts as it copies)
        logits = logits.float()
        rows_n, width, vocab = logits.shape
        # Processors may keep per-row state (e.g. the repetition penalty's prompt padding per row): call them on
        # the whole original batch, in its order; only the rows of the current length group are read back.
        out = torch.empty_like(logits)
        full = logits.new_zeros(self.buffer.shape[0], vocab)
        groups: dict[int, list[int]] = {}
        for i, length in enumerate(lengths):
            groups.setdefault(length, []).append(i)
        for length, members in groups.items():
            local = torch.tensor(members, device=logits.device)
            original = rows[local]
            for k in range(width):
                ids = self.buffer[:, : self.prompt_length + length + k]
                scores = full.clone()
                scores[original] = logits[local, k]
                out[local, k] = apply_logits_processors(self.logits_processor, ids, scores)[original]
        return out

    def _draft_input_ids(self, rows: torch.Tensor, lengths: list[int]) -> torch.Tensor | None:
        """Each row's sequence so far, left-padded to a rectangle (only processors that read ids need it)."""
        if self.position_free or len(self.logits_processor) == 0:
            return None
        total = torch.tensor([self.prompt_length + n for n in lengths], device=rows.device)
        width = int(max(self.prompt_length + n for n in lengths))
        cols = torch.arange(width, device=rows.device)[None, :] - (width - total)[:, None]
        ids = self.buffer[rows].gather(1, cols.clamp(min=0))
        return ids.masked_fill(cols < 0, self.pad_id)

    # -- commits -------------------------------------------------------------------------------------------

    def _commit(self, rows: torch.Tensor, row_ids: list[int], new_tokens: torch.Tensor, counts: torch.Tensor,
                scores: torch.Tensor | None, raw: torch.Tensor | None,
                extra: tuple[torch.Tensor, ...] = ()) -> tuple[list[int], list[bool], list[list[int]]]:
        """Write new_tokens [R, c] (counts [R] of them per row) after each row's sequence, cutting at the first
        stop. Returns (committed counts, finished flags, host copies of `extra` [R] tensors) through one
        device-to-host transfer: the round's only synchronization."""
        n_rows, width = new_tokens.shape
        device = new_tokens.device
        slot = torch.arange(width, device=device)[None, :]
        finished = torch.zeros(n_rows, dtype=torch.bool, device=device)
        if self.eos_ids is not None:
            counts, finished = cut_at_stop(new_tokens, counts, self.eos_ids.to(device))
        # Every column is written: those past a row's count lie beyond its length, where nothing reads them
        # before they are overwritten (and output() pads them).
        cols = self.prompt_length + self.lengths_t[rows][:, None] + slot
        self.buffer[rows[:, None].expand_as(cols), cols] = new_tokens
        self.lengths_t[rows] += counts
        host = torch.stack([counts, finished.long(), *extra]).tolist()
        counts_h, finished_h = host[0], [bool(f) for f in host[1]]
        if len(self.other_criteria):
            counts_h, finished_h = self._apply_criteria(rows, row_ids, counts_h, finished_h, scores)
            self.lengths_t[rows] += torch.tensor(counts_h, device=device) - counts  # cut at the criteria's stops
        finished_h = self._count_committed(row_ids, counts_h, finished_h)
        if self.want_scores or self.want_logits:
            for i, r in enumerate(row_ids):
                if self.want_scores:
                    self.row_scores[r].extend(scores[i, : counts_h[i]].unbind(0))
                if self.want_logits:
                    self.row_logits[r].extend(raw[i, : counts_h[i]].float().unbind(0))
        if self.streamer is not None:
            self.streamer.put(new_tokens[:1, : counts_h[0]].cpu())
        return counts_h, finished_h, host[2:]

    def _count_committed(self, row_ids: list[int], counts: list[int], finished: list[bool]) -> list[bool]:
        """The host's lengths after a commit; a row that reached the token budget is finished too."""
        finished = list(finished)
        for i, r in enumerate(row_ids):
            self.lengths[r] += counts[i]
            if self.lengths[r] >= self.budget:
                finished[i] = True
        self.stats.new_tokens += sum(counts)
        return finished

    def _apply_criteria(self, rows, row_ids, counts, finished, scores):
        """Evaluate the non-EOS stopping criteria on every committed prefix; cut each row at its first stop.

        Criteria see the whole batch (in its original order, as in `_sample`); rows are read back by length."""
        counts, finished = list(counts), list(finished)
        pending = {i: self.prompt_length + self.lengths[r] for i, r in enumerate(row_ids)}  # length before commit
        for j in range(1, max(counts, default=0) + 1):
            by_length: dict[int, list[int]] = {}
            for i, base in pending.items():
                if j <= counts[i]:
                    by_length.setdefault(base + j, []).append(i)
            for length, members in by_length.items():
                stop = self.other_criteria(self.buffer[:, :length], None)
                for i in members:
                    if bool(stop[row_ids[i]]):
                        counts[i], finished[i] = j, True
                        pending.pop(i)
        return counts, finished

    # -- one batch of rows ---------------------------------------------------------------------------------

    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache, rows: list[int]) -> None:
        self._init_buffer(input_ids)
        if self.budget <= 0:
            return
        device = input_ids.device
        model, draft = self.model, self.draft
        row_ids = list(rows)
        self.run_rows = len(row_ids)
        rows_t = torch.tensor(row_ids, device=device)
        prompt = input_ids[rows_t]
        mask = attention_mask[rows_t].long()
        if hasattr(cache, "activate_past_recording"):
            cache.activate_past_recording()  # sliding-window layers must keep states we may crop back to
        cache_kw = {self.cache_kwarg: cache}

        with TargetFeatureHooks(model, draft.config.target_layer_ids, capture_last_hidden=False) as hooks:
            # Prefill: the target's first token, exactly as _sample draws it.
            t0 = time.perf_counter()
            positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
            out = model(input_ids=prompt, attention_mask=mask, position_ids=positions, use_cache=True,
                        logits_to_keep=1, **cache_kw)
            raw = out.logits[:, -1:].float()
            scores = self._process(raw, rows_t, [0] * len(row_ids))
            first = self._select(scores[:, 0])
            # Room for every committed token plus one round's unread tail (static runs write whole rounds).
            # (A tree round's window holds every chain: 1 + k n columns.)
            width = 1 + self.candidates * self.num_tokens
            capacity = prompt.shape[1] + self.budget + 2 * width
            fused = runner = target_runner = None
            if self.static_target:  # (a fused round captures the verify forward inside its own graph)
                target_runner = static_target_runner(
                    model, self.cache_kwarg, cache, rows=len(row_ids), width=width, capacity=capacity,
                    capture=device.type == "cuda" and not self.fused, compile=self.compile,
                    tree=(self.candidates, self.num_tokens) if self.candidates > 1 else None,
                )
            if self.fused:
                fused = fused_round_runner(
                    draft, target_runner, self.sampler, self.logits_processor, self.do_sample,
                    tuple(self.eos_ids.tolist()) if self.eos_ids is not None else (), self.num_tokens, capacity,
                    capture=device.type == "cuda", compile_draft=self.compile_draft,
                    verification=self.config.verification, candidates=self.candidates,
                    compile_verify=self.compile_verify,
                )
                fused.reset()
                dcache = fused.dcache
            elif self.static_draft:
                runner = static_draft_runner(
                    draft, len(row_ids), capacity, self.sampler, self.do_sample,
                    self.num_tokens, capture=self.capture_graphs, compile=self.compile_draft,
                    candidates=self.candidates,
                )
                dcache = runner.cache
            else:
                dcache = draft.new_context_cache(len(row_ids), capacity=capacity)
            valid = mask.bool()
            # Left-padding positions have no real context (fully masked queries); keep them out of the draft.
            features = hooks.features.masked_fill(~valid[..., None], 0.0)
            following = torch.cat([prompt[:, 1:], first[:, None]], dim=1)  # the token after each position
            draft.extend_context(dcache, features, valid=valid, next_token_ids=following)
            del out
            if target_runner is not None:
                target_runner.load(cache, mask, hooks)
                self.stats.target_graphs = target_runner.captured
                cache.crop(0)  # the prompt's keys and values now live in the runner's buffers
            if fused is not None:
                self._run_fused(fused, rows_t, row_ids, mask, scores, raw, first, t0)
                return
            if runner is not None:
                self.stats.draft_graphs = runner.ready()
            local_t = torch.arange(len(row_ids), device=device)  # each running row's slot in this run
            counts, finished, _ = self._commit(rows_t, row_ids, first[:, None], torch.ones_like(first), scores, raw)
            self.stats.prefill_time += time.perf_counter() - t0
            real = mask.sum(-1)  # real tokens of each row in the target cache (= the anchor's position)

            while True:
                keep = [i for i, f in enumerate(finished) if not f]
                if not keep:
                    break
                if len(keep) < len(row_ids):
                    index = torch.tensor(keep, device=device)
                    if target_runner is None:  # (a static verification keeps every row's slot)
                        cache.batch_select_indices(index)
                    if runner is None:
                        dcache.select(index)  # (a static run keeps every row's slot)
                    mask, real, rows_t, local_t = mask[index], real[index], rows_t[index], local_t[index]
                    row_ids = [row_ids[i] for i in keep]
                if self.candidates > 1:
                    counts, finished, mask, real = self._tree_round(
                        cache_kw, dcache, hooks, rows_t, row_ids, mask, real, runner, local_t, target_runner
                    )
                    continue
                counts, finished, mask, real = self._round(
                    cache_kw, dcache, hooks, rows_t, row_ids, mask, real, runner, local_t, target_runner
                )

    def _run_fused(self, fused, rows_t, row_ids, mask, scores, raw, first, t0) -> None:
        """The rest of a call on the fused path: every round one graph replay and one host read."""
        counts, finished, _ = self._commit(rows_t, row_ids, first[:, None], torch.ones_like(first), scores, raw)
        self.buffer = fused.start(self.buffer, self.prompt_length, self.budget, self.lengths_t, mask.sum(-1),
                                  ~torch.tensor(finished, device=mask.device))  # fmt: skip
        self.lengths_t = fused.lengths
        self.stats.draft_graphs = self.stats.target_graphs = fused.capture
        self.stats.fused_round = True
        self.stats.prefill_time += time.perf_counter() - t0
        running = [i for i, f in enumerate(finished) if not f]
        while running:
            start = time.perf_counter()
            before = {i: self.lengths[row_ids[i]] for i in running}
            (counts_h, finished_h, accepted_h, verify_h, keep_h), confidences = fused.step()
            counts = [counts_h[i] for i in running]
            done = [bool(finished_h[i]) for i in running]
            if len(self.other_criteria):
                cut, done = self._apply_criteria(rows_t[running], [row_ids[i] for i in running], counts, done, None)
                changed = [k for k in range(len(running)) if cut[k] != counts[k]]
                if changed:
                    fused.set_lengths([running[k] for k in changed], [before[running[k]] + cut[k] for k in changed])
                counts = cut
            done = self._count_committed([row_ids[i] for i in running], counts, done)
            # Rows the host stopped (a criterion), not the graph (EOS, budget), must stop committing there too.
            stop = [i for k, i in enumerate(running) if done[k] and not finished_h[i]]
            if stop:
                fused.stop_rows(stop)
            self.stats.acceptance.add_round(
                [verify_h[i] for i in running], [accepted_h[i] for i in running],
                None if confidences is None else confidences[running], committed=counts,
                requests=[row_ids[i] for i in running], fed=[1 + self.candidates * verify_h[i] for i in running],
            )  # fmt: skip
            fused.target_runner.kept(keep_h[0])
            if self.streamer is not None and running[0] == 0 and counts[0]:
                base = self.prompt_length + before[0]
                self.streamer.put(self.buffer[:1, base : base + counts[0]].cpu())
            running = [i for k, i in enumerate(running) if not done[k]]
            self.stats.verify_time += time.perf_counter() - start

    def _select(self, scores: torch.Tensor) -> torch.Tensor:
        if self.do_sample:
            return sample_from(torch.softmax(scores, dim=-1))
        return scores.argmax(dim=-1)

    def _schedule(self, proposal, caps: torch.Tensor) -> torch.Tensor:
        schedule = self.config.schedule
        if proposal is None:
            return torch.zeros_like(caps)
        if self.whole_blocks:
            return fixed_schedule(caps, proposal.tokens.shape[1])
        conf = proposal.confidences
        if schedule == "threshold":
            return threshold_schedule(conf, float(self.config.threshold), caps)
        if self.sps_table is None:
            # Keyed by the batch this run started with (rows leave as they finish; profile once per shape).
            self.sps_table = _sps_cost_table(self.model, self.config, self.run_rows)
        return prefix_schedule(conf, self.sps_table, max_lengths=caps)

    def _round(self, cache_kw, dcache, hooks, rows_t, row_ids, mask, real, runner=None, local_t=None,
               target_runner=None):
        model, draft = self.model, self.draft
        device = rows_t.device
        n_rows = len(row_ids)
        t0 = time.perf_counter()
        lengths = [self.lengths[r] for r in row_ids]
        # The bonus token is committed too: verify at most budget - generated - 1 draft tokens.
        n_draft = max(max(0, min(self.num_tokens, self.budget - n - 1)) for n in lengths)
        with phase("propose"):
            lengths_t = self.lengths_t[rows_t]
            caps = (self.budget - 1 - lengths_t).clamp(min=0, max=self.num_tokens)
            anchors = self.buffer[rows_t, self.prompt_length + lengths_t - 1]
            proposal = None
            if n_draft > 0 and runner is not None:
                proposal = runner.propose(local_t, anchors, n_draft)
            elif n_draft > 0:
                self.draft_processors.rows, self.draft_processors.batch_size = rows_t, self.buffer.shape[0]
                proposal = draft.propose(
                    dcache,
                    anchors,
                    sampler=self.sampler,
                    num_tokens=n_draft,
                    input_ids=self._draft_input_ids(rows_t, lengths),
                )
            verify_len = self._schedule(proposal, caps)
            if self.whole_blocks:
                width = n_draft + 1  # known on the host: every row verifies min(cap, n_draft) = its whole cap
            else:
                width = int(verify_len.max().item()) + 1  # confidence schedules: one extra synchronization
        t1 = time.perf_counter()
        self.stats.draft_time += t1 - t0

        with phase("verify_forward"):
            window = anchors[:, None]
            if width > 1:
                drafts = proposal.tokens[:, : width - 1]
                window = torch.cat([window, drafts], dim=1)
                if not self.position_free:  # tentative drafts after each sequence: the logits processors read them
                    cols = self.prompt_length + lengths_t[:, None] + torch.arange(width - 1, device=device)
                    self.buffer[rows_t[:, None].expand_as(cols), cols] = drafts
            slot = torch.arange(width, device=device)[None, :]
            if target_runner is not None:
                raw, features = target_runner.verify(local_t, window, real[:, None] + slot)
                raw = raw.float()
            else:
                window_valid = slot <= verify_len[:, None]
                out = model(
                    input_ids=window,
                    attention_mask=self._verify_mask(mask, window_valid),
                    position_ids=real[:, None] + slot,
                    use_cache=True,
                    logits_to_keep=width,
                    **cache_kw,
                )
                raw = out.logits[:, -width:].float()
                features = hooks.features
                del out
        with phase("accept"):
            scores = self._process(raw, rows_t, lengths)
            result = verify_block(
                scores,
                window[:, 1:],
                None if proposal is None or proposal.probs is None else proposal.probs[:, : width - 1],
                verify_len,
                self.do_sample,
                method=self.config.verification,
            )
            accepted = result.num_accepted
            new_tokens = block_tokens(window, result)
        with phase("commit"):
            confidences = None
            if proposal is not None and proposal.confidences is not None:
                # Queued before the commit's synchronization, so it has arrived when the commit returns.
                confidences = proposal.confidences.to("cpu", non_blocking=True)
            counts, finished, (accepted_h, verify_h) = self._commit(
                rows_t, row_ids, new_tokens, accepted + 1, scores, raw, extra=(accepted, verify_len)
            )
        t2 = time.perf_counter()
        self.stats.verify_time += t2 - t1
        self.stats.acceptance.add_round(verify_h, accepted_h, confidences, committed=counts, requests=row_ids)

        # Roll the target cache back to the longest committed prefix among continuing rows; others keep holes.
        with phase("rollback"):
            continuing = [i for i, f in enumerate(finished) if not f]
            keep = max(accepted_h[i] + 1 for i in (continuing or range(n_rows)))
            committed = slot[:, :keep] <= accepted[:, None]
            if target_runner is not None:
                target_runner.commit(local_t, committed, keep)
            else:
                # Always: in transformers 5.17 crop(0) also trims sliding-window layers back to their window.
                cache_kw[self.cache_kwarg].crop(-(width - keep))
                mask = torch.cat([mask, committed.long()], dim=1)
            real = real + accepted + 1
        if continuing:  # context K/V of the committed positions
            with phase("extend"):
                prefix = accepted + 1  # each row commits a prefix of its window: nothing to left-pack
                if runner is not None:
                    runner.extend(local_t, features, prefix, new_tokens)
                else:
                    draft.extend_context(
                        dcache, features, next_token_ids=new_tokens, max_committed=max(accepted_h) + 1, counts=prefix
                    )
            self.stats.draft_time += time.perf_counter() - t2
        return counts, finished, mask, real

    def _tree_round(self, cache_kw, dcache, hooks, rows_t, row_ids, mask, real, runner, local_t, target_runner):
        """One round with k first-slot candidates (`SpeculativeConfig.candidates`): k chains of n drafts, one
        verify forward over [anchor, chain 1, ..., chain k] with each chain seeing the anchor and its own earlier
        slots (`tree_attention`), `verify_candidates`, then the committed path is packed for the draft and the
        target cache keeps every window column (the other chains' are holes, masked like a shorter row's). On the
        static paths the window always holds whole chains (the runners' fixed shapes); caps cut what is verified.
        (The fused round runs the same steps in `round_graph.FusedRoundRunner._tree_round`.)"""
        model, draft, k = self.model, self.draft, self.candidates
        device = rows_t.device
        n_rows = len(row_ids)
        t0 = time.perf_counter()
        lengths = [self.lengths[r] for r in row_ids]
        n = max(max(0, min(self.num_tokens, self.budget - length - 1)) for length in lengths)
        if n == 0:  # the budget allows no draft token: a plain round verifies the anchor alone
            return self._round(cache_kw, dcache, hooks, rows_t, row_ids, mask, real, None, local_t, target_runner)
        caps_max = n
        if target_runner is not None or runner is not None:
            n = self.num_tokens
        with phase("propose"):
            lengths_t = self.lengths_t[rows_t]
            caps = (self.budget - 1 - lengths_t).clamp(min=0, max=caps_max)
            anchors = self.buffer[rows_t, self.prompt_length + lengths_t - 1]
            if runner is not None:
                chains, probs = runner.propose_chains(local_t, anchors)
            else:
                proposal = draft.propose_chains(dcache, anchors, sampler=self.sampler, num_tokens=n, candidates=k)
                chains = proposal.tokens.view(n_rows, k, n)
                probs = None if proposal.probs is None else proposal.probs.view(n_rows, k, n, -1)
        t1 = time.perf_counter()
        self.stats.draft_time += t1 - t0

        with phase("verify_forward"):
            window = torch.cat([anchors[:, None], chains.reshape(n_rows, k * n)], dim=1)  # [R, 1 + k n]
            positions = real[:, None] + tree_depths(k, n, device)
            if target_runner is not None:
                raw, features = target_runner.verify(local_t, window, positions)
                raw = raw.float()
            else:
                out = model(
                    input_ids=window,
                    attention_mask=self._verify_mask(mask, None, tree_attention(k, n, device)),
                    position_ids=positions,
                    use_cache=True,
                    logits_to_keep=window.shape[1],
                    **cache_kw,
                )
                raw = out.logits[:, -window.shape[1] :].float()
                features = hooks.features
                del out
        with phase("accept"):
            scores = self._process(raw, rows_t, lengths)
            result = verify_candidates(scores, chains, probs, caps, self.do_sample, method=self.config.verification)
            accepted = result.num_accepted
            picked = result.chain.clamp(min=0)
            # The committed path's window columns: the anchor, then the accepted chain's slots.
            slots = 1 + picked[:, None] * n + torch.arange(n, device=device)
            path = torch.cat([torch.zeros_like(picked)[:, None], slots], dim=1)
            tokens = torch.cat([anchors[:, None], chains[torch.arange(n_rows, device=device), picked]], dim=1)
            new_tokens = block_tokens(tokens, VerifyResult(accepted, result.next_tokens))
        with phase("commit"):
            gather = lambda values: values.gather(1, path[..., None].expand(-1, -1, values.shape[-1]))  # noqa: E731
            counts, finished, (accepted_h, verify_h, picked_h) = self._commit(
                rows_t, row_ids, new_tokens, accepted + 1, gather(scores) if self.want_scores else None,
                gather(raw) if self.want_logits else None, extra=(accepted, caps, picked),
            )  # fmt: skip
        t2 = time.perf_counter()
        self.stats.verify_time += t2 - t1
        self.stats.acceptance.add_round(
            verify_h, accepted_h, committed=counts, requests=row_ids, fed=[1 + k * v for v in verify_h]
        )

        with phase("rollback"):
            continuing = [i for i, f in enumerate(finished) if not f]
            on_path = torch.zeros(n_rows, window.shape[1], dtype=torch.bool, device=device)
            on_path.scatter_(1, path, torch.arange(n + 1, device=device)[None, :] <= accepted[:, None])
            # Keep the window up to the last committed column among continuing rows; the rest are holes.
            last = [a and picked_h[i] * n + a for i, a in enumerate(accepted_h)]  # the anchor is column 0
            keep = max(last[i] for i in (continuing or range(n_rows))) + 1
            if target_runner is not None:
                target_runner.commit(local_t, on_path[:, :keep], keep)
            else:
                cache_kw[self.cache_kwarg].crop(-(window.shape[1] - keep))
                mask = torch.cat([mask, on_path[:, :keep].long()], dim=1)
            real = real + accepted + 1
        if continuing:
            with phase("extend"):
                if runner is not None:
                    runner.extend(local_t, gather(features), accepted + 1, new_tokens)
                else:
                    draft.extend_context(dcache, gather(features), next_token_ids=new_tokens,
                                         max_committed=max(accepted_h) + 1, counts=accepted + 1)  # fmt: skip
            self.stats.draft_time += time.perf_counter() - t2
        return counts, finished, mask, real

    def _verify_mask(self, mask: torch.Tensor, window_valid: torch.Tensor | None,
                     window_attention: torch.Tensor | None = None) -> torch.Tensor:
        """The verification forward's attention mask.

        Where the target's attention takes a ready 4D mask (sdpa, eager) and no layer has a sliding window, build
        it here: the committed keys (holes masked) plus a causal block over the window. transformers then skips
        its own mask construction (which reads the 2D mask back to the host to look for padding); a window slot
        past a row's verified length is attended only by later, equally unverified slots. Otherwise the 2D mask.
        """
        if not self.mask_4d:
            return torch.cat([mask, window_valid.long()], dim=1)
        if window_attention is None:
            width = window_valid.shape[1]
            window_attention = torch.ones(width, width, dtype=torch.bool, device=mask.device).tril()
        rows, width = mask.shape[0], window_attention.shape[0]
        past = mask.bool()[:, None, None, :].expand(rows, 1, width, mask.shape[1])
        full = torch.cat([past, window_attention[None, None].expand(rows, 1, width, width)], dim=-1)
        return additive_mask(full, self.mask_dtype)

    # -- output --------------------------------------------------------------------------------------------

    def output(self, cache, cache_key):
        if self.buffer is None:
            raise RuntimeError("generate() produced no output")
        total = self.prompt_length + max(self.lengths, default=0)
        sequences = self.buffer[:, :total].clone()
        ends = self.prompt_length + torch.tensor(self.lengths, device=sequences.device)
        sequences.masked_fill_(torch.arange(total, device=sequences.device)[None, :] >= ends[:, None], self.pad_id)
        gc = self.generation_config
        if not gc.return_dict_in_generate:
            return sequences
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        steps = max(self.lengths, default=0)
        values = {
            "sequences": sequences,
            "scores": self._per_step(self.row_scores, steps) if self.want_scores else None,
            "logits": self._per_step(self.row_logits, steps) if self.want_logits else None,
        }
        names = {f.name for f in fields(GenerateDecoderOnlyOutput)}
        for name in ("cache", "past_key_values"):
            if name in names:
                values[name] = cache
        output = GenerateDecoderOnlyOutput(**values)
        output.speculative_stats = self.stats
        return output

    @staticmethod
    def _per_step(per_row: list[list[torch.Tensor]], steps: int):
        reference = next((v[0] for v in per_row if v), None)
        if reference is None:
            return ()
        zeros = torch.zeros_like(reference)
        return tuple(torch.stack([v[t] if t < len(v) else zeros for v in per_row]) for t in range(steps))


__all__ = ["SpeculativeConfig", "speculative_generate", "check_draft_for_target"]
