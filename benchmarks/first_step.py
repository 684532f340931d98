"""Time to the first training step from a cold process, the wait a user has before training starts.

    python benchmarks/first_step.py --target TARGET --data DATA/smollm2-135m-instruct.jsonl.gz \
        --packages this=src before=OLD/src --runs 2 --output first_step.json
    python benchmarks/first_step.py --smoke --data DATA/smollm2-135m-instruct.jsonl.gz --output /tmp/fs.json  # CPU

Each run starts `examples/train_dspark.py` afresh for `--max_steps` steps with an empty torch.compile / Triton cache
(a user's first run on a machine) and reads, from the run's log, the seconds from the process's start to train()
(`startup_s`, with its phases: imports, target, data, draft, trainer) and from train() to the end of step 1
(`first_step_s`, the compilation of the step's graphs in it). The first run (role `tokenizes`) fills the `datasets`
cache with the tokenized conversations where it is empty (its `data` phase tells whether it did); the runs after it
read them from there, as a user's next run does. `--packages
NAME=SRC` times package sources against each other (a checkout of an earlier commit's `src/`), alternating within
each round so drift on the machine falls on both; `--warm` adds one run per package with the compile cache its last
run filled (a user's next run). Prints a table and writes JSON with the commands and hardware.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _bench_common import add_packages_arg, hardware, package_env, packages_of, write_report  # noqa: E402
from ablations import step_rate  # noqa: E402

EXAMPLE = HERE.parent / "examples" / "train_dspark.py"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default=None, help="target model folder (default: the package's default target)")
    p.add_argument("--data", nargs="+", required=True, help="conversations (JSONL(.gz)) the target's tokenizer renders")
    add_packages_arg(p)
    p.add_argument("--runs", type=int, default=2, help="cold runs per package after the first, tokenizing run")
    p.add_argument("--warm", action=argparse.BooleanOptionalAction, default=True,
                   help="one more run per package with the compile cache its last run filled")
    p.add_argument("--max_steps", type=int, default=3)
    p.add_argument("--work_dir", default=None, help="runs' folders and compile caches (default: a temporary folder)")
    p.add_argument("--output", default=None, help="JSON result file")
    p.add_argument("--smoke", action="store_true", help="tiny CPU runs (checks the script, not the timing)")
    p.add_argument("train_flags", nargs="*", help="more flags for examples/train_dspark.py (after --)")
    return p.parse_args(argv)


def run_command(args, output_dir: Path) -> list[str]:
    cmd = [sys.executable, str(EXAMPLE), "--train_file", *args.data, "--output_dir", str(output_dir),
           "--max_steps", str(args.max_steps), "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
           "--disable_tqdm", "true"]  # fmt: skip
    if args.target:
        cmd += ["--target_model", args.target]
    if args.smoke:
        cmd += ["--use_cpu", "true", "--per_device_train_batch_size", "1", "--max_length", "128", "--block_size", "4",
                "--num_anchors", "16"]  # fmt: skip
    return cmd + list(args.train_flags)


def timed_run(args, name: str, src: str, cache: Path, work: Path, role: str) -> dict:
    """One fresh process of the training example with `src` first on PYTHONPATH and `cache` as its compile cache."""
    folder = work / f"{name}_{role}"
    env = package_env(src)
    env["TORCHINDUCTOR_CACHE_DIR"], env["TRITON_CACHE_DIR"] = str(cache / "inductor"), str(cache / "triton")
    start = time.monotonic()
    with open(work / f"{name}_{role}.log", "w") as log:
        code = subprocess.run(run_command(args, folder), stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    rate = step_rate(folder)
    row = {"package": name, "role": role, "returncode": code, "wall_s": round(time.monotonic() - start, 1),
           "startup_s": rate["startup_s"], "first_step_s": rate["first_step_s"],
           "startup_phases": rate["startup_phases"]}  # fmt: skip
    if code != 0 or rate["startup_s"] is None or rate["first_step_s"] is None:
        raise SystemExit(f"run {name} {role} failed (rc {code}): see {work / f'{name}_{role}.log'}")
    row["to_first_step_s"] = round(rate["startup_s"] + rate["first_step_s"], 1)
    print(f"{name:>10} {role:>14}  startup {row['startup_s']:5.1f} s  first step {row['first_step_s']:5.1f} s  "
          f"total {row['to_first_step_s']:5.1f} s", flush=True)
    return row


def main(argv=None) -> dict:
    args = parse_args(argv)
    packages = packages_of(args.packages)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="first_step_"))
    work.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "time to the first training step from a cold process",
        "command": "python " + " ".join(sys.argv),
        "run_command": " ".join(run_command(args, Path("RUN"))),
        "packages": packages,
        "hardware": hardware("cuda" if torch.cuda.is_available() and not args.smoke else "cpu"),
        "runs": [],
    }
    names = list(packages)
    plan = [(names[0], work / "cache_tokenize", "tokenizes")]
    for r in range(args.runs):
        plan += [(name, work / f"cache_{name}_{r}", f"cold{r + 1}") for name in (names if r % 2 == 0 else names[::-1])]
    if args.warm:  # each package again with the compile cache its last run filled (a package that ran)
        last = {name: cache for name, cache, _ in plan}
        plan += [(name, last[name], "warm") for name in names if name in last]
    for name, cache, role in plan:
        report["runs"].append(timed_run(args, name, packages[name], cache, work, role))
        write_report(report, args.output)  # after every run: a run cut short keeps the rows before it
    report["summary"] = {}
    for name in names:
        rows = [row for row in report["runs"] if row["package"] == name]
        cold = [row["to_first_step_s"] for row in rows if row["role"].startswith("cold")]
        warm = [row["to_first_step_s"] for row in rows if row["role"] == "warm"]
        report["summary"][name] = {"cold_median_s": statistics.median(cold) if cold else None,
                                   "warm_s": warm[0] if warm else None}  # fmt: skip
    write_report(report, args.output)
    print("\n| package | cold runs: process start to end of step 1 (median) | with its compile cache |")
    print("|---|---|---|")
    for name, s in report["summary"].items():
        cold = f"{s['cold_median_s']:.1f} s" if s["cold_median_s"] is not None else "-"
        warm = f"{s['warm_s']:.1f} s" if s["warm_s"] is not None else "-"
        print(f"| {name} | {cold} | {warm} |")
    return report


if __name__ == "__main__":
    main()
