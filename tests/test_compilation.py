"""What torch.compile cost: the seconds since a mark survive `torch.compiler.reset()` (hf_dspark.compilation)."""

import torch
import torch._dynamo.utils as dynamo_utils

from hf_dspark.compilation import compile_mark, compile_seconds_since, run_warm


def test_seconds_since_a_mark_count_a_real_compilation_and_only_that():
    mark = compile_mark()
    torch.compile(lambda x: x * 3 + 1, backend="eager")(torch.ones(3))
    spent = compile_seconds_since(mark)
    assert spent > 0
    assert compile_seconds_since(compile_mark()) == 0.0  # nothing compiled since this mark


def test_a_reset_followed_by_as_much_compilation_is_still_counted(monkeypatch):
    """torch.compiler.reset() clears the timers; compiling the same again refills them to the same total, which a
    running total would read as no compilation at all."""
    timers = dynamo_utils.compilation_time_metrics
    monkeypatch.setitem(timers, "_compile.compile_inner", [0.25])
    mark = compile_mark()
    timers.clear()  # what reset() does
    timers["_compile.compile_inner"] = [0.25]  # the same compilation again, in a new list
    assert compile_seconds_since(mark) == 0.25
    timers["_compile.compile_inner"].append(0.5)
    assert compile_seconds_since(mark) == 0.75


def test_run_warm_reruns_only_a_call_that_compiled_and_keeps_its_draws():
    """A call that compiled runs again from the random state it started from and the second run is kept; one that
    did not runs once; without retime nothing reruns and the one-time work is reported."""
    runs = []

    def call(compile_first: bool):
        runs.append(1)
        if compile_first and len(runs) == 1:
            torch.compiler.reset()
            torch.compile(lambda x: x - 2, backend="eager")(torch.ones(2))
        return torch.rand(3)

    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    warm = run_warm(lambda: call(True))
    assert len(runs) == 2 and warm.retimed and warm.compile_s == 0 and torch.equal(warm.result, expected)
    runs.clear()
    assert not run_warm(lambda: call(False)).retimed and len(runs) == 1
    runs.clear()
    cold = run_warm(lambda: call(True), retime=False)
    assert len(runs) == 1 and not cold.retimed and cold.compile_s > 0
    runs.clear()
    torch.manual_seed(0)
    rehearsed = run_warm(lambda: call(True), rehearse=True)  # the first run compiled; the kept one did not
    assert len(runs) == 2 and not rehearsed.retimed and rehearsed.compile_s == 0
    assert torch.equal(rehearsed.result, expected)
