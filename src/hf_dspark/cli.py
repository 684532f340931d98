"""`hf-dspark`: one command for the whole workflow, thin wrappers over the Python API.

Each stage owns its subcommands in a `cli.py` next to its code (data, training, generation, evaluation, hub),
exposing `register(subparsers)`. A subcommand's options are one dataclass parsed by transformers'
`HfArgumentParser` (`add_command`), which accepts every option as `--foo_bar` and `--foo-bar`. One vocabulary
across subcommands: `--target` (a local model folder), `--target_dtype`, `--device`, `--output_dir` (a folder) or
`--output` (a file); older spellings stay as deprecated aliases (listed in --help, noted on use). The stage
modules import nothing heavy at module level, and `import hf_dspark` skips the models when started as
`hf-dspark`, so `--help` and argument errors come before torch is loaded.

Errors in what the user asked for (a missing folder, an empty prompt file, an unknown drafter: ValueError,
OSError, ImportError) print one line and exit with status 2; `--debug` (before the subcommand) or
`HF_DSPARK_DEBUG=1` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys

from .cli_args import TARGET_DTYPES, add_command, field  # noqa: F401 (the stage CLIs' shared vocabulary)

# Stage modules in workflow order; each has register(subparsers).
STAGES = (
    "hf_dspark.data.cli",
    "hf_dspark.training.cli",
    "hf_dspark.generation.cli",
    "hf_dspark.evaluation.cli",
    "hf_dspark.hub.cli",
)

# What a user can get wrong (paths, file contents, names, missing extras); anything else is a bug: traceback.
USER_ERRORS = (ValueError, OSError, ImportError)


def build_parser() -> argparse.ArgumentParser:
    from transformers import HfArgumentParser

    parser = argparse.ArgumentParser(
        prog="hf-dspark",
        description="Train, evaluate, calibrate, export and share speculative-decoding drafts (DSpark, DFlash, Eagle3).",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors (also: HF_DSPARK_DEBUG=1)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=HfArgumentParser)
    for name in STAGES:
        importlib.import_module(name).register(subparsers)
    return parser


def _arguments(namespace: argparse.Namespace):
    """The subcommand's dataclass built from the parsed options (argparse.Namespace for `train`)."""
    cls = getattr(namespace, "arguments", None)
    if cls is None:
        return namespace
    return cls(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls) if f.init})


def _deprecated_spellings(command: str, arguments, argv: list[str]) -> None:
    """One stderr line per deprecated alias (a field's `aliases`) found on the command line."""
    for f in dataclasses.fields(arguments):
        for alias in f.metadata.get("aliases", ()):
            if any(a == alias or a.startswith(alias + "=") for a in argv):
                print(f"hf-dspark {command}: {alias} is deprecated, use --{f.name}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    if getattr(args, "arguments", None) is not None:
        _deprecated_spellings(args.command, args.arguments, argv)
    debug = args.debug or os.environ.get("HF_DSPARK_DEBUG", "") not in ("", "0")
    try:
        arguments = _arguments(args)  # the dataclass's own checks, still before anything heavy
        before_models = getattr(args, "before_models", None)  # a subcommand's answer without the models (help)
        if before_models is not None and before_models(args):
            raise SystemExit(0)  # as argparse's --help of the other subcommands
        importlib.import_module("hf_dspark").load_models()  # Auto classes + hub services (see hf_dspark/__init__.py)
        return int(args.func(arguments) or 0)
    except USER_ERRORS as err:
        if debug:
            raise
        message = str(err) or type(err).__name__
        print(f"hf-dspark {args.command}: error: {message}", file=sys.stderr)
        print("(hf-dspark --debug ... or HF_DSPARK_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
