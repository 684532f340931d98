"""The generation benchmark runs end to end (tiny random target, CPU) and its greedy check holds in float32."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from conftest import REPO, load_script

from hf_dspark.generation.speculative import PHASES


@pytest.fixture(scope="module")
def generation_speed():
    return load_script("benchmarks/generation_speed.py")


def test_generation_speed_smoke_rows_and_greedy_equality(generation_speed, tmp_path):
    out = tmp_path / "speed.json"
    profile = tmp_path / "profile.txt"
    argv = ["--smoke", "--device", "cpu", "--dtype", "float32", "--batch-sizes", "1", "4", "--num-prompts", "4",
            "--json", str(out), "--profile", str(profile), "--profile-temperature", "1", "--static-target", "--compare-paths",
            "--candidates", "2"]
    assert generation_speed.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["command"].startswith("generation_speed.py --smoke")
    rows = result["rows"]
    methods = {r["method"] for r in rows}
    assert {"target", "prompt_lookup", "target+static-cache", "dspark", "dspark/static", "dspark/dynamic", "dspark/eager", "dspark/fused",
            "dspark/compiled", "dspark/compiled-draft", "dspark/fused-compiled-draft", "dspark/fused-compiled-verify",
            "dspark+threshold",
            "dspark+prefix", "dspark+k2", "dflash", "dflash+k2", "eagle3", "eagle3/compiled-draft"} <= methods
    assert "eagle3+k2" not in methods  # (a tree of chains needs a block drafter)
    assert result["complete"] is True
    for row in rows:
        assert not row["note"].startswith("failed"), row  # a compared path that errors is reported, not hidden
        if row["note"].startswith("skipped"):
            continue
        assert row["new_tokens"] > 0 and row["tokens_per_second"] > 0, row
        if row.get("tau") is not None and row["method"] != "prompt_lookup":  # τ with its interval over prompts
            assert row["tau_ci95"][0] <= row["tau"] <= row["tau_ci95"][1], row  # 4 prompts: an interval
        # The warm-ups (and any retiming) leave no compilation or graph capture inside a kept timing.
        assert (row["compile_s_in_timing"], row["graph_captures_in_timing"]) == (0, 0), row
        if row["temperature"] == 0 and row["method"] != "target":
            # float32 on CPU: every greedy decoding path reproduces target.generate() exactly.
            assert row["matches_target"] is True, row
            assert row["greedy_first_divergence"] == []
    # One cache length and one warm-up per batch shape for the whole run (rows: T 0 then 1, batch 1 then 4).
    static = [r for r in rows if r["method"] == "target+static-cache"]
    assert [r["static_cache_len"] for r in static] == [256] * 4
    assert [r["static_warmup_calls"] for r in static] == [1, 2, 2, 2]
    assert [r["static_cache_batch_shapes"] for r in static] == [[1], [1, 4], [1, 4], [1, 4]]
    # The target-alone rows give the cost of a step and the row fill their tokens/s came from.
    for row in (r for r in rows if r["method"] in ("target", "target+static-cache")):
        assert row["ms_per_step"] > 0 and 0 < row["row_fill"] <= 1, row
        steps = row["new_tokens"] / row["row_fill"] / row["batch_size"]  # full batches: slots = batch size x steps
        assert row["ms_per_step"] == pytest.approx(1e3 * row["seconds"] / steps, rel=1e-6), row
    text = profile.read_text()
    assert "per new token" in text
    assert [line.split(":")[0] for line in text.splitlines() if line.startswith("## ")] == \
        ["## target alone", "## dspark", "## dspark+k2"]  # the first draft, also with the tree round
    text = text.split("## dspark+k2")[0]
    # The draft's call: operators per round in each phase of the decoding loop, every phase present.
    lines = [line for line in text.split("by phase of the round")[1].splitlines()[3:] if line.startswith("|")]
    phases = {cells[0]: [float(c) for c in cells[1:]] for cells in (line.strip("| ").split(" | ") for line in lines)}
    assert set(PHASES) <= set(phases)
    # Each phase also in target steps' worth (operators a round / a target-alone step's); the total is the phases'.
    total = phases.pop("all phases")
    in_rounds = [v for name, v in phases.items() if name != "outside"]
    assert total[0] == sum(v[0] for v in in_rounds) and total[2] > 0
    assert total[2] == pytest.approx(sum(v[2] for v in in_rounds), abs=0.01)


def test_a_timed_call_that_compiled_runs_again_from_the_same_random_state(generation_speed, monkeypatch):
    """A timed call that compiled inside its timing is run again warm and kept; sampled, the rerun starts from the
    same random state, so the outputs are those of a run without the compile."""
    import torch

    args = generation_speed.parse_args(["--smoke", "--device", "cpu", "--dtype", "float32", "--num-prompts", "3"])
    target, _, drafts, prompts = generation_speed.smoke_setup(args, torch.device("cpu"), torch.float32)
    generate = target.generate

    def measure(compile_on_call):
        calls = []

        def compiling_once(*a, **k):
            calls.append(1)
            if len(calls) == compile_on_call:
                torch.compiler.reset()  # (dynamo would reuse the lambda's code compiled in an earlier run)
                torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))
            return generate(*a, **k)

        monkeypatch.setattr(target, "generate", compiling_once)
        row = generation_speed.Row("dspark", 1, 1.0)
        outputs, _ = generation_speed.run_method(row, target, prompts, 1, 1.0, args, 0, [2], drafts["dspark"])
        return row, outputs, len(calls)

    clean, clean_outputs, _ = measure(compile_on_call=0)
    # Warm-ups: the first batch (every batch has one prompt here) and the longest; call 3 is the first timed one.
    row, outputs, calls = measure(compile_on_call=3)
    assert calls == 3 + len(prompts)  # two warm-ups, the timed prompts, the first of them once more
    assert row.extra["retimed_calls"] == 1 and clean.extra["retimed_calls"] == 0
    assert (row.extra["compile_s_in_timing"], row.extra["graph_captures_in_timing"]) == (0, 0)
    assert all(torch.equal(a, b) for a, b in zip(outputs, clean_outputs)) and row.new_tokens == clean.new_tokens


def test_compare_paths_takes_a_subset(generation_speed, tmp_path):
    out = tmp_path / "speed.json"
    argv = ["--smoke", "--device", "cpu", "--dtype", "float32", "--batch-sizes", "1", "--num-prompts", "2",
            "--temperatures", "0", "--json", str(out), "--compare-paths", "fused", "eager", "--candidates", "2"]  # fmt: skip
    assert generation_speed.main(argv) == 0
    methods = [r["method"] for r in json.loads(out.read_text())["rows"] if r["method"].startswith("dspark")]
    # Paths named explicitly serve the tree round too.
    assert sorted(m for m in methods if "/" in m) == ["dspark+k2/eager", "dspark+k2/fused", "dspark/eager",
                                                      "dspark/fused"]
    assert all(r["matches_target"] for r in json.loads(out.read_text())["rows"] if r["method"] in methods)


def test_greedy_agreement_reports_divergence(generation_speed):
    import torch

    row = generation_speed.Row("x", 2, 0.0)
    reference = [torch.tensor([[5, 6, 2, 0], [7, 8, 9, 4]])]
    outputs = [torch.tensor([[5, 6, 2, 2], [7, 3, 9, 4]])]  # row 0 equal up to EOS (2), row 1 differs at token 1
    generation_speed.greedy_agreement(row, outputs, reference, eos_ids=[2])
    assert row.matches_target is False
    assert row.extra["greedy_identical_rows"] == "1/2"
    assert row.extra["greedy_first_divergence"] == [1]


@pytest.mark.parametrize("extra", [[], ["--compile_target", "--torch_compile"]], ids=["eager", "compiled"])
def test_profile_training_smoke_reports_every_phase(tmp_path, extra):
    module = load_script("benchmarks/profile_training.py")
    out = tmp_path / "profile.json"
    report = module.main(["--device", "cpu", "--smoke", "--trace_steps", "0", "--output", str(out), *extra])
    for key in ("phase_ms", "host_phase_ms"):  # synchronized, and the host's issue time
        assert set(report[key]) == set(module.PHASES) and all(v > 0 for v in report[key].values())
    assert report["trainer_step_ms"] > 0 and json.loads(out.read_text())["hardware"]["torch"]


def test_profile_training_random_weights_keep_the_target_shape_without_its_weights(tmp_path):
    """--random_weights: the folder's config with seeded random weights; the weights file is never read."""
    import torch
    from conftest import make_tiny_target

    module = load_script("benchmarks/profile_training.py")
    saved = make_tiny_target("llama")
    saved.save_pretrained(tmp_path)
    for weights in tmp_path.glob("*.safetensors"):
        weights.unlink()
    first, again = (module.random_target(tmp_path, torch.float32, seed=3) for _ in range(2))
    assert first.config.to_dict() == again.config.to_dict() and not first.training
    assert first.config.num_hidden_layers == saved.config.num_hidden_layers
    assert first.config.hidden_size == saved.config.hidden_size
    names = [n for n, _ in saved.named_parameters()]
    assert names == [n for n, _ in first.named_parameters()]
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), again.parameters()))  # seeded
    assert not all(torch.equal(a, b) for a, b in zip(first.parameters(), saved.parameters()))


def test_profile_training_traces_steps_after_untraced_ones():
    """The kernel table traces the last --trace_steps steps of one train() call, after --warmup untraced ones (a
    fresh train()'s first step holds one-time work), times the same steps, and leaves the trainer's callbacks as
    they were."""
    module = load_script("benchmarks/profile_training.py")
    args = module.parse_args(["--device", "cpu", "--smoke"])
    args.batch_size, args.max_length, args.num_anchors = 2, 64, 8
    with tempfile.TemporaryDirectory() as tmp:
        trainer = module.build(args, False, tmp)
        callbacks = list(trainer.callback_handler.callbacks)
        families, summary = module.kernel_table(trainer, 2, False, warmup=2)
        assert trainer.callback_handler.callbacks == callbacks
        assert trainer.state.global_step == 4  # 2 untraced + 2 traced, in one run
    assert families == []  # no CUDA kernels on CPU
    assert summary["traced_steps"] == 2 and summary["untraced_steps_before"] == 2
    assert summary["wall_ms_per_step"] > 0 and summary["device_busy_ms_per_step"] == 0


def test_profile_training_step_median_leaves_out_steps_that_compiled(monkeypatch):
    """A padded length first seen after the warm-up compiles inside its step: the trainer step's median leaves such
    steps out (and says how many), and the clock's callback is gone afterwards."""
    from hf_dspark import compilation

    module = load_script("benchmarks/profile_training.py")
    args = module.parse_args(["--device", "cpu", "--smoke"])
    args.batch_size, args.max_length, args.num_anchors = 2, 64, 8
    calls = []

    def one_time_work_since(mark):  # steps 2 and 4 of 5 "compiled"
        calls.append(mark)
        return (1.5 if len(calls) in (2, 4) else 0.0), 0

    monkeypatch.setattr(compilation, "one_time_work_since", one_time_work_since)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = module.build(args, False, tmp)
        callbacks = list(trainer.callback_handler.callbacks)
        times, first, left_out = module.trainer_steps(trainer, 4, 1, False)
        assert trainer.callback_handler.callbacks == callbacks
    assert len(calls) == 5 and left_out == 2 and len(times) == 2 and first > 0


@pytest.mark.parametrize("axis", ["batch_copy", "intermediate_size"])
def test_train_throughput_smoke_runs_each_variant_as_asked(tmp_path, axis):
    """benchmarks/train_throughput.py --batch_copy async wait / --intermediate_size A B: two runs, each reporting
    what the trainer it ran did (read from its arguments and its draft, not from the flag). The batch-copy runs also
    pass one --loss_chunk_elements value (an axis like the others), the width runs keep the trainer's default."""
    from conftest import require_default_target

    require_default_target()
    module = load_script("benchmarks/train_throughput.py")
    values = {"batch_copy": ["async", "wait", "--loss_chunk_elements", str(2**28)],
              "intermediate_size": ["1536", "768"]}[axis]  # fmt: skip
    report = module.main(["--smoke", "--device", "cpu", "--data", str(REPO / "examples/data/demo_answers.jsonl.gz"),
                          f"--{axis}", *values, "--output_dir", str(tmp_path / "drafts"),
                          "--output", str(tmp_path / "throughput.json")])  # fmt: skip
    if axis == "batch_copy":
        assert [run["batch_copy"] for run in report["runs"]] == ["async", "wait"]
        assert [run["loss_chunk_elements"] for run in report["runs"]] == [2**28, 2**28]
    else:
        assert [run["draft"]["intermediate_size"] for run in report["runs"]] == [1536, 768]
        assert [run["loss_chunk_elements"] for run in report["runs"]] == [2**26, 2**26]  # the trainer's default
    assert all(run["steps"] == 3 for run in report["runs"])
    assert all(run["median_step_ms"] > 0 for run in report["runs"])  # steps 2 and 3 (1 left out as warm-up)


def test_draft_draw_ops_counts_every_drafter_and_temperature(tmp_path):
    """benchmarks/draft_draw_ops.py on CPU: a row per drafter and temperature, no multinomial anywhere and no softmax
    in a greedy draw (the draws this commit made lean), DSpark's slot-by-slot draw dearer than DFlash's batched one,
    each proposal timed."""
    module = load_script("benchmarks/draft_draw_ops.py")
    out = tmp_path / "ops.json"
    assert module.main(["--device", "cpu", "--vocab", "512", "--context", "16", "--json", str(out)]) == 0
    rows = {(r["drafter"], r["temperature"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(d, t) for d in ("dspark", "dflash", "eagle3") for t in (0.0, 1.0)}
    assert all(r["multinomial_calls"] == 0 for r in rows.values())
    assert all(rows[d, 0.0]["softmax_calls"] == 0 for d in ("dspark", "dflash", "eagle3"))
    assert rows["dspark", 0.0]["operators"] > rows["dflash", 0.0]["operators"]
    assert all(r["ms_per_proposal"] > 0 and r["cuda_graph"] is False for r in rows.values())  # timed eagerly on CPU


def test_train_step_ops_counts_each_drafters_backward_nodes_with_and_without_compiled_layers(tmp_path):
    """benchmarks/train_step_ops.py on CPU: compiled layer methods shrink every drafter's backward; Eagle3's seven
    TTT steps each run its three compiled methods (the attention included) and few nodes besides them."""
    module = load_script("benchmarks/train_step_ops.py")
    out = tmp_path / "ops.json"
    assert module.main(["--seq", "32", "--num_anchors", "4", "--json", str(out)]) == 0
    rows = {(r["drafter"], r["compiled_layers"]): r for r in json.loads(out.read_text())["runs"]}
    assert set(rows) == {(d, c) for d in ("dspark", "dflash", "eagle3") for c in (False, True)}
    for d in ("dspark", "dflash", "eagle3"):
        assert rows[d, False]["compiled_regions"] == 0 < rows[d, True]["compiled_regions"]
        assert rows[d, True]["backward_nodes"] < rows[d, False]["backward_nodes"] / 3
    assert rows["eagle3", True]["compiled_regions"] == 3 * 7
    assert rows["eagle3", True]["backward_nodes"] < 4 * 21  # and the output norm once for all steps


def test_draft_draw_ops_round_counts_a_whole_round_with_the_target_apart(tmp_path):
    """--round: one fused round per drafter, temperature and number of candidates, the target's verify forward and
    the draft's proposal counted apart from the rest; a greedy round spends fewer operators than a sampled one
    outside the target, and a tree round (two candidates) more than a single chain's, in the proposal and after it."""
    module = load_script("benchmarks/draft_draw_ops.py")
    out = tmp_path / "rounds.json"
    argv = ["--round", "--device", "cpu", "--vocab", "512", "--drafters", "dspark", "eagle3", "--candidates", "1", "2",
            "--json", str(out)]  # fmt: skip
    assert module.main(argv) == 0
    rows = {(r["drafter"], r["temperature"], r["candidates"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(d, t, k) for t in (0.0, 1.0) for d, k in (("dspark", 1), ("dspark", 2), ("eagle3", 1))}
    for r in rows.values():
        assert 0 < r["target_forward_operators"] < r["operators"] and 0 < r["draft_proposal_operators"]
        assert r["other_operators"] == r["operators"] - r["target_forward_operators"] - r["draft_proposal_operators"]
    single = {t: rows[("dspark", t, 1)] for t in (0.0, 1.0)}
    assert single[0.0]["target_forward_operators"] == single[1.0]["target_forward_operators"]
    assert single[0.0]["other_operators"] < single[1.0]["other_operators"]
    for t in (0.0, 1.0):
        tree = rows[("dspark", t, 2)]
        assert tree["draft_proposal_operators"] > single[t]["draft_proposal_operators"]
        assert tree["other_operators"] > single[t]["other_operators"]


def test_verify_cost_smoke_times_every_case_with_both_spare_passes(tmp_path):
    """benchmarks/verify_cost.py --device cpu --smoke: block and token verification and the spare pass alone, each
    with the fused and the PyTorch spare pass (on CPU both are PyTorch: same sums), eagerly (no graphs on CPU)."""
    module = load_script("benchmarks/verify_cost.py")
    out = tmp_path / "verify_cost.json"
    report = module.main(["--device", "cpu", "--smoke", "--repeats", "2", "--output", str(out)])
    assert json.loads(out.read_text())["command"].startswith("verify_cost.py --device cpu --smoke")
    assert report["hardware"]["torch"] and report["fused_backend"] == "torch"
    assert report["fused_vs_torch_spare"] == {"max_abs": 0.0, "max_rel": 0.0}
    cases = [(r["case"], r["spare"]) for r in report["rows"]]
    assert cases == [(c, s) for c in ("verify block", "verify token", "spare pass") for s in ("fused", "torch")]
    for row in report["rows"]:
        assert row["eager"]["repeats"] == 2 and row["eager"]["ms_median"] > 0 and "graph" not in row, row


def test_regenerate_speed_smoke_times_every_mode(tmp_path):
    """benchmarks/regenerate_speed.py --smoke: every mode answers every prompt, and greedy in float32 they cut the
    same answers at the limit, so the timing compares like with like."""
    from conftest import require_default_target

    require_default_target()  # the smoke run borrows the default target's tokenizer (chat template)
    module = load_script("benchmarks/regenerate_speed.py")
    out = tmp_path / "regen.json"
    report = module.main(["--smoke", "--temperature", "0", "--json", str(out)])
    assert json.loads(out.read_text())["results"].keys() == {"grouped", "plain", "continuous"}
    for result in report["results"].values():
        assert result["prompts"] == 6 and result["answer_tokens_per_s"] > 0
    grouped, plain, continuous = (report["results"][m] for m in ("grouped", "plain", "continuous"))
    assert grouped["decoding_steps"] == plain["decoding_steps"] > 0 and grouped["ms_per_step"] > 0
    assert grouped["cut_at_limit"] == plain["cut_at_limit"] == continuous["cut_at_limit"]


def test_acceptance_depth_reads_both_report_forms_and_models_tau(tmp_path):
    """The depth profile from the stored markdown report and from an eval's results.json agree; the model's
    tau is 1 + sum of the reach probabilities (8 for a block of 7 that always accepts)."""
    depth = load_script("benchmarks/acceptance_depth.py")
    assert depth.modelled_tau(1.0, 1.0, 7) == 8.0
    assert depth.modelled_tau(0.5, 1.0, 2) == 1.75 and depth.modelled_tau(0.5, 0.5, 2) == 1.625
    report = "benchmarks/results/drafters_smollm2_3.5min_alone_eval.md"
    rates = depth.read_rates(Path(report))
    assert rates[("dflash", "gsm8k", 0.0)][:2] == [0.65, 0.60] and len(rates) == 18  # 3 drafters x 3 sets x 2 T
    results = [{"drafter": d, "dataset": s, "temperature": t, "accept_rate_by_position": v}
               for (d, s, t), v in rates.items()]  # fmt: skip
    (tmp_path / "results.json").write_text(json.dumps({"results": results}))
    out_md, out_json = tmp_path / "md.json", tmp_path / "json.json"
    for source, out in ((report, out_md), (tmp_path / "results.json", out_json)):
        assert depth.main(["--report", str(source), "--drafters", "baseline", "dflash", "--json", str(out)]) == 0
    md, js = json.loads(out_md.read_text()), json.loads(out_json.read_text())
    assert md["temperatures"] == js["temperatures"]
    profile = md["temperatures"]["0"]["profiles"]
    assert profile["baseline"]["later_over_first"] > 1 > profile["dflash"]["later_over_first"]  # the measured shape
    with pytest.raises(ValueError, match="no acceptance rates for drafter 'nope'"):
        depth.main(["--report", report, "--drafters", "baseline", "nope"])


def _eval_row(rounds: list[int], committed: list[int], wall: float, drafter: str = "dspark") -> dict:
    return {"drafter": drafter, "dataset": "gsm8k", "temperature": 1.0, "tau": sum(committed) / sum(rounds),
            "rounds": sum(rounds), "new_tokens": sum(committed), "wall_time_s": wall, "prefill_time_s": 0.1,
            "tokens_per_s": sum(committed) / wall, "tau_by_request": {"rounds": rounds, "committed": committed}}  # fmt: skip


def _eval_run(path: Path, rounds: list[int], committed: list[int], wall: float, extra_rows=(), **settings) -> Path:
    """A minimal `hf-dspark eval` results.json: one drafter (plus `extra_rows`), one dataset of four prompts in
    batches of two."""
    base = {"datasets": {"gsm8k": "x.jsonl"}, "num_prompts": {"gsm8k": 4}, "max_new_tokens": 8, "seed": 0,
            "temperatures": [1.0], "top_k": 0, "top_p": 1.0, "batch_size": 2, "generate_kwargs": {}}  # fmt: skip
    rows = [_eval_row(rounds, committed, wall), *extra_rows]
    path.mkdir()
    (path / "results.json").write_text(json.dumps({"settings": {**base, **settings}, "results": rows}))
    return path


def test_compare_evals_pairs_prompts_and_counts_each_batch_by_its_slowest_row(tmp_path):
    compare = load_script("benchmarks/compare_evals.py")
    assert compare.batch_rounds([3, 5, 4, 1], 2) == 5 + 4
    token = _eval_run(tmp_path / "token", [4, 4, 4, 4], [8, 8, 8, 8], wall=0.9)
    block = _eval_run(tmp_path / "block", [2, 4, 3, 3], [8, 8, 8, 8], wall=0.8)  # more τ, slowest rows as slow
    out = tmp_path / "cmp.json"
    assert compare.main([f"token={token}", f"block={block}", "--json", str(out)]) == 0
    table = json.loads(out.read_text())["temperatures"]["1"]
    assert table["token"]["batch_rounds"] == 8 and table["block"]["batch_rounds"] == 7
    assert table["token"]["ms_per_batch_round"] == pytest.approx(1000 * 0.8 / 8)
    assert table["block"]["mean_tau"] == pytest.approx(32 / 12)
    assert table["block"]["mean_tau_ratio"] == pytest.approx(4 / 3)
    assert table["block"]["tau_vs_reference"]["difference"] == pytest.approx(32 / 12 - 2)
    # A run that also decoded greedily pairs on the temperature both hold (batch seeds do not depend on the list).
    both = _eval_run(tmp_path / "both", [4, 4, 4, 4], [8, 8, 8, 8], wall=0.9, temperatures=[0.0, 1.0])
    assert compare.main([f"both={both}", f"block={block}", "--json", str(out)]) == 0
    assert list(json.loads(out.read_text())["temperatures"]) == ["1"]
    greedy = _eval_run(tmp_path / "greedy", [4, 4, 4, 4], [8, 8, 8, 8], wall=0.9, temperatures=[0.0])
    with pytest.raises(ValueError, match="share no temperature"):
        compare.main([f"greedy={greedy}", f"block={block}"])
    other = _eval_run(tmp_path / "other", [4, 4, 4, 4], [8, 8, 8, 8], wall=0.9, batch_size=4)
    with pytest.raises(ValueError, match="differ in batch_size"):
        compare.main([f"token={token}", f"other={other}"])
    with pytest.raises(ValueError, match="not LABEL=PATH"):
        compare.main([str(token), f"block={block}"])


def test_compare_evals_pairs_drafters_decoded_side_by_side_in_one_run(tmp_path):
    compare = load_script("benchmarks/compare_evals.py")
    both = _eval_run(tmp_path / "both", [4, 4, 4, 4], [8, 8, 8, 8], wall=0.9,
                     extra_rows=[_eval_row([2, 4, 3, 3], [8, 8, 8, 8], wall=0.8, drafter="walk")])  # fmt: skip
    with pytest.raises(ValueError, match="pick one with --drafter"):
        compare.main([f"a={both}", f"b={both}"])
    out = tmp_path / "cmp.json"
    assert compare.main([f"base={both}", f"walk={both}", "--drafter", "dspark", "walk", "--json", str(out)]) == 0
    table = json.loads(out.read_text())["temperatures"]["1"]
    assert table["base"]["mean_tau"] == pytest.approx(2) and table["walk"]["mean_tau"] == pytest.approx(32 / 12)
    assert table["walk"]["tau_vs_reference"]["difference"] == pytest.approx(32 / 12 - 2)
    with pytest.raises(ValueError, match="one name for every run or one per run"):
        compare.main([f"base={both}", f"walk={both}", "--drafter", "dspark", "walk", "dspark"])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_multi_candidate_one_candidate_is_the_trainers_teacher_forced_tau(temperature):
    """With k = 1 the script's τ is the training estimate on the same answers (greedy: τ_greedy; T = 1: τ_prob), so
    its slots line up with the trainer's; more candidates never lower the first slot's acceptance."""
    import torch
    from conftest import make_tiny_target

    from hf_dspark import DSparkModel
    from hf_dspark.evaluation.teacher_forced import teacher_forced_estimates

    script = load_script("benchmarks/multi_candidate.py")
    torch.manual_seed(0)
    target = make_tiny_target("qwen3")
    draft = DSparkModel.from_target(target, block_size=4, num_hidden_layers=1, num_anchors=8).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, target.config.vocab_size, (5 + i,), generator=g).tolist() for i in range(3)]
    with torch.no_grad():
        answers = [target.generate(torch.tensor([p]), max_new_tokens=14, do_sample=True, pad_token_id=0)[0, len(p):]
                   .tolist() for p in prompts]  # fmt: skip
    pairs = list(zip(prompts, answers))
    sums = script.score_blocks(draft, target, pairs, temperature, 3, batch_size=2, anchor_chunk=3, pad_id=0,
                               distinct_samples=64)  # fmt: skip
    expected = teacher_forced_estimates(draft, target, prompts, answers, batch_size=2)
    tau = sums["tau"] / sums["blocks"]
    assert tau[0].item() == pytest.approx(expected["tau_greedy" if temperature == 0 else "tau_prob"], rel=1e-4)
    first = sums["first"] / sums["blocks"]
    assert bool((first[1:] >= first[:-1]).all()) and bool((tau[1:] >= tau[:-1]).all())
    assert sums["blocks"] == sum(len(a) - 1 for a in answers)  # every answer position but the last anchors a block
    if temperature > 0:  # distinct candidates (as generate() draws them): one is the same draft, more gain more
        distinct = sums["first_distinct"] / sums["blocks"]
        assert distinct[0].item() == pytest.approx(first[0].item(), abs=0.02)
        assert bool((distinct[1:] >= first[1:] - 0.01).all())
    else:
        assert "first_distinct" not in sums  # greedy candidates are the top k: distinct already


def _event(name, start, end, cuda=False, annotation=False):
    import torch
    from types import SimpleNamespace

    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    return SimpleNamespace(name=name, device_type=kind, time_range=SimpleNamespace(start=start, end=end),
                           is_user_annotation=annotation)  # fmt: skip


def test_device_idle_charges_each_gap_to_the_host_phase_and_operator_running_when_it_began():
    """Kernels busy 0-100, 110-200 (a 10 us launch gap), 500-600 and 600-700 (back to back); the 300 us gap began
    inside phase:loss while the host ran aten::nonzero. Ranges on the GPU's timeline (record_function's copies,
    ProfilerStep) are no kernels. Microsecond trace over 2 steps -> ms a step."""
    common = load_script("benchmarks/_bench_common.py")
    events = [
        _event("k1", 0, 100, cuda=True), _event("k2", 110, 200, cuda=True),
        _event("k3", 500, 600, cuda=True), _event("k4", 600, 700, cuda=True), _event("k5", 650, 680, cuda=True),
        _event("phase:draft", -50, 150, annotation=True), _event("phase:loss", 150, 800, annotation=True),
        # the GPU-side copies of the ranges: annotations spanning the gaps, not kernels
        _event("phase:loss", 150, 800, cuda=True, annotation=True), _event("ProfilerStep#3", -60, 900, cuda=True),
        _event("aten::mm", 160, 170), _event("_Loss", 180, 400), _event("aten::nonzero", 190, 380),
    ]  # fmt: skip
    idle = common.device_idle(events, steps=2, phase_prefix="phase:")
    assert idle["busy_ms_per_step"] == pytest.approx(0.390 / 2)
    assert idle["idle_ms_per_step"] == pytest.approx(0.310 / 2)
    assert idle["idle_short_gaps_ms_per_step"] == pytest.approx(0.010 / 2)
    assert idle["idle_by_phase_ms_per_step"] == pytest.approx({"loss": 0.300 / 2})
    assert idle["idle_by_host_op_ms_per_step"] == pytest.approx({"aten::nonzero": 0.300 / 2})
    assert idle["largest_gaps"][0] == {"ms": pytest.approx(0.3), "phase": "loss", "host_op": "aten::nonzero"}
    assert common.device_idle([_event("phase:x", 0, 1)], steps=1, phase_prefix="phase:") == {}  # no kernels: nothing to report


def test_flex_tiles_smoke_times_the_drafts_mask(tmp_path):
    """benchmarks/flex_tiles.py --smoke on CPU: the sweep's code path (forward only there, torch's own tiles)."""
    bench = load_script("benchmarks/flex_tiles.py")
    out = tmp_path / "tiles.json"
    report = bench.main(["--smoke", "--device", "cpu", "--output", str(out)])
    assert json.loads(out.read_text())["best"] == report["best"] == "{}"
    [run] = report["runs"]
    assert run["fwd_ms"] > 0 and "error" not in run
    assert 0 < report["live_fraction"] < 1 and report["queries"] == 16 * 7
