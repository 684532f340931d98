"""Speculative decoding speed: tokens/s and tau of hf_dspark drafts through target.generate().

Compares, on the same prompts and settings, at each batch size and temperature:
  target        target.generate() alone (the baseline; speedup = tokens/s over this row's)
  prompt_lookup transformers' prompt lookup decoding (prompt_lookup_num_tokens; transformers runs it at batch 1 only)
  <draft>       each draft, whole blocks verified
  <draft>+threshold / <draft>+prefix   DSpark drafts with a confidence head: static threshold / Algorithm 1
  <draft>+kK    with --candidates K ...: DSpark / DFlash drafts with K first-slot candidates a round, verified as
                a tree (dspark_candidates=K)
  <draft>/static, /dynamic, /eager, /fused, /compiled, /compiled-draft, /fused-compiled-draft,
  /fused-compiled-verify   with
                --compare-paths: the static verification path in separate graphs with its verify forward uncompiled,
                the dynamic cache, no CUDA graphs at all, whole rounds as one graph with the draft and the
                verification uncompiled (dspark_fused_round; verify forward compiled as by default), separate graphs
                with the verify forward compiled before capture (dspark_compile), and with the draft's proposal and
                extension compiled too (dspark_compile_draft), separately or inside the fused round, and the fused
                round's verification and commit compiled as well (dspark_compile_verify; with the compiled draft,
                the default on CUDA where the fused round applies). Paths named explicitly also run each
                --candidates K (<draft>+kK/PATH)
  target+static-cache   with --static-target: transformers' static-cache generate() of the target (compiled by
                generate() on CUDA), the fastest target-alone baseline. Not plain cache_implementation="static":
                generate() sizes each call's new StaticCache by that call's prompt length + max_new_tokens (never
                shrinking below an earlier call's), so each longer prompt changed the compiled step's shapes and
                recompiled it inside the timing (and new cache addresses re-record its CUDA graphs). The row passes
                one StaticCache per batch shape, of one length for the whole run (longest prompt + max_new_tokens,
                rounded up to 256), reset before each call, and warms each batch shape once untimed
                (hf_dspark.evaluation.static_baseline); the row records static_cache_len and static_warmup_calls
  hf_dflash     transformers' built-in DFlash candidate generator (speculation_type="dflash"), only with
                --hf-dflash-draft (a transformers-format DFlash checkpoint; hf_dspark DFlash drafts use
                DeepSpec's slot convention and cannot run there)

Timing: one warm-up call per method and batch shape, then every prompt batch timed with CUDA-synchronized wall
clock. A timed call that compiled or captured a CUDA graph (a shape the warm-ups missed) runs again from the same
random state and its warm timing is kept; rows record `retimed_calls` and any one-time work left in their timings
(`compile_s_in_timing`, `graph_captures_in_timing`; the note says so). Generated tokens are counted up to and
including each row's first EOS. Prints a table last and writes JSON (command, hardware, versions, rows).

GPU:   python benchmarks/generation_speed.py --draft dspark=runs/dspark --draft eagle3=runs/eagle3 \
           --prompts ../shared/data/eval/mt-bench.jsonl --batch-sizes 1 16 --temperatures 0 1 --json bench.json
CPU smoke test (tiny random target and drafts): python benchmarks/generation_speed.py --device cpu --smoke
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import hardware  # noqa: E402

from hf_dspark.compilation import run_warm, timing_checks
from hf_dspark.data.prompts import count_new_tokens, eos_token_ids, new_token_lengths
from hf_dspark.metrics import batched_decoding_speed
from hf_dspark.evaluation.static_baseline import StaticTargetBaseline


@dataclass
class Row:
    method: str
    batch_size: int
    temperature: float
    new_tokens: int = 0
    seconds: float = 0.0
    tau: float | None = None
    draft_time: float | None = None
    verify_time: float | None = None
    matches_target: bool | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float | None:
        return self.new_tokens / self.seconds if self.seconds > 0 else None


# --compare-paths: generate() options of each decoding path, beside the defaults' row.
PATHS = {
    "static": {"dspark_target_graphs": True, "dspark_fused_round": False, "dspark_compile": False},
    "dynamic": {"dspark_target_graphs": False},
    "eager": {"dspark_target_graphs": False, "dspark_draft_graphs": False},
    "fused": {"dspark_target_graphs": True, "dspark_fused_round": True, "dspark_compile_draft": False,
              "dspark_compile_verify": False},
    "compiled": {"dspark_target_graphs": True, "dspark_fused_round": False, "dspark_compile": True},
    "compiled-draft": {"dspark_target_graphs": True, "dspark_fused_round": False, "dspark_compile": True,
                       "dspark_draft_graphs": True, "dspark_compile_draft": True},
    "fused-compiled-draft": {"dspark_target_graphs": True, "dspark_fused_round": True, "dspark_compile": True,
                             "dspark_compile_draft": True, "dspark_compile_verify": False},
    "fused-compiled-verify": {"dspark_target_graphs": True, "dspark_fused_round": True, "dspark_compile": True,
                              "dspark_compile_draft": True, "dspark_compile_verify": True},
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="target folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--draft", action="append", default=[], metavar="NAME=PATH", help="a trained draft (repeat)")
    parser.add_argument("--prompts", default=None, help='{"turns": [...]} JSONL; the first turn is used')
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="0 = greedy")
    parser.add_argument("--prompt-lookup-tokens", type=int, default=10)
    parser.add_argument("--threshold", type=float, default=0.5, help="dspark_threshold of the threshold rows")
    parser.add_argument("--candidates", type=int, nargs="*", default=[], metavar="K",
                        help="also time block drafts with K first-slot candidates a round (dspark_candidates)")
    parser.add_argument("--sps-table", default=None, help="SPS table JSON for the prefix rows (default: profile+cache)")
    parser.add_argument("--hf-dflash-draft", default=None, help="transformers-format DFlash draft (hf_dflash row)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--static-target", action="store_true",
                        help="also time target.generate() on a static cache (compiled by generate where it can), one "
                        "cache length for the whole run, each batch shape warmed up untimed")
    parser.add_argument("--compare-paths", nargs="*", default=None, choices=list(PATHS), metavar="PATH",
                        help="also time each draft on these decoding paths (no names: all): static "
                        "(dspark_target_graphs=True, separate graphs, dspark_compile=False), dynamic "
                        "(dspark_target_graphs=False), eager (no CUDA graphs at all), fused (whole rounds as one "
                        "graph, dspark_fused_round=True, its draft and verification uncompiled), compiled (separate "
                        "graphs, the verify forward compiled), compiled-draft (the draft's functions compiled too, "
                        "dspark_compile_draft=True), fused-compiled-draft (both in the fused round) and "
                        "fused-compiled-verify (the round's verification and commit compiled too, "
                        "dspark_compile_verify=True: the default on CUDA); paths named here also run each "
                        "--candidates K")
    parser.add_argument("--json", default="generation_speed.json", help="where to write the results")
    parser.add_argument("--smoke", action="store_true", help="tiny random target and drafts (CPU test of the script)")
    parser.add_argument("--smoke-depth", choices=("tiny", "smollm2"), default="tiny",
                        help="smollm2: the smoke target has SmolLM2's 30 layers and the DSpark draft its default 2 "
                        "layers and block 7, at tiny widths: with --profile, a round's host operators against a "
                        "target step's as the real model launches them")
    parser.add_argument("--profile", default=None, metavar="FILE",
                        help="after the timings, profile one call of the target alone and of the first draft (also "
                        "with each --candidates K) at the largest batch size (torch.profiler operator tables) into FILE")
    parser.add_argument("--profile-temperature", type=float, default=0.0, help="temperature of the profiled calls")
    return parser.parse_args(argv)


# -- setup ------------------------------------------------------------------------------------------------------


def load_setup(args):
    """(target, tokenizer or None, {name: draft}, prompts as token-id lists)."""
    from transformers import AutoModel

    import hf_dspark  # noqa: F401  (routes generate(assistant_model=draft))
    from hf_dspark.data.prompts import encode_chat_prompts, first_turns
    from hf_dspark.resources import load_target, resolve_dtype

    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.smoke:
        return smoke_setup(args, device, dtype)
    target, tokenizer = load_target(args.target, device, dtype)
    drafts = {}
    for spec in args.draft:
        name, _, path = spec.partition("=")
        if not path:
            raise SystemExit(f"--draft expects NAME=PATH, got {spec!r}")
        drafts[name] = AutoModel.from_pretrained(path, dtype=dtype).to(device).eval()
    if args.prompts is None:
        raise SystemExit("--prompts is required (a {'turns': [...]} JSONL), or use --smoke")
    prompts = encode_chat_prompts(tokenizer, first_turns(args.prompts, args.num_prompts))
    return target, tokenizer, drafts, prompts


def smoke_setup(args, device, dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_dspark import DFlashModel, DSparkModel, Eagle3Model

    torch.manual_seed(args.seed)
    smollm2 = args.smoke_depth == "smollm2"
    config = LlamaConfig(
        vocab_size=128, hidden_size=96 if smollm2 else 64, intermediate_size=128,
        num_hidden_layers=30 if smollm2 else 4, num_attention_heads=6 if smollm2 else 4, num_key_value_heads=2,
        max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # (SmolLM2 groups 3 query heads per key/value head)
    target = AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).eval()
    drafts = {
        "dspark": DSparkModel.from_target(target, num_hidden_layers=2 if smollm2 else 1, block_size=7 if smollm2 else 4,
                                          dtype=dtype),  # fmt: skip
        "dflash": DFlashModel.from_target(target, num_hidden_layers=1, block_size=4, dtype=dtype),
        "eagle3": Eagle3Model.from_target(target, block_size=4, dtype=dtype),
    }
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, 128, (int(torch.randint(4, 12, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(min(args.num_prompts, 8))]
    args.max_new_tokens = min(args.max_new_tokens, 64 if smollm2 else 16)
    args.batch_sizes = sorted({min(b, 4) for b in args.batch_sizes})
    return target, None, {k: v.eval() for k, v in drafts.items()}, prompts


# -- measurement ------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_method(row, target, prompts, batch_size, temperature, args, pad_id, eos_ids, draft=None, extra=None,
               static=None):
    """Generate every prompt batch once (after one warm-up batch per batch shape) into `row` (new tokens, seconds,
    the timing checks of `hf_dspark.compilation.TIMING_CHECKS`): (outputs, merged stats). `static`: a
    StaticTargetBaseline, whose fixed-length StaticCache each call of the target alone uses."""
    from hf_dspark.data.prompts import left_pad

    device = next(target.parameters()).device
    kwargs = dict(max_new_tokens=args.max_new_tokens, pad_token_id=pad_id)
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kwargs.update(do_sample=False)
    if draft is not None:
        kwargs["assistant_model"] = draft
    kwargs.update(extra or {})
    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]

    def timed_generate(batch):
        ids, mask = left_pad(batch, pad_id, device)
        cache = static.generate_kwargs(ids) if static is not None else {}  # emptied outside the timer
        _sync(device)
        start = time.perf_counter()
        out = target.generate(ids, attention_mask=mask, **kwargs, **cache)
        _sync(device)
        return ids, out, time.perf_counter() - start

    if static is not None:
        static.warm_up(batches, timed_generate)  # compiles the decoding step once per batch shape, for the whole run
    else:
        # Warm-up, once per batch shape (this also profiles and caches the prefix scheduler's SPS table), with the
        # longest prompts last: the static paths' buffers (kept between calls) are then sized for every timed call.
        longest = max(batches, key=lambda batch: max(len(p) for p in batch))
        for warm in [*{len(batches[0]): batches[0], len(batches[-1]): batches[-1]}.values(), longest]:
            timed_generate(warm)
    tokens, seconds, outputs, stats, runs = 0, 0.0, [], None, []
    torch.manual_seed(args.seed)
    for batch in batches:
        warm = run_warm(lambda: timed_generate(batch))  # a shape the warm-ups missed: run again, warm, same draws
        runs.append(warm)
        ids, out, elapsed = warm.result
        seconds += elapsed
        tokens += count_new_tokens(out, ids.shape[1], eos_ids)
        outputs.append(out[:, ids.shape[1] :].cpu())
        if draft is not None and hasattr(draft, "last_generation_stats"):
            call = draft.last_generation_stats
            stats = call if stats is None else stats.merge(call)
    row.new_tokens, row.seconds = tokens, seconds
    checks = timing_checks(runs)
    row.extra.update(checks)
    if checks["compile_s_in_timing"] or checks["graph_captures_in_timing"]:
        row.note = (row.note + "; " if row.note else "") + "timing holds one-time work (compile / graph capture)"
    return outputs, stats


def special_ids(target, tokenizer) -> tuple[int, list[int]]:
    """(pad id, EOS ids): the target's pad id, else the tokenizer's, else its first EOS id."""
    eos_ids = eos_token_ids(target, tokenizer)
    pad_id = target.generation_config.pad_token_id
    if pad_id is None:
        pad_id = getattr(tokenizer, "pad_token_id", None)
    if pad_id is None:
        pad_id = eos_ids[0] if eos_ids else 0
    return pad_id, eos_ids


def benchmark(args, setup, progress=None) -> list[Row]:
    """Every row; `progress(rows)` after each one (partial results survive an interrupted run)."""
    target, tokenizer, drafts, prompts = setup
    device = next(target.parameters()).device
    pad_id, eos_ids = special_ids(target, tokenizer)
    hf_dflash, hf_dflash_note = load_hf_dflash(args, device, target)
    static = StaticTargetBaseline(target, prompts, args.max_new_tokens) if args.static_target else None
    rows: list[Row] = []

    def add(row: Row) -> None:
        rows.append(row)
        if progress is not None:
            progress(rows)

    for temperature in args.temperatures:
        for batch_size in args.batch_sizes:
            base = Row("target", batch_size, temperature)
            common = (target, prompts, batch_size, temperature, args, pad_id, eos_ids)
            reference, _ = run_method(base, *common)
            step_cost(base, reference, eos_ids)
            add(base)
            if static is not None:
                # transformers' own fast path, the baseline that matters: timed right after the eager target, so a
                # run stopped early still holds it beside the rows before the stop. A static cache, whose decoding
                # step generate() compiles where it can (untimed warm-ups); one cache length for the run (docstring).
                row = Row("target+static-cache", batch_size, temperature)
                outputs, _ = run_method(row, *common, static=static)
                row.extra.update(static.record())
                note = f"static cache of {static.cache_len} for the run, compiled in untimed warm-ups"
                row.note = f"{note}; {row.note}" if row.note else note  # (run_method's note, if any, kept)
                step_cost(row, outputs, eos_ids)
                if temperature == 0:
                    greedy_agreement(row, outputs, reference, eos_ids)
                add(row)
            add(prompt_lookup_row(*common, reference))
            for name, draft in drafts.items():
                variants = [(name, {})]  # generate()'s defaults: what a user gets
                if args.compare_paths is not None:
                    wanted = args.compare_paths or list(PATHS)
                    variants += [(f"{name}/{path}", PATHS[path]) for path in wanted]
                if getattr(draft.config, "enable_confidence_head", False):
                    sps = {"dspark_sps_table": args.sps_table} if args.sps_table else {}
                    variants += [
                        (f"{name}+threshold", {"dspark_schedule": "threshold", "dspark_threshold": args.threshold}),
                        (f"{name}+prefix", {"dspark_schedule": "prefix", **sps}),
                    ]
                if hasattr(draft, "propose_chains"):
                    for k in (k for k in args.candidates if k > 1):
                        variants.append((f"{name}+k{k}", {"dspark_candidates": k}))
                        # Paths named explicitly (not the bare flag's all) also serve the tree round.
                        variants += [(f"{name}+k{k}/{path}", {**PATHS[path], "dspark_candidates": k})
                                     for path in args.compare_paths or []]  # fmt: skip
                for label, extra in variants:
                    row = Row(label, batch_size, temperature)
                    try:
                        outputs, stats = run_method(row, *common, draft, extra)
                    except Exception as error:  # noqa: BLE001
                        if label == name:  # the default path must work; a compared path may fail on some hardware
                            raise
                        row.note = f"failed: {type(error).__name__}: {error}"[:300]
                        add(row)
                        continue
                    if stats is not None:
                        row.tau, row.draft_time, row.verify_time = stats.tau, stats.draft_time, stats.verify_time
                        round_costs(row, base, stats, batch_size)
                        row.extra["draft_graphs"] = stats.draft_graphs
                        row.extra["target_graphs"] = stats.target_graphs
                        row.extra["fused_round"] = stats.fused_round
                        row.extra["accept_rate_by_position"] = stats.accept_rate_by_position
                        row.extra["tau_ci95"] = stats.acceptance.to_dict()["tau_ci95"]  # bootstrap over prompts
                        row.extra["verified_tokens"] = stats.verified_tokens
                    if temperature == 0:
                        greedy_agreement(row, outputs, reference, eos_ids)
                    add(row)
            add(hf_dflash_row(*common, hf_dflash, hf_dflash_note))
    return rows


def step_cost(row: Row, outputs, eos_ids) -> None:
    """A target-alone row's cost of one step and row fill (`metrics.batched_decoding_speed`): its tokens/s also
    depends on how many rows of each batch ended before the longest, which greedy and sampled text differ in."""
    lengths = [new_token_lengths(out, eos_ids) for out in outputs]
    batches = [(int(n.max()), n.numel()) for n in lengths if n.numel()]
    speed = batched_decoding_speed(row.new_tokens, row.seconds, batches)
    row.extra.update(ms_per_step=speed["ms_per_longest_row_token"], row_fill=speed["row_fill"])
    cost = f"{speed['ms_per_longest_row_token']:.2f} ms a step, row fill {speed['row_fill']:.2f}"
    row.note = f"{row.note}; {cost}" if row.note else cost


def round_costs(row: Row, base: Row, stats, batch_size: int) -> None:
    """Per-round cost: wall ms per round, the draft's share of it and, at batch 1, a round in target decode steps
    (the target alone decodes one token per step; a round commits tau tokens, so speedup = tau / round cost)."""
    rounds = stats.acceptance.rounds
    if not rounds or not row.seconds:
        return
    row.extra["rounds"] = rounds
    row.extra["ms_per_round"] = 1e3 * row.seconds / rounds
    row.extra["draft_share"] = stats.draft_time / row.seconds
    if batch_size == 1 and base.new_tokens and base.seconds:
        step_ms = 1e3 * base.seconds / base.new_tokens
        row.extra["target_step_ms"] = step_ms
        row.extra["round_cost_target_steps"] = row.extra["ms_per_round"] / step_ms


def prompt_lookup_row(target, prompts, batch_size, temperature, args, pad_id, eos_ids, reference) -> Row:
    row = Row("prompt_lookup", batch_size, temperature)
    if batch_size > 1:
        row.note = "skipped: transformers' assisted decoding (prompt lookup) supports batch size 1 only"
        return row
    extra = {"prompt_lookup_num_tokens": args.prompt_lookup_tokens}
    outputs, _ = run_method(row, target, prompts, 1, temperature, args, pad_id, eos_ids, None, extra)
    if temperature == 0:
        greedy_agreement(row, outputs, reference, eos_ids)
    return row


def greedy_agreement(row: Row, outputs, reference, eos_ids) -> None:
    """Compare greedy outputs with target.generate()'s, row by row: identical rows, and where the others diverge.

    In float32 they must be identical. In bf16/fp16 a verification forward over several tokens rounds differently
    from one-token decode steps, so a near-tied argmax can flip (transformers' own prompt lookup decoding shows the
    same), and the sequences continue differently from there."""
    identical, divergence = 0, []
    for out, ref in zip(outputs, reference):
        out_lengths, ref_lengths = new_token_lengths(out, eos_ids).tolist(), new_token_lengths(ref, eos_ids).tolist()
        for a, b, n_a, n_b in zip(out, ref, out_lengths, ref_lengths):
            a, b = a[:n_a].tolist(), b[:n_b].tolist()
            if a == b:
                identical += 1
                continue
            divergence.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    total = identical + len(divergence)
    row.matches_target = identical == total
    row.extra["greedy_identical_rows"] = f"{identical}/{total}"
    row.extra["greedy_first_divergence"] = sorted(divergence)
    if divergence:
        row.note = (row.note + " " if row.note else "") + (
            f"greedy: {identical}/{total} rows identical, others diverge at new token {sorted(divergence)}"
        )


def load_hf_dflash(args, device, target):
    import transformers
    from transformers import GenerationConfig

    if not hasattr(GenerationConfig(), "speculation_type"):
        return None, f"skipped: transformers {transformers.__version__} has no built-in DFlash path"
    if not args.hf_dflash_draft:
        return None, (
            "skipped: needs --hf-dflash-draft (a transformers-format DFlash checkpoint); hf_dspark DFlash drafts "
            "predict the token after each slot (DeepSpec convention) and cannot run in transformers' DFlash path"
        )
    from transformers import AutoModel

    dtype = next(target.parameters()).dtype
    model = AutoModel.from_pretrained(args.hf_dflash_draft, trust_remote_code=True, dtype=dtype)
    return model.to(device).eval(), ""


def hf_dflash_row(target, prompts, batch_size, temperature, args, pad_id, eos_ids, model, note) -> Row:
    row = Row("hf_dflash", batch_size, temperature, note=note)
    if model is None:
        return row
    if batch_size > 1:
        row.note = "skipped: transformers' assisted decoding supports batch size 1 only"
        return row
    # The draft is not an hf_dspark model, so generate() goes to transformers untouched.
    extra = {"speculation_type": "dflash"}
    run_method(row, target, prompts, 1, temperature, args, pad_id, eos_ids, model, extra)
    return row


def profile_calls(args, setup) -> None:
    """Operator tables (CPU and GPU kernel time, call counts) of one generate() call of the target alone and one with
    the first draft (and one with each --candidates K, for a block draft): where a round's time goes, and how many
    operators it launches per committed token."""
    from torch.profiler import ProfilerActivity, profile

    from hf_dspark.data.prompts import left_pad

    target, tokenizer, drafts, prompts = setup
    device = next(target.parameters()).device
    pad_id, eos_ids = special_ids(target, tokenizer)
    batch = prompts[: max(args.batch_sizes)]
    ids, mask = left_pad(batch, pad_id, device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    sections, step_ops = [], None
    calls = [("target alone", None, {}), *((name, draft, {}) for name, draft in list(drafts.items())[:1])]
    if calls[1:] and hasattr(calls[1][1], "propose_chains"):  # and with each --candidates K: where a tree round's time goes
        calls += [(f"{calls[1][0]}+k{k}", calls[1][1], {"dspark_candidates": k}) for k in args.candidates if k > 1]
    for name, draft, extra in calls:
        kwargs = dict(max_new_tokens=args.max_new_tokens, pad_token_id=pad_id, **extra)
        if args.profile_temperature > 0:
            kwargs.update(do_sample=True, temperature=args.profile_temperature, top_k=0, top_p=1.0)
        else:
            kwargs.update(do_sample=False)
        if draft is not None:
            kwargs["assistant_model"] = draft
        target.generate(ids, attention_mask=mask, **kwargs)  # warm
        _sync(device)
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            out = target.generate(ids, attention_mask=mask, **kwargs)
            _sync(device)
            seconds = time.perf_counter() - start
        events = prof.key_averages()
        ops = sum(e.count for e in events if e.key.startswith("aten::"))
        tokens = count_new_tokens(out, ids.shape[1], eos_ids)
        rounds = draft.last_generation_stats.acceptance.rounds if draft is not None else None
        if draft is None:  # top-level operators of a decoding step of the target alone (its prefill as one step)
            step_ops = sum(phase_counts(prof.events()).values()) / (out.shape[1] - ids.shape[1] + 1)
        sections.append(
            f"## {name}: batch {len(batch)}, T={args.profile_temperature:g}, {tokens} new tokens, "
            f"{seconds:.3f} s profiled, "
            f"{ops} aten operators ({ops / max(tokens, 1):.0f} per new token)\n"
            + events.table(sort_by=sort, row_limit=30)
            + (phase_table(prof.events(), rounds, step_ops) if rounds else "")
        )
    with open(args.profile, "w") as handle:
        handle.write("\n\n".join(sections))
    print(f"profile written to {args.profile}")


def phase_table(events, rounds: int, step_ops: float | None = None) -> str:
    """Operators launched per round in each phase of the decoding loop (the "hf_dspark::" profiler ranges of
    `hf_dspark.generation.speculative.PHASES`), and in target steps' worth (`step_ops`: top-level operators of
    one step of the target alone, its prefill counted as one step). Whole rounds replayed as one graph (the fused
    round) have no phases."""
    counts = phase_counts(events)
    if set(counts) <= {"outside"}:
        return "\n(no decoding-loop phases: whole rounds ran as one graph)\n"
    steps = lambda n: f" | {n / rounds / step_ops:.3f}" if step_ops else ""  # noqa: E731
    lines = [f"\n### aten operators by phase of the round ({rounds} rounds)",
             "| phase | operators | per round |" + (" target steps |" if step_ops else ""),
             "|---|---|---|" + ("---|" if step_ops else "")]  # fmt: skip
    for label, count in counts.most_common():
        lines.append(f"| {label} | {count} | {count / rounds:.1f}{steps(count)} |")
    in_rounds = sum(n for label, n in counts.items() if label != "outside")
    lines.append(f"| all phases | {in_rounds} | {in_rounds / rounds:.1f}{steps(in_rounds)} |")
    return "\n".join(lines) + "\n"


def phase_counts(events) -> collections.Counter:
    """Top-level aten operators (ones the host dispatches itself, not one inside another) by innermost phase;
    "outside" is the rest of generate() (prefill, setup), and all of a call without phases."""
    counts = collections.Counter()
    for event in events:
        if not event.name.startswith("aten::") or (event.cpu_parent and event.cpu_parent.name.startswith("aten::")):
            continue
        parent, label = event.cpu_parent, "outside"
        while parent is not None:
            if parent.name.startswith("hf_dspark::"):
                label = parent.name.removeprefix("hf_dspark::")
                break
            parent = parent.cpu_parent
        counts[label] += 1
    return counts


# -- report -----------------------------------------------------------------------------------------------------


def table(rows: list[Row]) -> str:
    base = {(r.batch_size, r.temperature): r.tokens_per_second for r in rows if r.method == "target"}
    header = (
        f"{'method':<20} {'batch':>5} {'temp':>4} {'tok/s':>9} {'speedup':>8} {'tau':>6} {'spd/tau':>8} "
        f"{'greedy=':>7} {'ms/rnd':>7} {'rnd/step':>8} {'draft%':>6}  note"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        tps = r.tokens_per_second
        ref = base.get((r.batch_size, r.temperature))
        speedup = tps / ref if tps and ref else None
        fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        ratio = speedup / r.tau if speedup and r.tau else None
        same = "" if r.matches_target is None else ("yes" if r.matches_target else "NO")
        lines.append(
            f"{r.method:<20} {r.batch_size:>5} {r.temperature:>4g} {fmt(tps, '9.1f'):>9} {fmt(speedup, '8.2f'):>8} "
            f"{fmt(r.tau, '6.2f'):>6} {fmt(ratio, '8.2f'):>8} {same:>7} {fmt(r.extra.get('ms_per_round'), '7.2f'):>7} "
            f"{fmt(r.extra.get('round_cost_target_steps'), '8.2f'):>8} "
            f"{fmt(100 * r.extra['draft_share'] if 'draft_share' in r.extra else None, '6.1f'):>6}  {r.note}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    setup = load_setup(args)  # (target, tokenizer, drafts, prompts), shared by the timings and the profile
    weights = next(setup[0].parameters())
    header = {
        "command": " ".join([sys.executable, *sys.argv]) if argv is None else " ".join(["generation_speed.py", *argv]),
        "hardware": hardware(weights.device),
        "dtype": str(weights.dtype),
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
    }

    def save(rows: list[Row], complete: bool = False) -> None:
        result = {
            **header,
            "complete": complete,
            "rows": [
                {**{k: v for k, v in vars(r).items() if k != "extra"}, **r.extra, "tokens_per_second": r.tokens_per_second}
                for r in rows
            ],
        }
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
        if not complete:
            print(table(rows).splitlines()[-1], flush=True)  # the row just measured

    rows = benchmark(args, setup, progress=save)
    save(rows, complete=True)
    if args.profile:
        profile_calls(args, setup)
    print(f"results written to {args.json}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
