"""Several conversation files, or a glob, for `--train_file` (example script, `hf-dspark train`) and for
`hf-dspark build-cache --data`."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest
from conftest import shared_dir
from test_train_example import write_tiny_target

from hf_dspark.data import load_conversations

RESPONSES = ("smollm2-135m-instruct.jsonl.gz", "smollm2-135m-instruct-part2.jsonl.gz")


def response_rows(name: str, count: int, offset: int) -> list[dict]:
    """`count` rows of the shared responses file `name` when it is here, else rows in its format
    (`{"id", "source", "domain", "messages", "finish", "prompt_tokens", "completion_tokens"}`)."""
    if shared_dir() is not None:
        path = Path(shared_dir()) / "data" / "responses" / name
        if path.exists():
            with gzip.open(path, "rt", encoding="utf-8") as f:
                return [json.loads(line) for _, line in zip(range(count), f)]
    rows = []
    for i in range(offset, offset + count):
        answer = f"Sure. {i} times 3 is {3 * i}, because adding {i} three times gives {3 * i}."
        messages = [{"role": "user", "content": f"What is {i} times 3?"}, {"role": "assistant", "content": answer}]
        finish = "length" if i % 4 == 0 else "stop"
        rows.append({"id": f"row-{i}", "source": "synthetic", "domain": "math", "messages": messages,
                     "finish": finish, "prompt_tokens": 9, "completion_tokens": 25})  # fmt: skip
    return rows


def write_gz(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return path


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """data/part-1.jsonl.gz (7 rows) and data/part-2.jsonl.gz (5 rows) in the responses format."""
    root = tmp_path_factory.mktemp("several")
    first = write_gz(root / "data" / "part-1.jsonl.gz", response_rows(RESPONSES[0], 7, 0))
    second = write_gz(root / "data" / "part-2.jsonl.gz", response_rows(RESPONSES[1], 5, 100))
    return root, first, second


def ids(dataset) -> list[str]:
    return list(dataset["id"])


def test_several_files_and_a_glob_load_in_order(parts, tmp_path):
    root, first, second = parts
    cache = str(tmp_path / "hf")
    one, two = load_conversations(first, cache_dir=cache), load_conversations(second, cache_dir=cache)
    both = load_conversations([first, second], cache_dir=cache)
    assert ids(both) == ids(one) + ids(two) and len(both) == 12
    assert ids(load_conversations([second, first], cache_dir=cache)) == ids(two) + ids(one)  # the order given
    assert ids(load_conversations(str(root / "data" / "part-*.jsonl.gz"), cache_dir=cache)) == ids(both)  # sorted
    assert ids(load_conversations([str(root / "data" / "*-2.jsonl.gz"), first], cache_dir=cache)) == ids(two) + ids(one)
    assert both.column_names == one.column_names


def test_a_pattern_that_matches_nothing_is_a_clear_error(parts):
    root, first, _ = parts
    with pytest.raises(FileNotFoundError, match="the pattern .*nothing-\\*.jsonl.gz' matches no files"):
        load_conversations(str(root / "data" / "nothing-*.jsonl.gz"))
    with pytest.raises(FileNotFoundError, match="matches no files"):
        load_conversations([first, str(root / "elsewhere" / "*.jsonl")])
    with pytest.raises(ValueError, match="no conversation source given"):
        load_conversations([])


def test_a_column_only_some_files_have_is_kept(tmp_path):
    # regenerate_responses writes `finish`; hand-written chats do not. Rows cut at the limit must stay marked.
    with_finish = write_gz(tmp_path / "a.jsonl.gz", response_rows(RESPONSES[0], 3, 0))
    plain = tmp_path / "b.jsonl"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    plain.write_text(json.dumps({"messages": messages}) + "\n")
    both = load_conversations([with_finish, plain], cache_dir=str(tmp_path / "hf"))
    assert both["finish"][:3] == [row["finish"] for row in response_rows(RESPONSES[0], 3, 0)]
    assert both["finish"][3] is None and both["messages"][3][1]["content"] == "hello"


def test_files_with_clashing_columns_name_the_fix(tmp_path):
    first = tmp_path / "a.jsonl"
    first.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "finish": "stop"}) + "\n")
    second = tmp_path / "b.jsonl"
    second.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "finish": 3}) + "\n")
    with pytest.raises(ValueError, match="incompatible columns.*same fields with the same types"):
        load_conversations([first, second], cache_dir=str(tmp_path / "hf"))


@pytest.mark.skipif(
    shared_dir() is None or not all((Path(shared_dir()) / "data" / "responses" / n).exists() for n in RESPONSES),
    reason="needs ../shared/data/responses",
)
def test_the_shared_responses_load_together_through_a_glob(tmp_path):
    pattern = str(Path(shared_dir()) / "data" / "responses" / "smollm2-135m-instruct*.jsonl.gz")
    both = load_conversations(pattern, cache_dir=str(tmp_path / "hf"))
    assert len(both) == 10_240 + 7_168  # the README's row counts


# -- the command lines ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("target")
    write_tiny_target(folder)
    return folder


def test_train_takes_several_files_and_a_glob(parts, tiny_target, tmp_path, monkeypatch):
    from hf_dspark.training.cli import build_train_parser
    from hf_dspark.training.script import train_draft

    root, first, second = parts
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    flags = ["--target_model", str(tiny_target), "--algorithm", "dflash", "--num_hidden_layers", "1",
             "--block_size", "4", "--num_anchors", "4", "--max_length", "128", "--min_loss_tokens", "1",
             "--max_steps", "1", "--per_device_train_batch_size", "2", "--report_to", "none", "--save_strategy", "no",
             "--use_cpu", "--disable_tqdm", "true"]  # fmt: skip
    for sources, output in (([str(first), str(second)], "files"), ([str(root / "data" / "part-*.jsonl.gz")], "glob")):
        script_args, training_args = build_train_parser().parse_args_into_dataclasses(
            args=["--train_file", *sources, "--output_dir", str(tmp_path / output), *flags]
        )
        assert script_args.train_file == sources
        trainer = train_draft(script_args, training_args)
        assert len(trainer.train_dataset) == 12  # rows of both files (none is dropped at min_loss_tokens=1)
        summary = next(h for h in trainer.state.log_history if "train_runtime" in h)
        phases = [k for k in summary if k.startswith("startup_") and k != "startup_s"]  # the wait before train()
        assert phases == [f"startup_{p}_s" for p in ("process", "target", "data", "draft", "trainer")], phases
        assert sum(summary[k] for k in phases) <= summary["startup_s"] + 0.3  # (each rounded to 0.1 s)
        assert (tmp_path / output / "config.json").exists()
    with pytest.raises(FileNotFoundError, match="matches no files"):
        train_draft(*build_train_parser().parse_args_into_dataclasses(
            args=["--train_file", str(root / "none-*.jsonl.gz"), "--output_dir", str(tmp_path / "none"), *flags]
        ))  # fmt: skip


def test_build_cache_takes_several_files_and_a_glob(parts, tiny_target, tmp_path, monkeypatch):
    from hf_dspark.cli import main

    root, first, second = parts
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    common = ["--target", str(tiny_target), "--torch-dtype", "float32", "--device", "cpu", "--max-length", "128",
              "--min-loss-tokens", "1", "--target-layer-ids", "0,1", "--batch-size", "4"]  # fmt: skip
    files = ["--data", str(first), str(second), "--output-dir", str(tmp_path / "files")]
    assert main(["build-cache", *files, *common]) == 0
    pattern = os.path.join(str(root), "data", "part-*.jsonl.gz")
    assert main(["build-cache", "--data", pattern, "--output-dir", str(tmp_path / "glob"), *common]) == 0
    for output in ("files", "glob"):
        manifest = json.loads((tmp_path / output / "manifest.json").read_text())
        assert manifest["complete"] and manifest["num_rows"] == 12


def test_in_memory_datasets_mix_with_files(parts, tmp_path):
    import datasets

    _, first, _ = parts
    extra = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "hi"}], "id": "mem-0"}])
    both = load_conversations([extra, first], cache_dir=str(tmp_path / "hf"))
    assert ids(both)[0] == "mem-0" and len(both) == 8
