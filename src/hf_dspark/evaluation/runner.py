"""`evaluate_drafts`: speculative decoding over prompt files, per (drafter, dataset, temperature).

For each dataset the same fixed prompt subset (the first N rows, first turn, rendered with the target's chat
template and `add_generation_prompt=True`) is decoded

- by the target alone (`target.generate()`, no draft), once per dataset and temperature; reused by all drafters;
- by the target with each draft (`target.generate(..., assistant_model=draft)`).

Both use identical generation settings and per-batch seeds, a warm-up call before timing, and timers that
synchronize the accelerator, so tokens/s and speedup compare like with like. Acceptance statistics come from the
decoding loop's per-call `AcceptanceStats` (the one metric definition, `metrics.py`), read by the single
adapter `generation_stats`; calibration is computed from the confidences recorded there (`calibration.py`).
"""

from __future__ import annotations

import copy
import logging
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import torch
from torch import nn

from .calibration import calibration_summary, uncalibrate_records
from ..compilation import TIMING_CHECKS, run_warm, timing_checks
from ..metrics import AcceptanceStats, batched_decoding_speed
from .report import save_results
from ..data.prompts import count_new_tokens, encode_chat_prompts, eos_token_ids, first_turns, left_pad, new_token_lengths  # noqa: F401 (count_new_tokens: re-exported)
from ..resources import load_target
from .static_baseline import StaticTargetBaseline
from .teacher_forced import teacher_forced_estimates

logger = logging.getLogger(__name__)


# -- prompts --------------------------------------------------------------------------------------------------


def load_eval_prompts(path: str | Path, num_prompts: int | None = None) -> list[str]:
    """First turns of the first `num_prompts` rows of a `{"turns": [...]}` JSONL file (all rows when None)."""
    return first_turns(path, num_prompts)


def render_prompts(tokenizer, prompts: Sequence[str]) -> list[list[int]]:
    """Token ids of each prompt as a one-turn chat with the generation prompt appended."""
    return encode_chat_prompts(tokenizer, prompts)


def dataset_name(path: str | Path) -> str:
    """gsm8k.jsonl -> gsm8k."""
    name = Path(path).name
    for suffix in (".gz", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name


# -- loading models (used by the CLI; the Python API takes model objects) --------------------------------------


def load_drafts(specs: Sequence[str], target: nn.Module) -> dict[str, nn.Module]:
    """Load drafts given as `PATH` or `NAME=PATH`, on the target's device and dtype.

    Unnamed drafts are called by their config's model_type (dspark, dflash, eagle3); when two share a
    model_type, each is called by its folder name instead.
    """
    from transformers import AutoConfig, AutoModel

    from .. import models  # noqa: F401  (registers the drafters with AutoConfig/AutoModel)

    parsed = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or Path(spec).exists():
            name, path = None, spec
        if not Path(path).is_dir():
            raise FileNotFoundError(f"draft {path} is not a folder: pass a folder written by draft.save_pretrained()")
        config = AutoConfig.from_pretrained(path)
        if not hasattr(config, "num_draft_tokens"):
            raise ValueError(
                f"{path} holds a {config.model_type!r} model, not a draft: expected one of dspark, dflash, eagle3"
            )
        parsed.append((name, path, config.model_type))
    types = [t for n, _, t in parsed if n is None]
    param = target.get_input_embeddings().weight
    drafts: dict[str, nn.Module] = {}
    for name, path, model_type in parsed:
        if name is None:
            name = model_type if types.count(model_type) == 1 else Path(path).resolve().name
        if name in drafts:
            raise ValueError(f"two drafts are both named {name!r}: name them explicitly with NAME=PATH")
        draft = AutoModel.from_pretrained(path, dtype=param.dtype)
        drafts[name] = draft.to(param.device).eval()
    return drafts


# -- one generate() call ---------------------------------------------------------------------------------------


@dataclass
class CallStats:
    """What evaluation needs from one speculative generate() call."""

    acceptance: AcceptanceStats
    draft_time: float | None = None  # seconds proposing (and scheduling)
    verify_time: float | None = None  # seconds in target verification forwards + rejection sampling
    prefill_time: float | None = None
    block_size: int | None = None  # draft tokens per round actually used (a generate() option may lower it)
    schedule: str | None = None
    target_graphs: bool = False  # the verify forwards replayed as CUDA graphs (the static path)
    draft_graphs: bool = False
    fused_round: bool = False  # whole rounds as one graph: the draft's time is inside verify_time


def generation_stats(draft: nn.Module, output) -> CallStats | None:
    """Statistics of the generate() call that returned `output`; None when the call reported none.

    The one adapter between the decoding loop's report (`hf_dspark.generation.stats.SpeculativeStats`, found as
    `output.speculative_stats` with return_dict_in_generate, else `draft.last_generation_stats`) and evaluation.
    """
    stats = getattr(output, "speculative_stats", None)
    if stats is None:
        stats = getattr(draft, "last_generation_stats", None)
    if stats is None:
        return None
    if isinstance(stats, AcceptanceStats):
        return CallStats(stats)
    return CallStats(
        acceptance=stats.acceptance,
        draft_time=getattr(stats, "draft_time", None),
        verify_time=getattr(stats, "verify_time", None),
        prefill_time=getattr(stats, "prefill_time", None),
        block_size=getattr(stats, "block_size", None) or None,
        schedule=getattr(stats, "schedule", None),
        target_graphs=bool(getattr(stats, "target_graphs", False)),
        draft_graphs=bool(getattr(stats, "draft_graphs", False)),
        fused_round=bool(getattr(stats, "fused_round", False)),
    )


def _raw_confidence_records(draft: nn.Module, records: list) -> list:
    """Confidence records at temperature 1 (the decoding loop records the STS-calibrated c_k it scheduled with)."""
    return uncalibrate_records(records, getattr(draft.config, "confidence_temperatures", None))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu":
        torch.xpu.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@dataclass
class _CallResult:
    new_tokens: int
    seconds: float
    stats: CallStats | None = None
    # The longest row's output: a batch decodes until its last row stops, so throughput over rows of unequal
    # lengths (greedy answers that stop early next to one caught in a loop) falls although each step costs the same.
    longest: int = 0
    rows: int = 0
    # The target-alone calls keep their prompts and answers (end-of-turn included) for `teacher_forced_estimates`.
    prompts: list[list[int]] = field(default_factory=list)
    completions: list[list[int]] = field(default_factory=list)
    # One-time work inside the timing (`compilation.run_warm`): torch.compile seconds and CUDA graphs captured
    # during the call, and whether this is the second run of a call whose first run did some.
    compile_s: float = 0.0
    captures: int = 0
    retimed: bool = False


def _left_pad(batch: Sequence[Sequence[int]], pad_id: int, device) -> dict[str, torch.Tensor]:
    input_ids, attention_mask = left_pad(batch, pad_id, device)
    return {"input_ids": input_ids, "attention_mask": attention_mask}


@torch.no_grad()
def _generate(target, inputs, generation_config, eos_ids, draft=None, generate_kwargs=None, static=None) -> _CallResult:
    device = inputs["input_ids"].device
    extra = dict(generate_kwargs or {}) if draft is not None else {}
    if draft is not None:
        extra["assistant_model"] = draft
    if static is not None:  # the static-cache baseline's cache for this batch shape, emptied outside the timer
        extra.update(static.generate_kwargs(inputs["input_ids"]))
    _synchronize(device)
    start = time.perf_counter()
    output = target.generate(**inputs, generation_config=generation_config, **extra)
    _synchronize(device)
    seconds = time.perf_counter() - start
    sequences = output.sequences if hasattr(output, "sequences") else output
    lengths = new_token_lengths(sequences[:, inputs["input_ids"].shape[1] :], eos_ids)
    result = _CallResult(
        int(lengths.sum()), seconds, longest=int(lengths.max()) if lengths.numel() else 0, rows=lengths.numel()
    )
    if draft is None:  # the target's own answers (for the teacher-forced τ)
        width = inputs["input_ids"].shape[1]
        for ids, mask, out, n in zip(inputs["input_ids"], inputs["attention_mask"], sequences, lengths.tolist()):
            result.prompts.append(ids[mask.bool()].tolist())
            result.completions.append(out[width : width + n].tolist())
    if draft is not None:
        # Read before the next call: `draft.last_generation_stats` is replaced by every generate().
        result.stats = generation_stats(draft, output)
        if result.stats is None:
            raise RuntimeError(
                f"generate() with the {type(draft).__name__} draft returned no speculative statistics: is "
                "`import hf_dspark` routing assistant_model=draft through hf_dspark's decoding loop?"
            )
    return result


# -- the evaluation --------------------------------------------------------------------------------------------


@dataclass
class EvaluationResults:
    """What `evaluate_drafts` measured; `report.save_results` writes it as results.json / results.md / plots."""

    rows: list[dict]
    baselines: list[dict]
    target: str
    hardware: str
    command: str | None
    settings: dict
    reliability: dict = field(default_factory=dict)  # (drafter, dataset, temperature) -> curves, for plots

    def to_dict(self) -> dict:
        return {
            "target": self.target,
            "hardware": self.hardware,
            "command": self.command,
            "settings": self.settings,
            "baselines": self.baselines,
            "results": self.rows,
        }


def hardware_description(device: torch.device) -> str:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"{torch.cuda.get_device_name(index)} (x{torch.cuda.device_count()} visible)"
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"CPU: {model} ({cores} cores)"


def _generation_config(target, temperature: float, top_k: int, top_p: float, max_new_tokens: int, eos_ids, pad_id):
    config = copy.deepcopy(target.generation_config)
    sampling = temperature > 0
    config.update(
        do_sample=sampling,
        temperature=temperature if sampling else None,
        # 0 / 1.0 disable top-k / top-p explicitly (otherwise generate() falls back to its own defaults).
        top_k=top_k if sampling else None,
        top_p=top_p if sampling else None,
        max_new_tokens=max_new_tokens,
        eos_token_id=list(eos_ids),
        pad_token_id=pad_id,
        return_dict_in_generate=True,
        num_return_sequences=1,
    )
    return config


def evaluate_drafts(
    target: nn.Module,
    tokenizer,
    drafts: Mapping[str, nn.Module],
    datasets: Mapping[str, str | Path] | Sequence[str | Path],
    *,
    num_prompts: int | None = 80,
    max_new_tokens: int = 256,
    temperature: float | Sequence[float] = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    batch_size: int = 1,
    seed: int = 0,
    output_dir: str | Path | None = None,
    generate_kwargs: dict | None = None,
    draft_generate_kwargs: dict[str, dict] | None = None,
    warmup: bool = True,
    progress: bool = True,
    n_bins: int = 15,
    plots: bool = True,
    command: str | None = None,
    target_name: str | None = None,
    static_baseline: bool = False,
    teacher_forced: bool = True,
    eager_baseline: bool = True,
) -> EvaluationResults:
    """Speculative decoding of each draft over each prompt file; acceptance, calibration and speed.

    drafts: {name: draft model}; datasets: {name: JSONL path} or a list of paths (named by file stem), rows
    `{"turns": [...]}` (first turn used); num_prompts: the first N prompts of every file (None: all);
    temperature: one value or several (0 = greedy), each giving its own rows; top_k=0 / top_p=1.0 mean off;
    generate_kwargs: extra arguments for the draft generate() calls only (e.g. scheduler options);
    draft_generate_kwargs: {draft name: arguments} over those for one draft (the same draft loaded under two names
    with other options decodes side by side: same prompts, seeds and baselines in one process).
    static_baseline: also time the target alone on transformers' static cache (transformers compiles its decoding
    step on CUDA: the fastest target-alone baseline), with one cache length for every call of the run and each
    batch shape warmed up untimed (`static_baseline.StaticTargetBaseline`); rows then carry
    `speedup_vs_static_target`, the baselines `static_cache` (with `static_cache_len`).
    teacher_forced: rows also carry `teacher_forced`, the draft's τ estimated as in training (teacher-forced
    blocks) on the target-alone answers of the same prompts and temperature (`teacher_forced.py`): where it is
    close to the decoding τ, the decoding path delivers what the model predicts.
    eager_baseline=False skips timing the target alone on the eager path (on a GPU the slowest part of an
    evaluation: 57 ms a step for SmolLM2, against 3.5 on the static cache); it needs static_baseline, whose
    answers the teacher-forced τ then reads, and rows carry no `speedup` (None) beside `speedup_vs_static_target`.
    Returns `EvaluationResults`; with `output_dir`, also writes results.json, results.md and PNG plots there
    (JSON and markdown are rewritten after every row, so an interrupted run keeps its finished rows).
    """
    from tqdm.auto import tqdm

    if not drafts:
        raise ValueError("no drafts to evaluate: pass at least one {name: draft}")
    unknown = sorted(set(draft_generate_kwargs or {}) - set(drafts))
    if unknown:
        raise ValueError(f"generate options for {unknown}, which are not among the drafts {sorted(drafts)}: name the "
                         "draft as NAME=PATH with --draft")  # fmt: skip
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"batch_size and max_new_tokens must be >= 1, got {batch_size} and {max_new_tokens}")
    temperatures = [float(temperature)] if isinstance(temperature, (int, float)) else [float(t) for t in temperature]
    if not temperatures or any(t < 0 for t in temperatures):
        raise ValueError(f"temperatures must be >= 0 (0 = greedy), got {temperatures}")
    if not isinstance(datasets, Mapping):
        paths = list(datasets)
        datasets = {dataset_name(p): p for p in paths}
        if len(datasets) < len(paths):
            raise ValueError(f"prompt files with the same name in {paths}: pass a {{name: path}} dict instead")
    if not datasets:
        raise ValueError("no datasets given: pass at least one {'turns': [...]} JSONL file")
    if not eager_baseline and not static_baseline:
        raise ValueError("eager_baseline=False leaves no target-alone baseline: pass static_baseline=True "
                         "(--static_baseline true), or keep the eager one")  # fmt: skip
    vocab = target.get_input_embeddings().weight.shape[0]
    for name, draft in drafts.items():
        if draft.config.vocab_size != vocab:
            raise ValueError(
                f"draft {name!r} has vocab {draft.config.vocab_size} but the target has {vocab}: "
                "the draft was trained for another target"
            )
    eos_ids = eos_token_ids(target, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    device = target.get_input_embeddings().weight.device
    was_training = target.training
    target.eval()

    prompts = {}
    for name, path in datasets.items():
        prompts[name] = render_prompts(tokenizer, load_eval_prompts(path, num_prompts))

    warmed: set[tuple[str, float]] = set()
    # Drafts warm up on the full batch with the longest prompt of every dataset: the static decoding paths keep
    # their buffers (and graphs) between calls, sized by the first call that needs them, so none is rebuilt later
    # inside the timing. Once per temperature: a sampled round is another graph than a greedy one (warmed once per
    # model, the first T = 1 dataset captured it inside its timing: 6.9 s of a 7.0 s row on an H200).
    every_batch = [r[i : i + batch_size] for r in prompts.values() for i in range(0, len(r), batch_size)]
    full = [b for b in every_batch if len(b) == batch_size] or every_batch
    longest_batch = max(full, key=lambda b: max(len(p) for p in b)) if full else None
    static = None
    if static_baseline:  # one cache length for every prompt of every dataset: one compiled shape per batch shape
        static = StaticTargetBaseline(target, [p for r in prompts.values() for p in r], max_new_tokens)

    def run(model_name, draft, rendered, gen_config, desc, static=None):
        batches = [rendered[i : i + batch_size] for i in range(0, len(rendered), batch_size)]
        call_kwargs = {**(generate_kwargs or {}), **(draft_generate_kwargs or {}).get(model_name, {})}
        warm_key = (model_name, gen_config.temperature if gen_config.do_sample else 0.0)
        if warmup and static is not None:
            # The compiled step is specialised on the batch shape: each new one is compiled here, untimed.
            static.warm_up(
                batches, lambda b: _generate(target, _left_pad(b, pad_id, device), gen_config, eos_ids, static=static)
            )
        elif warmup and warm_key not in warmed:
            # First calls pay for kernel selection, allocator growth and (for drafts) any scheduler profiling, and
            # attention kernels are planned per sequence length: warm up over the whole length. A 16-token warm-up
            # left the first measured rows (greedy target alone, run first) 1.5-2.6x slower per step than the
            # same target later in the process on an H200 (65 / 38 / 34 ms per step, then 25 ms at T = 1).
            warm_config = copy.deepcopy(gen_config)
            _generate(target, _left_pad(longest_batch, pad_id, device), warm_config, eos_ids, draft, call_kwargs)
            warmed.add(warm_key)
        calls = []
        with tqdm(total=len(rendered), desc=desc, unit="prompt", disable=not progress, leave=False) as bar:
            for index, batch in enumerate(batches):
                torch.manual_seed(seed + index)  # same seeds for the target alone and every draft
                inputs = _left_pad(batch, pad_id, device)
                # A call that compiled or captured a graph the warm-up did not reach (an H200 row once took 3x its
                # neighbours' time) runs again from the same seed, and the warm timing is kept. Draft calls are
                # cheap and rehearsed: each batch's first prefill pays for work no counter sees.
                warm = run_warm(
                    lambda: _generate(target, inputs, gen_config, eos_ids, draft, call_kwargs, static), warmup,
                    rehearse=warmup and draft is not None,
                )
                call = warm.result
                call.compile_s, call.captures, call.retimed = warm.compile_s, warm.captures, warm.retimed
                calls.append(call)
                bar.update(len(batch))
        return calls

    # The rows fill this object in place; with output_dir it is rewritten (JSON + markdown) after every row, so
    # an interrupted run keeps what it measured.
    results = EvaluationResults(
        rows=[],
        baselines=[],
        target=target_name or str(getattr(target.config, "_name_or_path", "") or type(target).__name__),
        hardware=hardware_description(device),
        command=command,
        settings={
            "datasets": {name: str(path) for name, path in datasets.items()},
            "prompt_subset": (
                f"the first {num_prompts} prompts of each file (first turn, chat template with generation prompt)"
                if num_prompts is not None
                else "every prompt of each file (first turn, chat template with generation prompt)"
            ),
            "num_prompts": {name: len(r) for name, r in prompts.items()},
            "max_new_tokens": max_new_tokens,
            "temperatures": temperatures,
            "top_k": top_k,
            "top_p": top_p,
            "batch_size": batch_size,
            "seed": seed,
            "warmup": warmup,
            "draft_calls_rehearsed": warmup,
            "generate_kwargs": dict(generate_kwargs or {}),
            "draft_generate_kwargs": {name: dict(kw) for name, kw in (draft_generate_kwargs or {}).items()},
            "static_baseline": static_baseline,
            "eager_baseline": eager_baseline,
            "static_cache_len": static.cache_len if static is not None else None,
            "dtype": str(target.get_input_embeddings().weight.dtype).removeprefix("torch."),
            "device": str(device),
            "drafts": {name: _draft_description(d) for name, d in drafts.items()},
            "versions": _versions(),
        },
    )
    try:
        for temp in temperatures:
            gen_config = _generation_config(target, temp, top_k, top_p, max_new_tokens, eos_ids, pad_id)
            for data_name, rendered in prompts.items():
                target_calls, base = None, dict.fromkeys(_speed([]))  # (eager baseline skipped: no figures)
                if eager_baseline:
                    desc = f"target alone | {data_name} | T={temp:g}"
                    target_calls = run("target", None, rendered, gen_config, desc)
                    base = _speed(target_calls)
                baseline = {"dataset": data_name, "temperature": temp, "num_prompts": len(rendered), **base}
                if static is not None:
                    desc = f"target alone, static cache | {data_name} | T={temp:g}"
                    calls = run("target-static", None, rendered, gen_config, desc, static)
                    baseline["static_cache"] = {**_speed(calls), **static.record()}
                    target_calls = target_calls or calls  # the target's answers for the teacher-forced τ
                results.baselines.append(baseline)
                for draft_name, draft in drafts.items():
                    calls = run(draft_name, draft, rendered, gen_config, f"{draft_name} | {data_name} | T={temp:g}")
                    row, curves = _draft_row(draft_name, draft, data_name, temp, calls, base, len(rendered), n_bins)
                    if teacher_forced:
                        row["teacher_forced"] = _teacher_forced(draft, target, target_calls, batch_size, seed)
                    if static_baseline:
                        row["speedup_vs_static_target"] = _ratio(row["tokens_per_s"],
                                                                 baseline["static_cache"]["tokens_per_s"])
                    results.rows.append(row)
                    if curves is not None:
                        results.reliability[(draft_name, data_name, temp)] = curves
                    if output_dir is not None:
                        save_results(results, output_dir, plots=False)
    finally:
        target.train(was_training)
    if output_dir is not None:
        save_results(results, output_dir, plots=plots)
    return results


def _teacher_forced(draft, target, target_calls: list[_CallResult], batch_size: int, seed: int) -> dict:
    """`teacher_forced_estimates` on the target-alone answers; a diagnostic, so a failure is recorded in the row
    (and logged) instead of ending the evaluation and losing the rows measured so far."""
    prompts = [p for c in target_calls for p in c.prompts]
    answers = [a for c in target_calls for a in c.completions]
    try:
        return teacher_forced_estimates(draft, target, prompts, answers, batch_size=batch_size, seed=seed)
    except Exception as err:  # noqa: BLE001 - reported in the row
        logger.warning("teacher-forced estimates failed (%s: %s)", type(err).__name__, err)
        return {"error": f"{type(err).__name__}: {err}"}


def _speed(calls: list[_CallResult]) -> dict:
    """Throughput and the cost of one decoding step of these calls (`metrics.batched_decoding_speed`), and what of
    one-time work their timings hold (`TIMING_CHECKS`)."""
    return batched_decoding_speed(
        sum(c.new_tokens for c in calls), sum(c.seconds for c in calls), [(c.longest, c.rows) for c in calls]
    ) | timing_checks(calls)


def _ratio(tokens_per_s: float, baseline_tokens_per_s: float | None) -> float | None:
    """A speedup over a baseline: None without one (a skipped baseline), NaN when it measured nothing."""
    if baseline_tokens_per_s is None:
        return None
    return tokens_per_s / baseline_tokens_per_s if baseline_tokens_per_s else float("nan")


def _total(values):
    return None if any(v is None for v in values) else float(sum(values))


def _draft_row(name, draft, data_name, temperature, calls, base, num_prompts, n_bins):
    stats = AcceptanceStats()
    for call in calls:
        stats.merge(call.stats.acceptance)
    speed = _speed(calls)
    acceptance = stats.to_dict()
    # Per prompt in prompt order (a prompt answered in its first token has 0 rounds), so drafts evaluated on the
    # same prompts pair up (`metrics.tau_difference_interval`) and a mean over datasets gets its interval too.
    per_prompt = [c.stats.acceptance.per_request(c.rows) for c in calls]
    request_rounds = [int(n) for rounds, _ in per_prompt for n in rounds]
    request_committed = [int(n) for _, committed in per_prompt for n in committed]
    block_sizes = {c.stats.block_size for c in calls if c.stats.block_size}
    block_size = max(block_sizes) if block_sizes else int(draft.config.num_draft_tokens)
    row = {
        "drafter": name,
        "dataset": data_name,
        "temperature": temperature,
        "tau": acceptance.pop("tau"),
        "accept_rate_by_position": acceptance.pop("accept_rate_by_position"),
        "tau_by_request": {"rounds": request_rounds, "committed": request_committed},
        "tokens_per_s": speed["tokens_per_s"],
        "speedup": _ratio(speed["tokens_per_s"], base["tokens_per_s"]),  # None: the eager baseline was skipped
        "target_tokens_per_s": base["tokens_per_s"],
        "num_prompts": num_prompts,
        "model_type": draft.config.model_type,
        "block_size": block_size,
        "schedule": next((c.stats.schedule for c in calls if c.stats.schedule), None),
        **acceptance,  # rounds, committed/verified/proposed tokens, verify_efficiency
        "new_tokens": speed["new_tokens"],
        "wall_time_s": speed["wall_time_s"],
        **{key: speed[key] for key in TIMING_CHECKS},
        "prefill_time_s": _total([c.stats.prefill_time for c in calls]),
        "draft_time_s": _total([c.stats.draft_time for c in calls]),
        "verify_time_s": _total([c.stats.verify_time for c in calls]),
        # Which decoding path ran (generate()'s defaults choose per device): CUDA graphs make much of a speedup
        # over the eager target on a small model, so the row says whether they were used.
        "target_graphs": all(c.stats.target_graphs for c in calls),
        "draft_graphs": all(c.stats.draft_graphs for c in calls),
        "fused_round": all(c.stats.fused_round for c in calls),
        "calibration": None,
    }
    groups = [_raw_confidence_records(draft, c.stats.acceptance.confidence_records) for c in calls]
    summary = calibration_summary(
        groups, block_size, getattr(draft.config, "confidence_temperatures", None), n_bins
    )
    curves = None
    if summary is not None:
        curves = summary.pop("reliability")
        row["calibration"] = summary
    return row, curves


def _draft_description(draft) -> dict:
    cfg = draft.config
    return {
        "model_type": cfg.model_type,
        "name_or_path": str(getattr(cfg, "_name_or_path", "") or ""),
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_draft_tokens": int(cfg.num_draft_tokens),
        "target_layer_ids": list(cfg.target_layer_ids or []),
        "confidence_temperatures": getattr(cfg, "confidence_temperatures", None),
    }


def _versions() -> dict:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


__all__ = [
    "EvaluationResults",
    "evaluate_drafts",
    "generation_stats",
    "CallStats",
    "load_eval_prompts",
    "render_prompts",
    "load_target",
    "load_drafts",
    "hardware_description",
    "count_new_tokens",
]
