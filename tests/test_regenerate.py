"""Answering prompts with the target: batched, resumable, crash safe."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_target, require_default_target
from torch import nn

from hf_dspark.data import load_conversations, regenerate_responses, tokenize_conversations
from hf_dspark.data.regenerate import finished_ids

PROMPTS = [
    {"id": "a", "source": "test", "turns": ["Say something."]},
    {"id": "b", "source": "test", "turns": ["Count to three.", "Now backwards."]},
    {"id": "c", "source": "test", "turns": ["Name a colour."]},
    {"id": "d", "source": "test", "turns": ["Write a very long sentence about the sea."]},
    {"id": "e", "source": "test", "turns": ["Hi"]},
]


@pytest.fixture(scope="module")
def tokenizer():
    require_default_target()
    from transformers import AutoTokenizer

    from hf_dspark.resources import default_target_path

    return AutoTokenizer.from_pretrained(default_target_path())


def smollm2_vocab_target(tokenizer, attn_implementation: str = "eager"):
    """A tiny random Llama over SmolLM2's vocabulary (its query heads share key/value heads): real generate(), fast
    on CPU."""
    model = make_tiny_target("llama", vocab_size=len(tokenizer), attn_implementation=attn_implementation)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


@pytest.fixture
def target(tokenizer):
    return smollm2_vocab_target(tokenizer)


def write_prompts(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def always_end_turn(target, tokenizer) -> None:
    """Give `target` a head that always prefers <|im_end|>."""
    head = nn.Linear(target.config.hidden_size, target.config.vocab_size, bias=True)
    nn.init.zeros_(head.weight)
    with torch.no_grad():
        head.bias.zero_()
        head.bias[tokenizer.eos_token_id] = 10.0
    target.config.tie_word_embeddings = False
    target.lm_head = head


def record_generate_calls(model, read=lambda kwargs: kwargs["input_ids"].shape[0]) -> list:
    """Wrap `model.generate`; each call appends `read(its kwargs)` (default: the batch's rows) to the list."""
    calls = []
    original = model.generate

    def generate(*args, **kwargs):
        calls.append(read(kwargs))
        return original(*args, **kwargs)

    model.generate = generate
    return calls


def test_writes_one_conversation_per_prompt_with_token_counts(tmp_path, target, tokenizer):
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    out = regenerate_responses(target, tokenizer, prompts, tmp_path / "out.jsonl", batch_size=2,
                               max_new_tokens=6, progress=False)
    rows = read_rows(out)
    assert [r["id"] for r in rows] == ["a", "b", "c", "d", "e"]
    for row, prompt in zip(rows, PROMPTS):
        assert row["source"] == "test"
        assert [m["role"] for m in row["messages"]] == ["user", "assistant"]  # first turn only by default
        assert row["messages"][0]["content"] == prompt["turns"][0]
        text = tokenizer.apply_chat_template(row["messages"][:1], tokenize=False, add_generation_prompt=True)
        assert row["prompt_tokens"] == len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if row["finish"] == "length":
            assert row["completion_tokens"] == 6
        else:
            assert row["finish"] == "stop" and 1 <= row["completion_tokens"] <= 6
    # The output is training data: it loads and tokenizes like any conversation file.
    tokenized = tokenize_conversations(load_conversations(out, cache_dir=str(tmp_path / "hf")), tokenizer, 256,
                                       min_loss_tokens=1)
    assert len(tokenized) == 5


def test_all_turns_are_answered_in_order_seeing_earlier_answers(tmp_path, target, tokenizer):
    calls = record_generate_calls(target)
    out = regenerate_responses(target, tokenizer, PROMPTS[:3], tmp_path / "out.jsonl", batch_size=3,
                               max_new_tokens=4, all_turns=True, progress=False)
    rows = {r["id"]: r for r in read_rows(out)}
    assert calls == [3, 1]  # round 1: all three prompts; round 2: only "b" has a second turn
    b = rows["b"]
    assert [m["role"] for m in b["messages"]] == ["user", "assistant", "user", "assistant"]
    assert b["messages"][2]["content"] == "Now backwards."
    first = tokenizer.apply_chat_template(b["messages"][:1], tokenize=False, add_generation_prompt=True)
    second = tokenizer.apply_chat_template(b["messages"][:3], tokenize=False, add_generation_prompt=True)
    n = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    assert b["prompt_tokens"] == n(first) + n(second)


def test_end_of_turn_token_ends_the_answer_with_finish_stop(tmp_path, target, tokenizer):
    always_end_turn(target, tokenizer)  # every answer is empty and stops at once
    out = regenerate_responses(target, tokenizer, PROMPTS[:2], tmp_path / "out.jsonl", max_new_tokens=8,
                               temperature=0, progress=False)
    for row in read_rows(out):
        assert row["finish"] == "stop" and row["completion_tokens"] == 1
        assert row["messages"][1]["content"] == ""


def test_resume_after_a_crash_repairs_the_last_line_and_matches_an_uninterrupted_run(tmp_path, target, tokenizer):
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    kwargs = dict(batch_size=2, max_new_tokens=5, seed=3, progress=False)
    reference = regenerate_responses(target, tokenizer, prompts, tmp_path / "reference.jsonl", **kwargs)

    # Crash during the second batch...
    original, calls = target.generate, []

    def crashing_generate(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(*args, **kw)

    target.generate = crashing_generate
    out = tmp_path / "out.jsonl"
    with pytest.raises(KeyboardInterrupt):
        regenerate_responses(target, tokenizer, prompts, out, **kwargs)
    target.generate = original
    assert [r["id"] for r in read_rows(out)] == ["a", "b"]
    # ...and a later crash that left half a line behind.
    with open(out, "a") as f:
        f.write('{"id": "c", "messages": [{"role": "us')

    calls = record_generate_calls(target)
    regenerate_responses(target, tokenizer, prompts, out, **kwargs)
    assert calls == [2, 1]  # only c, d, e were generated
    assert out.read_text() == reference.read_text()
    assert finished_ids(out) == {"a", "b", "c", "d", "e"}
    calls.clear()
    regenerate_responses(target, tokenizer, prompts, out, **kwargs)  # nothing left to do
    assert calls == []


def test_a_corrupt_line_before_the_end_is_not_silently_dropped(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "messages": []}\nGARBAGE\n{"id": "b", "messages": []}\n')
    with pytest.raises(ValueError, match="line 2 is not a valid conversation row.*fix or move the file"):
        finished_ids(out)


@pytest.mark.parametrize(
    "rows, message",
    [
        ([], "contains no prompts"),
        ([{"id": "x", "prompt": "hi"}], r"row 1: expected \{'turns'"),
        ([{"id": "x", "turns": []}], r"row 1: expected \{'turns'"),
        ([{"id": "x", "turns": ["a"]}, {"id": "x", "turns": ["b"]}], "row 2: duplicate id 'x'"),
    ],
)
def test_bad_prompt_files_are_refused_before_any_work(tmp_path, target, tokenizer, rows, message):
    prompts = write_prompts(tmp_path / "p.jsonl", rows)
    with pytest.raises(ValueError, match=message):
        regenerate_responses(target, tokenizer, prompts, tmp_path / "out.jsonl", progress=False)
    assert not (tmp_path / "out.jsonl").exists()


def test_regenerate_command_line(tmp_path, target, tokenizer):
    from hf_dspark.cli import main

    target.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS[:3])
    code = main(["regenerate", "--target", str(tmp_path / "tiny"), "--prompts", str(prompts),
                 "--output", str(tmp_path / "out.jsonl"), "--max-new-tokens", "3", "--batch-size", "2",
                 "--all-turns"])
    assert code == 0
    rows = read_rows(tmp_path / "out.jsonl")
    assert [len(r["messages"]) for r in rows] == [2, 4, 2]


def test_a_row_range_and_a_length_limit_answer_part_of_a_prompt_file(tmp_path, target, tokenizer):
    """--rows counts the file's rows before the length filter; ids stay the file's, so the part resumes alone."""
    from hf_dspark.cli import main

    target.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)  # "d" is the one prompt longer than 20 characters
    argv = ["regenerate", "--target", str(tmp_path / "tiny"), "--prompts", str(prompts), "--output",
            str(tmp_path / "out.jsonl"), "--max-new-tokens", "2", "--rows", "2:5", "--max_prompt_chars", "20"]
    assert main(argv) == 0
    assert [r["id"] for r in read_rows(tmp_path / "out.jsonl")] == ["c", "e"]
    assert main(argv[:-4] + ["--rows", "1:"]) == 0  # a wider part answers only what is missing
    assert [r["id"] for r in read_rows(tmp_path / "out.jsonl")] == ["c", "e", "b", "d"]


@pytest.mark.parametrize(("rows", "max_chars", "message"), [
    ("5", None, "START:END"), ("a:3", None, "START:END"), ("-2:", None, "no negative"),
    ("9:", None, "no prompt left"), (None, 0, "max_prompt_chars must be >= 1"),
])  # fmt: skip
def test_a_bad_prompt_selection_names_the_fix(tmp_path, target, tokenizer, rows, max_chars, message):
    from hf_dspark.data.prompts import parse_rows

    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    with pytest.raises(ValueError, match=message):
        regenerate_responses(target, tokenizer, prompts, tmp_path / "out.jsonl", progress=False,
                             rows=parse_rows(rows) if rows else None, max_prompt_chars=max_chars)
    assert not (tmp_path / "out.jsonl").exists()


def test_a_complete_last_row_missing_its_newline_is_kept(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "messages": []}\n{"id": "b", "messages": []}')
    assert finished_ids(out) == {"a", "b"}
    assert out.read_text().endswith('"messages": []}\n')  # the next append starts on a fresh line


def test_static_cache_decoding_answers_like_the_dynamic_cache(tmp_path, target, tokenizer):
    """static_cache: every call decodes on a static cache of one length (longest prompt + max_new_tokens, rounded
    up to 256) and one batch size (a smaller last batch is filled up, the filler's answers dropped) and, greedy
    in float32, writes exactly what the dynamic cache writes; all_turns cannot use it."""
    configs = record_generate_calls(
        target, lambda kwargs: (kwargs["generation_config"].cache_implementation,
                                kwargs["generation_config"].max_cache_len, kwargs["input_ids"].shape[0])
    )  # fmt: skip
    first_turns = [p for p in PROMPTS if len(p["turns"]) == 1]  # 4 prompts: batches of 3 and 1
    settings = dict(batch_size=3, max_new_tokens=12, temperature=0, progress=False)
    static = regenerate_responses(target, tokenizer, first_turns, tmp_path / "static.jsonl", static_cache=True,
                                  **settings)  # fmt: skip
    assert configs == [("static", 256, 3)] * 2
    configs = record_generate_calls(target, lambda kwargs: kwargs["generation_config"])
    configs.clear()
    dynamic = regenerate_responses(target, tokenizer, first_turns, tmp_path / "dynamic.jsonl", **settings)
    assert {c.cache_implementation for c in configs} == {None}  # "auto" on CPU: the dynamic cache
    assert read_rows(static) == read_rows(dynamic)
    with pytest.raises(ValueError, match="static_cache needs every prompt's length up front"):
        regenerate_responses(target, tokenizer, PROMPTS, tmp_path / "x.jsonl", all_turns=True, static_cache=True,
                             **settings)  # fmt: skip


def test_grouped_attention_writes_what_sdpa_writes(tmp_path, tokenizer):
    """grouped_attention (default on): an "sdpa" target with grouped key/value heads answers through
    hf_dspark.grouped_sdpa during the run, writes exactly what plain "sdpa" writes (greedy, static cache, float32)
    and gets its own attention setting back afterwards."""
    from hf_dspark.grouped_sdpa import NAME

    target = smollm2_vocab_target(tokenizer, attn_implementation="sdpa")
    used = record_generate_calls(target, lambda kwargs: target.config._attn_implementation)
    first_turns = [p for p in PROMPTS if len(p["turns"]) == 1]
    settings = dict(batch_size=2, max_new_tokens=12, temperature=0, progress=False, static_cache=True)
    grouped = regenerate_responses(target, tokenizer, first_turns, tmp_path / "grouped.jsonl", **settings)
    assert set(used) == {NAME} and target.config._attn_implementation == "sdpa"
    used.clear()
    plain = regenerate_responses(target, tokenizer, first_turns, tmp_path / "plain.jsonl", grouped_attention=False,
                                 **settings)  # fmt: skip
    assert set(used) == {"sdpa"}
    assert read_rows(grouped) == read_rows(plain)


def test_continuous_batching_writes_what_generate_writes(tmp_path, target, tokenizer):
    """engine="continuous" (transformers' generate_batch): greedy, the same answers, finish reasons and token
    counts as fixed batches through generate(); an end-of-turn answer stops with finish "stop"; first turns only."""
    first_turns = [p for p in PROMPTS if len(p["turns"]) == 1]
    settings = dict(batch_size=2, max_new_tokens=9, temperature=0, progress=False)
    continuous = regenerate_responses(target, tokenizer, first_turns, tmp_path / "cb.jsonl", engine="continuous",
                                      **settings)  # fmt: skip
    fixed = regenerate_responses(target, tokenizer, first_turns, tmp_path / "fixed.jsonl", **settings)
    assert read_rows(continuous) == read_rows(fixed)
    with pytest.raises(ValueError, match="first turns on its own paged cache"):
        regenerate_responses(target, tokenizer, PROMPTS, tmp_path / "x.jsonl", all_turns=True, engine="continuous",
                             **settings)  # fmt: skip
    with pytest.raises(ValueError, match="engine must be one of generate, continuous"):
        regenerate_responses(target, tokenizer, PROMPTS, tmp_path / "x.jsonl", engine="vllm", **settings)
    always_end_turn(target, tokenizer)  # empty answers that stop at once
    out = regenerate_responses(target, tokenizer, first_turns[:2], tmp_path / "eos.jsonl", engine="continuous",
                               **settings)  # fmt: skip
    assert [(r["finish"], r["completion_tokens"], r["messages"][1]["content"]) for r in read_rows(out)] == [
        ("stop", 1, "")] * 2


def test_a_failing_grouped_attention_falls_back_to_the_models_own(tmp_path, tokenizer, monkeypatch, caplog):
    """If grouped attention fails on some machine, the batch is answered again with the model's own attention (and
    so is the rest), with a warning: a data run is not lost to an optimization."""
    import hf_dspark.grouped_sdpa as grouped

    target = smollm2_vocab_target(tokenizer, attn_implementation="sdpa")
    first_turns = [p for p in PROMPTS if len(p["turns"]) == 1]
    settings = dict(batch_size=2, max_new_tokens=6, temperature=0, progress=False, static_cache=True)
    plain = regenerate_responses(target, tokenizer, first_turns, tmp_path / "plain.jsonl", grouped_attention=False,
                                 **settings)  # fmt: skip

    def broken(*args, **kwargs):
        raise RuntimeError("kernel not supported")

    monkeypatch.setattr(grouped, "grouped_sdpa_attention", broken)  # what register() installs
    with caplog.at_level("WARNING"):
        out = regenerate_responses(target, tokenizer, first_turns, tmp_path / "fallback.jsonl", **settings)
    assert read_rows(out) == read_rows(plain)
    assert "grouped attention failed (RuntimeError: kernel not supported)" in caplog.text
    assert target.config._attn_implementation == "sdpa"
    monkeypatch.undo()
    grouped.register()  # the working function back in transformers' (process-wide) attention registry


def test_the_default_samples_the_targets_own_distribution_on_the_command_line_too():
    """Answers sampled at temperature 1 without top-p/top-k trained the best drafts for sampled decoding (the data
    ablation in benchmarks/results): the library and `hf-dspark regenerate` default to it, one set of values."""
    import dataclasses
    import inspect

    from hf_dspark.data.cli import RegenerateArguments

    library = inspect.signature(regenerate_responses).parameters
    cli = {f.name: f.default for f in dataclasses.fields(RegenerateArguments)}
    for name, value in {"temperature": 1.0, "top_p": 1.0, "top_k": 0}.items():
        assert library[name].default == cli[name] == value, name
