"""The command line's shared vocabulary: how a subcommand declares its options (one dataclass per subcommand,
parsed by transformers' HfArgumentParser) and the choices several subcommands share. The stage CLIs and the
`hf-dspark` entry point both use it; it imports nothing heavy."""

from __future__ import annotations

import dataclasses

# The same choices wherever a target's weights dtype is chosen ("auto": bfloat16 on CUDA, float32 on CPU).
TARGET_DTYPES = ("auto", "bfloat16", "float16", "float32")


def add_command(subparsers, name: str, arguments, func, help: str, description: str | None = None):
    """Subcommand `name` whose options are the fields of the dataclass `arguments`; `func(arguments(...))`."""
    parser = subparsers.add_parser(name, dataclass_types=[arguments], help=help, description=description or help)
    parser.set_defaults(func=func, arguments=arguments)
    return parser


def field(default=dataclasses.MISSING, *, help: str, aliases: list[str] | None = None, **metadata):
    """A dataclass field with its --help text (and deprecated spellings in `aliases`)."""
    metadata["help"] = help
    if aliases:
        metadata["aliases"] = aliases
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


__all__ = ["TARGET_DTYPES", "add_command", "field"]
