"""Compare `hf-dspark eval` runs of the same prompts and settings that differ in one decoding option.

Each run is LABEL=PATH (an eval's results.json or its output folder); the first is the reference. For every
temperature the runs share, the script reports, per run: mean τ, the paired difference in mean τ against the reference (bootstrap
over the same prompts, `hf_dspark.metrics.tau_difference_interval`), verification rounds, *batch rounds* (a batch
steps until its slowest row is done, so its wall time follows the most rounds any of its rows needed, summed over
batches), milliseconds per batch round after the prefill, and tokens per second. More τ shortens the run only as
far as it shortens the slowest rows, and only if a round does not cost more: the last two columns tell which.

    python benchmarks/compare_evals.py token=runs/token block=runs/block --json results/compare.json

Drafts decoded side by side in one eval (same prompts, same per-batch seeds) pair the same way: name the run once
per draft and pick each one's drafter in order,

    python benchmarks/compare_evals.py base=runs/eval walk=runs/eval --drafter baseline walk_weighting
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from hf_dspark.evaluation.report import per_prompt_counts
from hf_dspark.metrics import tau_difference_interval

# Settings that must agree for the per-prompt counts of two runs to pair up. Temperatures need not: a batch's seed
# is seed + its index within its dataset whatever the temperatures, so the ones all runs hold pair up.
PAIRED_SETTINGS = ("datasets", "num_prompts", "max_new_tokens", "top_k", "top_p", "batch_size", "seed")


def load_run(spec: str) -> tuple[str, dict]:
    label, sep, path = spec.partition("=")
    if not sep or not label or not path:
        raise ValueError(f"run {spec!r} is not LABEL=PATH (an eval's results.json or its output folder)")
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: pass an `hf-dspark eval` output folder or its results.json")
    return label, json.loads(path.read_text())


def check_paired(runs: dict[str, dict]) -> None:
    (first, reference), *others = runs.items()
    for label, run in others:
        for key in PAIRED_SETTINGS:
            a, b = reference["settings"].get(key), run["settings"].get(key)
            if key == "datasets":  # the same sets by name; the files may sit in other folders
                a, b = sorted(a or {}), sorted(b or {})
            if a != b:
                raise ValueError(f"runs {first!r} and {label!r} differ in {key} ({a} vs {b}): their prompts do not "
                                 "pair up; rerun one with the other's settings")  # fmt: skip
    if not shared_temperatures(runs):
        temps = {label: run["settings"].get("temperatures") for label, run in runs.items()}
        raise ValueError(f"the runs share no temperature ({temps}): rerun one at a temperature of the other")


def shared_temperatures(runs: dict[str, dict]) -> list[float]:
    """The temperatures every run decoded, in the reference's order."""
    first, *others = (run["settings"].get("temperatures") or [] for run in runs.values())
    return [t for t in first if all(t in temps for temps in others)]


def batch_rounds(rounds: list[int], batch_size: int) -> int:
    """Rounds a run of consecutive batches takes: each batch's slowest row (the eval batches prompts in order)."""
    return sum(max(rounds[i : i + batch_size]) for i in range(0, len(rounds), batch_size))


def draft_rows(run: dict, drafter: str | None) -> list[dict]:
    names = sorted({row["drafter"] for row in run["results"]})
    if drafter is None and len(names) > 1:
        raise ValueError(f"the run holds drafters {names}: pick one with --drafter")
    drafter = drafter or names[0]
    rows = [row for row in run["results"] if row["drafter"] == drafter]
    if not rows:
        raise ValueError(f"no rows for drafter {drafter!r}; the run holds {names}")
    missing = [row["dataset"] for row in rows if not per_prompt_counts(row)]
    if missing:
        raise ValueError(f"rows of {missing} carry no per-prompt counts (tau_by_request): rerun with today's eval")
    return rows


def summarize(rows: list[dict], batch_size: int) -> dict:
    by_dataset = {r["dataset"]: {"tau": r["tau"], "rounds": r["rounds"], "tokens_per_s": r["tokens_per_s"],
                                 "batch_rounds": batch_rounds(per_prompt_counts(r)[0], batch_size)}
                  for r in rows}  # fmt: skip
    steps = sum(d["batch_rounds"] for d in by_dataset.values())
    wall = sum(r["wall_time_s"] for r in rows)
    decode = wall - sum(r.get("prefill_time_s") or 0.0 for r in rows)
    return {
        "mean_tau": sum(r["tau"] for r in rows) / len(rows),  # over datasets, as the eval's table
        "rounds": sum(r["rounds"] for r in rows),
        "batch_rounds": steps,
        "ms_per_batch_round": 1000 * decode / steps,
        "tokens_per_s": sum(r["new_tokens"] for r in rows) / wall,
        "by_dataset": by_dataset,
    }


def compare(runs: dict[str, dict], drafter: str | list[str] | None = None) -> dict:
    """drafter: the one to compare in every run (None: each run's only one), or a list with one per run."""
    check_paired(runs)
    reference = next(iter(runs))
    batch_size = runs[reference]["settings"]["batch_size"]
    drafters = drafter if isinstance(drafter, list) else [drafter] * len(runs)
    if len(drafters) != len(runs):
        raise ValueError(f"--drafter takes one name for every run or one per run: got {len(drafters)} for "
                         f"{len(runs)} runs")  # fmt: skip
    rows = {label: draft_rows(run, name) for (label, run), name in zip(runs.items(), drafters)}
    out = {}
    for temp in shared_temperatures(runs):
        at = {label: sorted((r for r in rs if r["temperature"] == temp), key=lambda r: r["dataset"])
              for label, rs in rows.items()}  # fmt: skip
        table = {label: summarize(rs, batch_size) for label, rs in at.items()}
        for label, rs in at.items():
            if label == reference:
                continue
            pairs = [(per_prompt_counts(a), per_prompt_counts(b)) for a, b in zip(rs, at[reference])]
            table[label]["tau_vs_reference"] = tau_difference_interval(pairs)
            for key in ("mean_tau", "batch_rounds", "ms_per_batch_round", "tokens_per_s"):
                table[label][f"{key}_ratio"] = table[label][key] / table[reference][key]
        out[f"{temp:g}"] = table
    return out


def print_table(result: dict) -> None:
    for temp, table in result.items():
        print(f"\nT = {temp}")
        head = ["run", "mean τ", "Δτ (95%)", "rounds", "batch rounds", "ms/batch round", "tokens/s"]
        print(" | ".join(head))
        print(" | ".join("---" for _ in head))
        for label, row in table.items():
            paired = row.get("tau_vs_reference")
            delta = "–"
            if paired:
                delta = f"{paired['difference']:+.3f} ({paired['ci95'][0]:+.3f} to {paired['ci95'][1]:+.3f})"
            print(f"{label} | {row['mean_tau']:.3f} | {delta} | {row['rounds']} | {row['batch_rounds']} | "
                  f"{row['ms_per_batch_round']:.3f} | {row['tokens_per_s']:.0f}")  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", metavar="LABEL=PATH", help="eval runs; the first is the reference")
    p.add_argument("--drafter", nargs="+", default=None, metavar="NAME",
                   help="the drafter to compare when a run holds several: one for every run, or one per run in order")
    p.add_argument("--json", default=None, help="write the comparison here")
    args = p.parse_args(argv)
    if len(args.runs) < 2:
        p.error("give at least two runs to compare")
    runs = dict(load_run(spec) for spec in args.runs)
    if len(runs) < len(args.runs):
        p.error("run labels must differ")
    result = compare(runs, args.drafter[0] if args.drafter and len(args.drafter) == 1 else args.drafter)
    print_table(result)
    if args.json:
        first = next(iter(runs.values()))
        record = {
            "benchmark": "compare_evals",
            "command": "compare_evals.py " + " ".join(map(shlex.quote, argv if argv is not None else sys.argv[1:])),
            "hardware": first.get("hardware"),
            "runs": {label: {"command": run.get("command"), "generate_kwargs": run["settings"].get("generate_kwargs")}
                     for label, run in runs.items()},  # fmt: skip
            "drafter": args.drafter,
            "temperatures": result,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
