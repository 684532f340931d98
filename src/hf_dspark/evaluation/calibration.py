"""Per-slot confidence calibration of a draft's rollouts, before and after Sequential Temperature Scaling.

Every number comes from `hf_dspark.metrics` (ECE, AUROC, Brier, reliability curves, STS fitting);
this module only decides which rollouts are scored with which temperatures:

- `raw`: the confidence head's own c_k = sigmoid(logit_k) (temperature 1).
- `stored_sts`: the temperatures saved in the draft config (`confidence_temperatures`), when there are any.
  The draft was calibrated on other rollouts, so scoring them on all evaluation rollouts is out-of-sample.
- `held_out`: STS fitted here on one half of the rollouts and scored on the other half (`eval_half`). The fit
  half is reported too (`fit_half`, in-sample, optimistic) so the gap between the two is visible.

Two views per slot k (1-based in the text, 0-based in lists): "conditional" scores c_k against "slot k accepted"
among rounds whose slots < k were accepted; "survival" scores a_k = prod_{i<=k} c_i against "slots 1..k all
accepted" among rounds that proposed slot k. STS minimizes the survival ECE, so that is where it must help.
Only verified slots have outcomes: with a confidence schedule (threshold / prefix) the slots it cut are not scored,
so calibrate on fixed-block runs (`dspark_schedule="none"`, the default).
"""

from __future__ import annotations

import numpy as np

from ..metrics import calibration_report, fit_sts_temperatures, reliability_curve, slot_calibration_data

KINDS = ("conditional", "survival")


def slot_table(records, num_slots: int, temperatures=None, n_bins: int = 15) -> dict[str, list[dict]]:
    """{kind: [calibration_report of slot k for k in range(num_slots)]} for confidence records."""
    table = {}
    for kind in KINDS:
        rows = []
        for slot in range(num_slots):
            pred, out = slot_calibration_data(records, slot, temperatures, kind=kind)
            rows.append(calibration_report(pred, out, n_bins))
        table[kind] = rows
    return table


def slot_reliability(records, num_slots: int, temperatures=None, n_bins: int = 10) -> dict[str, list[dict]]:
    """{kind: [reliability_curve of slot k]}: the data of reliability diagrams."""
    return {
        kind: [
            reliability_curve(*slot_calibration_data(records, slot, temperatures, kind=kind), n_bins=n_bins)
            for slot in range(num_slots)
        ]
        for kind in KINDS
    }


def uncalibrate_records(records, temperatures) -> list:
    """Undo STS temperatures on recorded confidences: c = sigmoid(l / T)  ->  sigmoid(l).

    Decoding records the confidences it scheduled with, which already include the draft's stored
    temperatures; calibration "before STS" needs the head's raw output. Confidences that saturated in float32
    (exactly 0 or 1) come back clipped to 1e-7 from the boundary.
    """
    if temperatures is None:
        return list(records)
    temps = np.asarray(temperatures, dtype=np.float64)
    out = []
    for conf, accepted, proposed in records:
        c = np.clip(np.asarray(conf, dtype=np.float64), 1e-7, 1 - 1e-7)
        logits = (np.log(c) - np.log1p(-c)) * temps[: len(c)]
        out.append((1.0 / (1.0 + np.exp(-logits)), accepted, proposed))
    return out


def calibration_summary(
    record_groups: list[list],
    num_slots: int,
    stored_temperatures=None,
    n_bins: int = 15,
    reliability_bins: int = 10,
) -> dict | None:
    """Calibration of one (drafter, dataset, temperature) evaluation.

    record_groups: raw (temperature-1) confidence records grouped by generate() call, in prompt order; the
    held-out split alternates groups (even -> fit, odd -> evaluate), so both halves cover the whole prompt range
    and rounds of one prompt never straddle the split. Returns None when there are no confidence records (a
    draft without a confidence head).
    """
    records = [r for group in record_groups for r in group]
    if not records:
        return None
    fit = [r for i, group in enumerate(record_groups) if i % 2 == 0 for r in group]
    held = [r for i, group in enumerate(record_groups) if i % 2 == 1 for r in group]
    summary = {
        "num_slots": num_slots,
        "num_rounds": len(records),
        "n_bins": n_bins,
        "raw": slot_table(records, num_slots, None, n_bins),
        "stored_temperatures": list(stored_temperatures) if stored_temperatures is not None else None,
        "stored_sts": None,
        "held_out": None,
        "reliability": {"raw": slot_reliability(records, num_slots, None, reliability_bins)},
    }
    if stored_temperatures is not None:
        summary["stored_sts"] = slot_table(records, num_slots, stored_temperatures, n_bins)
        summary["reliability"]["stored_sts"] = slot_reliability(
            records, num_slots, stored_temperatures, reliability_bins
        )
    if fit and held:
        temps = fit_sts_temperatures(fit, num_slots, n_bins=n_bins)
        summary["held_out"] = {
            "split": "generate() calls alternate: even-numbered calls fit STS, odd-numbered calls evaluate it",
            "fit_rounds": len(fit),
            "eval_rounds": len(held),
            "temperatures": temps,
            "fit_half": {
                "raw": slot_table(fit, num_slots, None, n_bins),
                "sts": slot_table(fit, num_slots, temps, n_bins),
            },
            "eval_half": {
                "raw": slot_table(held, num_slots, None, n_bins),
                "sts": slot_table(held, num_slots, temps, n_bins),
            },
        }
        summary["reliability"]["held_out_raw"] = slot_reliability(held, num_slots, None, reliability_bins)
        summary["reliability"]["held_out_sts"] = slot_reliability(held, num_slots, temps, reliability_bins)
    return summary


def mean_over_slots(table_rows: list[dict], key: str) -> float:
    """Count-weighted mean of one metric over slots (nan slots, e.g. AUROC with one class, are skipped)."""
    values = [(r[key], r["count"]) for r in table_rows if r["count"] and not np.isnan(r[key])]
    if not values:
        return float("nan")
    total = sum(c for _, c in values)
    return float(sum(v * c for v, c in values) / total)


__all__ = ["slot_table", "slot_reliability", "uncalibrate_records", "calibration_summary", "mean_over_slots", "KINDS"]
