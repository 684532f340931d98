"""`hf-dspark`: every workflow stage is a subcommand, and options accept both --foo_bar and --foo-bar."""

import pytest

from hf_dspark.cli import build_parser, main

SUBCOMMANDS = ["regenerate", "build-cache", "train", "calibrate", "profile-sps", "eval", "card", "export", "import",
               "push"]  # fmt: skip


def test_every_stage_has_a_subcommand_with_help(capsys):
    parser = build_parser()
    choices = parser._subparsers._group_actions[0].choices
    assert set(SUBCOMMANDS) <= set(choices)
    for name in SUBCOMMANDS:
        with pytest.raises(SystemExit) as exit_info:
            main([name, "--help"])
        assert exit_info.value.code == 0
        assert "usage: hf-dspark " + name in capsys.readouterr().out


def test_options_accept_dash_and_underscore_spellings():
    parser = build_parser()
    a = parser.parse_args(["build-cache", "--data", "x.jsonl", "--output_dir", "out", "--batch_size", "4"])
    b = parser.parse_args(["build-cache", "--data", "x.jsonl", "--output-dir", "out", "--batch-size", "4"])
    assert (a.output_dir, a.batch_size) == (b.output_dir, b.batch_size) == ("out", 4)
    c = parser.parse_args(["eval", "--draft", "d", "--data", "f", "--output-dir", "o", "--num-prompts", "3"])
    assert (c.output_dir, c.num_prompts) == ("o", 3)


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_importing_the_package_does_not_load_the_heavy_stages():
    """`import hf_dspark` (models + generate() routing) stays light: datasets/pyarrow load with the data stage."""
    import subprocess
    import sys

    code = "import sys, hf_dspark; print(sorted(m for m in ('datasets', 'pyarrow', 'matplotlib') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
