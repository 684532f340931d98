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
    """`import hf_dspark` (the models, for the Auto classes) stays light: datasets/pyarrow load with the data stage."""
    import subprocess
    import sys

    code = "import sys, hf_dspark; print(sorted(m for m in ('datasets', 'pyarrow', 'matplotlib') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_user_mistakes_exit_2_with_one_line_and_no_traceback(tmp_path, capsys):
    assert main(["calibrate", "--draft", str(tmp_path / "missing"), "--prompts", "p.jsonl", "--output_dir", "o"]) == 2
    err = capsys.readouterr().err
    assert "hf-dspark calibrate: error: draft folder" in err and "Traceback" not in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["regenerate", "--target", str(tmp_path / "nope"), "--prompts", str(empty), "--output", "o.jsonl"]) == 2
    assert "does not exist" in capsys.readouterr().err
    # Dataclass checks run at parse time too: exactly one output.
    assert main(["calibrate", "--draft", "d", "--prompts", "p"]) == 2
    assert "--output_dir" in capsys.readouterr().err


def test_debug_flag_and_env_show_the_traceback(tmp_path, monkeypatch):
    argv = ["calibrate", "--draft", str(tmp_path / "missing"), "--prompts", "p.jsonl", "--output_dir", "o"]
    with pytest.raises(FileNotFoundError):
        main(["--debug", *argv])
    monkeypatch.setenv("HF_DSPARK_DEBUG", "1")
    with pytest.raises(FileNotFoundError):
        main(argv)


def test_one_vocabulary_with_deprecated_aliases(capsys):
    parser = build_parser()
    for command, extra in (("regenerate", ["--prompts", "p", "--output", "o"]), ("build-cache", ["--data", "d",
                           "--output_dir", "o"]), ("calibrate", ["--draft", "d", "--prompts", "p", "--in_place"]),
                           ("profile-sps", []), ("eval", ["--draft", "d", "--data", "f", "--output_dir", "o"])):  # fmt: skip
        args = parser.parse_args([command, *extra, "--target", "t", "--target_dtype", "float32", "--device", "cpu"])
        assert (args.target, args.target_dtype, args.device) == ("t", "float32", "cpu"), command
    old = parser.parse_args(["regenerate", "--prompts", "p", "--output", "o", "--torch-dtype", "bfloat16"])
    assert old.target_dtype == "bfloat16"
    assert parser.parse_args(["build-cache", "--data", "d", "--output_dir", "o", "--dtype", "fp8"]).cache_dtype == "fp8"
    assert parser.parse_args(["eval", "--draft", "a", "--draft", "b", "--data", "f", "--output_dir", "o"]).draft == [
        "a", "b"]  # fmt: skip
    assert main(["calibrate", "--draft", "d", "--prompts", "p", "--output", "o", "--dtype", "float32"]) == 2
    assert "--dtype is deprecated, use --target_dtype" in capsys.readouterr().err


def test_parsing_loads_no_stage_code(tmp_path):
    """--help and argument errors come before any stage's heavy modules (Trainer, datasets, generation)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from hf_dspark.cli import build_parser\n"
        "build_parser().parse_args(['eval', '--draft', 'd', '--data', 'f', '--output_dir', 'o'])\n"
        "heavy = ('datasets', 'transformers.trainer', 'hf_dspark.generation.speculative', 'hf_dspark.training.trainer',"
        " 'hf_dspark.evaluation.runner', 'matplotlib')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def _run_as_command(argv: list[str], env=None):
    """`hf-dspark ARGV` in a fresh interpreter; its stdout ends with whether torch was loaded by exit."""
    import subprocess
    import sys

    script = (
        f"import atexit, sys\nsys.argv = ['hf-dspark', *{argv!r}]\n"
        "atexit.register(lambda: print('torch loaded' if 'torch' in sys.modules else 'no torch'))\n"
        "from hf_dspark.cli import main\nsys.exit(main())\n"
    )
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)


def test_help_and_argument_errors_load_no_torch():
    """Started as `hf-dspark`, --help and a bad argument exit before torch is imported."""
    for argv, code in ((["--help"], 0), (["eval", "--help"], 0), (["eval", "--nope"], 2)):
        out = _run_as_command(argv)
        assert out.returncode == code, out.stderr[-2000:]
        assert out.stdout.strip().endswith("no torch"), (argv, out.stdout[-500:])


def test_train_help_is_rendered_once_then_printed_without_torch(tmp_path):
    """`train --help` needs TrainingArguments (torch) to render; later calls print the cached text."""
    import os

    env = {**os.environ, "HF_DSPARK_CACHE": str(tmp_path)}
    runs = [_run_as_command(["train", "--help"], env=env) for _ in range(2)]
    for out in runs:
        assert out.returncode == 0, out.stderr[-2000:]
        assert "usage: hf-dspark train" in out.stdout and "--max_train_minutes" in out.stdout
    assert runs[0].stdout.strip().endswith("torch loaded") and runs[1].stdout.strip().endswith("no torch")
    assert runs[0].stdout.replace("torch loaded", "") == runs[1].stdout.replace("no torch", "")
    assert list((tmp_path / "help").glob("train-*.txt"))
