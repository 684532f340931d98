"""examples/demo.py, the main job: its CPU run end to end, and the data a CUDA run trains on."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

from conftest import REPO, load_script, make_tiny_target, require_default_target


def load_demo():
    return load_script("examples/demo.py")


def test_cpu_run_trains_decodes_losslessly_and_writes_its_results(tmp_path):
    """The demo as a user runs it (a short budget): the real target, DraftTrainer, generate() with the draft,
    greedy output identical to the target's, and the results file."""
    require_default_target()
    out = tmp_path / "demo"
    run = subprocess.run(
        [sys.executable, str(REPO / "examples" / "demo.py"), "--minutes", "0.1", "--eval_prompts", "1",
         "--max_new_tokens", "8", "--output_dir", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    results = json.loads((out / "demo_results.json").read_text())
    assert results["device"] == "cpu" and results["train_steps"] >= 1
    assert results["greedy_outputs_identical"] == "1/1" and results["tau"] >= 1.0
    assert "cannot show a speedup" in run.stdout


def test_the_extra_prompts_are_shipped_with_their_sources_and_licences():
    from hf_dspark.data.prompts import read_prompts

    demo = load_demo()
    rows = read_prompts(demo.MORE_PROMPTS)  # the reader regeneration uses (unique ids, non-empty turns)
    assert len(rows) == 4096
    assert all(r.extra["licence"] in ("MIT", "Apache-2.0", "CC0-1.0") and r.extra["source"] for r in rows)
    demo_prompts = {p.turns[0] for p in read_prompts(demo.PROMPTS)}
    assert not demo_prompts & {r.turns[0] for r in rows}  # never a held-out demo prompt


def test_cuda_data_is_the_shipped_answers_plus_the_targets_answers_to_the_extra_prompts(tmp_path, monkeypatch):
    """On CUDA without ../shared the demo has the target answer the extra prompts first (once: a rerun reuses
    them), then trains on those and the shipped answers; with ../shared present it uses that set."""
    require_default_target()
    from transformers import AutoTokenizer

    from hf_dspark.resources import default_target_path

    demo = load_demo()
    monkeypatch.setattr(demo, "SHARED_RESPONSES", tmp_path / "absent.jsonl.gz")
    assert demo.pick_data("auto", cuda=True) == "more"
    assert demo.pick_data("auto", cuda=False) == str(demo.SHIPPED_ANSWERS)
    present = tmp_path / "shared.jsonl.gz"
    present.write_bytes(b"")
    monkeypatch.setattr(demo, "SHARED_RESPONSES", present)
    assert demo.pick_data("auto", cuda=True) == str(present)

    with gzip.open(demo.MORE_PROMPTS, "rt", encoding="utf-8") as f:
        first = [json.loads(next(f)) for _ in range(3)]
    few = tmp_path / "more.jsonl.gz"
    with gzip.open(few, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in first)
    monkeypatch.setattr(demo, "MORE_PROMPTS", few)
    tokenizer = AutoTokenizer.from_pretrained(default_target_path())
    target = make_tiny_target("llama", vocab_size=len(tokenizer))
    target.generation_config.eos_token_id = tokenizer.eos_token_id
    out = tmp_path / "out"
    out.mkdir()
    files = demo.answer_more_prompts(target, tokenizer, out, passes=2)
    assert [f.name for f in files] == ["more_answers_seed0.jsonl", "more_answers_seed1.jsonl"]
    passes = [[json.loads(line) for line in f.read_text().splitlines()] for f in files]
    for rows in passes:
        assert [r["id"] for r in rows] == [r["id"] for r in first]
        assert all(r["messages"][0]["content"] == p["turns"][0] and r["messages"][1]["role"] == "assistant"
                   for r, p in zip(rows, first))  # fmt: skip
    answers = lambda rows: [r["messages"][1]["content"] for r in rows]  # noqa: E731
    assert answers(passes[0]) != answers(passes[1])  # another seed, other samples

    calls = []
    monkeypatch.setattr(demo, "regenerate_responses", lambda *a, **k: calls.append(k["seed"]))
    demo.answer_more_prompts(target, tokenizer, out, passes=3)  # two passes kept, only the third is answered
    assert calls == [2]
