"""Flex attention's Triton tile sizes for the anchor-block mask: forward and backward time of each configuration.

The draft's training attention (queries: every block slot; keys: `[context; blocks]`; each slot sees the context
before its anchor and its own block) runs as one flex_attention call per layer with a sparse BlockMask. torch picks
its kernels' tiles by GPU, dtype and head size; this script times that choice against others on the mask the draft
builds (`anchors.flex_block_mask` over anchors from `sample_anchors(fixed_count=True)`), each configuration
compiled on its own, forward alone and forward + backward, and reports the fastest. The winner can be set for
training through `hf_dspark.models.backbone.FLEX_KERNEL_OPTIONS` (`train_production_shapes.py --flex_kernel_options`).

    python benchmarks/flex_tiles.py --preset production --output flex_tiles_production.json
    python benchmarks/flex_tiles.py --preset smollm2 --output flex_tiles_smollm2.json
    python benchmarks/flex_tiles.py --preset production --configs '{}' '{"USE_TMA": true}'
    python benchmarks/flex_tiles.py --device cpu --smoke          # tiny shapes: checks the code path

Options prefixed `fwd_` / `bwd_` reach only that kernel (torch >= 2.8); unprefixed ones reach both. A
configuration the kernel refuses (tile sizes that do not divide the mask's 128 tiles, shared memory overflow) is
reported with its error and skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import hardware, write_report  # noqa: E402

from hf_dspark.models.anchors import dense_block_mask, flex_block_mask, sample_anchors

# Shapes of the draft's attention: DeepSpec's production draft (Qwen3-4B target) and the SmolLM2 recipe's.
PRESETS = {
    "production": dict(batch=1, seq_len=4096, num_anchors=512, block_size=7, heads=32, kv_heads=8, head_dim=128,
                       prompt=256),
    "smollm2": dict(batch=16, seq_len=1024, num_anchors=512, block_size=7, heads=9, kv_heads=3, head_dim=64,
                    prompt=256),
    "smoke": dict(batch=2, seq_len=128, num_anchors=16, block_size=7, heads=4, kv_heads=2, head_dim=16, prompt=32),
}  # fmt: skip

# Candidates around torch's Hopper defaults (forward 128 x 64, 3 stages, 8 warps; backward 64/128/128/64, 3 stages,
# 8 warps for head sizes up to 128) and its own autotuning lists. Backward tiles obey BLOCK_N1 % BLOCK_M1 == 0 and
# BLOCK_M2 % BLOCK_N2 == 0 (the kernel's static assertions).
DEFAULT_CONFIGS = [
    {},
    {"USE_TMA": True},
    {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_stages": 2, "fwd_num_warps": 8},
    {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 128, "fwd_num_stages": 3, "fwd_num_warps": 4},
    {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64, "bwd_num_stages": 3,
     "bwd_num_warps": 4},
    {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32, "bwd_num_stages": 3,
     "bwd_num_warps": 8},
    {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32, "bwd_num_stages": 4,
     "bwd_num_warps": 4},
    {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64, "bwd_num_stages": 2,
     "bwd_num_warps": 8},
]  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="production", choices=sorted(PRESETS))
    p.add_argument("--smoke", action="store_true", help="the smoke preset (tiny shapes), 2 timed calls")
    for name in ("batch", "seq_len", "num_anchors", "block_size", "heads", "kv_heads", "head_dim", "prompt"):
        p.add_argument(f"--{name}", type=int, default=None, help="override the preset's value")
    p.add_argument("--configs", nargs="+", type=json.loads, default=None, metavar="JSON",
                   help="kernel_options dicts to time ('{}' is torch's choice; default: a built-in list)")
    p.add_argument("--autotune", action="store_true",
                   help="also time torch.compile(mode='max-autotune-no-cudagraphs'): inductor tries its own list")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=20, help="timed calls per configuration (median reported)")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def shapes_of(args) -> dict:
    shapes = dict(PRESETS["smoke" if args.smoke else args.preset])
    for name in shapes:
        if getattr(args, name) is not None:
            shapes[name] = getattr(args, name)
    return shapes


def attention_inputs(shapes: dict, device, dtype, seed: int = 0):
    """(q, k, v, block_mask, live fraction) as a draft layer sees them: anchors sampled on a row whose first
    `prompt` tokens are unsupervised, keys `[context; blocks]`."""
    s = shapes
    gen = torch.Generator(device="cpu").manual_seed(seed)
    loss_mask = torch.ones(s["batch"], s["seq_len"], dtype=torch.long)
    loss_mask[:, : s["prompt"]] = 0
    positions, _ = sample_anchors(loss_mask, s["num_anchors"], gen, fixed_count=True)
    queries = positions.shape[1] * s["block_size"]
    live = float(dense_block_mask(positions, s["seq_len"], s["block_size"]).float().mean())
    positions = positions.to(device)
    mask = flex_block_mask(positions, s["seq_len"], s["block_size"])
    keys = mask.seq_lengths[1]  # padded to whole tiles on CPU
    q = torch.randn(s["batch"], s["heads"], queries, s["head_dim"], generator=gen).to(device, dtype)
    k = torch.randn(s["batch"], s["kv_heads"], keys, s["head_dim"], generator=gen).to(device, dtype)
    v = torch.randn(s["batch"], s["kv_heads"], keys, s["head_dim"], generator=gen).to(device, dtype)
    return q, k, v, mask, live


def time_config(q, k, v, mask, options: dict | None, iters: int, mode: str | None = None) -> dict:
    """Median forward and forward + backward milliseconds of one compiled flex_attention configuration."""
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()  # a fresh compilation: kernel options are read when the kernels compile
    fn = torch.compile(flex_attention, dynamic=False, mode=mode)
    cuda = q.device.type == "cuda"
    passes = [("fwd_ms", False), ("fwd_bwd_ms", True)] if cuda else [("fwd_ms", False)]  # no CPU flex backward
    q, k, v = (t.detach().requires_grad_(cuda) for t in (q, k, v))
    grad = torch.randn_like(q)

    def call(backward: bool):
        out = fn(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=options or None)
        if backward:
            out.backward(grad)
        return out

    t0 = time.perf_counter()
    call(cuda)  # compiles forward (and backward)
    if cuda:
        torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    result = {"compile_s": compile_s}
    for name, backward in passes:
        times = []
        for _ in range(iters):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                call(backward)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                call(backward)
                times.append((time.perf_counter() - t) * 1e3)
        result[name] = statistics.median(times)
    if cuda:
        result["bwd_ms"] = result["fwd_bwd_ms"] - result["fwd_ms"]
    return result


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        args.iters = 2
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    shapes = shapes_of(args)
    q, k, v, mask, live = attention_inputs(shapes, device, dtype)
    configs = args.configs if args.configs is not None else DEFAULT_CONFIGS
    if args.smoke or device.type != "cuda":
        configs = [c for c in configs if not c] or [{}]  # tile options are for the GPU kernels
    runs = []
    jobs = [(json.dumps(c, sort_keys=True), c, None) for c in configs]
    if args.autotune:
        jobs.append(("max-autotune-no-cudagraphs", {}, "max-autotune-no-cudagraphs"))
    for name, options, mode in jobs:
        try:
            row = {"config": name, **time_config(q, k, v, mask, options, args.iters, mode)}
        except Exception as err:  # noqa: BLE001 - a refused configuration is a result, not a failure of the sweep
            row = {"config": name, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
        runs.append(row)
        print(row, flush=True)
    timed = [r for r in runs if "error" not in r]
    default = next((r for r in timed if r["config"] == "{}"), None)
    key = "fwd_bwd_ms" if device.type == "cuda" else "fwd_ms"
    best = min(timed, key=lambda r: r[key]) if timed else None
    dense = 4 * shapes["batch"] * shapes["heads"] * q.shape[2] * k.shape[2] * shapes["head_dim"]  # QK^T + PV
    report = {
        "benchmark": "flex_tiles",
        "command": "python " + " ".join(sys.argv),
        "hardware": hardware(device),
        "shapes": shapes,
        "queries": q.shape[2],
        "keys": k.shape[2],
        "live_fraction": live,
        "forward_tflop_live": dense * live / 1e12,
        "runs": runs,
        "best": best["config"] if best else None,
        "best_vs_default": (default[key] / best[key]) if best and default else None,
    }
    write_report(report, args.output)
    print(f"\nshapes {shapes}: {q.shape[2]} queries x {k.shape[2]} keys, {live:.0%} of pairs inside the mask")
    print("| kernel_options | forward ms | backward ms | forward + backward ms | compile s |\n|---|---|---|---|---|")
    for r in runs:
        if "error" in r:
            print(f"| `{r['config']}` | refused: {r['error'][:80]} | | | |")
        else:
            cells = [f"{r[n]:.3f}" if n in r else "-" for n in ("fwd_ms", "bwd_ms", "fwd_bwd_ms")]
            print(f"| `{r['config']}` | " + " | ".join(cells) + f" | {r['compile_s']:.1f} |")
    if best:
        print(f"\nfastest: {best['config']}" + (f" ({report['best_vs_default']:.2f}x torch's choice)" if default else ""))
    return report


if __name__ == "__main__":
    main()
