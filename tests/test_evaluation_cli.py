"""`hf-dspark eval` end to end on a tiny random target that uses SmolLM2's tokenizer and chat template."""

import json

import pytest
from conftest import load_script, make_tiny_target

from hf_dspark import DFlashModel, DSparkModel, Eagle3Model
from hf_dspark.cli import main
from hf_dspark.evaluation.report import ROW_KEYS
from hf_dspark.evaluation.runner import load_drafts, load_eval_prompts, render_prompts

PROMPTS = ["What is 2+2?", "Write a haiku about rain.", "Name three colors."]
STORED_TEMPERATURES = [1.5, 2.0, 2.5, 3.0]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """target/ (tiny llama, vocab 49152, SmolLM2 tokenizer), dspark/ (with STS temperatures), dflash/, eagle3/,
    prompts.jsonl."""
    from transformers import AutoTokenizer

    from hf_dspark.resources import default_target_path

    try:
        tokenizer = AutoTokenizer.from_pretrained(default_target_path())
    except (ImportError, FileNotFoundError) as err:
        pytest.skip(f"SmolLM2 tokenizer unavailable: {err}")
    root = tmp_path_factory.mktemp("eval_cli")
    target = make_tiny_target("llama", vocab_size=len(tokenizer))
    for config in (target.config, target.generation_config):
        config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    DSparkModel.from_target(
        target, num_hidden_layers=1, block_size=4, markov_rank=8, confidence_temperatures=STORED_TEMPERATURES
    ).save_pretrained(root / "dspark")
    DFlashModel.from_target(target, num_hidden_layers=1, block_size=4).save_pretrained(root / "dflash")
    Eagle3Model.from_target(target, block_size=3).save_pretrained(root / "eagle3")
    with open(root / "prompts.jsonl", "w") as f:
        for text in PROMPTS:
            f.write(json.dumps({"turns": [text, "a second turn that is never used"]}) + "\n")
    return root


def test_eval_help_lists_the_documented_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--target", "--draft", "--data", "--num_prompts", "--max_new_tokens", "--temperature",
                   "--output_dir", "--batch_size", "--seed"):
        assert option in text


def test_prompts_are_the_first_n_first_turns_in_the_chat_template(workdir):
    from transformers import AutoTokenizer

    prompts = load_eval_prompts(workdir / "prompts.jsonl", 2)
    assert prompts == PROMPTS[:2]
    tokenizer = AutoTokenizer.from_pretrained(workdir / "target")
    text = tokenizer.decode(render_prompts(tokenizer, prompts)[1])
    assert PROMPTS[1] in text and "second turn" not in text
    assert text.endswith("<|im_start|>assistant\n")  # the generation prompt
    with pytest.raises(ValueError, match="num_prompts must be >= 1"):
        load_eval_prompts(workdir / "prompts.jsonl", 0)


def test_drafts_are_named_by_model_type_then_folder(workdir, tmp_path):
    import shutil

    target = make_tiny_target("llama", vocab_size=49152)
    drafts = load_drafts([str(workdir / "dspark"), str(workdir / "eagle3")], target)
    assert list(drafts) == ["dspark", "eagle3"]
    shutil.copytree(workdir / "dspark", tmp_path / "dspark_v2")
    drafts = load_drafts([str(workdir / "dspark"), str(tmp_path / "dspark_v2"), f"mine={workdir / 'dflash'}"], target)
    assert list(drafts) == ["dspark", "dspark_v2", "mine"]
    with pytest.raises(ValueError, match="not a draft"):
        load_drafts([str(workdir / "target")], target)
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        load_drafts([str(tmp_path / "missing")], target)


def test_draft_for_another_vocabulary_is_rejected(workdir):
    from hf_dspark.evaluation import evaluate_drafts, load_target

    target, tokenizer = load_target(workdir / "target")
    other = DFlashModel.from_target(make_tiny_target("llama"), num_hidden_layers=1, block_size=2)  # vocab 96
    with pytest.raises(ValueError, match="trained for another target"):
        evaluate_drafts(target, tokenizer, {"other": other}, [workdir / "prompts.jsonl"], num_prompts=1)


def test_eval_end_to_end(workdir, capsys):
    out = workdir / "out"
    code = main([
        "eval", "--target", str(workdir / "target"), "--draft", str(workdir / "dspark"), "--draft",
        str(workdir / "eagle3"), "--data", str(workdir / "prompts.jsonl"), "--num_prompts", "2",
        "--max_new_tokens", "8", "--temperature", "0", "1", "--output_dir", str(out), "--no_progress",
    ])
    assert code == 0
    assert "## tau and speedup, temperature 0" in capsys.readouterr().out
    data = json.loads((out / "results.json").read_text())
    assert data["command"].startswith("hf-dspark eval --target")
    assert data["hardware"].startswith("CPU") and data["target"] == str(workdir / "target")
    assert data["settings"]["num_prompts"] == {"prompts": 2}
    assert data["settings"]["static_baseline"] is False  # "auto": transformers compiles it on CUDA only
    assert "static_baseline" not in data["command"]
    assert "first 2 prompts" in data["settings"]["prompt_subset"]
    rows = {(r["drafter"], r["temperature"]): r for r in data["results"]}
    assert set(rows) == {("dspark", 0.0), ("eagle3", 0.0), ("dspark", 1.0), ("eagle3", 1.0)}
    baselines = {b["temperature"]: b for b in data["baselines"]}
    for (drafter, temp), row in rows.items():
        assert set(ROW_KEYS) <= set(row)
        assert row["rounds"] > 0 and row["tau"] == pytest.approx(row["committed_tokens"] / row["rounds"])
        assert len(row["accept_rate_by_position"]) <= row["block_size"]
        assert row["speedup"] == pytest.approx(row["tokens_per_s"] / baselines[temp]["tokens_per_s"])
        assert row["target_graphs"] is False  # CPU: generate()'s default is the dynamic cache
        # Each prompt's first token comes from the prefill; every later one was committed by a round.
        assert row["new_tokens"] - 2 <= row["committed_tokens"] <= row["new_tokens"]
        if temp == 0.0:  # greedy speculative decoding reproduces the target's own output, so its length too
            assert row["new_tokens"] == baselines[0.0]["new_tokens"]
    calibration = rows[("dspark", 0.0)]["calibration"]
    assert calibration["stored_temperatures"] == STORED_TEMPERATURES
    # Rounds that proposed nothing (max_new_tokens left room for one token only) carry no confidences.
    assert 0 < calibration["num_rounds"] <= rows[("dspark", 0.0)]["rounds"]
    assert calibration["stored_sts"] is not None and calibration["held_out"] is not None
    assert rows[("eagle3", 0.0)]["calibration"] is None
    for name in ("results.md", "acceptance_by_position_T0.png", "acceptance_by_position_T1.png",
                 "reliability_dspark_prompts_T0.png", "reliability_dspark_prompts_T1.png"):
        assert (out / name).stat().st_size > 0
    markdown = (out / "results.md").read_text()
    assert "| dspark |" in markdown and "| eagle3 |" in markdown
    # Each draft is also scored teacher-forced on the target-alone answers of the same prompts and temperature.
    for (drafter, temp), row in rows.items():
        forced = row["teacher_forced"]
        assert forced["sequences"] <= 2 and 1.0 <= forced["tau_greedy"] <= row["block_size"] + 1, (drafter, temp)
        # ... and walked as decoding runs rounds (every answer position has a block at this length).
        assert 1.0 <= forced["tau_walk_greedy"] <= row["block_size"] + 1, (drafter, temp)
    assert "| dspark, teacher-forced on the target's answers |" in markdown
    assert "| dspark, the same walked as decoding |" in markdown


def test_eval_static_baseline(workdir, capsys):
    """--static_baseline times the target alone with a static cache too; rows gain the second speedup."""
    out = workdir / "out-static"
    code = main([
        "eval", "--target", str(workdir / "target"), "--draft", str(workdir / "dspark"), "--data",
        str(workdir / "prompts.jsonl"), "--num_prompts", "2", "--max_new_tokens", "6", "--output_dir", str(out),
        "--no_progress", "--no_plots", "--static_baseline", "--no_teacher_forced",
    ])
    assert code == 0
    data = json.loads((out / "results.json").read_text())
    assert "--static_baseline true" in data["command"] and data["settings"]["static_baseline"] is True
    assert "--no_teacher_forced" in data["command"] and "teacher_forced" not in data["results"][0]
    (baseline,) = data["baselines"]
    static = baseline["static_cache"]
    assert static["new_tokens"] == baseline["new_tokens"]  # greedy: the same outputs, so the same lengths
    # One cache length for the run (longest prompt + 6, rounded up), one warm-up per batch shape (batch 1 here).
    assert static["static_cache_len"] == data["settings"]["static_cache_len"] == 256
    assert static["static_warmup_calls"] == 1 and static["static_cache_batch_shapes"] == [1]
    (row,) = data["results"]
    assert row["speedup_vs_static_target"] == pytest.approx(row["tokens_per_s"] / static["tokens_per_s"])
    markdown = (out / "results.md").read_text()
    assert "target alone, static cache" in markdown and "one StaticCache length (256 tokens)" in markdown


def test_eval_without_the_eager_baseline(workdir, capsys):
    """--eager_baseline false: the target alone runs on the static cache only (no eager call of it at all), the
    teacher-forced τ reads the static run's answers, rows carry no eager speedup; without the static baseline
    there would be none, which is refused."""
    import hf_dspark.evaluation.runner as runner

    out = workdir / "out-no-eager"
    calls = []
    original = runner._generate

    def generate(target, inputs, generation_config, eos_ids, draft=None, generate_kwargs=None, static=None):
        calls.append("draft" if draft is not None else "static" if static is not None else "eager")
        return original(target, inputs, generation_config, eos_ids, draft, generate_kwargs, static)

    runner._generate = generate
    try:
        code = main([
            "eval", "--target", str(workdir / "target"), "--draft", str(workdir / "dspark"), "--data",
            str(workdir / "prompts.jsonl"), "--num_prompts", "2", "--max_new_tokens", "6", "--output_dir", str(out),
            "--no_progress", "--no_plots", "--static_baseline", "--eager_baseline", "false",
        ])
    finally:
        runner._generate = original
    assert code == 0 and "eager" not in calls and {"static", "draft"} <= set(calls)
    data = json.loads((out / "results.json").read_text())
    assert "--eager_baseline false" in data["command"] and data["settings"]["eager_baseline"] is False
    (baseline,) = data["baselines"]
    assert baseline["tokens_per_s"] is None and baseline["static_cache"]["tokens_per_s"] > 0
    (row,) = data["results"]
    assert row["speedup"] is None and row["speedup_vs_static_target"] > 0
    assert row["teacher_forced"]["tau_greedy"] >= 1.0  # on the static run's answers
    markdown = (out / "results.md").read_text()
    assert "ran on its static cache only" in markdown and "–x" not in markdown
    capsys.readouterr()
    code = main(["eval", "--target", str(workdir / "target"), "--draft", str(workdir / "dspark"), "--data",
                 str(workdir / "prompts.jsonl"), "--num_prompts", "1", "--max_new_tokens", "2", "--output_dir",
                 str(workdir / "out-none"), "--no_progress", "--no_plots", "--static_baseline", "false",
                 "--eager_baseline", "false"])  # fmt: skip
    assert code == 2 and "pass static_baseline=True (--static_baseline true)" in capsys.readouterr().err


def test_one_draft_under_two_names_decodes_with_its_own_options(workdir, capsys):
    """--draft_kwargs NAME=JSON: options for one draft over --generate_kwargs, so the same folder under two names
    decodes side by side (same prompts, seeds and baselines); recorded in the settings, the command and the report,
    and compare_evals pairs the two rows of the one run. A name that is no draft is refused."""
    import hf_dspark.evaluation.runner as runner

    out = workdir / "out-per-draft"
    seen = []
    original = runner._generate

    def generate(target, inputs, generation_config, eos_ids, draft=None, generate_kwargs=None, static=None):
        if draft is not None:
            seen.append(dict(generate_kwargs))
        return original(target, inputs, generation_config, eos_ids, draft, generate_kwargs, static)

    runner._generate = generate
    path = str(workdir / "dspark")
    try:
        code = main([
            "eval", "--target", str(workdir / "target"), "--draft", f"k1={path}", "--draft", f"k2={path}", "--data",
            str(workdir / "prompts.jsonl"), "--num_prompts", "2", "--max_new_tokens", "6", "--output_dir", str(out),
            "--no_progress", "--no_plots", "--temperature", "1", "--generate_kwargs", '{"dspark_verification": "token"}',
            "--draft_kwargs", 'k2={"dspark_candidates": 2}',
        ])  # fmt: skip
    finally:
        runner._generate = original
    assert code == 0
    both = {"dspark_verification": "token"}
    assert both in seen and {**both, "dspark_candidates": 2} in seen and len(seen) >= 4
    data = json.loads((out / "results.json").read_text())
    assert data["settings"]["draft_generate_kwargs"] == {"k2": {"dspark_candidates": 2}}
    assert "--draft_kwargs" in data["command"] and '"dspark_candidates": 2' in data["command"]
    assert "k2's generate() options" in (out / "results.md").read_text()
    assert {row["drafter"] for row in data["results"]} == {"k1", "k2"}
    compare = load_script("benchmarks/compare_evals.py")
    paired = compare.compare({"k1": data, "k2": data}, ["k1", "k2"])["1"]
    assert "tau_vs_reference" in paired["k2"]
    capsys.readouterr()
    code = main(["eval", "--target", str(workdir / "target"), "--draft", path, "--data", str(workdir / "prompts.jsonl"),
                 "--num_prompts", "1", "--max_new_tokens", "2", "--output_dir", str(workdir / "out-bad"),
                 "--no_progress", "--no_plots", "--draft_kwargs", 'k9={"dspark_candidates": 2}'])  # fmt: skip
    assert code == 2 and "not among the drafts" in capsys.readouterr().err
    code = main(["eval", "--target", str(workdir / "target"), "--draft", path, "--data", str(workdir / "prompts.jsonl"),
                 "--output_dir", str(workdir / "out-bad"), "--draft_kwargs", "k2=3"])  # fmt: skip
    assert code == 2 and "is not NAME=JSON" in capsys.readouterr().err


def test_missing_prompt_file_names_the_expected_format(workdir, tmp_path, capsys):
    code = main(["eval", "--target", str(workdir / "target"), "--draft", str(workdir / "dflash"), "--data",
                 str(tmp_path / "nope.jsonl"), "--output_dir", str(tmp_path / "out")])
    assert code == 2
    assert "turns" in capsys.readouterr().err


def test_drafts_warm_up_on_the_longest_batch_so_timed_calls_keep_their_static_buffers(workdir, tmp_path, monkeypatch):
    """The static verification buffers are kept between calls and sized by the first call that needs them: the
    warm-up runs the longest prompt batch of every dataset, so no timed call builds (on CUDA: captures) new ones."""
    from hf_dspark import evaluate_drafts
    from hf_dspark.generation import target_graphs
    from hf_dspark.resources import load_target

    short, long_ = tmp_path / "short.jsonl", tmp_path / "long.jsonl"
    short.write_text(json.dumps({"turns": ["Hi."]}) + "\n")
    long_.write_text(json.dumps({"turns": ["word " * 260]}) + "\n")  # past the first capacity step
    target, tokenizer = load_target(workdir / "target")
    draft = DSparkModel.from_pretrained(workdir / "dspark")
    built = []
    runner = target_graphs.StaticTargetRunner
    monkeypatch.setattr(target_graphs, "StaticTargetRunner", lambda *a, **k: built.append(a) or runner(*a, **k))
    evaluate_drafts(target, tokenizer, {"dspark": draft}, [short, long_], max_new_tokens=8, batch_size=1,
                    progress=False, plots=False, generate_kwargs={"dspark_target_graphs": True})  # fmt: skip
    assert len(built) == 1  # the warm-up's: every timed call of both datasets reused it


def test_drafts_warm_up_again_at_each_temperature(workdir, tmp_path, monkeypatch):
    """A sampled round is another graph than a greedy one: each temperature's first timed call must not build it."""
    from hf_dspark import evaluate_drafts
    from hf_dspark.evaluation import runner
    from hf_dspark.resources import load_target

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["Hi."]}) + "\n")
    target, tokenizer = load_target(workdir / "target")
    draft = DSparkModel.from_pretrained(workdir / "dspark")
    draft_calls = []  # do_sample of every generate() call with the draft
    generate = runner._generate

    def recording(target, inputs, config, eos_ids, draft=None, *args, **kwargs):
        if draft is not None:
            draft_calls.append(config.do_sample)
        return generate(target, inputs, config, eos_ids, draft, *args, **kwargs)

    monkeypatch.setattr(runner, "_generate", recording)
    evaluate_drafts(target, tokenizer, {"dspark": draft}, [prompts], max_new_tokens=4, batch_size=1,
                    temperature=[0, 1], progress=False, plots=False, teacher_forced=False)  # fmt: skip
    # per temperature: the warm-up, then the prompt rehearsed untimed and timed
    assert draft_calls == [False] * 3 + [True] * 3


def test_a_timed_call_that_compiled_is_timed_again_warm(workdir, monkeypatch):
    """A timed call that compiled (or captured a CUDA graph) inside its timing is run again with the same seed and
    its warm timing kept; without the warm-up nothing is rerun, and the row and the report say what the timing holds."""
    import torch

    from hf_dspark import evaluate_drafts
    from hf_dspark.evaluation.report import results_markdown
    from hf_dspark.resources import load_target

    target, tokenizer = load_target(workdir / "target")
    draft = DSparkModel.from_pretrained(workdir / "dspark")
    generate = target.generate

    def evaluate(compile_on_call, warmup):
        draft_calls = []

        def compiling_once(*args, **kwargs):
            if kwargs.get("assistant_model") is not None:
                draft_calls.append(1)
                if len(draft_calls) == compile_on_call:  # a real torch.compile inside this generate() call
                    torch.compiler.reset()  # (dynamo would reuse the lambda's code compiled in an earlier run)
                    torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))
            return generate(*args, **kwargs)

        monkeypatch.setattr(target, "generate", compiling_once)
        results = evaluate_drafts(target, tokenizer, {"dspark": draft}, [workdir / "prompts.jsonl"], num_prompts=2,
                                  max_new_tokens=6, batch_size=1, warmup=warmup, progress=False, plots=False,
                                  teacher_forced=False)  # fmt: skip
        return results, len(draft_calls)

    clean, _ = evaluate(compile_on_call=0, warmup=True)
    rehearsed, calls = evaluate(compile_on_call=2, warmup=True)  # call 1 is the warm-up, 2 the first rehearsal
    assert calls == 5 and rehearsed.rows[0]["retimed_calls"] == 0  # one-time work in a rehearsal stays untimed
    assert rehearsed.rows[0]["compile_s_in_timing"] == 0 and rehearsed.settings["draft_calls_rehearsed"]
    assert "ran once untimed before its timed run" in results_markdown(rehearsed)
    retimed, calls = evaluate(compile_on_call=3, warmup=True)  # call 3: the first timed one
    row, clean_row = retimed.rows[0], clean.rows[0]
    assert calls == 6  # the warm-up, two prompts rehearsed and timed, the first of them timed once more
    assert (row["retimed_calls"], row["compile_s_in_timing"], row["graph_captures_in_timing"]) == (1, 0, 0)
    assert (row["tau"], row["new_tokens"]) == (clean_row["tau"], clean_row["new_tokens"])  # same seed, same outputs
    per_prompt = row["tau_by_request"]  # one entry per prompt, in prompt order, summing to the row's totals
    assert len(per_prompt["rounds"]) == 2 and sum(per_prompt["rounds"]) == row["rounds"]
    assert sum(per_prompt["committed"]) == row["committed_tokens"]
    assert clean_row["retimed_calls"] == 0 and retimed.baselines[0]["retimed_calls"] == 0
    md = results_markdown(retimed)
    assert "timed again" in md and "dspark, prompts, T = 0 (1)" in md and "still hold" not in md
    assert "timed again" not in results_markdown(clean)

    unwarmed, calls = evaluate(compile_on_call=1, warmup=False)
    row = unwarmed.rows[0]
    assert calls == 2 and row["retimed_calls"] == 0 and row["compile_s_in_timing"] > 0
    assert "timings that still hold one-time work" in results_markdown(unwarmed)
