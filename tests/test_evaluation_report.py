"""Evaluation reports from recorded rounds: rows, calibration before/after STS, results.json, results.md, plots."""

import json
import math

import numpy as np
import pytest
import torch
from conftest import make_tiny_target

from hf_dspark import DFlashModel, DSparkModel
from hf_dspark.evaluation.calibration import calibration_summary, mean_over_slots, uncalibrate_records
from hf_dspark.metrics import AcceptanceStats, calibration_report, slot_calibration_data
from hf_dspark.evaluation.report import ROW_KEYS, results_markdown, save_results
from hf_dspark.evaluation.runner import (
    CallStats,
    EvaluationResults,
    _CallResult,
    _draft_row,
    _speed,
    count_new_tokens,
)

K = 4
OVERCONFIDENCE = 2.5  # recorded logits are the true acceptance logits times this: STS should find T ~ 2.5


def synthetic_call(rng, rounds=60, block=K, overconfidence=OVERCONFIDENCE, calibrated_by=None) -> _CallResult:
    """One generate() call's statistics: slot k is accepted with probability sigmoid(l_k) and the head reports
    sigmoid(overconfidence * l_k) (divided by `calibrated_by` temperatures, as the decoding loop would record)."""
    stats = AcceptanceStats()
    logits = rng.normal(0.8, 1.5, size=(rounds, block))
    accept = rng.random((rounds, block)) < 1 / (1 + np.exp(-logits))
    accepted = np.where(accept.all(1), block, accept.argmin(1))
    recorded = overconfidence * logits
    if calibrated_by is not None:
        recorded = recorded / np.asarray(calibrated_by)
    requests = rng.integers(0, 3, size=rounds)  # three prompts in the call
    stats.add_round(np.full(rounds, block), accepted, confidences=1 / (1 + np.exp(-recorded)), requests=requests)
    return _CallResult(
        new_tokens=int(accepted.sum() + rounds), seconds=0.5, stats=CallStats(stats, draft_time=0.1, verify_time=0.3),
        rows=3,
    )


@pytest.fixture(scope="module")
def drafts():
    target = make_tiny_target("llama")
    dspark = DSparkModel.from_target(target, num_hidden_layers=1, block_size=K, markov_rank=8)
    dflash = DFlashModel.from_target(target, num_hidden_layers=1, block_size=K)
    return {"dspark": dspark, "dflash": dflash}


@pytest.fixture(scope="module")
def results(drafts):
    rng = np.random.default_rng(0)
    rows, baselines, reliability = [], [], {}
    for temp in (0.0, 1.0):
        for data in ("gsm8k", "mt-bench"):
            base = _speed([_CallResult(new_tokens=400, seconds=2.0, longest=100, rows=6)])  # the real fields
            baselines.append({"dataset": data, "temperature": temp, "num_prompts": 6, **base})
            for name, draft in drafts.items():
                calls = [synthetic_call(rng) for _ in range(6)]
                if name == "dflash":  # no confidence head: nothing recorded
                    for c in calls:
                        c.stats.acceptance.confidence_records.clear()
                row, curves = _draft_row(name, draft, data, temp, calls, base, 6, n_bins=10)
                rows.append(row)
                if curves:
                    reliability[(name, data, temp)] = curves
    return EvaluationResults(
        rows=rows, baselines=baselines, target="tiny-llama", hardware="CPU: test (2 cores)",
        command="hf-dspark eval --draft a --data gsm8k.jsonl", settings={"num_prompts": {"gsm8k": 6, "mt-bench": 6},
        "prompt_subset": "the first 6 prompts of each file", "max_new_tokens": 8, "batch_size": 1, "seed": 0},
        reliability=reliability,
    )


def test_row_combines_calls_with_the_shared_metric_definitions(drafts):
    rng = np.random.default_rng(1)
    calls = [synthetic_call(rng, rounds=20) for _ in range(3)]
    merged = AcceptanceStats()
    for c in calls:
        merged.merge(c.stats.acceptance)
    base = _speed([_CallResult(new_tokens=100, seconds=1.0)])
    row, _ = _draft_row("dspark", drafts["dspark"], "gsm8k", 0.0, calls, base, 3, n_bins=10)
    assert row["tau"] == merged.tau
    assert row["accept_rate_by_position"] == merged.accept_rate_by_position
    assert row["verified_tokens"] == merged.fed and row["verify_efficiency"] == merged.verify_efficiency
    tokens = sum(c.new_tokens for c in calls)
    assert row["tokens_per_s"] == pytest.approx(tokens / 1.5)
    assert row["speedup"] == pytest.approx(tokens / 1.5 / 100.0)
    assert row["draft_time_s"] == pytest.approx(0.3) and row["verify_time_s"] == pytest.approx(0.9)
    assert row["block_size"] == K and row["calibration"]["num_rounds"] == 60


def test_sts_fit_on_one_half_improves_calibration_on_the_other(drafts):
    rng = np.random.default_rng(2)
    groups = [synthetic_call(rng, rounds=150).stats.acceptance.confidence_records for _ in range(8)]
    summary = calibration_summary(groups, K, n_bins=10)
    held = summary["held_out"]
    assert held["fit_rounds"] == held["eval_rounds"] == 600
    # The recorded logits are OVERCONFIDENCE x the truth: the first slot's temperature recovers it.
    assert held["temperatures"][0] == pytest.approx(OVERCONFIDENCE, rel=0.3)
    raw = mean_over_slots(held["eval_half"]["raw"]["survival"], "ece")
    sts = mean_over_slots(held["eval_half"]["sts"]["survival"], "ece")
    assert sts < 0.6 * raw, (raw, sts)
    # Temperature scaling is monotone per slot: ranking quality (AUROC of c_1) is unchanged.
    assert held["eval_half"]["sts"]["conditional"][0]["auroc"] == pytest.approx(
        held["eval_half"]["raw"]["conditional"][0]["auroc"]
    )
    assert summary["stored_sts"] is None and "held_out_sts" in summary["reliability"]


def test_stored_temperatures_are_undone_for_raw_and_applied_for_after(drafts):
    rng = np.random.default_rng(3)
    temps = [2.0, 2.5, 3.0, 2.0]
    # What decoding records for a draft with stored temperatures: already-calibrated confidences.
    calls = [synthetic_call(rng, rounds=100, calibrated_by=temps) for _ in range(4)]
    recorded = [call.stats.acceptance.confidence_records for call in calls]
    raw_groups = [uncalibrate_records(g, temps) for g in recorded]
    # The same rounds recorded without temperatures (same generator seed): what "raw" must give back.
    uncalibrated = synthetic_call(np.random.default_rng(3), rounds=100).stats.acceptance.confidence_records
    for got, want in zip(raw_groups[0], uncalibrated):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-9)
    summary = calibration_summary(raw_groups, K, stored_temperatures=temps, n_bins=10)
    # "after" with the stored temperatures scores exactly the recorded (calibrated) confidences.
    flat = [r for g in recorded for r in g]
    pred, out = slot_calibration_data(flat, 2, kind="survival")
    stored = summary["stored_sts"]["survival"][2]
    assert stored["count"] == pred.size
    # (up to the 1e-7 clipping of saturated confidences in the round trip)
    assert stored["ece"] == pytest.approx(calibration_report(pred, out, 10)["ece"], rel=1e-4)
    assert mean_over_slots(summary["stored_sts"]["survival"], "ece") < mean_over_slots(
        summary["raw"]["survival"], "ece"
    )


@pytest.fixture(scope="module")
def saved(results, tmp_path_factory):
    return save_results(results, tmp_path_factory.mktemp("eval"))


def test_no_confidence_head_means_no_calibration(results):
    for row in results.rows:
        assert (row["calibration"] is None) == (row["drafter"] == "dflash")


def test_results_json_has_the_documented_schema(saved):
    data = json.loads(saved["results.json"].read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))
    assert {"target", "hardware", "command", "settings", "results", "baselines"} <= set(data)
    assert data["target"] == "tiny-llama" and data["command"].startswith("hf-dspark eval")
    assert len(data["results"]) == 2 * 2 * 2
    for row in data["results"]:
        assert set(ROW_KEYS) <= set(row)
        assert isinstance(row["drafter"], str) and isinstance(row["dataset"], str)
        assert isinstance(row["temperature"], float)
        assert row["tau"] >= 1.0 and row["speedup"] > 0 and row["tokens_per_s"] > 0
        assert all(v is None or 0.0 <= v <= 1.0 for v in row["accept_rate_by_position"])
        assert len(row["accept_rate_by_position"]) == K
    for b in data["baselines"]:
        assert {"dataset", "temperature", "tokens_per_s"} <= set(b)


def test_results_markdown_tables(results):
    md = results_markdown(results)
    assert "## tau and speedup, temperature 0" in md and "## tau and speedup, temperature 1" in md
    header = "| drafter | gsm8k tau | mt-bench tau | gsm8k speedup | mt-bench speedup | mean tau |"
    assert md.count(header) == 2
    row = next(r for r in results.rows if r["drafter"] == "dspark" and r["temperature"] == 0.0)
    other = next(r for r in results.rows if r["drafter"] == "dspark" and r["temperature"] == 0.0 and r is not row)
    mean_tau = (row["tau"] + other["tau"]) / 2
    assert f"| dspark | {row['tau']:.2f} | {other['tau']:.2f} | {row['speedup']:.2f}x |" in md
    assert f"| {mean_tau:.2f} |" in md
    assert "| drafter | dataset | T | @1 | @2 | @3 | @4 |" in md
    assert "## Confidence calibration" in md and "### dspark / gsm8k / T=0: per slot" in md
    assert "dflash / gsm8k" not in md.split("## Confidence calibration")[1]
    assert "the first 6 prompts of each file" in md and "`hf-dspark eval --draft a --data gsm8k.jsonl`" in md
    # The target alone's step cost and row fill, beside its tokens/s (why greedy and T = 1 baselines differ).
    base = next(b for b in results.baselines if b["dataset"] == "gsm8k" and b["temperature"] == 0.0)
    step, fill = base["ms_per_longest_row_token"], base["row_fill"]
    assert f"| target alone, ms a step / row fill | {step:.1f} / {fill:.2f} |" in md and "row fill:" in md
    # τ's 95% interval over prompts, per dataset and for the mean over datasets, which lies inside its bounds.
    lo, hi = row["tau_ci95"]
    assert row["requests"] == 6 * 3 and lo < row["tau"] < hi
    line = next(x for x in md.splitlines() if x.startswith("| dspark, 95% interval (bootstrap over prompts) |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1] == f"{lo:.2f}-{hi:.2f}"
    mean_lo, mean_hi = (float(v) for v in cells[-1].split("-"))
    assert mean_lo < mean_tau < mean_hi
    # Each drafter against the first on the same prompts: a paired difference in mean τ with its interval.
    assert "## Mean tau against dspark (paired bootstrap over the same prompts, 95%)" in md
    assert md.count("| dflash - dspark |") == 2  # T 0 and 1


def test_static_path_note_names_the_compiled_baseline_when_it_ran(results):
    """Drafts verified through CUDA graphs against an eager target: the note says which baseline is the fair one."""
    import dataclasses

    graphs = [dict(r, target_graphs=True) for r in results.rows]
    for static, expected in ((True, "the rows 'vs static target' compare"), (False, "--static_baseline true adds")):
        settings = dict(results.settings, static_baseline=static)
        md = results_markdown(dataclasses.replace(results, rows=graphs, settings=settings))
        assert "part of the speedup is the graphs" in md and expected in md
    assert "part of the speedup is the graphs" not in results_markdown(results)  # dynamic path: no note
    assert "verify forward as a CUDA graph" in md and "whole round" not in md
    fused = [dict(r, fused_round=True) for r in graphs]
    md = results_markdown(dataclasses.replace(results, rows=fused, settings=settings))
    assert "each whole round as one CUDA graph (dspark_fused_round; draft s is then inside verify s)" in md


def test_plots_are_written_as_png(saved):
    written = saved
    pngs = sorted(name for name in written if name.endswith(".png"))
    assert pngs == [
        "acceptance_by_position_T0.png", "acceptance_by_position_T1.png",
        "reliability_dspark_gsm8k_T0.png", "reliability_dspark_gsm8k_T1.png",
        "reliability_dspark_mt-bench_T0.png", "reliability_dspark_mt-bench_T1.png",
    ]
    for name in pngs:
        data = written[name].read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    curves = json.loads(written["reliability.json"].read_text())
    assert {c["drafter"] for c in curves} == {"dspark"}
    assert set(curves[0]["curves"]) == {"raw", "held_out_raw", "held_out_sts"}


def test_unreached_positions_are_null_in_json_and_dash_in_markdown(drafts, tmp_path):
    stats = AcceptanceStats()
    stats.add_round([K, K], [0, 0])  # slot 2+ never reached: nan rates
    call = _CallResult(new_tokens=2, seconds=1.0, stats=CallStats(stats))
    row, _ = _draft_row("dflash", drafts["dflash"], "d", 0.0, [call], _speed([call]), 1, 10)
    assert row["accept_rate_by_position"] == [0.0]
    stats.add_round([K], [1])
    row, _ = _draft_row("dflash", drafts["dflash"], "d", 0.0, [call], _speed([call]), 1, 10)
    assert row["accept_rate_by_position"][0] == pytest.approx(1 / 3) and row["accept_rate_by_position"][1] == 0.0
    row["accept_rate_by_position"].append(math.nan)
    res = EvaluationResults([row], [], "t", "cpu", None, {})
    written = save_results(res, tmp_path, plots=False)
    assert json.loads(written["results.json"].read_text())["results"][0]["accept_rate_by_position"][2] is None
    assert "| – |" in written["results.md"].read_text()


def test_count_new_tokens_stops_at_the_first_eos():
    sequences = torch.tensor([[5, 5, 7, 2, 2, 2], [5, 5, 7, 8, 9, 3], [5, 5, 2, 7, 2, 2]])
    assert count_new_tokens(sequences, 2, eos_ids=[2]) == 2 + 4 + 1
    assert count_new_tokens(sequences, 2, eos_ids=[2, 3]) == 2 + 4 + 1
    assert count_new_tokens(sequences, 6, eos_ids=[2]) == 0


def test_fast_sts_fit_equals_the_grid_search_definition():
    """fit_sts_temperatures = per slot, the grid value minimizing the survival ECE given the earlier slots."""
    from hf_dspark.metrics import expected_calibration_error, fit_sts_temperatures

    rng = np.random.default_rng(4)
    records = []
    for _ in range(300):
        proposed = int(rng.integers(1, K + 1))
        conf = np.round(1 / (1 + np.exp(-rng.normal(1, 2, proposed))), 2)  # ties, exact 0 and 1
        records.append((conf, int(rng.integers(0, proposed + 1)), proposed))
    grid = (0.25, 0.5, 0.8, 1.0, 1.3, 2.0, 4.0)
    expected = []
    for slot in range(K + 1):  # one slot more than any round proposed: keeps T = 1
        scores = []
        for t in grid:
            pred, out = slot_calibration_data(records, slot, expected + [t], kind="survival")
            scores.append(expected_calibration_error(pred, out, 10) if pred.size else math.inf)
        expected.append(grid[int(np.argmin(scores))] if math.isfinite(min(scores)) else 1.0)
    assert fit_sts_temperatures(records, K + 1, grid=grid, n_bins=10) == expected


def test_acceptance_plot_marks_intervals_and_thin_positions(tmp_path, monkeypatch):
    """Rows with accept_count_by_position get Wilson error bars, and positions behind few rounds hollow markers."""
    import matplotlib.pyplot as plt

    from hf_dspark.evaluation import plots

    drawn = {}
    savefig = plt.Figure.savefig

    def capture(fig, path, *args, **kwargs):
        ax = fig.axes[0]
        drawn["errorbars"] = len(ax.containers)
        drawn["hollow"] = [line for line in ax.lines if line.get_markerfacecolor() == "white"]
        drawn["title"] = fig._suptitle.get_text() if fig._suptitle else ""
        return savefig(fig, path, *args, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", capture)
    row = {"drafter": "dspark", "dataset": "d", "temperature": 1.0, "tau": 1.5,
           "accept_rate_by_position": [0.4, 0.5, 1.0], "accept_count_by_position": [200, 80, 1]}
    path = plots.plot_acceptance_by_position([row], tmp_path / "a.png", title="t")
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert drawn["errorbars"] == 1
    assert [list(line.get_xdata()) for line in drawn["hollow"]] == [[3]]  # only the 1-round position
    assert "Wilson" in drawn["title"]
    # Rows without counts (older results files) still plot, without intervals.
    legacy = {k: v for k, v in row.items() if k != "accept_count_by_position"}
    plots.plot_acceptance_by_position([legacy], tmp_path / "b.png")
    assert drawn["errorbars"] == 0 and drawn["hollow"] == []


def test_speed_separates_step_cost_from_unequal_row_lengths():
    """A batch decodes until its longest row stops: tokens/s falls when rows end early, the cost per step does not."""
    from hf_dspark.evaluation.runner import _CallResult, _speed

    equal = _speed([_CallResult(new_tokens=4 * 100, seconds=2.0, longest=100, rows=4)])
    ragged = _speed([_CallResult(new_tokens=100 + 3 * 10, seconds=2.0, longest=100, rows=4)])
    assert equal["ms_per_longest_row_token"] == ragged["ms_per_longest_row_token"] == 20.0
    assert equal["row_fill"] == 1.0 and ragged["row_fill"] == 130 / 400
    assert ragged["tokens_per_s"] < equal["tokens_per_s"] / 3
