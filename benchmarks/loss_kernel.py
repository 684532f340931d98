"""The vocabulary-wide training loss: Triton kernels vs the PyTorch path (eager and compiled), one GPU.

For each setting, every variant runs forward + backward of `fused_head_loss` (hidden, Markov features and W2
get gradients; the lm_head is frozen) on the full shapes: median time (triton.testing.do_bench) and peak
memory above the inputs. Accuracy: on the first `--check_rows` rows, the variant's loss, per-row stats
(ce, l1, soft_ce, argmax agreement) and gradients against an fp32 reference (the PyTorch path on fp32 copies
of the inputs): max absolute difference and max difference relative to the reference's largest magnitude.
A failing variant is reported in its row and the run goes on. A variant ending in `-masked` passes `row_mask`
(the rows with a nonzero weight), so only those reach the vocabulary-wide math: with `--invalid_fraction 0.36`
(the share of zero-weight rows in a SmolLM2 training batch) that row shows what skipping them buys, next to the
same variant without it.

Settings (random inputs, bf16):
  smollm2      DSpark for SmolLM2-135M: d 576, V 49,152, 16 x 512 anchors x 7 = 57,344 rows, Markov rank 256,
               0.1 CE + 0.9 L1
  production   DeepSpec's production shapes: d 2560, V 151,936, 512 x 7 = 3,584 rows, Markov rank 256, 0.1/0.9
  smollm2-dflash, smollm2-eagle3 (optional): CE only / soft CE against the target, no Markov head

    python benchmarks/loss_kernel.py --output benchmarks/results/loss_kernel.json
    python benchmarks/loss_kernel.py --device cpu --smoke        # tiny shapes; Triton through its interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback

SETTINGS = {
    "smollm2": dict(d=576, V=49_152, rows=16 * 512 * 7, markov=True, terms="ce+l1"),
    "production": dict(d=2560, V=151_936, rows=512 * 7, markov=True, terms="ce+l1"),
    "smollm2-dflash": dict(d=576, V=49_152, rows=16 * 512 * 7, markov=False, terms="ce"),
    "smollm2-eagle3": dict(d=576, V=49_152, rows=16 * 512 * 7, markov=False, terms="soft_ce"),
}
# --smoke: tiny shapes, ragged against every tile (the interpreter runs each program in Python).
SMOKE = {"production": dict(d=80, V=500, rows=35)}
SMOKE_DEFAULT = dict(d=48, V=300, rows=70)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check of the code path)")
    p.add_argument("--settings", nargs="+", default=["smollm2", "production"], choices=list(SETTINGS))
    # PyTorch first: a kernel fault that poisons the CUDA context then costs only the variants after it.
    p.add_argument("--variants", nargs="+",
                   default=["torch-eager", "torch-compiled", "triton", "triton-chunked", "triton-128x128"],
                   help="torch-eager, torch-compiled, triton[-MxV[xD]][-chunked]: tile rows x vocabulary [x hidden "
                        "step]; -chunked: gradient products by cuBLAS from a bounded g buffer (else fused atomics)")
    p.add_argument("--check_rows", type=int, default=1024, help="rows compared against the fp32 reference")
    p.add_argument("--softcap", type=float, default=None, help="tanh soft-capping of the logits (Gemma-style)")
    p.add_argument("--rep_ms", type=int, default=200, help="do_bench measuring time per variant")
    p.add_argument("--invalid_fraction", type=float, default=0.1,
                   help="share of rows with zero weight (0.36 in a SmolLM2 training batch)")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    for variant in args.variants:
        base = variant.removesuffix("-masked")
        if base not in ("torch-eager", "torch-compiled") and not base.startswith("triton"):
            p.error(f"unknown variant {variant!r}: torch-eager, torch-compiled or triton[-MxV[xD]][-chunked], "
                    "each optionally with -masked")  # fmt: skip
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def make_inputs(shape, device, dtype, seed=0, invalid_fraction=0.1):
    """Draft states and a nearby target (mixed argmax agreement), logits with a few nats of spread."""
    import torch

    from hf_dspark import DSparkConfig
    from hf_dspark.training.losses import slot_weights

    gen = torch.Generator(device=device).manual_seed(seed)
    d, V, S = shape["d"], shape["V"], shape["rows"]
    r = DSparkConfig.markov_rank
    rand = lambda *size, scale=1.0: (torch.randn(*size, generator=gen, device=device) * scale).to(dtype)  # noqa: E731
    h = torch.randn(S, d, generator=gen, device=device)
    x = {
        "hidden": h.to(dtype),
        "target_hidden": (h + 0.5 * torch.randn(S, d, generator=gen, device=device)).to(dtype),
        "lm_weight": rand(V, d, scale=2.5 / d**0.5),
        "labels": torch.randint(0, V, (S,), generator=gen, device=device),
        "markov_features": rand(S, r) if shape["markov"] else None,
        "markov_weight": rand(V, r, scale=1.0 / r**0.5) if shape["markov"] else None,
    }
    # Block slot weights (7 slots, gamma 4) with a share of the rows invalid, normalized like the objective.
    w = slot_weights(7, DSparkConfig.loss_decay_gamma, device).repeat(-(-S // 7))[:S]
    w = w * (torch.rand(S, generator=gen, device=device) > invalid_fraction)
    w = w / w.sum()
    weights = {"ce": 0.1 * w, "l1": 0.9 * w}  # the reference implementation's mix (the settings name it)
    if shape["terms"] == "ce":
        weights = {"ce": w}
    elif shape["terms"] == "soft_ce":
        weights = {"ce": torch.zeros_like(w), "soft_ce": w}
    return x, weights


def subset(inputs, weights, n, dtype=None):
    """The first n rows (and all of the weights), optionally cast to dtype."""
    cast = lambda t: t if dtype is None or not t.is_floating_point() else t.to(dtype)  # noqa: E731
    rows = {"hidden", "target_hidden", "labels", "markov_features"}
    x = {k: None if v is None else cast(v[:n] if k in rows else v) for k, v in inputs.items()}
    return x, {k: v[:n] for k, v in weights.items()}


def loss_and_grads(inputs, weights, variant, softcap):
    """One forward + backward; returns (loss, stats, {name: grad})."""
    import torch

    from hf_dspark.training.losses import fused_head_loss

    leaves = {k: inputs[k].detach().requires_grad_() for k in ("hidden", "markov_features", "markov_weight")
              if inputs[k] is not None}  # fmt: skip
    base = variant.removesuffix("-masked")
    kw = {"backend": "torch", "compile": base == "torch-compiled"} if base.startswith("torch") else {}
    if base.startswith("triton"):
        kw["backend"] = "triton"
    if variant.endswith("-masked"):
        kw["row_mask"] = sum(weights.values()) > 0
    loss, stats = fused_head_loss(
        leaves["hidden"], inputs["lm_weight"], inputs["labels"], weights["ce"],
        target_hidden=inputs["target_hidden"],
        markov_features=leaves.get("markov_features"), markov_weight=leaves.get("markov_weight"),
        l1_weight=weights.get("l1"), soft_ce_weight=weights.get("soft_ce"), softcap=softcap, **kw,
    )  # fmt: skip
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return loss, stats, dict(zip(leaves, grads))


def triton_options(variant):
    """(TileConfig or None for the defaults, grad mode) of 'triton[-MxV[xD]][-chunked]'."""
    from hf_dspark.training.triton_head_loss import TileConfig

    tiles, grad_mode = None, "fused"
    for token in variant.removesuffix("-masked").split("-")[1:]:
        if token == "chunked":
            grad_mode = "chunked"
            continue
        sizes = [int(x) for x in token.split("x")]
        block_m, block_v = sizes[:2]
        block_d = sizes[2] if len(sizes) > 2 else 64
        tiles = TileConfig(block_m, block_v, block_d, num_warps=8, num_stages=3)
    return tiles, grad_mode


class triton_defaults:
    """Make (tiles, grad mode) the defaults for the run's dtype while the variant runs (fused_head_loss itself
    always takes the defaults)."""

    def __init__(self, variant, dtype):
        self.variant, self.dtype = variant, dtype

    def __enter__(self):
        if not self.variant.startswith("triton"):
            return
        from hf_dspark.training import triton_head_loss as module

        tiles, grad_mode = triton_options(self.variant)
        self.module, self.saved = module, (module.DEFAULT_TILES[self.dtype], module.DEFAULT_GRAD_MODE)
        module.DEFAULT_TILES[self.dtype] = tiles or module.DEFAULT_TILES[self.dtype]
        module.DEFAULT_GRAD_MODE = grad_mode

    def __exit__(self, *exc):
        if self.variant.startswith("triton"):
            self.module.DEFAULT_TILES[self.dtype], self.module.DEFAULT_GRAD_MODE = self.saved


def differences(got, want, rows=None):
    """{quantity: (max |got - want|, that / max |want|)} for the loss, stats and gradients; per-row stats only on
    `rows` (bool) when given (a masked variant reports zeros for the rows it skips)."""
    (loss, stats, grads), (ref_loss, ref_stats, ref_grads) = got, want
    pick = (lambda t: t) if rows is None else (lambda t: t[rows])  # noqa: E731
    pairs = {"loss": (loss, ref_loss)}
    for name in ("ce", "l1", "soft_ce"):
        a, b = getattr(stats, name), getattr(ref_stats, name)
        if a is not None and b is not None:
            pairs[name] = (pick(a), pick(b))
    for name, g in grads.items():
        pairs[f"grad_{name}"] = (g, ref_grads[name])
    out = {}
    for name, (a, b) in pairs.items():
        a, b = a.detach().double(), b.detach().double()
        err = (a - b).abs().max().item()
        out[name] = {"max_abs": err, "max_rel": err / max(b.abs().max().item(), 1e-30)}
    if ref_stats.greedy_match is not None and stats.greedy_match is not None:
        agree = (pick(stats.greedy_match) == pick(ref_stats.greedy_match)).float().mean().item()
        out["greedy_match_agreement"] = {"fraction": agree}
    return out


def time_ms(fn, device, rep_ms):
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def run_variant(variant, inputs, weights, reference, check, args):
    import torch

    cuda = args.device == "cuda"
    row = {"variant": variant}
    with triton_defaults(variant, inputs["hidden"].dtype):
        t0 = time.perf_counter()
        checked = subset(inputs, weights, check)
        got = loss_and_grads(*checked, variant, args.softcap)  # also compiles
        row["first_call_s"] = time.perf_counter() - t0
        rows = sum(checked[1].values()) > 0 if variant.endswith("-masked") else None
        row["accuracy_vs_fp32"] = differences(got, reference, rows)
        del got
        fn = lambda: loss_and_grads(inputs, weights, variant, args.softcap)  # noqa: E731
        if cuda:
            fn()  # shapes of the full run (compiled variants specialize)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            row["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        row["ms"] = time_ms(fn, args.device, args.rep_ms)
    return row


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import torch

    device = args.device
    dtype = torch.bfloat16
    results = []
    report = {
        "benchmark": "loss_kernel",
        "command": "loss_kernel.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "python": sys.version.split()[0],
        "dtype": str(dtype).replace("torch.", ""),
        "smoke": args.smoke,
        "softcap": args.softcap,
        "triton_interpreter": os.environ.get("TRITON_INTERPRET") == "1",
        "settings": results,
    }
    for name in args.settings:
        shape = dict(SETTINGS[name], **(SMOKE.get(name, SMOKE_DEFAULT) if args.smoke else {}))
        setting = {"setting": name, **shape, "markov_rank": None, "rows_checked": None, "variants": []}
        try:
            inputs, weights = make_inputs(shape, device, dtype, invalid_fraction=args.invalid_fraction)
            if shape["markov"]:
                setting["markov_rank"] = inputs["markov_features"].shape[1]
            check = min(args.check_rows, shape["rows"])
            setting["rows_checked"] = check
            reference = loss_and_grads(*subset(inputs, weights, check, torch.float32), "torch-eager", args.softcap)
        except Exception as err:  # noqa: BLE001
            setting["error"] = f"{type(err).__name__}: {err}"
            results.append(setting)
            continue
        for variant in args.variants:
            try:
                row = run_variant(variant, inputs, weights, reference, check, args)
            except Exception as err:  # noqa: BLE001 - report and go on
                traceback.print_exc()
                row = {"variant": variant, "error": f"{type(err).__name__}: {str(err)[:300]}"}
            setting["variants"].append(row)
            print(json.dumps({"setting": name, **row}), flush=True)
            write(report, args.output, results, setting)
            if device == "cuda":
                torch.cuda.empty_cache()
        results.append(setting)
        del inputs, weights, reference

    write(report, args.output, results)
    print_table(report)
    return 0 if all("error" not in s and all("error" not in v for v in s["variants"]) for s in results) else 1


def _triton_version():
    try:
        import triton

        return triton.__version__
    except Exception:  # noqa: BLE001 - the PyTorch variants still run
        return None


def write(report, path, results, current=None):
    """The JSON so far (after every variant, so a crash keeps what was measured)."""
    if path:
        settings = results + ([current] if current is not None and current not in results else [])
        with open(path, "w") as f:
            json.dump({**report, "settings": settings}, f, indent=2)


def print_table(report):
    head = ("setting", "variant", "fwd+bwd ms", "peak GiB", "loss rel", "l1 rel", "grad_h rel", "grad_W2 rel",
            "first s")
    lines = []
    for s in report["settings"]:
        if "error" in s:
            lines.append((s["setting"], "-", "error: " + s["error"], "", "", "", "", "", ""))
            continue
        for v in s["variants"]:
            if "error" in v:
                lines.append((s["setting"], v["variant"], "error: " + v["error"][:80], "", "", "", "", "", ""))
                continue
            acc = v["accuracy_vs_fp32"]
            rel = lambda k: f"{acc[k]['max_rel']:.1e}" if k in acc else "-"  # noqa: E731
            peak = f"{v['peak_extra_gib']:.2f}" if "peak_extra_gib" in v else "-"
            lines.append((s["setting"], v["variant"], f"{v['ms']:.2f}", peak, rel("loss"), rel("l1"),
                          rel("grad_hidden"), rel("grad_markov_weight"), f"{v['first_call_s']:.1f}"))  # fmt: skip
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    fmt = lambda row: "| " + " | ".join(str(x).ljust(w) for x, w in zip(row, widths)) + " |"  # noqa: E731
    print(f"\n{report['device']}, torch {report['torch']}, triton {report['triton']}, {report['dtype']}; "
          "accuracy: max |diff| / max |reference| on the checked rows vs fp32")  # fmt: skip
    print(fmt(head))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in lines:
        print(fmt(row))


if __name__ == "__main__":
    sys.exit(main())
