"""Recipe ablations for a draft: each variant is one short training run with the same data order and wall-clock
budget (its schedule fitted to the budget), logging held-out τ during training; the runs are spread over the GPUs
given, `--runs_per_gpu` at a time on each.

    python benchmarks/ablations.py --target TARGET_DIR --data 'DATA/*.jsonl.gz' --output_dir ablations \\
        --minutes 4 --gpus 0 1 [--runs_per_gpu 2] [--variants baseline layers_1 qk_norm ...]

`--runs_per_gpu N` starts N at once per device. They then share its time, so compare variants of one batch of
runs with each other (same sharing), not with runs made alone. Sharing buys little for SmolLM2's recipe: its step
keeps an H200 busy (100% utilization), and four runs at once did about 1.3x the work of one run alone in total,
each at 31% of the lone speed: sharing saves machine starts, not time.

Every variant is the default recipe (`examples/train_dspark.py` with no flags) plus the flags listed in VARIANTS,
so one flag changes at a time. `--data_variant NAME=FILES` adds a variant that changes the data instead: the default
recipe trained on FILES (comma-separated files or quoted globs) in place of `--data`, e.g. answers sampled at
another temperature. Held-out rows come from each run's own data unless `--eval_file` gives every run the same
ones (e.g. the target's greedy answers to prompts like the evaluation's; `NAME=FILE` entries give several sets,
reported side by side): without it, compare data variants by decoding τ (`--eval_data`), not held-out τ.

Each run compiles into its own empty torch.compile/Triton cache (`--compile_cache per_run`), as a first run on a
machine does: with the machine's cache shared, a run finds the kernels it shares with earlier runs compiled and
trains longer in the same budget. Writes OUTPUT_DIR/ablations.json (command, hardware, per variant: flags, steps
reached, seconds in torch.compile, the held-out τ curve by step and training time) and ablations.png (held-out
τ_prob against training time), and prints a table of the last held-out τ_prob and τ_greedy. With `--eval_data`,
every variant's draft is then decoded on those prompt files by `hf-dspark eval` (T 0 and 1; the three drafters:
`--variants baseline dflash eagle3`), and the report adds each variant's τ per file and temperature; the eval's
results.md compares each with the first variant named, paired over the same prompts.

    python benchmarks/ablations.py --device cpu --smoke --output_dir /tmp/ablations   # tiny CPU check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parent / "examples" / "train_dspark.py"

# name -> flags added to the default recipe (one change each).
VARIANTS = {
    "baseline": [],
    "layers_1": ["--num_hidden_layers", "1"],
    "layers_3": ["--num_hidden_layers", "3"],
    "layers_4": ["--num_hidden_layers", "4"],
    "mlp_2x": ["--intermediate_size", "3072"],  # SmolLM2's MLP is 1536 wide
    "qk_norm": ["--use_qk_norm", "true"],
    "lr_3e-4": ["--learning_rate", "3e-4"],
    "lr_1.2e-3": ["--learning_rate", "1.2e-3"],
    "warmup_10pct": ["--warmup_steps", "0.1"],
    # A floor on the rate (the 15-minute curves flatten as the cosine ends): 0.15 τ worse greedily at 8 minutes.
    "min_lr_0.1": ["--lr_scheduler_type", "cosine_with_min_lr", "--lr_scheduler_kwargs", '{"min_lr_rate": 0.1}'],
    # DSpark's recipe samples 256 anchors and cuts final loops to 2 repeats since the 6-minute x5 ablations of
    # 2026-12-06 (anchors_256 and loops_2 then); anchors_512 and loops_whole are the defaults before.
    "anchors_128": ["--num_anchors", "128"],  # does the trend of 1,024 -> 512 -> 256 go on?
    "anchors_256": ["--num_anchors", "256"],
    "anchors_512": ["--num_anchors", "512"],
    "anchors_1024": ["--num_anchors", "1024"],
    "loops_2": ["--max_loop_repeats", "2"],
    "loops_whole": ["--max_loop_repeats", "0"],
    "sequence_normalization": ["--loss_normalization", "sequence"],
    "walk_weighting": ["--anchor_weighting", "walk"],  # anchor blocks weighted as often as decoding visits them
    # DSpark's loss mix. The default (since 2026-12-05) is the soft CE against the target's distribution with L1;
    # `soft_ce` names it explicitly (the run that made it the default used that name), the others replace it.
    "label_ce": ["--ce_loss_alpha", "0.5", "--soft_ce_loss_alpha", "0"],  # the default before: one sampled label
    "ce_0.1": ["--ce_loss_alpha", "0.1", "--l1_loss_alpha", "0.9", "--soft_ce_loss_alpha", "0"],
    "ce_only": ["--ce_loss_alpha", "1", "--l1_loss_alpha", "0", "--soft_ce_loss_alpha", "0"],
    "soft_ce": ["--ce_loss_alpha", "0", "--soft_ce_loss_alpha", "0.5"],
    "l1_1.0": ["--l1_loss_alpha", "1.0"],  # twice the weight on L1 (twice the TV distance: T = 1 acceptance itself)
    "markov_64": ["--markov_rank", "64"],
    "late_layers": ["--target_layer_ids", "8", "14", "20", "24", "28"],
    "padded_1024_random_order": ["--train_sampling_strategy", "random", "--pad_to_multiple_of", "1024"],
    # Twice the conversations a step: the GPU was idle a quarter to a third of SmolLM2's step at batch 16.
    "batch_32": ["--per_device_train_batch_size", "32"],
    # The three drafters at equal wall-clock budget (issue 13): each with its recipe defaults.
    "dflash": ["--algorithm", "dflash"],
    "eagle3": ["--algorithm", "eagle3"],
}


# Variants that became the recipe: their flags now repeat the defaults (the baseline trains the same), and they stay
# so that the commands of the results that named them still run.
NOW_DEFAULTS = ("anchors_256", "loops_2")


def variant_name(name: str) -> str:
    """A variant, or variants joined by '+' (their flags together), each known."""
    unknown = [part for part in name.split("+") if part not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown variant(s) {unknown} in {name!r}; known: {', '.join(VARIANTS)}")
    return name


def variant_flags(name: str) -> list[str]:
    return [flag for part in name.split("+") for flag in VARIANTS[part]]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default=None, help="target model folder (default: the embedded SmolLM2)")
    p.add_argument("--data", nargs="+", default=None, help="conversations (files or a quoted glob)")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), type=variant_name, metavar="NAME[+NAME]",
                   help=f"runs, each a variant or several joined by '+' (e.g. mlp_2x+soft_ce); from {list(VARIANTS)}")
    p.add_argument("--data_variant", action="append", default=[], metavar="NAME=FILES",
                   help="a variant trained on other data (comma-separated files or quoted globs), the recipe "
                   "unchanged; repeatable")  # fmt: skip
    p.add_argument("--minutes", type=float, default=4.0, help="wall-clock budget of each run (compilation included)")
    p.add_argument("--max_steps", type=int, default=None,
                   help="a fixed schedule length instead of one fitted to the budget")  # fmt: skip
    p.add_argument("--eval_steps", type=int, default=200, help="held-out τ every N steps")
    p.add_argument("--eval_rows", type=int, default=256)
    p.add_argument("--eval_file", nargs="+", default=None,
                   help="held-out conversations shared by every run (instead of rows split off each run's data)")
    p.add_argument("--gpus", nargs="+", default=["0"], help="CUDA devices")
    p.add_argument("--runs_per_gpu", type=int, default=1, help="concurrent runs per device (they share it)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--smoke", action="store_true", help="tiny runs on CPU (checks the driver, not the recipe)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile_cache", default="per_run", choices=["per_run", "shared"],
                   help="per_run (default): each run compiles into its own empty torch.compile/Triton cache, as a "
                   "first run on a machine does, so no run's budget depends on the runs before it; shared: the "
                   "machine's cache (later runs reuse the kernels of earlier ones and spend less of their budget "
                   "compiling)")  # fmt: skip
    p.add_argument("--eval_data", nargs="+", default=None, metavar="FILE",
                   help='after the runs, `hf-dspark eval` of every variant\'s draft on these {"turns": [...]} prompt '
                   "files (T 0 and 1): decoding τ side by side, in OUTPUT_DIR/eval and the report")
    p.add_argument("--eval_prompts", type=int, default=16, help="prompts per file for --eval_data")
    p.add_argument("--eval_max_new_tokens", type=int, default=256)
    p.add_argument("--eval_batch_size", type=int, default=16)
    p.add_argument("--eval_baselines", choices=["both", "static"], default="both",
                   help="target-alone baselines of the decoding eval: eager and static cache (both), or the static "
                   "cache only (static: hf-dspark eval --eager_baseline false, the eager target being its slowest "
                   "part on a GPU)")  # fmt: skip
    return p.parse_args(argv)


def data_variants(specs: list[str]) -> dict[str, list[str]]:
    """`--data_variant NAME=FILES` values -> {NAME: ["--train_file", file, ...]} (flags that replace --data)."""
    out: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, files = spec.partition("=")
        paths = [f for f in files.split(",") if f]
        if not sep or not name or not paths:
            raise SystemExit(f"--data_variant expects NAME=FILE[,FILE...], got {spec!r}")
        if name in VARIANTS or name in out:
            raise SystemExit(f"--data_variant name {name!r} is already a variant: pick another")
        out[name] = ["--train_file", *paths]
    return out


def run_env(args, name: str, device: str, cache_root: Path) -> dict[str, str]:
    """A run's environment: its GPU, and with `--compile_cache per_run` its own empty compile caches. On one H200 a
    2-layer SmolLM2 draft spent 70.8 s of a 212 s budget compiling into an empty cache and 8.7-17.5 s for the
    drafters run after it, which found most kernels cached: with a shared cache the run order decides steps."""
    env = dict(os.environ)
    if args.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = device
    if args.compile_cache == "per_run":
        folder = cache_root / name
        env["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor")
        env["TRITON_CACHE_DIR"] = str(folder / "triton")
    return env


def run_command(args, name: str, flags: list[str]) -> list[str]:
    out = Path(args.output_dir) / name
    # Without --max_steps the schedule is fitted to the budget (a large cap); with it, a fixed schedule.
    schedule = ["--max_steps", str(args.max_steps), "--fit_schedule_to_budget", "false"] if args.max_steps else [
        "--max_steps", "1000000"]
    cmd = [sys.executable, str(EXAMPLE), "--train_file", *args.data, "--output_dir", str(out), *schedule,
           "--max_train_minutes", str(args.minutes), "--save_strategy", "no",
           "--eval_strategy", "steps", "--eval_steps", str(args.eval_steps), "--eval_rows", str(args.eval_rows),
           "--logging_steps", str(args.eval_steps), "--report_to", "none",
           "--disable_tqdm", "True", "--seed", str(args.seed)]  # fmt: skip
    if args.target:
        cmd += ["--target_model", args.target]
    if args.eval_file:
        cmd += ["--eval_file", *args.eval_file]
    if args.smoke:
        cmd += ["--use_cpu", "true", "--per_device_train_batch_size", "2", "--max_length", "128", "--block_size", "4",
                "--per_device_eval_batch_size", "2"]  # fmt: skip
        if "eagle3" not in flags:  # Eagle3 trains on every position: it has no anchors
            cmd += ["--num_anchors", "128"]  # every position of these short rows: the walked τ covers them all
    return cmd + flags  # the variant's flags last: they win over the settings above


def log_history(folder: Path) -> list[dict]:
    """The run's log (written by examples/train_dspark.py as trainer_state.json); empty before it exists."""
    state = folder / "trainer_state.json"
    return json.loads(state.read_text()).get("log_history", []) if state.exists() else []


HELD_OUT_METRICS = ("tau_prob", "tau_greedy", "tau_walk_prob", "tau_walk_greedy", "_loss")


def curve(folder: Path) -> list[dict]:
    """Held-out τ by step from the run's log: eval_tau_prob / eval_tau_greedy (and their decoding walks,
    eval_tau_walk_*) / eval_loss, or eval_NAME_* for each named held-out set (--eval_file NAME=FILE; transformers
    logs each set apart), merged per step."""
    points: dict[int, dict] = {}
    for h in log_history(folder):
        found = {k: v for k, v in h.items() if k.startswith("eval_") and k.endswith(HELD_OUT_METRICS)}
        if any(k.endswith("tau_prob") for k in found):
            point = points.setdefault(h["step"], {"step": h["step"]})
            point.update(found)
            if "elapsed_s" in h:
                point.setdefault("elapsed_s", h["elapsed_s"])  # the first set's: its evaluation began then
    return list(points.values())


def held_out_sets(point: dict) -> list[str]:
    """Metric prefixes of a curve point's held-out sets: ["eval_"], or ["eval_NAME_", ...]."""
    return sorted(k[: -len("tau_prob")] for k in point if k.endswith("tau_prob"))


def step_rate(folder: Path) -> dict:
    """Training speed from the run's log: when the first training log came (compilation included), the median
    seconds a step between training logs, each interval starting after that step's evaluation (not counting it),
    and the seconds the run spent in torch.compile by its last log."""
    history = log_history(folder)
    ends: dict[int, float] = {}  # step -> the last elapsed_s logged at it (after its evaluation, if any)
    for h in history:
        if "elapsed_s" in h:
            ends[h["step"]] = max(ends.get(h["step"], 0.0), h["elapsed_s"])
    train = [(h["step"], h["elapsed_s"]) for h in history if "loss" in h and "elapsed_s" in h]
    rates = [(e1 - ends[s0]) / (s1 - s0) for (s0, _), (s1, e1) in zip(train, train[1:]) if s1 > s0]
    compiled = [h["compile_s"] for h in history if "compile_s" in h]
    summary = next((h for h in history if "train_runtime" in h), {})
    return {
        "first_log": {"step": train[0][0], "elapsed_s": train[0][1]} if train else None,
        "seconds_per_step": statistics.median(rates) if rates else None,
        "compile_s": compiled[-1] if compiled else None,
        # The wait for the first step: the process's start to train(), then train() to the end of step 1.
        "startup_s": summary.get("startup_s"),
        "first_step_s": summary.get("first_step_s"),
        # where the wait before train() went (train_draft's phases: process start and imports, target, data, ...)
        "startup_phases": {k[len("startup_"):-2]: v for k, v in summary.items()
                           if k.startswith("startup_") and k.endswith("_s") and k != "startup_s"},  # fmt: skip
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.smoke:
        args.device, args.minutes, args.max_steps, args.eval_steps, args.eval_rows = "cpu", 0.5, 4, 2, 4
        args.variants = args.variants if len(args.variants) < len(VARIANTS) else ["baseline", "sequence_normalization"]
        if args.data is None:
            raise SystemExit("--smoke still needs --data (a conversations file the target's tokenizer can render)")
    if args.data is None:
        raise SystemExit("--data is required: the target's own answers (JSONL(.gz) conversations)")
    flags_of = {name: variant_flags(name) for name in args.variants} | data_variants(args.data_variant)
    for name in args.variants:
        if name in NOW_DEFAULTS:
            print(f"note: {name} is the recipe now; it trains what baseline trains", flush=True)
    root = Path(args.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    pending = list(flags_of)
    running: dict[str, tuple[str, subprocess.Popen, float]] = {}
    if args.runs_per_gpu < 1:
        raise SystemExit(f"--runs_per_gpu must be >= 1, got {args.runs_per_gpu}")
    free = list(args.gpus if args.device == "cuda" else ["cpu"]) * args.runs_per_gpu
    results = {}
    # Per-run caches live in a scratch folder removed at the end (compiled kernels are not results).
    cache_root = Path(tempfile.mkdtemp(prefix="compile_caches_", dir=root))
    while pending or running:
        while pending and free:
            name, gpu = pending.pop(0), free.pop(0)
            env = run_env(args, name, gpu, cache_root)
            log = open(root / f"{name}.log", "w")
            cmd = run_command(args, name, flags_of[name])
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            running[name] = (gpu, proc, time.monotonic())
            print(f"started {name} on {gpu}", flush=True)
        time.sleep(2)
        for name, (gpu, proc, start) in list(running.items()):
            if proc.poll() is None:
                continue
            del running[name]
            free.append(gpu)
            points = curve(root / name)
            results[name] = {"flags": flags_of[name], "returncode": proc.returncode,
                             "wall_s": time.monotonic() - start, "held_out": points, **step_rate(root / name)}  # fmt: skip
            print(f"finished {name} (rc {proc.returncode}): {points[-1] if points else 'no evaluation'}", flush=True)
    shutil.rmtree(cache_root, ignore_errors=True)
    report = {
        "benchmark": "ablations",
        "command": "python " + " ".join(sys.argv),
        "hardware": _hardware(args.device),
        "minutes_per_run": args.minutes,
        "runs_per_gpu": args.runs_per_gpu,
        "compile_cache": args.compile_cache,
        "variants": results,
    }
    if args.eval_data:
        report["decoding_eval"] = decoding_eval(args, root, results, list(flags_of))
    (root / "ablations.json").write_text(json.dumps(report, indent=2))
    plot_curves(results, root / "ablations.png")
    # The walked values count rounds as decoding runs them (the all-anchor means overstate decoding on loops).
    decoded = report.get("decoding_eval", {}).get("mean_tau", {})
    print("| variant | flags | last step | s/step | compile s | first step at s | held-out τ_prob / τ_greedy "
          "| walked as decoding, prob / greedy | decoded mean τ, T 0 / 1 |\n" + "|---" * 9 + "|")
    nan = float("nan")
    for name, r in results.items():
        last = r["held_out"][-1] if r["held_out"] else {}
        rate = f"{r['seconds_per_step']:.3f}" if r.get("seconds_per_step") else "-"
        compiled = f"{r['compile_s']:.1f}" if r.get("compile_s") is not None else "-"
        waits = [r.get("startup_s"), r.get("first_step_s")]
        first = f"{sum(waits):.1f} ({waits[0]:.1f} + {waits[1]:.1f})" if None not in waits else "-"
        label = lambda p: p[5:-1] + ": " if p != "eval_" else ""  # noqa: E731
        tau = "; ".join(f"{label(p)}{last[p + 'tau_prob']:.3f} / {last.get(p + 'tau_greedy', nan):.3f}"
                        for p in held_out_sets(last)) or "-"  # fmt: skip
        walked = "; ".join(f"{label(p)}{last.get(p + 'tau_walk_prob', nan):.3f} / "
                           f"{last.get(p + 'tau_walk_greedy', nan):.3f}" for p in held_out_sets(last)) or "-"  # fmt: skip
        means = decoded.get(name, {})
        mean = " / ".join(f"{means[t]:.2f}" if t in means else "-" for t in ("T0", "T1")) if means else "-"
        print(f"| {name} | {' '.join(r['flags']) or '(defaults)'} | {last.get('step', '-')} | {rate} | {compiled} | "
              f"{first} | {tau} | {walked} | {mean} |")
    return report


def decoding_eval(args, root: Path, results: dict, flags_order: list[str]) -> dict:
    """`hf-dspark eval` of every finished variant's draft in one process (the target loaded once, the same prompts
    and seeds for all): {"command", "returncode", "tau": {variant: {dataset@T: τ}}}."""
    # In the order asked for (runs finish in any order): the first is the one results.md compares the others with.
    order = [name for name in flags_order if name in results]
    drafts = [f"{name}={root / name}" for name in order if results[name]["returncode"] == 0 and (root / name).is_dir()]
    if not drafts:
        return {"returncode": None, "note": "no finished draft to evaluate"}
    out = root / "eval"
    cmd = [sys.executable, "-m", "hf_dspark.cli", "eval", "--draft", *drafts, "--data", *args.eval_data,
           "--output_dir", str(out), "--num_prompts", str(args.eval_prompts), "--max_new_tokens",
           str(args.eval_max_new_tokens), "--batch_size", str(args.eval_batch_size), "--temperature", "0", "1",
           "--seed", str(args.seed), "--no_progress", "--no_plots"]  # fmt: skip
    if args.target:
        cmd += ["--target", args.target]
    if args.device == "cpu":
        cmd += ["--device", "cpu"]
    if args.eval_baselines == "static":
        cmd += ["--static_baseline", "true", "--eager_baseline", "false"]
    with open(root / "eval.log", "w") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    tau: dict = {}
    if code == 0:
        for row in json.loads((out / "results.json").read_text())["results"]:
            tau.setdefault(row["drafter"], {})[f"{row['dataset']}@T{row['temperature']:g}"] = row["tau"]
    print(f"decoding eval (rc {code}): " + "; ".join(f"{k}: {v}" for k, v in tau.items()), flush=True)
    return {"command": " ".join(cmd[1:]), "returncode": code, "tau": tau, "mean_tau": decoded_mean_tau(tau)}


def decoded_mean_tau(tau: dict) -> dict:
    """{variant: {"dataset@T0": τ, ...}} -> {variant: {"T0": mean over the datasets, ...}} (the README's means)."""
    means: dict = {}
    for name, cells in tau.items():
        by_t: dict = {}
        for key, value in cells.items():
            by_t.setdefault(key.rpartition("@")[2], []).append(value)
        means[name] = {t: sum(v) / len(v) for t, v in by_t.items()}
    return means


def plot_curves(results: dict, path: Path) -> None:
    """Held-out τ_prob against training time (seconds since each run's train() began), one line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in results.items():
        points = [p for p in r["held_out"] if "elapsed_s" in p]
        for style, prefix in zip(("-", "--", ":", "-."), held_out_sets(points[-1]) if points else []):
            label = name if prefix == "eval_" else f"{name} ({prefix[5:-1]})"
            ax.plot([p["elapsed_s"] for p in points], [p.get(prefix + "tau_prob") for p in points], style, marker="o",
                    label=label)  # fmt: skip
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("held-out τ_prob")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _hardware(device: str) -> dict:
    sys.path.insert(0, str(HERE))
    from _bench_common import hardware

    return hardware(device)


if __name__ == "__main__":
    main()
