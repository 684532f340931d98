"""Sequential Temperature Scaling (STS) of a DSpark draft's confidence head (paper 3.2.1).

`calibrate_confidence(draft, target, tokenizer, prompts)` runs speculative rollouts of the target on the prompts
with whole blocks verified (so every slot gets an outcome), records each round's raw confidences and how many
slots were accepted, fits one temperature per slot with `hf_dspark.metrics.fit_sts_temperatures`
(left to right, minimizing the ECE of the prefix survival prod_{i<=k} sigmoid(logit_i / T_i)), stores them in
`draft.config.confidence_temperatures` (so `save_pretrained` / `from_pretrained` keep them and
`DraftProposal.confidences` applies them) and returns a `CalibrationReport` with ECE/AUROC/Brier before and
after, measured on a held-out share of the rounds. `calibrate_from_records` does the fitting part for rollouts
collected elsewhere (any `AcceptanceStats.confidence_records`).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from ..data.prompts import encode_chat_prompts, left_pad
from ..metrics import calibration_report, fit_sts_temperatures, slot_calibration_data


@dataclass
class CalibrationReport:
    """temperatures: the fitted T_k; per_slot: survival-calibration metrics per slot on the evaluation rounds;
    ece_before / ece_after: count-weighted mean survival ECE over slots (raw head vs STS)."""

    temperatures: list[float]
    previous_temperatures: list[float] | None
    fit_rounds: int
    eval_rounds: int
    ece_before: float
    ece_after: float
    per_slot: list[dict] = field(default_factory=list)
    tau: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        lines = [
            f"STS calibration: {self.fit_rounds} fit rounds, {self.eval_rounds} eval rounds, "
            f"ECE {self.ece_before:.4f} -> {self.ece_after:.4f}",
            "slot  T       count  ECE before  ECE after  AUROC   Brier before  Brier after",
        ]
        for row in self.per_slot:
            lines.append(
                f"{row['slot']:>4}  {row['temperature']:<6.3f}  {row['count']:>5}  {row['ece_before']:>10.4f}  "
                f"{row['ece_after']:>9.4f}  {row['auroc']:>6.3f}  {row['brier_before']:>12.4f}  "
                f"{row['brier_after']:>11.4f}"
            )
        return "\n".join(lines)


def _raw_records(records):
    return [(np.asarray(c, dtype=np.float64), int(a), int(p)) for c, a, p in records]


def calibrate_from_records(
    draft, records, holdout_fraction: float = 0.3, seed: int = 0, n_bins: int = 15, tau: float | None = None
) -> CalibrationReport:
    """Fit STS temperatures on (raw confidences, accepted, proposed) rounds and store them in the draft config."""
    num_slots = int(getattr(draft.config, "block_size", 0) or 0)
    if not getattr(draft.config, "enable_confidence_head", False) or num_slots < 1:
        raise ValueError(f"{type(draft).__name__} has no confidence head to calibrate (DSpark drafts only)")
    records = _raw_records(records)
    if len(records) < 2:
        raise ValueError(f"STS needs rollout rounds to fit on, got {len(records)}: use more or longer prompts")
    if not 0.0 <= holdout_fraction < 1.0:
        raise ValueError(f"holdout_fraction must be in [0, 1), got {holdout_fraction}")
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    num_eval = int(round(len(records) * holdout_fraction))
    eval_records = [records[i] for i in order[:num_eval]] or records
    fit_records = [records[i] for i in order[num_eval:]]
    temperatures = fit_sts_temperatures(fit_records, num_slots, n_bins=n_bins)

    per_slot, weighted_before, weighted_after, total = [], 0.0, 0.0, 0
    for slot in range(num_slots):
        raw_pred, outcome = slot_calibration_data(eval_records, slot, None, kind="survival")
        if raw_pred.size == 0:
            continue
        cal_pred, _ = slot_calibration_data(eval_records, slot, temperatures, kind="survival")
        before = calibration_report(raw_pred, outcome, n_bins)
        after = calibration_report(cal_pred, outcome, n_bins)
        per_slot.append(
            {
                "slot": slot + 1,
                "temperature": temperatures[slot],
                "count": int(raw_pred.size),
                "accept_rate": float(outcome.mean()),
                "ece_before": before["ece"],
                "ece_after": after["ece"],
                "auroc": after["auroc"],
                "brier_before": before["brier"],
                "brier_after": after["brier"],
            }
        )
        weighted_before += before["ece"] * raw_pred.size
        weighted_after += after["ece"] * raw_pred.size
        total += raw_pred.size
    previous = draft.config.confidence_temperatures
    draft.config.confidence_temperatures = [float(t) for t in temperatures]
    draft.config.check_draft_fields()
    return CalibrationReport(
        temperatures=list(draft.config.confidence_temperatures),
        previous_temperatures=None if previous is None else list(previous),
        fit_rounds=len(fit_records),
        eval_rounds=len(eval_records),
        ece_before=weighted_before / total if total else float("nan"),
        ece_after=weighted_after / total if total else float("nan"),
        per_slot=per_slot,
        tau=tau,
    )


@torch.no_grad()
def collect_rollouts(
    draft,
    target,
    tokenizer,
    prompts,
    max_new_tokens: int = 128,
    batch_size: int = 8,
    use_chat_template: bool = True,
    **generate_kwargs,
):
    """Speculative rollouts with whole blocks verified and raw (uncalibrated) confidences recorded.

    Returns (records, stats): records as in `AcceptanceStats.confidence_records`, stats merged over batches.
    """
    from .stats import SpeculativeStats

    encoded = encode_chat_prompts(tokenizer, prompts, use_chat_template)
    if not encoded:
        raise ValueError("calibration needs at least one prompt")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(target.parameters()).device
    saved = draft.config.confidence_temperatures
    draft.config.confidence_temperatures = None  # record the raw head
    merged = None
    try:
        for start in range(0, len(encoded), batch_size):
            ids, mask = left_pad(encoded[start : start + batch_size], pad, device)
            target.generate(
                ids,
                attention_mask=mask,
                assistant_model=draft,
                max_new_tokens=max_new_tokens,
                pad_token_id=pad,
                dspark_schedule="none",
                **generate_kwargs,
            )
            stats: SpeculativeStats = draft.last_generation_stats
            merged = stats if merged is None else merged.merge(stats)
    finally:
        draft.config.confidence_temperatures = saved
    return list(merged.confidence_records), merged


def calibrate_confidence(
    draft,
    target,
    tokenizer,
    prompts,
    max_new_tokens: int = 128,
    batch_size: int = 8,
    holdout_fraction: float = 0.3,
    seed: int = 0,
    n_bins: int = 15,
    use_chat_template: bool = True,
    do_sample: bool = True,
    temperature: float = 1.0,
    **generate_kwargs,
) -> CalibrationReport:
    """Roll out the target with `draft` on `prompts`, fit STS temperatures, store them in `draft.config`."""
    if not getattr(draft.config, "enable_confidence_head", False):
        raise ValueError(f"{type(draft).__name__} has no confidence head to calibrate (DSpark drafts only)")
    if do_sample:
        generate_kwargs.update(do_sample=True, temperature=temperature)
    else:
        generate_kwargs.update(do_sample=False)
    records, stats = collect_rollouts(
        draft, target, tokenizer, prompts, max_new_tokens, batch_size, use_chat_template, **generate_kwargs
    )
    return calibrate_from_records(draft, records, holdout_fraction, seed, n_bins, tau=stats.tau)


__all__ = [
    "CalibrationReport",
    "calibrate_confidence",
    "calibrate_from_records",
    "collect_rollouts",
]
