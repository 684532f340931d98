"""Training step time and peak memory of a DSpark draft at DeepSpec's production shapes (random weights).

Shapes (Qwen3-4B target): draft hidden 2560, 5 layers, intermediate 9728, 32 heads / 8 kv heads, head_dim 128,
vocab 151,936, block 7, 512 anchors, sequence 4096, batch 1, Markov rank 256, confidence head, loss
0.1 CE + 0.9 L1 + 1.0 BCE, bf16 weights, fused AdamW. Goal (PERFORMANCE.md): <= 41 ms and <= 11.4 GiB on one
H200; the DeepSpec reference takes 110 ms / 23.9 GiB.

The step is exactly what DraftTrainer runs: anchors from `sample_anchors(fixed_count=True)`, the draft's training forward
(flex_attention with a sparse BlockMask on CUDA), `block_draft_loss` (row-chunked, fused over the vocabulary),
backward, optimizer step. No host synchronization inside the timed steps except the per-step CUDA events.
Before timing it counts one step's floating-point operations (torch's FlopCounterMode on an eager step) and times the
best dense matrix product on the device: FLOPs / that rate is the least time the step's products can take.

    python benchmarks/train_production_shapes.py --output benchmarks/results/train_production_shapes.json
    python benchmarks/train_production_shapes.py --device cpu --smoke        # tiny shapes, checks the code path
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import resource
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import device_idle, hardware  # noqa: E402

from hf_dspark import DSparkConfig, DSparkModel
from hf_dspark.training.loss_graphs import LossGraphs
from hf_dspark.models import backbone
from hf_dspark.training.arguments import draft_layer_compile_blocker
from hf_dspark.training import loss_buffers
from hf_dspark.training.compiled_layers import compiled_draft_layers
from hf_dspark.training.losses import DEFAULT_CHUNK_ELEMENTS, block_draft_loss
from hf_dspark.training.trainer import PROFILE_RANGE
from hf_dspark.models.anchors import anchor_slots_bound, fixed_anchor_count, sample_anchors

PRODUCTION = dict(
    vocab_size=151_936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=5, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, block_size=7, num_anchors=512, markov_rank=256, seq_len=4096,
    target_layer_ids=[1, 9, 17, 25, 33], num_target_layers=36, rope_theta=1_000_000.0, use_qk_norm=True,
)  # fmt: skip
SMOKE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, block_size=7, num_anchors=16, markov_rank=16, seq_len=128,
    target_layer_ids=[1, 3], num_target_layers=6, rope_theta=10_000.0, use_qk_norm=True,
)  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check of the code path)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, allocator warm-up)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--attention", default="auto", choices=["auto", "flex", "dense"],
                   help="auto: flex_attention BlockMask on CUDA, dense boolean mask elsewhere")  # fmt: skip
    p.add_argument("--chunk_elements", type=int, default=DEFAULT_CHUNK_ELEMENTS, help="loss buffer size per chunk")
    p.add_argument("--compile_loss", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the loss math (default: on CUDA; falls back to eager on failure)")  # fmt: skip
    p.add_argument("--loss_backend", default="torch", choices=["torch", "triton", "auto"],
                   help="the vocabulary-wide loss's backend (default: torch, the trainer's default; auto: Triton on CUDA)")
    p.add_argument("--gradient_checkpointing", action="store_true", help="recompute decoder layers in backward")
    p.add_argument("--loss_rows", choices=["host", "device"], default="host",
                   help="the loss's row count: from the host (as the trainer's collator gives it; no wait a step) "
                   "or counted on the device (one wait a step)")  # fmt: skip
    p.add_argument("--loss_cuda_graphs", action="store_true",
                   help="replay the loss's forward from CUDA graphs (the trainer's loss_cuda_graphs)")
    p.add_argument("--compile_draft_layers", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the draft's layer methods (the trainer's compile_draft_layers; default as "
                   "there: on CUDA without gradient checkpointing)")  # fmt: skip
    p.add_argument("--compile_mode", default=None, choices=["default", "max-autotune-no-cudagraphs", "max-autotune"],
                   help="torch.compile mode of the compiled draft layers (max-autotune*: inductor tunes their kernels, "
                   "flex attention's included; longer compilation)")
    p.add_argument("--seq_len", type=int, default=None, help="override the sequence length")
    p.add_argument("--num_anchors", type=int, default=None, help="override the anchors per sequence")
    p.add_argument("--num_layers", type=int, default=None, help="override the draft's decoder layers")
    p.add_argument("--flex_kernel_options", type=json.loads, default=None, metavar="JSON",
                   help='flex attention\'s Triton tile sizes, e.g. \'{"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, '
                   '"BLOCK_N2": 32}\' (backward) or BLOCK_M / BLOCK_N (forward), num_warps, num_stages; default: '
                   "torch's choice")  # fmt: skip
    p.add_argument("--flops_only", action="store_true",
                   help="print the step's matrix-product FLOPs from its shapes (product_flops) and stop: no weights, "
                   "no device, any machine")  # fmt: skip
    p.add_argument("--count_flops", action=argparse.BooleanOptionalAction, default=True,
                   help="count one step's floating-point operations (an eager step under torch's FlopCounterMode) and "
                   "time the best dense matrix product here: the step's matrix-product floor")  # fmt: skip
    p.add_argument("--output", default=None, help="write the results as JSON here")
    p.add_argument("--profile", default=None, help="after timing, profile 2 steps; write the kernel table here")
    return p.parse_args(argv)


def build_config(args) -> tuple[DSparkConfig, int]:
    """(the draft's config, the sequence length) for these arguments; no weights."""
    shapes = dict(SMOKE if args.smoke else PRODUCTION)
    if args.seq_len:
        shapes["seq_len"] = args.seq_len
    if args.num_anchors:
        shapes["num_anchors"] = args.num_anchors
    if args.num_layers:
        shapes["num_hidden_layers"] = args.num_layers
    seq_len = shapes.pop("seq_len")
    theta = shapes.pop("rope_theta")
    config = DSparkConfig(
        **shapes,
        target_hidden_size=shapes["hidden_size"],
        mask_token_id=shapes["vocab_size"] - 1,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        max_position_embeddings=max(40_960, seq_len + 16),
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        ce_loss_alpha=0.1,  # the reference implementation's mix, which the comparison runs
        l1_loss_alpha=0.9,
        soft_ce_loss_alpha=0.0,
    )
    return config, seq_len


def build(args):
    config, seq_len = build_config(args)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    with torch.device(args.device):  # initialize on the device: 1.4 B parameters initialize slowly on a CPU
        draft = DSparkModel(config)
    draft = draft.to(dtype)
    draft.block_mask_kind = args.attention
    if args.gradient_checkpointing:
        draft.gradient_checkpointing_enable()
    draft.train()
    return draft, seq_len


def synthetic_batch(config, seq_len, device, dtype, features: bool = True):
    """One row: a 256-token prompt (unsupervised), then supervised answer tokens; random target features (None
    with features=False)."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    input_ids = torch.randint(0, config.vocab_size - 1, (1, seq_len), generator=gen)
    loss_mask = torch.ones(1, seq_len, dtype=torch.long)
    loss_mask[:, : min(256, seq_len // 8)] = 0
    if not features:
        return input_ids, loss_mask, None, None
    width = config.num_context_features * config.target_hidden_size
    context = torch.randn(1, seq_len, width, generator=gen)
    last = torch.randn(1, seq_len, config.target_hidden_size, generator=gen)
    to = lambda t: t.to(device)  # noqa: E731
    return to(input_ids), to(loss_mask), to(context).to(dtype), to(last).to(dtype)


def product_flops(config, seq_len: int, loss_rows: int) -> dict[str, int]:
    """The step's matrix-product FLOPs from its shapes, forward and backward, term by term (`step_flops` counts the
    same products on a real step; a test holds the two equal): the context projection (forward, weight gradient:
    the target's features need none), every decoder layer (block tokens' q/k/v/o and MLP, the context's k/v; each
    forward, input gradient, weight gradient), the confidence head, and the loss's vocabulary products over its
    `loss_rows` rows (draft, Markov and target logits; gradients of the hidden states, the Markov features and the
    Markov weight). `loss_rows`: the row bound the trainer's collator gives the loss."""
    c = config
    slots = fixed_anchor_count(c.num_anchors, seq_len) * c.block_size  # the draft layers' rows
    d, q_width, kv_width = c.hidden_size, c.num_attention_heads * c.head_dim, 2 * c.num_key_value_heads * c.head_dim
    layer = 3 * (2 * slots * d * (q_width + kv_width) + 2 * slots * q_width * d + 6 * slots * d * c.intermediate_size
                 + 2 * seq_len * d * kv_width)  # fmt: skip
    markov = c.markov_rank if c.has_markov_head else 0
    out = {
        "context_projection": 2 * 2 * seq_len * c.num_context_features * c.target_hidden_size * d,
        "decoder_layers": c.num_hidden_layers * layer,
        "confidence_head": (3 * 2 * slots * (d + (markov if c.confidence_head_with_markov else 0))
                            if c.enable_confidence_head else 0),
        "vocabulary": 3 * 2 * loss_rows * c.vocab_size * (d + markov),
    }
    out["total"] = sum(out.values())
    return out


def step_flops(draft, input_ids, loss_mask, context, last, positions, valid, max_rows, chunk_elements) -> dict:
    """Floating-point operations of one training step, forward and backward.

    Matrix products as torch's FlopCounterMode counts them on an eager step (the compiled step runs the same
    products; attention kernels are left out of that sum, whichever backend ran them). Attention from its shapes:
    QK^T and PV forward, then dQ, dK, dV and dP backward (3x the forward; a fused kernel's recomputation not
    counted), over every [query, key] pair and over the pairs the block mask lets through (what a sparse kernel
    computes). The optimizer and element-wise work are not products and are not counted. Gradients are cleared."""
    from torch.utils.flop_counter import FlopCounterMode

    from hf_dspark.models.anchors import dense_block_mask

    cfg = draft.config
    kind = draft.block_mask_kind
    draft.block_mask_kind = "dense"  # an eager flex call would materialize its scores
    counter = FlopCounterMode(display=False)
    try:
        with counter:
            out = draft(input_ids, context, loss_mask, target_last_hidden=last, anchor_positions=positions,
                        anchor_mask=valid)  # fmt: skip
            block_draft_loss(draft, out, chunk_elements=chunk_elements, compile=False, backend="torch",
                             max_rows=max_rows).loss.backward()  # fmt: skip
    finally:
        draft.block_mask_kind = kind
        draft.zero_grad(set_to_none=True)
    by_op: dict[str, int] = defaultdict(int)
    for op, n in counter.get_flop_counts()["Global"].items():
        by_op[str(op).removeprefix("aten.")] += int(n)
    mask = dense_block_mask(positions, input_ids.shape[1], cfg.block_size)  # [B, 1, queries, keys]
    batch, _, queries, keys = mask.shape
    dense = 3 * 4 * batch * cfg.num_attention_heads * queries * keys * cfg.head_dim * cfg.num_hidden_layers
    live = float(mask.float().mean())
    return {
        "by_operator": dict(by_op),
        "matmul": sum(n for op, n in by_op.items() if "attention" not in op),
        "attention_dense": dense,
        "attention_live_fraction": live,
        "attention_live": dense * live,
    }


def best_gemm_tflops(device: torch.device, dtype: torch.dtype, sizes=(4096, 8192), repeats: int = 10) -> float:
    """The fastest dense matrix product measured here (TFLOP/s over square products of these sizes): an upper bound
    on the rate the step's products can reach, so FLOPs / this rate is a lower bound on their time."""
    best = 0.0
    for n in sizes:
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        for _ in range(2):  # warm-up: library heuristics, clocks
            a @ b
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            for _ in range(repeats):
                a @ b
            end.record()
            torch.cuda.synchronize(device)
            seconds = start.elapsed_time(end) / 1000
        else:
            t0 = time.perf_counter()
            for _ in range(repeats):
                a @ b
            seconds = time.perf_counter() - t0
        best = max(best, 2 * n**3 * repeats / seconds / 1e12)
        del a, b
    return best


def profile_steps(step, first: int, path: str, cuda: bool, steps: int = 2) -> dict:
    """Where a step's time goes: torch.profiler over `steps` steps back to back, operators sorted by GPU kernel
    time (written to `path`), and where the GPU waited for the host (`device_idle`, returned and appended)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for i in range(first, first + steps):
            step(i)
        if cuda:
            torch.cuda.synchronize()
    key = "cuda_time_total" if cuda else "cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=40)
    idle = device_idle(prof.events(), steps, PROFILE_RANGE) if cuda else {}
    with open(path, "w") as f:
        f.write(table)
        if idle:
            f.write("\nGPU idle, waiting for the host (device_idle):\n" + json.dumps(idle, indent=1) + "\n")
    print(prof.key_averages().table(sort_by=key, row_limit=15))
    if idle:
        print(f"GPU busy {idle['busy_ms_per_step']:.1f} ms, idle {idle['idle_ms_per_step']:.1f} ms a step; idle by "
              f"phase: {', '.join(f'{k} {v:.2f}' for k, v in idle['idle_by_phase_ms_per_step'].items())}")
    return idle


def flops_only(args) -> dict:
    """`--flops_only`: the product count of one step at the configured shapes, from the shapes alone."""
    cfg, seq_len = build_config(args)
    loss_mask = synthetic_batch(cfg, seq_len, torch.device("cpu"), torch.float32, features=False)[1]
    rows = anchor_slots_bound(loss_mask, cfg.num_anchors, cfg.block_size)  # DSparkModel.loss_rows_bound_fn's bound
    result = {"benchmark": "train_production_shapes --flops_only", "command": "python " + " ".join(sys.argv),
              "seq_len": seq_len, "loss_rows": rows, "product_flops": product_flops(cfg, seq_len, rows)}  # fmt: skip
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print("| matrix products of one step (forward + backward) | TFLOP |\n|---|---|")
    for name, flops in result["product_flops"].items():
        print(f"| {name.replace('_', ' ')} | {flops / 1e12:.3f} |")
    return result


def main(argv=None):
    args = parse_args(argv)
    if args.flops_only:
        return flops_only(args)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if args.compile_loss is None:
        args.compile_loss = cuda
    if args.compile_draft_layers is None:
        # The trainer's rule (this loop has neither DeepSpeed nor FSDP).
        blocker = draft_layer_compile_blocker(args.gradient_checkpointing, False, False)
        args.compile_draft_layers = cuda and blocker is None
    backbone.FLEX_KERNEL_OPTIONS = args.flex_kernel_options  # before anything compiles
    draft, seq_len = build(args)
    cfg = draft.config
    dtype = getattr(torch, args.dtype)
    trainable = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.0, fused=cuda)
    input_ids, loss_mask, context, last = synthetic_batch(cfg, seq_len, device, dtype)
    layers = contextlib.nullcontext()
    if args.compile_draft_layers:  # as the trainer does it
        layers = compiled_draft_layers(draft, mode=args.compile_mode)

    loss_graphs = LossGraphs() if args.loss_cuda_graphs else None
    # the fixed batch's row bound, counted once on the host (the trainer's collator does it for every batch)
    max_rows = draft.loss_rows_bound_fn()(loss_mask.cpu()) if args.loss_rows == "host" else None

    def step(i: int):
        with record_function(PROFILE_RANGE + "draft"):  # the trainer's phase names: idle time by phase
            generator = torch.Generator(device=device).manual_seed(i)
            positions, valid = sample_anchors(loss_mask, cfg.num_anchors, generator, fixed_count=True)
            with layers:
                out = draft(input_ids, context, loss_mask, target_last_hidden=last, anchor_positions=positions,
                            anchor_mask=valid)  # fmt: skip
        with record_function(PROFILE_RANGE + "loss"):
            result = block_draft_loss(draft, out, chunk_elements=args.chunk_elements, compile=args.compile_loss,
                                      backend=args.loss_backend, max_rows=max_rows, graphs=loss_graphs)  # fmt: skip
        with record_function(PROFILE_RANGE + "backward"):
            result.loss.backward()
        with record_function(PROFILE_RANGE + "optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return result.estimates["supervised_tokens"].detach(), result.loss.detach()

    flops = floor = None
    if args.count_flops:  # before any step: the count's eager step leaves no gradients and moves no weights
        generator = torch.Generator(device=device).manual_seed(0)
        positions, valid = sample_anchors(loss_mask, cfg.num_anchors, generator, fixed_count=True)
        flops = step_flops(draft, input_ids, loss_mask, context, last, positions, valid, max_rows, args.chunk_elements)
        rate = best_gemm_tflops(device, dtype, sizes=(256,) if args.smoke or not cuda else (4096, 8192))
        floor = {"best_gemm_tflops": rate, "matmul_ms": flops["matmul"] / rate / 1e9,
                 "attention_live_ms": flops["attention_live"] / rate / 1e9}  # fmt: skip
    for i in range(args.warmup):
        step(i)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    def timed(steps: range) -> tuple[list, float]:
        """Run these steps back to back: (their outputs, milliseconds from the first launch to the last one's end;
        CUDA events on a GPU, so waiting happens only after the last step)."""
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            outputs = [step(i) for i in steps]
            end.record()
            torch.cuda.synchronize(device)
            return outputs, start.elapsed_time(end)
        t0 = time.perf_counter()
        outputs = [step(i) for i in steps]
        return outputs, (time.perf_counter() - t0) * 1000

    times, tokens, losses = [], [], []
    for i in range(args.warmup, args.warmup + args.steps):
        [(n, loss)], ms = timed(range(i, i + 1))  # a wait after every step: timing only, never inside one
        times.append(ms)
        tokens.append(n)
        losses.append(loss)
    step_ms = statistics.median(times)
    # The same number of steps back to back, one wait at the end: as training runs them, the host may queue the next
    # step's kernels while the GPU finishes this one (the median above waits after every step).
    first = args.warmup + args.steps
    pipelined_ms = timed(range(first, first + args.steps))[1] / args.steps
    first += args.steps
    idle = profile_steps(step, first, args.profile, cuda) if args.profile else None
    supervised = float(torch.stack(tokens).float().mean())
    if cuda:
        peak_gib = torch.cuda.max_memory_allocated(device) / 2**30
        device_name = torch.cuda.get_device_name(device)
    else:
        peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (Linux)
        device_name = platform.processor() or "cpu"
    result = {
        "benchmark": "train_production_shapes",
        "command": "python " + " ".join(sys.argv),
        "hardware": hardware(device),
        "smoke": args.smoke,
        "device": device_name,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "dtype": args.dtype,
        "attention": "flex" if draft._use_flex(device) else "dense",
        "compile_loss": args.compile_loss,
        "loss_backend": args.loss_backend,
        "gradient_checkpointing": args.gradient_checkpointing,
        "compile_draft_layers": args.compile_draft_layers,
        "loss_cuda_graphs": args.loss_cuda_graphs,
        "loss_graphs_failed": None if loss_graphs is None else loss_graphs.failed,
        "compile_mode": args.compile_mode,
        "flex_kernel_options": args.flex_kernel_options,
        "loss_rows_counted_on": args.loss_rows,
        "chunk_elements": args.chunk_elements,
        # Whether the loss's products accumulated bf16 inputs into fp32 in the GEMM itself (False: a separate pass
        # over each [rows, V] buffer; None: never tried, e.g. off CUDA).
        "fused_fp32_accumulation": {"mm": loss_buffers._MM_OUT_DTYPE_OK, "addmm": loss_buffers._ADDMM_OUT_DTYPE_OK},
        "shapes": {
            "hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "intermediate": cfg.intermediate_size,
            "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "vocab": cfg.vocab_size, "block": cfg.block_size, "anchors": cfg.num_anchors, "seq_len": seq_len,
            "batch": 1, "markov_rank": cfg.markov_rank,
        },  # fmt: skip
        "trainable_params": sum(p.numel() for p in trainable),
        "step_ms_median": step_ms,
        "step_ms_all": times,
        "step_ms_pipelined": pipelined_ms,
        "supervised_block_tokens_per_step": supervised,
        "supervised_block_tokens_per_s": supervised / (step_ms / 1000),
        "peak_memory_gib": peak_gib,
        "peak_memory_kind": "torch.cuda.max_memory_allocated" if cuda else "process max RSS",
        "final_loss": float(losses[-1]),
        # One step's products (FlopCounterMode on an eager step) and their time at the best dense rate measured here.
        "flops": flops,
        "device_idle": idle,
        "floor": floor,
        "goal": {"step_ms": 41.0, "peak_memory_gib": 11.4},
        "deepspec_reference": {"eager_ms": 110.0, "compiled_ms": 83.0, "peak_memory_gib": 23.9},
    }
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
    rows = [
        ("device", result["device"]),
        ("shapes", f"d={cfg.hidden_size} L={cfg.num_hidden_layers} V={cfg.vocab_size} K={cfg.block_size} "
                   f"N={cfg.num_anchors} T={seq_len}"),
        ("trainable params", f"{result['trainable_params'] / 1e6:.1f} M"),
        ("attention / loss backend / compiled loss / compiled layers",
         f"{result['attention']} / {args.loss_backend} / {args.compile_loss} / {args.compile_draft_layers}"),
        ("step time (median of %d)" % args.steps, f"{step_ms:.1f} ms   (goal 41 ms; DeepSpec 110 ms)"),
        ("step time, %d steps back to back (mean)" % args.steps, f"{pipelined_ms:.1f} ms"),
        ("supervised block tokens/s", f"{result['supervised_block_tokens_per_s'] / 1e3:.1f} k   (goal 86 k)"),
        (f"peak memory ({result['peak_memory_kind']})", f"{peak_gib:.2f} GiB   (goal 11.4 GiB; DeepSpec 23.9)"),
    ]  # fmt: skip
    if flops is not None:
        rows += [
            ("matrix products a step (forward + backward)",
             f"{flops['matmul'] / 1e12:.2f} TFLOP = {floor['matmul_ms']:.1f} ms at {floor['best_gemm_tflops']:.0f} "
             "TFLOP/s (the best dense product measured here)"),
            ("attention products, dense / inside the block mask",
             f"{flops['attention_dense'] / 1e12:.2f} / {flops['attention_live'] / 1e12:.2f} TFLOP "
             f"({flops['attention_live_fraction']:.0%} live; {floor['attention_live_ms']:.1f} ms at that rate)"),
        ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    print("\n| " + "metric".ljust(width) + " | value |\n|" + "-" * (width + 2) + "|-------|")
    for key, value in rows:
        print(f"| {key.ljust(width)} | {value} |")
    return result


if __name__ == "__main__":
    main()
