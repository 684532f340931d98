"""Where a draft-training step spends its time: phases, kernel families, host gaps.

Runs the real `DraftTrainer` step pieces on real batches (tokenized conversations answered by the target) and
reports, per phase, the wall time with the device synchronized at the phase boundaries, and the host's time to
issue the phase with no synchronization inside the step (what a host-bound step costs per phase):
    data      next batch from the Trainer's dataloader, moved to the device
    target    the online target's forward (context features + final hidden states), no grad
    draft     anchor sampling + the draft's training forward
    loss      the vocabulary-wide objective (its forward also forms the gradients it can)
    backward  autograd through the draft
    optimizer clip + optimizer step + zero_grad
then the end-to-end step time of `trainer.train()` itself over the same number of steps (Trainer overhead included),
and a kernel table from torch.profiler (GPU kernel time by kernel family, plus GPU idle = host gaps) over the last
--trace_steps steps of one more train() call, after --warmup untraced ones.

    python benchmarks/profile_training.py --target PATH --data answers.jsonl.gz --output profile.json
    python benchmarks/profile_training.py --device cpu --smoke        # tiny random target (checks the code path)
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import (  # noqa: E402
    add_draft_shape_args, annotation, bench_training_args, device_idle, hardware, tiny_target,
)

PHASES = ("data", "target", "draft", "loss", "backward", "optimizer")

# Kernel name -> family, first match wins.
FAMILIES = [
    ("attention (flex)", r"flex|triton_tem_fused_flex"),
    ("attention (sdpa/flash)", r"flash|fmha|attention|sdpa|efficient_attention"),
    ("matmul", r"gemm|cutlass|nvjet|sm90_xmma|wgmma|cublas|splitK|ampere_.*_s16816|matmul"),
    ("triton (compiled/fused)", r"^triton_"),
    ("softmax/logsumexp", r"softmax|logsumexp"),
    ("reduce", r"reduce|argmax|sum|norm"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("copy/cast", r"copy|cast|to_|convert|cat|index|gather|scatter|fill"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise"),
]


def family(name: str) -> str:
    for label, pattern in FAMILIES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default=None, help="target model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--random_weights", action="store_true",
                   help="the target's config and tokenizer, randomly initialized weights (seeded; no weights file "
                   "needed): the same shapes and kernels, so the same timings")  # fmt: skip
    p.add_argument("--data", default=None, help="conversations answered by the target, JSONL(.gz)")
    p.add_argument("--algorithm", default="dspark", choices=["dspark", "dflash", "eagle3"])
    add_draft_shape_args(p)
    p.add_argument("--steps", type=int, default=8, help="measured steps per measurement")
    p.add_argument("--warmup", type=int, default=3, help="steps before measuring (compilation)")
    p.add_argument("--compile_loss", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--loss_backend", default=None, help="loss backend (auto/triton/torch) where supported")
    p.add_argument("--compile_target", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the online target's decoder layers (default: the trainer's, on CUDA)")
    p.add_argument("--target_cuda_graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay the online target's forward from CUDA graphs (the trainer's target_cuda_graphs; "
                   "default: the trainer's, on CUDA)")
    p.add_argument("--loss_cuda_graphs", action="store_true",
                   help="replay the loss's forward from CUDA graphs (the trainer's loss_cuda_graphs)")
    p.add_argument("--torch_compile", action="store_true",
                   help="the Trainer's torch_compile=True (the draft compiled; the trainer step's time shows it)")
    p.add_argument("--attention", default="auto", choices=["auto", "flex", "dense"],
                   help="the draft's training attention (block_mask_kind): auto is each drafter's default")
    p.add_argument("--dataloader_num_workers", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="tiny random target and synthetic conversations")
    p.add_argument("--trace_steps", type=int, default=3,
                   help="steps under torch.profiler, after --warmup untraced ones (0: no kernel table)")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    p.add_argument("--table", default=None, help="also write the kernel table (text) here")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def random_target(path, dtype: torch.dtype, seed: int):
    """The causal LM of the folder's config with seeded random weights, in eval mode (its weights are not read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype).eval()


def build(args, cuda: bool, output_dir: str):
    from hf_dspark import DraftTrainer
    from hf_dspark.data import load_conversations, tokenize_conversations

    if args.smoke:
        target, rows = tiny_target(num_rows=4 * args.batch_size, length=args.max_length)
    else:
        from transformers import AutoTokenizer

        from hf_dspark.resources import default_target_path, load_target

        dtype = torch.bfloat16 if cuda else torch.float32
        if args.random_weights:
            path = args.target or default_target_path()
            target, tokenizer = random_target(path, dtype, args.seed), AutoTokenizer.from_pretrained(path)
        else:
            target, tokenizer = load_target(args.target, dtype=dtype)
        conversations = load_conversations(args.data)
        conversations = conversations.select(range(min(len(conversations), 64 * args.batch_size)))
        rows = tokenize_conversations(conversations, tokenizer, max_length=args.max_length)
    extra = {"compile_target": args.compile_target, "torch_compile": args.torch_compile,
             "target_cuda_graphs": args.target_cuda_graphs, "loss_cuda_graphs": args.loss_cuda_graphs}
    if args.loss_backend is not None:
        extra["loss_backend"] = args.loss_backend
    training_args = bench_training_args(
        args, args.algorithm, output_dir, cuda, learning_rate=6e-4, max_steps=10_000, logging_steps=10_000,
        disable_tqdm=True, **extra,
    )  # fmt: skip
    trainer = DraftTrainer(args=training_args, train_dataset=rows, target_model=target)
    trainer.model.block_mask_kind = args.attention
    return trainer


def phase_times(trainer, steps: int, warmup: int, cuda: bool, synchronized: bool = True) -> dict[str, list[float]]:
    """Run steps piece by piece (seconds per phase). synchronized: the device finishes each piece before the clock
    reads (the piece's wall time); otherwise only each step's start waits for the device, and a piece's time is
    the host's time to issue it (launches, Python, the dispatcher), as long as nothing in it waits."""
    model, device = trainer.model, trainer.args.device
    model.train()
    trainer.create_optimizer_and_scheduler(num_training_steps=10_000)
    optimizer = trainer.optimizer
    loader = iter(trainer.get_train_dataloader())
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    between = sync if synchronized else (lambda: None)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)
    out: dict[str, list[float]] = defaultdict(list)
    from hf_dspark.models.anchors import sample_anchors
    from hf_dspark.training.collator import LOSS_ROWS_BOUND
    from hf_dspark.training.losses import draft_loss

    for step in range(warmup + steps):
        sync()
        t = [time.perf_counter()]
        batch = next(loader)
        max_rows = batch.pop(LOSS_ROWS_BOUND, None)  # counted by the collator on the host, as the trainer uses it
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        between(); t.append(time.perf_counter())  # fmt: skip
        inputs = dict(batch)
        with autocast:
            inputs.update(trainer._target_features(model, inputs))
        between(); t.append(time.perf_counter())  # fmt: skip
        with autocast:
            if hasattr(model.config, "num_anchors"):
                gen = torch.Generator(device=device).manual_seed(step)
                positions, valid = sample_anchors(
                    inputs["loss_mask"] * inputs["attention_mask"], model.config.num_anchors, gen, fixed_count=True
                )
                inputs.update(anchor_positions=positions, anchor_mask=valid)
            outputs = model(**inputs)
        between(); t.append(time.perf_counter())  # fmt: skip
        with autocast:
            kwargs = {"compile": trainer.args.compile_loss, "max_rows": max_rows}
            backend = getattr(trainer.args, "loss_backend", None)
            if backend is not None:
                kwargs["backend"] = backend
            result = draft_loss(model, outputs, **kwargs)
        between(); t.append(time.perf_counter())  # fmt: skip
        result.loss.backward()
        between(); t.append(time.perf_counter())  # fmt: skip
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        between(); t.append(time.perf_counter())  # fmt: skip
        if step >= warmup:
            for name, a, b in zip(PHASES, t, t[1:]):
                out[name].append(b - a)
    return out


class _StepClock:
    """Trainer callback: wall time of each optimizer step (device synchronized at step ends), and whether the step
    did one-time work (compiled something, captured a CUDA graph)."""

    def __init__(self, cuda):
        from transformers import TrainerCallback

        from hf_dspark.compilation import one_time_work_mark, one_time_work_since

        clock = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                if cuda:
                    torch.cuda.synchronize()
                clock.mark = one_time_work_mark()
                clock.begin = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                if cuda:
                    torch.cuda.synchronize()
                clock.times.append(time.perf_counter() - clock.begin)
                compile_s, captures = one_time_work_since(clock.mark)
                clock.one_time.append(compile_s > 0 or captures > 0)

        self.times: list[float] = []
        self.one_time: list[bool] = []
        self.callback = Callback()


def trainer_steps(trainer, steps: int, warmup: int, cuda: bool) -> tuple[list[float], float, int]:
    """trainer.train() for warmup + steps steps; (seconds of each step after warm-up that did no one-time work,
    seconds to the first step end, how many steps after warm-up were left out for it). Padded lengths first seen
    after the warm-up compile inside their step; a median over such steps is no step time. All steps, if none is
    free of it."""
    clock = _StepClock(cuda)
    trainer.add_callback(clock.callback)
    try:
        trainer.args.max_steps = warmup + steps
        trainer.train()
    finally:
        trainer.remove_callback(clock.callback)
    first = clock.times[0] if clock.times else float("nan")
    after = list(zip(clock.times[warmup:], clock.one_time[warmup:]))
    clean = [t for t, busy in after if not busy]
    return (clean or [t for t, _ in after]), first, (len(after) - len(clean) if clean else 0)


def kernel_table(trainer, steps: int, cuda: bool, warmup: int = 2) -> tuple[list[dict], dict]:
    """GPU kernel time by kernel family over `steps` Trainer steps, and the device-busy fraction.

    The steps traced are the last `steps` of one train() call that first runs `warmup` untraced steps: a fresh
    train() pays one-time work in its first step (optimizer state, the loader's first batches), which spread over a
    few traced steps put more kernel time per step than the step takes. The wall time is that of the traced steps
    alone (device synchronized at each step end, as `trainer_steps` times them)."""
    from torch.profiler import ProfilerActivity, profile, schedule
    from transformers import TrainerCallback

    from hf_dspark.training.trainer import PROFILE_RANGE

    warmup = max(1, warmup)  # the traced window starts at a step end
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    step_ends: list[float] = []
    traced = {}

    class Tick(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            step_ends.append(time.perf_counter())
            prof.step()

    def keep(p):  # the schedule's one cycle ended: its events, before the profiler lets them go
        traced["events"] = p.key_averages()
        traced["idle"] = device_idle(p.events(), steps, PROFILE_RANGE) if cuda else {}

    trainer.args.max_steps = warmup + steps  # train() starts a new run of that many steps
    tick = Tick()
    trainer.add_callback(tick)
    try:
        with profile(activities=activities, schedule=schedule(wait=warmup - 1, warmup=1, active=steps, repeat=1),
                     on_trace_ready=keep) as prof:  # fmt: skip
            trainer.train(resume_from_checkpoint=None)
    finally:
        trainer.remove_callback(tick)
    if len(step_ends) != warmup + steps or "events" not in traced:
        raise RuntimeError(f"traced {len(step_ends)} step ends of {warmup + steps}: the trainer stopped early")
    wall = step_ends[-1] - step_ends[warmup - 1]
    by_family: dict[str, float] = defaultdict(float)
    by_kernel: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for event in traced["events"]:
        dev = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        if dev and event.device_type == torch.autograd.DeviceType.CUDA and not annotation(event):
            by_family[family(event.key)] += dev / 1e3
            by_kernel[event.key][0] += dev / 1e3
            by_kernel[event.key][1] += event.count
    busy = sum(by_family.values())
    rows = [{"family": f, "ms_per_step": ms / steps, "share": ms / busy if busy else 0.0}
            for f, ms in sorted(by_family.items(), key=lambda kv: -kv[1])]  # fmt: skip
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:25]
    summary = {
        "traced_steps": steps,
        "untraced_steps_before": warmup,
        "wall_ms_per_step": 1e3 * wall / steps,
        "device_busy_ms_per_step": busy / steps,
        "device_idle_fraction": max(0.0, 1 - busy / (1e3 * wall)) if wall else None,
        "top_kernels": [{"kernel": k[:120], "ms_per_step": v[0] / steps, "calls_per_step": v[1] / steps} for k, v in top],
        # where the GPU waited for the host, by the host operator running when each wait began
        "device_idle": traced["idle"],
    }
    return rows, summary


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        args.batch_size, args.max_length, args.num_anchors, args.steps, args.warmup = 2, 64, 8, 2, 1
    cuda = args.device.startswith("cuda")
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build(args, cuda, tmp)
        setup_s = time.perf_counter() - t0
        step_s, first_s, left_out = trainer_steps(trainer, args.steps, args.warmup, cuda)
        phases = phase_times(trainer, args.steps, 1, cuda)
        host = phase_times(trainer, args.steps, 1, cuda, synchronized=False)
        families, summary = ([], {})
        if args.trace_steps:
            families, summary = kernel_table(trainer, args.trace_steps, cuda, args.warmup)
    median = {name: statistics.median(v) * 1e3 for name, v in phases.items()}
    host_median = {name: statistics.median(v) * 1e3 for name, v in host.items()}
    tokens = args.batch_size * args.max_length
    report = {
        "benchmark": "profile_training",
        "command": "python " + " ".join(sys.argv),
        "hardware": hardware(args.device),
        # What ran: defaults (None) resolved by the trainer's arguments.
        "settings": {k: v for k, v in vars(args).items() if k not in ("output", "table")}
        | {"compile_target": trainer.args.compile_target, "compile_loss": trainer.args.compile_loss},
        "setup_s": setup_s,
        "time_to_first_step_end_s": first_s,
        "trainer_step_ms": statistics.median(step_s) * 1e3 if step_s else None,
        "trainer_steps_left_out": left_out,  # measured steps that compiled or captured (their time is not a step's)
        "trainer_tokens_per_s": tokens / statistics.median(step_s) if step_s else None,
        "phase_ms": median,
        "phase_sum_ms": sum(median.values()),
        "host_phase_ms": host_median,
        "host_phase_sum_ms": sum(host_median.values()),
        "kernel_families": families,
        "kernel_summary": summary,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }
    lines = [f"| {args.algorithm} | ms |", "|---|---|"]
    lines += [f"| trainer step (median of {len(step_s)}; {left_out} that compiled left out) | "
              f"{report['trainer_step_ms']:.1f} |",
              f"| first step end after start of train() | {first_s * 1e3:.0f} |"]  # fmt: skip
    lines += [f"| phase: {name} (synchronized / host issue) | {median[name]:.1f} / {host_median[name]:.1f} |"
              for name in PHASES]  # fmt: skip
    lines += [f"| phases summed (synchronized / host issue) | {report['phase_sum_ms']:.1f} / "
              f"{report['host_phase_sum_ms']:.1f} |"]  # fmt: skip
    if families:
        lines += ["", "| kernel family | ms/step | share |", "|---|---|---|"]
        lines += [f"| {r['family']} | {r['ms_per_step']:.2f} | {r['share']:.0%} |" for r in families]
        lines += [f"| GPU busy / wall per step | {summary['device_busy_ms_per_step']:.1f} / "
                  f"{summary['wall_ms_per_step']:.1f} | idle {summary['device_idle_fraction']:.0%} |"]  # fmt: skip
        lines += ["", "| top kernels | ms/step | calls/step |", "|---|---|---|"]
        lines += [f"| {k['kernel'][:70]} | {k['ms_per_step']:.2f} | {k['calls_per_step']:.0f} |"
                  for k in summary["top_kernels"][:12]]  # fmt: skip
    text = "\n".join(lines)
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2))
    if args.table:
        Path(args.table).write_text(text + "\n")
    print(text)
    return report


if __name__ == "__main__":
    main()
