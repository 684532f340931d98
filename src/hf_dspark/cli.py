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
    return parser


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
