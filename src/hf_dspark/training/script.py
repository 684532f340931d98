"""`train_draft`: conversations -> (target cache) -> DraftTrainer -> a saved draft.

The code path of `examples/train_dspark.py` and `hf-dspark train`. Under `accelerate launch` every process runs
it: tokenization happens on the main process first (the others reuse its `datasets` cache), cache shards are
built in parallel, and the Trainer places the draft.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .arguments import DraftTrainingArguments
from .trainer import DraftTrainer, build_draft, data_seed, process_age_s, seed_run
from .zero3 import zero3_init_disabled

logger = logging.getLogger(__name__)

@dataclass
class DraftScriptArguments:
    """Where the data and the target come from (the draft and training fields are in DraftTrainingArguments)."""

    train_file: list[str] = field(
        metadata={
            "help": "Conversations: JSON/JSONL(.gz) files of {'messages': [...]} rows (several, or a quoted glob such "
            "as 'data/*.jsonl.gz'), a saved dataset or a Hub name."
        }
    )
    target_model: str | None = field(
        default=None,
        metadata={"help": "Target model folder (default: embedded SmolLM2-135M-Instruct).", "aliases": ["--target"]},
    )
    cache_dir: str | None = field(
        default=None,
        metadata={"help": "Build (or reuse) the target cache here and train from it; without: online target."},
    )
    cache_dtype: str = field(default="bf16", metadata={"help": "Storage dtype of cached features: bf16, fp16 or fp8."})
    cache_batch_size: int = field(default=8, metadata={"help": "Rows per target forward while building the cache."})
    eval_rows: int = field(default=0, metadata={"help": "Conversations held out for evaluation (tau estimates)."})
    eval_file: list[str] | None = field(
        default=None,
        metadata={
            "help": "Evaluate on these conversations (files or quoted globs, like --train_file) instead of rows held out "
            "of the training data: the same held-out rows for runs on different data, or the target's own answers "
            "at the temperature you decode with. NAME=FILE entries make separate sets, logged as eval_NAME_*. "
            "--eval_rows caps the rows of each set (0: all)."
        },
    )
    target_dtype: str | None = field(
        default=None, metadata={"help": "Target weights: float32, bfloat16 or float16 (default: bfloat16 with --bf16)."}
    )

    def __post_init__(self):
        if isinstance(self.train_file, (str, Path)):  # one source given from Python
            self.train_file = [str(self.train_file)]
        if isinstance(self.eval_file, (str, Path)):
            self.eval_file = [str(self.eval_file)]


def training_argument_parser(**kwargs):
    """transformers' HfArgumentParser over `DraftScriptArguments` and `DraftTrainingArguments` (kwargs go to it),
    where a bare `--flag` turns on an optional switch (a `bool | None` field, None = decided by the machine:
    `--compile_draft_layers` means `--compile_draft_layers true`) as it does a plain `bool` field."""
    from transformers import HfArgumentParser
    from transformers.hf_argparser import string_to_bool

    parser = HfArgumentParser((DraftScriptArguments, DraftTrainingArguments), **kwargs)
    for action in parser._actions:
        if action.type is string_to_bool and action.nargs is None:  # plain bools already have nargs="?"
            action.nargs, action.const = "?", True
    return parser


def eval_file_sets(entries: list[str]) -> dict[str, list[str]]:
    """`--eval_file` entries -> {set name: files}. Plain entries form one unnamed set (""); NAME=FILE entries
    name theirs (repeat a NAME for several files). Mixing the two is refused: which set would plain files join?"""
    sets: dict[str, list[str]] = {}
    for entry in entries:
        name, sep, files = entry.partition("=")
        if not sep or "/" in name or not name.isidentifier():
            name, files = "", entry  # a path (which may itself contain "=")
        sets.setdefault(name, []).append(files)
    if "" in sets and len(sets) > 1:
        raise ValueError(f"--eval_file mixes named (NAME=FILE) and unnamed entries: {entries}; name every set")
    return sets


def load_target(script_args: DraftScriptArguments, training_args: DraftTrainingArguments):
    """(target, tokenizer) as the arguments describe them (placed on the device later, by the trainer)."""
    from ..resources import load_target as load

    dtype = script_args.target_dtype or ("bfloat16" if training_args.bf16 else "float32")
    with zero3_init_disabled():  # the frozen target runs whole on every process, outside DeepSpeed
        return load(script_args.target_model, dtype=dtype)

class StartupPhases:
    """Seconds each phase before training took, in order; the run's summary logs them as `startup_<phase>_s`
    (`process`: interpreter start, imports and argument parsing, up to `train_draft`)."""

    def __init__(self):
        age = process_age_s()
        self.seconds: dict[str, float] = {"process": age} if age is not None else {}
        self._last = time.monotonic()

    def done(self, phase: str) -> None:
        now = time.monotonic()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now


def train_draft(script_args: DraftScriptArguments, training_args: DraftTrainingArguments) -> DraftTrainer:
    """Train a draft for the target on the conversations and save it to `training_args.output_dir`."""
    from accelerate import PartialState

    from ..data import build_target_cache, load_conversations, load_target_cache, tokenize_conversations

    phases = StartupPhases()
    if script_args.eval_rows < 0:
        raise ValueError(f"eval_rows must be >= 0, got {script_args.eval_rows}")
    # Fail on a typo before loading anything.
    from ..models import drafter_classes

    drafter_classes(training_args.algorithm)
    # As transformers' example scripts do: seed before anything random (the draft's initialization below).
    seed_run(training_args)
    target, tokenizer = load_target(script_args, training_args)
    phases.done("target")

    def tokenized(files):
        return tokenize_conversations(
            load_conversations(files),
            tokenizer,
            max_length=training_args.max_length,
            min_loss_tokens=training_args.min_loss_tokens,
            max_loop_repeats=training_args.max_loop_repeats,
        )

    eval_sets = eval_file_sets(script_args.eval_file) if script_args.eval_file else None
    with training_args.main_process_first(desc="tokenizing conversations"):
        dataset = tokenized(script_args.train_file)
        eval_dataset = {name: tokenized(files) for name, files in eval_sets.items()} if eval_sets else None
    if eval_dataset is not None:
        if script_args.eval_rows:  # the first rows of each set: the same rows in every run
            eval_dataset = {name: rows.select(range(min(script_args.eval_rows, len(rows))))
                            for name, rows in eval_dataset.items()}  # fmt: skip
        if list(eval_dataset) == [""]:  # one unnamed set: metrics named eval_* as for a held-out split
            eval_dataset = eval_dataset[""]
    elif script_args.eval_rows:
        if script_args.eval_rows >= len(dataset):
            raise ValueError(f"eval_rows={script_args.eval_rows} leaves no training rows (the data has {len(dataset)})")
        split = dataset.train_test_split(test_size=script_args.eval_rows, seed=data_seed(training_args))
        dataset, eval_dataset = split["train"], split["test"]
    phases.done("data")
    draft = build_draft(target, training_args)
    phases.done("draft")

    if script_args.cache_dir:
        target.to(training_args.device)

        def cached(rows, name: str):
            path = build_target_cache(
                target,
                rows,
                Path(script_args.cache_dir) / name,
                target_layer_ids=draft.config.target_layer_ids,
                tokenizer=tokenizer,
                max_length=training_args.max_length,
                min_loss_tokens=training_args.min_loss_tokens,
                batch_size=script_args.cache_batch_size,
                dtype=script_args.cache_dtype,
            )
            PartialState().wait_for_everyone()  # the main process finalizes the manifest after the shards
            return load_target_cache(path, draft_config=draft.config, target=target)

        dataset = cached(dataset, "train")
        if isinstance(eval_dataset, dict):  # named held-out sets: one cache each
            eval_dataset = {name: cached(rows, f"eval_{name}") for name, rows in eval_dataset.items()}
        elif eval_dataset is not None:
            eval_dataset = cached(eval_dataset, "eval")
        online_target = None
        del target  # features come from the cache; free the target's memory before training
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        phases.done("cache")
    else:
        online_target = target
    trainer = DraftTrainer(
        model=draft,
        args=training_args,
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        target_model=online_target,
    )
    phases.done("trainer")
    trainer.startup_phases = phases.seconds
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    if trainer.stopped_by_signal is not None:  # a checkpoint holds the run: no final save or evaluation
        return trainer  # within the grace period; the caller exits with 128 + the signal number
    trainer.save_model(training_args.output_dir)
    if eval_dataset is not None:
        trainer.log_metrics("eval", trainer.evaluate())
    if trainer.is_world_process_zero():
        trainer.save_state()  # trainer_state.json beside the draft: the whole run's log, final evaluation included
    return trainer


__all__ = ["DraftScriptArguments", "eval_file_sets", "train_draft", "load_target"]
