"""PNG plots of an evaluation (matplotlib, Agg backend: no display needed).

- acceptance by position: one panel per dataset, one line per drafter (conditional accept_rate@k);
- reliability diagrams: one figure per (drafter, dataset, temperature) of a draft with a confidence head,
  a column per slot, rows "conditional c_k" and "prefix survival a_k", raw vs. STS-calibrated curves.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: plots are files, never windows
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

# Curve names in `calibration_summary(...)["reliability"]` -> legend label, style.
_CURVES = {
    "raw": ("raw head (all rollouts)", dict(color="tab:red", marker="o")),
    "stored_sts": ("stored STS (all rollouts)", dict(color="tab:green", marker="s")),
    "held_out_raw": ("raw head (held-out half)", dict(color="tab:orange", marker="o", linestyle="--")),
    "held_out_sts": ("STS fit on other half", dict(color="tab:blue", marker="^", linestyle="--")),
}
_KIND_LABELS = {
    "conditional": "c_k vs slot k accepted | slots < k accepted",
    "survival": "prod c_i vs slots 1..k accepted",
}


# Points behind fewer rounds than this are drawn hollow: a rate from a handful of rounds says little.
FEW_ROUNDS = 20


def plot_acceptance_by_position(rows: list[dict], path: str | Path, title: str | None = None) -> Path:
    """Conditional acceptance rate by draft position; rows of one temperature. Rows that carry
    `accept_count_by_position` (rounds behind each rate) get 95% Wilson intervals, and positions with fewer than
    FEW_ROUNDS rounds are drawn hollow."""
    from ..metrics import wilson_interval

    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    drafters = list(dict.fromkeys(r["drafter"] for r in rows))
    if not datasets:
        raise ValueError("no result rows to plot")
    fig, axes = plt.subplots(
        1, len(datasets), figsize=(max(6.0, 4.2 * len(datasets)), 3.8), squeeze=False, sharey=True
    )
    annotated = False
    for ax, data in zip(axes[0], datasets):
        for drafter in drafters:
            for row in rows:
                if row["dataset"] == data and row["drafter"] == drafter:
                    rates = row["accept_rate_by_position"]
                    positions = list(range(1, len(rates) + 1))
                    (line,) = ax.plot(positions, rates, marker="o", label=f"{drafter} (tau {row['tau']:.2f})")
                    counts = row.get("accept_count_by_position")
                    if counts and len(counts) == len(rates):
                        bounds = [wilson_interval(r * n, n) for r, n in zip(rates, counts)]
                        below = [max(r - lo, 0.0) if n else 0.0 for r, n, (lo, _) in zip(rates, counts, bounds)]
                        above = [max(hi - r, 0.0) if n else 0.0 for r, n, (_, hi) in zip(rates, counts, bounds)]
                        # Explicit colors: an unset color would advance the axes' color cycle.
                        ax.errorbar(positions, rates, yerr=[below, above], fmt="none", color=line.get_color(),
                                    alpha=0.5, capsize=2)
                        few = [(k, r) for k, r, n in zip(positions, rates, counts) if n < FEW_ROUNDS]
                        if few:
                            xs, ys = zip(*few)
                            ax.plot(xs, ys, linestyle="none", marker="o", color=line.get_color(),
                                    markerfacecolor="white")
                        annotated = True
        ax.set_title(data)
        ax.set_xlabel("draft position k")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("P(k accepted | 1..k-1 accepted)")
    if annotated:
        title = (title + "\n" if title else "") + f"bars: 95% Wilson interval; hollow: fewer than {FEW_ROUNDS} rounds"
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_reliability(curves: dict, path: str | Path, title: str | None = None) -> Path:
    """Reliability diagrams per slot: curves = {curve name: {kind: [reliability_curve per slot]}}."""
    num_slots = len(curves["raw"]["conditional"])
    kinds = list(_KIND_LABELS)
    fig, axes = plt.subplots(
        len(kinds), num_slots, figsize=(2.6 * num_slots, 2.7 * len(kinds)), squeeze=False, sharex=True, sharey=True
    )
    for r, kind in enumerate(kinds):
        for slot in range(num_slots):
            ax = axes[r][slot]
            ax.plot([0, 1], [0, 1], color="gray", linewidth=0.8, linestyle=":")
            for name, (label, style) in _CURVES.items():
                if name not in curves:
                    continue
                curve = curves[name][kind][slot]
                points = [
                    (p, o) for p, o, n in zip(curve["predicted"], curve["observed"], curve["count"])
                    if n and not (math.isnan(p) or math.isnan(o))
                ]
                if points:
                    xs, ys = zip(*points)
                    ax.plot(xs, ys, label=label, markersize=3, linewidth=1, **style)
            ax.set_xlim(0, 1)
            ax.set_ylim(0, 1)
            if r == 0:
                ax.set_title(f"slot {slot + 1}")
            if slot == 0:
                ax.set_ylabel(f"observed\n({kind})")
            if r == len(kinds) - 1:
                ax.set_xlabel("predicted")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=len(handles), fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.07, 1, 0.95 if title else 1))
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["plot_acceptance_by_position", "plot_reliability"]
