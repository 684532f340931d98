"""`hf-dspark train`: the same code path as examples/train_dspark.py (`train_draft`), same flags.

The flags are the fields of `DraftScriptArguments` and `DraftTrainingArguments` (transformers' TrainingArguments
plus the draft's), parsed by `HfArgumentParser`. `--help` shows the draft, data and target flags and the Trainer
flags a draft run usually sets; `--help_all` lists every Trainer flag too. Building that parser imports torch
and transformers' TrainingArguments (seconds), so the rendered help is cached per version of hf_dspark,
transformers and torch under `$HF_DSPARK_CACHE/help/` and later help calls print it without those imports.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..paths import cache_root

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
    # Help is answered before the command loads the models (main's `before_models`): see _cached_help.
    train.set_defaults(func=run_train, before_models=lambda args: _cached_help(list(args.argv)))


def build_train_parser(show_all: bool = True):
    from transformers import TrainingArguments

    from ..models import DRAFTERS
    from .script import training_argument_parser

    parser = training_argument_parser(
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


def _help_cache(show_all: bool) -> Path | None:
    """Where the rendered help of these versions lives (None when a version cannot be read)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        tag = "-".join(version(name) for name in ("hf_dspark", "transformers", "torch"))
        # An editable install keeps its version while the flags change: the defining files' times count too.
        here = Path(__file__).resolve().parent
        sources = [here / "arguments.py", here / "script.py", here / "cli.py", here.parent / "cli_args.py"]
        tag += f"-{max(p.stat().st_mtime_ns for p in sources if p.exists())}"
    except (PackageNotFoundError, OSError):
        return None
    return cache_root() / "help" / f"train{'-all' if show_all else ''}-{tag}.txt"


def _cached_help(argv: list[str]) -> bool:
    """Print the train help from the cache (rendering and caching it the first time); False if argv is no help."""
    if argv not in (["--help"], ["-h"], ["--help_all"], ["--help-all"]):
        return False
    show_all = argv[0] in ("--help_all", "--help-all")
    cache = _help_cache(show_all)
    if cache is not None and cache.is_file():
        print(cache.read_text(), end="")
        return True
    text = build_train_parser(show_all=show_all).format_help()
    if cache is not None:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(text)
            tmp.replace(cache)  # atomic: a concurrent reader sees the old file or the whole new one
        except OSError:
            pass  # a read-only home: help still works, only slower next time
    print(text, end="")
    return True


def run_train(args) -> int:
    if _cached_help(list(args.argv)):
        raise SystemExit(0)  # as argparse's own --help (main() answers it earlier)
    from .script import train_draft

    show_all = any(a in ("--help_all", "--help-all") for a in args.argv)
    parser = build_train_parser(show_all=show_all)
    script_args, training_args = parser.parse_args_into_dataclasses(args=args.argv)
    trainer = train_draft(script_args, training_args)
    stopped = trainer.stopped_by_signal
    return 0 if stopped is None else 128 + stopped  # stopped early, with a checkpoint to resume from
