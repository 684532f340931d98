"""Pieces the benchmark scripts share: the hardware record of every JSON result and a tiny CPU smoke setup."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch


def hardware(device) -> dict:
    """What ran the benchmark: platform, library versions, GPU or CPU."""
    import transformers

    device = torch.device(device)
    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__}
    info["transformers"] = transformers.__version__
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_count"] = torch.cuda.device_count()
    else:
        info["cpu"] = platform.processor() or platform.machine()
        info["cpu_threads"] = torch.get_num_threads()
    return info


def add_draft_shape_args(p, pad_help: str = "default: max_length (one shape)") -> None:
    """The flags every training benchmark shares: the draft's shape and the batch."""
    p.add_argument("--num_hidden_layers", type=int, default=2)
    p.add_argument("--block_size", type=int, default=7)
    p.add_argument("--num_anchors", type=int, default=512)
    p.add_argument("--max_length", type=int, default=1024)
    p.add_argument("--pad_to_multiple_of", type=int, default=None, help=pad_help)
    p.add_argument("--batch_size", type=int, default=16)


def bench_training_args(args, algorithm: str, output_dir: str, cuda: bool, **overrides):
    """DraftTrainingArguments of a benchmark run: the draft shape and batch from the script's flags, bf16 and fused
    AdamW on CUDA, no checkpoints or reporting."""
    from hf_dspark import DraftTrainingArguments

    fields = dict(
        output_dir=output_dir,
        algorithm=algorithm,
        num_hidden_layers=None if algorithm == "eagle3" else args.num_hidden_layers,
        block_size=args.block_size,
        num_anchors=None if algorithm == "eagle3" else args.num_anchors,
        max_length=args.max_length,
        pad_to_multiple_of=args.pad_to_multiple_of or args.max_length,
        compile_loss=cuda if args.compile_loss is None else args.compile_loss,
        per_device_train_batch_size=args.batch_size,
        bf16=cuda,
        optim="adamw_torch_fused" if cuda else "adamw_torch",
        save_strategy="no",
        report_to="none",
        use_cpu=not cuda,
        dataloader_num_workers=args.dataloader_num_workers,
        dataloader_pin_memory=cuda,
        seed=args.seed,
    )
    fields.update(overrides)
    return DraftTrainingArguments(**fields)


def tiny_target(num_rows: int = 8, length: int = 64, seed: int = 0):
    """(random tiny Llama target, tokenized rows) for --smoke runs: rows carry input_ids and a loss mask on their
    second half, as `tokenize_conversations` produces them."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    target = AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (num_rows, length), generator=gen).tolist()
    mask = [[0] * (length // 2) + [1] * (length - length // 2) for _ in range(num_rows)]
    return target, Dataset.from_dict({"input_ids": ids, "loss_mask": mask})


def add_packages_arg(p) -> None:
    """`--packages NAME=SRC_DIR ...`: package sources a benchmark times against each other (read by packages_of)."""
    this = Path(__file__).resolve().parent.parent / "src"
    p.add_argument("--packages", nargs="+", default=[f"this={this}"],
                   help="NAME=SRC_DIR: package sources to time (put first on PYTHONPATH); default this checkout's")


def packages_of(specs: list[str]) -> dict[str, str]:
    """{name: source folder} of `--packages`, each checked to hold an hf_dspark package."""
    out = {}
    for spec in specs:
        name, sep, src = spec.partition("=")
        if not sep or not name or not src:
            raise SystemExit(f"--packages expects NAME=SRC_DIR, got {spec!r}")
        if not (Path(src) / "hf_dspark" / "__init__.py").exists():
            raise SystemExit(f"--packages {spec!r}: {src} holds no hf_dspark package (give the folder above it)")
        if name in out:
            raise SystemExit(f"--packages names {name!r} twice")
        out[name] = str(Path(src).resolve())
    return out


def package_env(src: str) -> dict[str, str]:
    """This process's environment with the package source `src` (a `--packages` entry) first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    return env


def write_report(report: dict, output: str | None) -> None:
    """The JSON result, rewritten whole (scripts call it after every run, so a run cut short keeps its rows)."""
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(report, indent=1) + "\n")


def annotation(event) -> bool:
    """A profiler event that marks a range (record_function, ProfilerStep#N) rather than running code or a kernel."""
    name = getattr(event, "name", None) or getattr(event, "key", "")  # FunctionEvent / FunctionEventAvg
    return bool(getattr(event, "is_user_annotation", False)) or name.startswith("ProfilerStep")


def device_idle(events, steps: int, phase_prefix: str, largest: int = 12) -> dict:
    """Where the GPU waited for the host in a torch.profiler trace (`prof.events()` over `steps` steps).

    GPU kernels' intervals are merged into busy time over the window from the first kernel's start to the last one's
    end; the rest is idle: the device had nothing queued. Each idle interval is charged to the step phase the host
    was in when it began (CPU ranges named `<phase_prefix>NAME`, e.g. the trainer's `record_function("hf_dspark:loss")`) and to the
    innermost host operator running then: what the host was doing while the device starved. Gaps shorter than
    20 us are launch latency between back-to-back kernels and are counted apart."""
    from bisect import bisect_right

    # GPU-side copies of record_function ranges (and ProfilerStep) are user annotations, not kernels.
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events
                     if e.device_type == torch.autograd.DeviceType.CUDA and not annotation(e))  # fmt: skip
    if not kernels:
        return {}
    merged = []
    for start, end in kernels:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    busy = sum(end - start for start, end in merged)
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    phases = sorted((e.time_range.start, e.time_range.end, e.name[len(phase_prefix):]) for e in host
                    if e.name.startswith(phase_prefix))  # fmt: skip
    ops = sorted((e.time_range.start, e.time_range.end, e.name) for e in host
                 if not (annotation(e) or e.name.startswith(phase_prefix)))  # fmt: skip
    op_starts = [start for start, _, _ in ops]

    def phase_at(t):
        inside = [name for start, end, name in phases if start <= t < end]
        return inside[-1] if inside else "(between phases)"

    def op_at(t):  # the innermost operator open at t: the latest-starting one that has not ended
        for start, end, name in reversed(ops[: bisect_right(op_starts, t)]):
            if end > t:
                return name
        return "(python, no operator)"

    # Each gap between merged busy intervals: (length, phase, operator), charged once.
    gaps, short = [], 0.0
    for (_, idle_from), (idle_to, _) in zip(merged, merged[1:]):
        if idle_to - idle_from < 20:
            short += idle_to - idle_from
        else:
            gaps.append((idle_to - idle_from, phase_at(idle_from), op_at(idle_from)[:100]))
    by_phase: dict[str, float] = {}
    by_op: dict[str, float] = {}
    for length, phase, op in gaps:
        by_phase[phase] = by_phase.get(phase, 0.0) + length
        by_op[op] = by_op.get(op, 0.0) + length
    window = merged[-1][1] - merged[0][0]
    per_step = lambda us: us / 1e3 / steps  # noqa: E731 - microseconds over the trace -> ms a step
    top = sorted(gaps, reverse=True)[:largest]
    return {
        "steps": steps,
        "window_ms_per_step": per_step(window),
        "busy_ms_per_step": per_step(busy),
        "idle_ms_per_step": per_step(window - busy),
        "idle_short_gaps_ms_per_step": per_step(short),
        "idle_by_phase_ms_per_step": {k: per_step(v) for k, v in sorted(by_phase.items(), key=lambda kv: -kv[1])},
        "idle_by_host_op_ms_per_step": {k: per_step(v) for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:15]},
        "largest_gaps": [{"ms": us / 1e3, "phase": phase, "host_op": op} for us, phase, op in top],
    }
