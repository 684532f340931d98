"""τ as training estimates it, on the text the target itself produced while decoding the evaluation prompts.

Training logs held-out τ from teacher-forced blocks (`metrics.training_acceptance_estimates`: per slot
1 - TV(draft, target) and argmax agreement, on answers the target sampled earlier). Decoding measures τ from the
rounds it ran. The two can differ for two reasons: the text (the held-out answers were sampled with other settings
than the evaluation decodes with) or the decoding path (a loss of τ between the trained model and the rounds).
`teacher_forced_estimates` removes the first: it scores the draft, teacher-forced, on the target-alone answers of
the same prompts at the same temperature, through the trainer's own evaluation. Close to the decoding τ: the
decoding path delivers what the model predicts, and the gap to held-out rows is the text. Far above it: the
decoding path is losing τ.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from typing import Sequence

logger = logging.getLogger(__name__)


def teacher_forced_estimates(
    draft,
    target,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    batch_size: int = 16,
    seed: int = 0,
) -> dict:
    """{"tau_prob", "tau_greedy", "tau_walk_prob", "tau_walk_greedy", "accept_rate_by_position", "sequences"} of
    `draft` on `prompt + completion` token sequences, the completions supervised (as `DraftTrainer.evaluate`
    computes held-out τ); {} when no completion has two tokens. The walk values count rounds as decoding would
    (`metrics.decoding_walk_estimates`; every answer position anchors a block, in passes of the draft's
    `num_anchors`)."""
    import datasets

    from ..training import DraftTrainer, DraftTrainingArguments

    rows = [
        {"input_ids": list(p) + list(c), "loss_mask": [0] * len(p) + [1] * len(c)}
        for p, c in zip(prompts, completions)
        if len(c) >= 2  # a block needs an anchor and a label inside the answer
    ]
    if not rows:
        return {}
    device = next(draft.parameters()).device
    with tempfile.TemporaryDirectory() as scratch, _dense_block_mask(draft):
        args = DraftTrainingArguments(
            output_dir=scratch,
            per_device_eval_batch_size=batch_size,
            max_length=max(len(r["input_ids"]) for r in rows),
            pad_to_multiple_of=8,
            use_cpu=device.type == "cpu",
            bf16=False,  # the models run in their own dtypes
            compile_loss=False,
            compile_target=False,
            report_to="none",
            disable_tqdm=True,
            seed=seed,
        )
        if args.device != device:  # Trainer would move both models to its device: leave them where they are
            logger.warning("teacher-forced estimates skipped: the models are on %s, the trainer's device is %s",
                           device, args.device)  # fmt: skip
            return {}
        args._n_gpu = 1  # (after args.device set it) several visible GPUs would make Trainer wrap a DataParallel
        trainer = DraftTrainer(model=draft, args=args, eval_dataset=datasets.Dataset.from_list(rows),
                               target_model=target)  # fmt: skip
        metrics = trainer.evaluate()
    slots = sorted(int(k.split("@")[1]) for k in metrics if k.startswith("eval_accept@"))
    walk = {k: metrics[f"eval_{k}"] for k in ("tau_walk_greedy", "tau_walk_prob") if f"eval_{k}" in metrics}
    return {
        "tau_prob": metrics["eval_tau_prob"],
        "tau_greedy": metrics["eval_tau_greedy"],
        **walk,
        "accept_rate_by_position": [metrics[f"eval_accept@{k}"] for k in slots],
        "sequences": len(rows),
    }


@contextlib.contextmanager
def _dense_block_mask(draft):
    """Drafts attend through the dense mask here: flex attention would compile anew for every evaluation length,
    for a handful of batches."""
    own = "block_mask_kind" in vars(draft)
    saved = draft.block_mask_kind
    draft.block_mask_kind = "dense"
    try:
        yield
    finally:
        if own:
            draft.block_mask_kind = saved
        else:
            del draft.block_mask_kind


__all__ = ["teacher_forced_estimates"]
