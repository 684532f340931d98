"""`hf-dspark train`: the same code path as examples/train_dspark.py (`train_draft`), same flags.

The flags are the fields of `DraftScriptArguments` and `DraftTrainingArguments` (transformers' TrainingArguments
plus the draft's), parsed by `HfArgumentParser`. `--help` shows the draft, data and target flags and the Trainer
flags a draft run usually sets; `--help_all` lists every Trainer flag too.
"""

from __future__ import annotations

import argparse

# Trainer flags shown by the short --help (the rest: --help_all).
COMMON_TRAINER_FLAGS = (
    "output_dir", "max_steps", "num_train_epochs", "per_device_train_batch_size", "gradient_accumulation_steps",
    "learning_rate", "lr_scheduler_type", "warmup_steps", "bf16", "logging_steps", "save_steps", "eval_steps",
    "report_to", "seed", "use_cpu", "resume_from_checkpoint",
)  # fmt: skip


def register(subparsers) -> None:
    train = subparsers.add_parser(
        "train",
        help="train a DSpark / DFlash / Eagle3 draft (Trainer flags plus --train_file, --algorithm, --cache_dir, ...)",
        description="Flags are those of DraftScriptArguments and DraftTrainingArguments; see `hf-dspark train --help`.",
        add_help=False,  # --help goes to the HfArgumentParser below
        prefix_chars="\0",  # every token, including --flags, is passed through untouched
    )
    train.add_argument("argv", nargs=argparse.REMAINDER)
    train.set_defaults(func=run_train)


def build_train_parser(show_all: bool = True):
    from transformers import HfArgumentParser, TrainingArguments

    from ..models import DRAFTERS
    from .arguments import DraftTrainingArguments
    from .script import DraftScriptArguments

    parser = HfArgumentParser(
        (DraftScriptArguments, DraftTrainingArguments),
        prog="hf-dspark train",
        description="Train a draft for a target on conversations and save it to --output_dir. Any transformers "
        "TrainingArguments flag works" + ("." if show_all else " (all listed by --help_all)."),
    )  # fmt: skip
    parser.add_argument("--help_all", "--help-all", action="help", help="show every Trainer flag and exit")
    trainer_fields = {f for f in TrainingArguments.__dataclass_fields__} - set(COMMON_TRAINER_FLAGS)
    for action in parser._actions:
        if action.dest == "algorithm":
            action.choices = tuple(DRAFTERS)
        elif not show_all and action.dest in trainer_fields:
            action.help = argparse.SUPPRESS
    return parser


def run_train(args) -> int:
    from .script import train_draft

    show_all = any(a in ("--help_all", "--help-all") for a in args.argv)
    parser = build_train_parser(show_all=show_all)
    script_args, training_args = parser.parse_args_into_dataclasses(args=args.argv)
    train_draft(script_args, training_args)
    return 0
