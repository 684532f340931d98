"""`hf-dspark train`: the same code path as examples/train_dspark.py (`train_draft`), same flags."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    train = subparsers.add_parser(
        "train",
        help="train a DSpark / DFlash / Eagle3 draft (Trainer flags plus --train_file, --algorithm, --cache_dir, ...)",
        description="Flags are those of DraftScriptArguments and DraftTrainingArguments; see `hf-dspark train --help`.",
        add_help=False,  # --help goes to the full HfArgumentParser below
        prefix_chars="\0",  # every token, including --flags, is passed through untouched
    )
    train.add_argument("argv", nargs=argparse.REMAINDER)
    train.set_defaults(func=run_train)


def build_train_parser():
    from transformers import HfArgumentParser

    from .arguments import DraftTrainingArguments
    from .script import DraftScriptArguments

    return HfArgumentParser((DraftScriptArguments, DraftTrainingArguments), prog="hf-dspark train")


def run_train(args) -> int:
    from .script import train_draft

    script_args, training_args = build_train_parser().parse_args_into_dataclasses(args=args.argv)
    train_draft(script_args, training_args)
    return 0
