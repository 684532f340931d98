"""Verification-length schedules: Algorithm 1 (hardware-aware prefix scheduler), threshold, SPS cost tables."""

import json

import numpy as np
import pytest
import torch
from conftest import make_tiny_target
from generation_utils import left_padded, make_draft

from hf_dspark.generation import scheduler
from hf_dspark.generation.scheduler import SPSTable, prefix_schedule, survival, threshold_schedule


def algorithm1_reference(conf, sps, caps=None, early_stop=True):
    """Paper Algorithm 1 transcribed line by line (slow, for comparison)."""
    conf = np.asarray(conf, dtype=np.float64)
    rows, n = conf.shape
    a = np.cumprod(conf, axis=1)
    items = [(r, j) for r in range(rows) for j in range(n) if a[r, j] > 0 and (caps is None or j < caps[r])]
    items.sort(key=lambda rj: (-a[rj], rj[1], rj[0]))
    lengths, best_lengths = [0] * rows, [0] * rows
    batch, expected = rows, float(rows)
    best = rows * sps(rows)
    best_at_any = (best, list(best_lengths))
    for r, j in items:
        lengths[r] = j + 1
        batch += 1
        expected += a[r, j]
        theta = expected * sps(batch)
        if theta > best_at_any[0]:
            best_at_any = (theta, list(lengths))
        if early_stop:
            if theta > best:
                best, best_lengths = theta, list(lengths)
            else:
                break
    return best_lengths if early_stop else best_at_any[1]


def concave_table(rows, width=8, knee=None):
    knee = knee or rows * 2
    tokens = [rows * w for w in range(1, width + 2)]
    return SPSTable(tokens, [100.0 if t <= knee else 100.0 * knee / t for t in tokens])


def test_survival_is_the_cumulative_product_and_never_increases():
    conf = torch.rand(5, 7)
    a = survival(conf)
    torch.testing.assert_close(a, torch.cumprod(conf, dim=-1))
    assert bool((a[:, 1:] <= a[:, :-1]).all())


@pytest.mark.parametrize("seed", range(20))
def test_prefix_schedule_matches_the_paper_pseudocode(seed):
    gen = torch.Generator().manual_seed(seed)
    rows, n = int(torch.randint(1, 6, (1,), generator=gen)), 6
    conf = torch.rand(rows, n, generator=gen)
    conf[conf < 0.15] = 0.0  # zero-confidence slots leave the candidate space
    conf[:, 0][conf[:, 0] > 0.9] = 1.0  # exact ties between a row's slots
    table = SPSTable([1, 3, 8, 20, 40], sorted(torch.rand(5, generator=gen).mul(50).add(10).tolist(), reverse=True))
    caps = torch.randint(0, n + 1, (rows,), generator=gen)
    for early_stop in (True, False):
        got = prefix_schedule(conf, table, caps, early_stop=early_stop).tolist()
        assert got == algorithm1_reference(conf, table, caps.tolist(), early_stop)


def test_free_verification_admits_every_slot_with_positive_survival():
    conf = torch.tensor([[0.9, 0.5, 0.2, 0.0, 0.9], [1.0, 1.0, 1.0, 1.0, 1.0]])
    flat = SPSTable([1, 1000], [50.0, 50.0])
    assert prefix_schedule(conf, flat).tolist() == [3, 5]  # a = 0 from slot 4 on: never admitted


def test_expensive_verification_admits_nothing_and_caps_bound_lengths():
    conf = torch.full((3, 4), 0.99)
    steep = SPSTable([3, 4], [100.0, 50.0])  # one more token halves the step rate
    assert prefix_schedule(conf, steep).tolist() == [0, 0, 0]
    flat = SPSTable([1, 100], [50.0, 50.0])
    assert prefix_schedule(conf, flat, max_lengths=torch.tensor([0, 2, 9])).tolist() == [0, 2, 4]


def test_admission_follows_global_survival_order_across_requests():
    conf = torch.tensor([[0.95, 0.95, 0.95], [0.5, 0.9, 0.9]])
    # Costs rise after 2 extra tokens: the two most probable extensions are both request 0's.
    table = SPSTable([2, 4, 5], [100.0, 100.0, 60.0])
    assert prefix_schedule(conf, table).tolist() == [2, 0]


def test_early_stop_ends_the_search_at_the_first_non_improving_admission():
    """Paper Appendix A: SPS(1)=1, SPS(2)=0.5, SPS(3)=0.45, c_1 = 0.8. Admitting x_1 alone lowers the expected
    throughput (0.9 < 1), so the scheduler stops there, whatever c_2 (which depends on x_1) would be."""
    table = SPSTable([1, 2, 3], [1.0, 0.5, 0.45])
    for c2 in (0.9, 0.0):
        conf = torch.tensor([[0.8, c2]])
        assert prefix_schedule(conf, table).tolist() == [0]
    # The retrospective global search admits x_1 only if x_1 led to a confident continuation: selection bias.
    assert prefix_schedule(torch.tensor([[0.8, 0.9]]), table, early_stop=False).tolist() == [2]
    assert prefix_schedule(torch.tensor([[0.8, 0.0]]), table, early_stop=False).tolist() == [0]


def _decisions_depend_on_later_slots(early_stop, trials=300, seed=0):
    """Does 'slot j of row r is verified' ever change when the confidences after slot j (functions of x_j and
    later tokens) change? Random batches, random jagged cost tables."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(trials):
        rows, n = int(torch.randint(1, 5, (1,), generator=gen)), 5
        conf = torch.rand(rows, n, generator=gen)
        rates = torch.rand(6, generator=gen).mul(90).add(10).tolist()  # not monotone: cliffs and bumps
        table = SPSTable([rows * w for w in range(1, 7)], rates)
        base = prefix_schedule(conf, table, early_stop=early_stop)
        for r in range(rows):
            for j in range(1, n):
                changed = conf.clone()
                changed[r, j:] = torch.rand(n - j, generator=gen)
                after = prefix_schedule(changed, table, early_stop=early_stop)
                if bool(base[r] >= j) != bool(after[r] >= j):
                    return True
    return False


def test_the_decision_for_a_slot_never_depends_on_tokens_sampled_after_it():
    assert not _decisions_depend_on_later_slots(early_stop=True)


def test_without_early_stop_decisions_leak_later_tokens():
    assert _decisions_depend_on_later_slots(early_stop=False)


def test_threshold_schedule_verifies_the_prefix_before_the_first_low_confidence():
    conf = torch.tensor([[0.9, 0.7, 0.3, 0.9], [0.2, 0.9, 0.9, 0.9], [0.8, 0.8, 0.8, 0.8]])
    assert threshold_schedule(conf, 0.5).tolist() == [2, 0, 4]
    assert threshold_schedule(conf, 0.5, torch.tensor([1, 4, 3])).tolist() == [1, 0, 3]


# -- the cost table ---------------------------------------------------------------------------------------------


def test_sps_table_interpolates_step_time_and_extrapolates_conservatively():
    table = SPSTable([2, 10, 4], [100.0, 25.0, 50.0])  # unsorted input is sorted
    assert table.tokens == [2, 4, 10]
    assert table(4) == pytest.approx(50.0)
    assert table(3) == pytest.approx(1 / ((1 / 100 + 1 / 50) / 2))  # linear in step time
    assert table(1) == pytest.approx(100.0)  # below the range: clamped
    assert table(20) == pytest.approx(12.5)  # above: compute-bound, time grows with tokens
    np.testing.assert_allclose(table(np.array([2, 10])), [100.0, 25.0])


def test_sps_table_formats_and_round_trip(tmp_path):
    table = SPSTable.from_any({1: 10.0, 8: 5.0})
    assert SPSTable.from_any([(1, 10.0), (8, 5.0)]).tokens == table.tokens
    path = table.save(tmp_path / "t.json")
    assert SPSTable.from_any(str(path)).sps == table.sps
    assert json.loads(path.read_text())["tokens"] == [1, 8]
    with pytest.raises(ValueError, match="duplicate"):
        SPSTable([1, 1], [2.0, 3.0])
    with pytest.raises(ValueError, match="> 0"):
        SPSTable([1, 2], [2.0, 0.0])
    with pytest.raises(FileNotFoundError, match="profile-sps"):
        SPSTable.load(tmp_path / "missing.json")
    with pytest.raises(TypeError, match="dspark_sps_table"):
        SPSTable.from_any(3.5)


def test_profiled_tables_are_cached_per_model_dtype_device_and_shape(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DSPARK_CACHE", str(tmp_path))
    target = make_tiny_target("llama")
    table = scheduler.load_or_profile_sps(target, batch_size=2, context_length=8, widths=(1, 3), repeats=1, warmup=0)
    assert table.tokens == [2, 6] and all(s > 0 for s in table.sps)
    path = scheduler.sps_cache_path(target, 2, 8)
    assert path.is_file() and path.parent == tmp_path / "sps"
    assert "float32" in path.name and "rows2" in path.name
    monkeypatch.setattr(scheduler, "profile_sps", lambda *a, **k: pytest.fail("should load the cached table"))
    assert scheduler.load_or_profile_sps(target, batch_size=2, context_length=8).sps == table.sps


def test_generate_profiles_the_target_when_no_table_is_given(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DSPARK_CACHE", str(tmp_path))
    target = make_tiny_target("llama")
    draft = make_draft("dspark", target)
    ids, mask = left_padded([[5, 6, 7], [8, 9]])
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    out = target.generate(
        ids, attention_mask=mask, max_new_tokens=8, do_sample=False, assistant_model=draft, dspark_schedule="prefix"
    )
    assert torch.equal(out, expected)
    assert list((tmp_path / "sps").glob("*rows2*.json"))


def test_a_flat_cost_table_is_told_from_a_steep_one():
    """Whole blocks suit the static path where a block per row costs about one token per row."""
    flat = SPSTable([2, 16], [100.0, 90.0])  # 8 tokens per row cost 1.11 one-token steps
    steep = SPSTable([2, 16], [100.0, 25.0])  # compute-bound: 4x
    assert scheduler.verify_cost_is_flat(flat, rows=2, width=8)
    assert not scheduler.verify_cost_is_flat(steep, rows=2, width=8)
    assert not scheduler.verify_cost_is_flat(flat, rows=2, width=8, ratio=1.05)


@pytest.mark.parametrize("table, static", [({2: 100.0, 16: 95.0}, True), ({2: 100.0, 16: 20.0}, False)])
def test_auto_takes_the_static_path_for_confidence_schedules_only_where_the_cost_is_flat(table, static):
    from hf_dspark.generation.speculative import SpeculativeConfig, _static_suits_schedule

    target = make_tiny_target("llama")
    for schedule in ("prefix", "threshold"):
        config = SpeculativeConfig(schedule=schedule, sps_table=table)
        assert _static_suits_schedule(target, config, rows=2, width=8) is static
    assert _static_suits_schedule(target, SpeculativeConfig(schedule="none"), rows=2, width=8)


def _greedy_stats_by_path(target, draft, schedule, max_new_tokens, **kw):
    """{"none/static", f"{schedule}/static", f"{schedule}/dynamic"}: each call's stats, its output checked equal to
    the target's own greedy output."""
    ids, mask = left_padded([[5, 6, 7], [8, 9]])
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False)
    stats = {}
    for name, sched, static in [("none/static", "none", True), (f"{schedule}/static", schedule, True),
                                (f"{schedule}/dynamic", schedule, False)]:  # fmt: skip
        out = target.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                              assistant_model=draft, dspark_schedule=sched, dspark_target_graphs=static, **kw)
        assert torch.equal(out, expected), name
        stats[name] = draft.last_generation_stats
    return stats


def test_prefix_on_the_static_path_verifies_whole_blocks():
    """The static verify forward costs the same for any prefix: "prefix" there verifies what "none" does (same
    output, same verified tokens), while on the dynamic cache a steep table makes it verify less."""
    target = make_tiny_target("llama")
    steep = {1: 100.0, 2: 50.0, 64: 100.0 / 32}
    stats = _greedy_stats_by_path(target, make_draft("dspark", target), "prefix", 12, dspark_sps_table=steep)
    verified = {name: s.verified_tokens for name, s in stats.items()}
    assert verified["prefix/static"] == verified["none/static"]
    assert verified["prefix/dynamic"] < verified["none/static"]


def test_threshold_keeps_its_cut_on_the_static_path_and_stays_greedy_equal():
    """"auto" now sends "threshold" to the static path where the cost is flat: there it must still verify only
    the confident prefix (not whole blocks, unlike "prefix") and reproduce the target's greedy output."""
    target = make_tiny_target("llama")
    draft = make_draft("dspark", target, seed=2)  # (seed 1's confidences fall below 0.5 at the first slot)
    with torch.no_grad():  # spread the random confidences so the threshold cuts blocks at varied lengths
        draft.confidence_head.proj.weight.mul_(40.0)
    stats = _greedy_stats_by_path(target, draft, "threshold", 16)
    proposed = {name: s.acceptance.proposed_total / s.acceptance.rounds for name, s in stats.items()}
    assert 0 < proposed["threshold/static"] < proposed["none/static"]
    assert proposed["threshold/static"] == pytest.approx(proposed["threshold/dynamic"], rel=0.35)
