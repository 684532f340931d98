"""Where two drafters' acceptance differs: the first slot, or the slots after it, and what that is worth at
higher acceptance.

Reads the conditional acceptance by slot (slot k accepted given slots 1..k-1 were) from an `hf-dspark eval`
report: its `results.json`, or the markdown `results.md` / `*_eval.md` (the form kept in `benchmarks/results/`).
Per drafter and temperature it averages the datasets' rates over the first `--positions` slots (later slots are
reached by few rounds, so their rates are noisy) and summarizes the depth profile as one number, the geometric
mean of rate(k) / rate(1) for k = 2..positions. Then a model: a drafter whose first slot is accepted with
probability A and every later slot with A x ratio (capped at 1) commits tau(A) = 1 + sum_k prod_{i <= k} a_i
tokens a round (block K). The table gives both drafters' tau(A) and their ratio over a range of A: the
measured profiles, extrapolated to the acceptance of better-trained drafts. A model, not a measurement.

    python benchmarks/acceptance_depth.py --report benchmarks/results/drafters_smollm2_3.5min_alone_eval.md \
        --drafters baseline dflash --json depth.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--report", required=True, help="hf-dspark eval results.json, or its markdown report")
    p.add_argument("--drafters", nargs=2, required=True, metavar=("A", "B"), help="the two drafters to compare")
    p.add_argument("--positions", type=int, default=4, help="slots averaged for the depth profile (default 4)")
    p.add_argument("--block", type=int, default=7, help="slots a round proposes in the model (default 7)")
    p.add_argument("--first_slot", nargs="+", type=float, default=[0.5, 0.6, 0.7, 0.8, 0.9],
                   help="first-slot acceptance values A for the model's table")  # fmt: skip
    p.add_argument("--json", default=None, help="write the profiles and the table here")
    return p.parse_args(argv)


def read_rates(path: Path) -> dict[tuple[str, str, float], list[float]]:
    """{(drafter, dataset, temperature): conditional acceptance by slot} from a report."""
    if path.suffix == ".json":
        results = json.loads(path.read_text())["results"]
        return {(r["drafter"], r["dataset"], float(r["temperature"])): list(r["accept_rate_by_position"])
                for r in results}  # fmt: skip
    text = path.read_text()
    start = text.index("## Acceptance rate by position")
    section = text[start : text.find("\n## ", start + 1)]
    rates = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not re.fullmatch(r"\d+(\.\d+)?", cells[2]):
            continue  # the header, its rule, anything else
        rates[(cells[0], cells[1], float(cells[2]))] = [float(c) if c else math.nan for c in cells[3:]]
    return rates


def depth_profile(rates: dict, drafter: str, temperature: float, positions: int) -> tuple[list[float], float]:
    """(mean rate of slots 1..positions over the datasets, geometric mean of rate(k) / rate(1) for k >= 2)."""
    runs = [v for (d, _, t), v in rates.items() if d == drafter and t == temperature]
    if not runs:
        raise ValueError(f"no acceptance rates for drafter {drafter!r} at T = {temperature:g} in the report")
    if any(len(v) < positions or any(math.isnan(x) for x in v[:positions]) for v in runs):
        raise ValueError(f"{drafter!r} at T = {temperature:g} has no rate for some of the first {positions} slots: "
                         "lower --positions")  # fmt: skip
    mean = [statistics.mean(v[k] for v in runs) for k in range(positions)]
    if mean[0] <= 0:
        raise ValueError(f"{drafter!r} at T = {temperature:g} never accepts its first slot")
    return mean, statistics.geometric_mean([mean[k] / mean[0] for k in range(1, positions)])


def modelled_tau(first: float, ratio: float, block: int) -> float:
    tau, reach = 1.0, 1.0
    for k in range(block):
        reach *= min(1.0, first * (ratio if k else 1.0))
        tau += reach
    return tau


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.positions < 2:
        raise SystemExit("--positions must be at least 2: the profile compares later slots with the first")
    rates = read_rates(Path(args.report))
    a, b = args.drafters
    command = "python benchmarks/acceptance_depth.py " + " ".join(sys.argv[1:] if argv is None else argv)
    out = {"benchmark": "acceptance_depth", "command": command, "report": str(args.report),
           "positions": args.positions, "block": args.block, "temperatures": {}}  # fmt: skip
    for temperature in sorted({t for (_, _, t) in rates}):
        profiles = {d: depth_profile(rates, d, temperature, args.positions) for d in (a, b)}
        print(f"\nT = {temperature:g}: conditional acceptance, slots 1..{args.positions} (mean over datasets)")
        for d, (mean, ratio) in profiles.items():
            print(f"  {d:>12}: {' '.join(f'{x:.3f}' for x in mean)}   later / first {ratio:.3f}")
        table = []
        for first in args.first_slot:
            ta, tb = (modelled_tau(first, profiles[d][1], args.block) for d in (a, b))
            table.append({"first_slot": first, "tau": {a: ta, b: tb}, "ratio": ta / tb})
        print(f"  {'first slot A':>12} | {a} tau | {b} tau | {a} / {b}")
        for row in table:
            print(f"  {row['first_slot']:>12.2f} | {row['tau'][a]:.2f} | {row['tau'][b]:.2f} | {row['ratio']:.3f}")
        out["temperatures"][f"{temperature:g}"] = {
            "profiles": {d: {"mean_rates": m, "later_over_first": r} for d, (m, r) in profiles.items()},
            "modelled": table,
        }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
