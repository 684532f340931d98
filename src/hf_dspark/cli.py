"""`hf-dspark`: one command for the whole workflow, thin wrappers over the Python API.

Each stage owns its subcommands in a `cli.py` next to its code (data, training, generation, evaluation, hub)
exposing `register(subparsers)`; every subcommand sets `func` to a callable taking the parsed args.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Stage modules in workflow order; each has register(subparsers).
STAGES = (
    "hf_dspark.data.cli",
    "hf_dspark.training.cli",
    "hf_dspark.generation.cli",
    "hf_dspark.evaluation.cli",
    "hf_dspark.hub.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-dspark",
        description="Train, evaluate, calibrate, export and share speculative-decoding drafts (DSpark, DFlash, Eagle3).",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in STAGES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name == name:  # stage not built yet
                continue
            raise
        module.register(subparsers)
    for subparser in subparsers.choices.values():
        accept_both_spellings(subparser)
    return parser


def accept_both_spellings(parser: argparse.ArgumentParser) -> None:
    """Let every `--foo_bar` option also be written `--foo-bar` and vice versa.

    Stages use transformers' underscore style (HfArgumentParser) or the dash style of most CLIs; users should not
    have to remember which. The extra spelling is hidden from --help.
    """
    for action in list(parser._actions):
        for option in list(action.option_strings):
            if not option.startswith("--"):
                continue
            name = option[2:]
            other = "--" + (name.replace("_", "-") if "_" in name else name.replace("-", "_"))
            if other != option and other not in parser._option_string_actions:
                parser._option_string_actions[other] = action


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
