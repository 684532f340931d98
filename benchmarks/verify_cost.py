"""The cost of verifying one sampled block (`verify_block`), with block verification's spare-mass pass fused (one
Triton kernel) and as the PyTorch expression (four kernels), each run eagerly and replayed from a CUDA graph.

    python benchmarks/verify_cost.py --rows 16 --slots 7 --vocab 49152 --output verify_cost.json
    python benchmarks/verify_cost.py --device cpu --smoke                  # checks the script, not the speed

Cases: `verify_block(method="block")`, `verify_block(method="token")` (it never computes the spare mass: its two
rows differ by noise alone) and the spare pass alone as `_block_prefix` calls it (weight, p and q sliced to slots
1..n-1 in place), each with `spare_mass.DEFAULT_BACKEND` set to "triton" (fused; on CPU "auto", i.e. PyTorch) and
to "torch". Inputs are random: target logits, a draft distribution near the target's, draft tokens drawn from it,
every row verifying all slots. Eager calls include their launches, as an uncaptured round pays them; a graph
(captured after warm-up runs on a side stream, `cuda_graphs.capture`) replays the same kernels as the decoding
round's graph does. Each time is the median of `--repeats` calls timed one by one with CUDA events (perf_counter
on CPU) after `--warmup` untimed ones, with the L2 cache flushed before each (`--l2_flush_mb`). Writes JSON
(command, hardware, settings, rows, the fused sums' deviation from the PyTorch expression); prints a markdown table
last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import hardware  # noqa: E402

from hf_dspark.generation import spare_mass as spare_module  # noqa: E402
from hf_dspark.generation.rejection import verify_block  # noqa: E402

CASES = ("verify block", "verify token", "spare pass")
SPARE = ("fused", "torch")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", type=int, default=16, help="rows verified at once (the batch)")
    p.add_argument("--slots", type=int, default=7, help="draft slots a row verifies (the block)")
    p.add_argument("--vocab", type=int, default=49152, help="vocabulary (SmolLM2's by default)")
    p.add_argument("--repeats", type=int, default=500, help="timed calls per case")
    p.add_argument("--warmup", type=int, default=20, help="untimed calls per case first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--l2_flush_mb", type=int, default=256, help="CUDA: bytes zeroed between timed calls (0: none)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, at most 3 repeats")
    p.add_argument("--output", default=None, help="write the JSON report here")
    return p.parse_args(argv)


@contextlib.contextmanager
def spare_backend(name: str):
    """verify_block's spare-mass backend while inside (`spare_mass.DEFAULT_BACKEND`)."""
    before = spare_module.DEFAULT_BACKEND
    spare_module.DEFAULT_BACKEND = name
    try:
        yield
    finally:
        spare_module.DEFAULT_BACKEND = before


def make_inputs(args, device: torch.device) -> dict:
    """Random verification inputs: float32 target logits [R, n+1, V], draft probabilities [R, n, V] near the
    target's, draft tokens drawn from them, every row verifying all n slots; p and a weight for the spare pass."""
    rows, n, vocab = args.rows, args.slots, args.vocab
    gen = torch.Generator(device).manual_seed(args.seed)
    scores = 3 * torch.randn(rows, n + 1, vocab, generator=gen, device=device)
    probs = torch.softmax(scores[:, :n] + torch.randn(rows, n, vocab, generator=gen, device=device), dim=-1)
    drafts = torch.multinomial(probs.reshape(-1, vocab), 1, generator=gen).view(rows, n)
    weight = torch.rand(rows, n + 1, generator=gen, device=device)
    weight[:, 0] = 1.0  # w_0
    return {"scores": scores, "probs": probs, "drafts": drafts, "caps": torch.full((rows,), n, device=device),
            "p": torch.softmax(scores, dim=-1), "weight": weight}  # fmt: skip


def case_fn(case: str, x: dict, n: int):
    """The call a case times (the spare backend is read at call time, or at capture)."""
    if case == "spare pass":  # as _block_prefix slices them: slots 1..n-1, no copies
        return lambda: spare_module.spare_mass(x["weight"][:, 1:n], x["p"][:, 1:n], x["probs"][:, 1:n])
    method = case.split()[1]
    return lambda: verify_block(x["scores"], x["drafts"], x["probs"], x["caps"], do_sample=True, method=method)


def timed(run, repeats: int, warmup: int, cuda: bool, flush: torch.Tensor | None = None) -> list[float]:
    """Milliseconds of each of `repeats` calls of `run` after `warmup` untimed ones; `flush` (CUDA) is zeroed before
    each call, outside its timing, so inputs come from memory as after a round's target forward, not from L2."""
    for _ in range(warmup):
        run()
    if not cuda:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(1e3 * (time.perf_counter() - start))
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    torch.cuda.synchronize()
    for start, end in events:
        if flush is not None:
            flush.zero_()
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def summary(times: list[float]) -> dict:
    ordered = sorted(times)
    pick = lambda f: ordered[min(len(ordered) - 1, int(f * len(ordered)))]  # noqa: E731
    return {"ms_median": statistics.median(times), "ms_p10": pick(0.1), "ms_p90": pick(0.9), "repeats": len(times)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.smoke:
        args.rows, args.slots, args.vocab = 4, 3, 300
        args.repeats, args.warmup = min(args.repeats, 3), min(args.warmup, 1)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    x = make_inputs(args, device)
    n = args.slots
    flush = torch.empty(args.l2_flush_mb << 20, dtype=torch.int8, device=device) if cuda and args.l2_flush_mb else None
    # Fused: the kernel itself on CUDA (an error, not a silent fallback, if it cannot run); on CPU what "auto" gives.
    backends = {"fused": "triton" if cuda else "auto", "torch": "torch"}
    spare_args = (x["weight"][:, 1:n], x["p"][:, 1:n], x["probs"][:, 1:n])
    fused_ran = spare_module.resolve_backend(*spare_args, backends["fused"])
    auto = spare_module.resolve_backend(*spare_args, "auto")  # what verify_block runs by default
    fused = spare_module.spare_mass(*spare_args, backend=backends["fused"])
    reference = spare_module.torch_spare_mass(*spare_args)
    deviation = (fused - reference).abs()
    relative = deviation / reference.abs().clamp_min(1e-30)
    accuracy = {k: v.max().item() if v.numel() else 0.0 for k, v in (("max_abs", deviation), ("max_rel", relative))}
    spare_bytes = 2 * spare_args[1].numel() * spare_args[1].element_size()  # p and q, read once
    rows = []
    for case in CASES:
        for spare in SPARE:
            row = {"case": case, "spare": spare, "backend": fused_ran if spare == "fused" else "torch"}
            with spare_backend(backends[spare]):
                fn = case_fn(case, x, n)
                row["eager"] = summary(timed(fn, args.repeats, args.warmup, cuda, flush))
                if cuda:
                    from hf_dspark.generation.cuda_graphs import capture

                    graph, _ = capture(fn)
                    row["graph"] = summary(timed(graph.replay, args.repeats, args.warmup, cuda, flush))
            if case == "spare pass":
                best = row.get("graph", row["eager"])["ms_median"]
                row["read_gb_per_s"] = spare_bytes / best / 1e6  # p and q once, at the graph's (else eager) time
            rows.append(row)
    report = {
        "benchmark": "verify_cost",
        "command": "verify_cost.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "hardware": hardware(device),
        "settings": {k: v for k, v in vars(args).items() if k != "output"},
        "fused_backend": fused_ran,
        "auto_backend": auto,
        "spare_bytes_read": spare_bytes,
        "fused_vs_torch_spare": accuracy,
        "rows": rows,
    }
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1))
    print(f"fused spare pass ({fused_ran}) vs the PyTorch expression: max abs diff {accuracy['max_abs']:.3g}, "
          f"max rel {accuracy['max_rel']:.3g}")  # fmt: skip
    ms = lambda r, mode: f"{r[mode]['ms_median']:.4f}" if mode in r else "-"  # noqa: E731
    print(f"| case (R {args.rows}, n {n}, V {args.vocab}) | spare pass | backend | eager ms | CUDA graph ms |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['spare']} | {r['backend']} | {ms(r, 'eager')} | {ms(r, 'graph')} |")
    return report


if __name__ == "__main__":
    main()
