"""One-time work this process did: torch.compile (seconds from its own timers, and a per-function report of the
compilations since a mark) and CUDA graph captures (`capture`, the one function that captures them; `KeyedGraphs`
keeps one graph per shape of a call and replays it). Training logs the compile time (`compile_s`,
compile_report.json); evaluation and the speed benchmark time calls of warm code through `run_warm`."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

logger = logging.getLogger(__name__)


# torch.compile's own timers: each compilation of a frame (forward graphs) and each lazy backward compilation.
_COMPILE_TIMERS = ("_compile.compile_inner", "backward._backward_impl")


def _compile_timers() -> dict[str, list[float] | None]:
    """torch's per-timer lists of compilation durations (None before a timer's first record, or in a torch
    without them: the logs then show 0)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return {}
    return {name: compilation_time_metrics.get(name) for name in _COMPILE_TIMERS}


def compile_mark() -> dict:
    """A mark for `compile_seconds_since`: each timer's list and how many durations it held."""
    return {name: (durations, len(durations or ())) for name, durations in _compile_timers().items()}


def compile_seconds_since(mark: dict) -> float:
    """Seconds spent compiling with torch.compile (dynamo + inductor, forward and lazy backward) since
    `compile_mark()` made `mark`, from torch's own timers. `torch.compiler.reset()` empties them, and they start new
    lists: a list other than the marked one was filled entirely after the mark. (A running total cannot tell a reset
    followed by as much compilation as before from no compilation at all.)"""
    seconds = 0.0
    for name, durations in _compile_timers().items():
        held, count = mark.get(name, (None, 0))
        if durations:
            seconds += sum(durations[count:]) if durations is held else sum(durations)
    return float(seconds)


def keep_compilation_records() -> int:
    """Let dynamo keep a record of every compilation of the run (it keeps the last 64 by default); returns the
    current time in microseconds, the mark `compile_report` counts from."""
    try:
        from torch._dynamo.utils import get_compilation_metrics, set_compilation_metrics_limit

        set_compilation_metrics_limit(max(4096, len(get_compilation_metrics())))
    except ImportError:  # a torch without per-compilation records: the report is then empty
        pass
    return time.time_ns() // 1000


def compile_report(since_us: int) -> dict:
    """torch.compile's work since `since_us`, from dynamo's per-compilation records, grouped by compiled function
    (name and source line, forward and backward graphs): count, seconds, when the first one started (seconds after
    the mark) and the recompilation reasons dynamo gave (shape changes, guard failures). Sorted by seconds."""
    try:
        from torch._dynamo.utils import get_compilation_metrics
    except ImportError:
        return {"total_s": 0.0, "compilations": 0, "frames": []}
    groups: dict[tuple, dict] = {}
    for record in get_compilation_metrics():
        start = getattr(record, "start_time_us", None) or 0
        if start < since_us:
            continue
        name = getattr(record, "co_name", None) or "(graph without a frame: a lazy backward)"
        filename = getattr(record, "co_filename", None)
        where = f"{Path(filename).name}:{getattr(record, 'co_firstlineno', '?')}" if filename else ""
        backward = getattr(record, "is_forward", True) is False
        entry = groups.setdefault((name, where, backward), {
            "function": name, "where": where, "graph": "backward" if backward else "forward", "count": 0,
            "seconds": 0.0, "first_at_s": round((start - since_us) / 1e6, 1), "reasons": [],
        })  # fmt: skip
        entry["count"] += 1
        entry["seconds"] += (getattr(record, "duration_us", None) or 0) / 1e6
        reason = getattr(record, "recompile_reason", None)
        if reason and reason not in entry["reasons"] and len(entry["reasons"]) < 5:
            entry["reasons"].append(reason)
    frames = sorted(groups.values(), key=lambda f: -f["seconds"])
    for frame in frames:
        frame["seconds"] = round(frame["seconds"], 2)
    return {
        "total_s": round(sum(f["seconds"] for f in frames), 1),
        "compilations": sum(f["count"] for f in frames),
        "frames": frames,
    }


_graph_captures = 0


def count_graph_capture() -> None:
    """Called by the one function that captures CUDA graphs (`capture`)."""
    global _graph_captures
    _graph_captures += 1


def graph_captures() -> int:
    """CUDA graphs captured by this process so far."""
    return _graph_captures


def capture(fn, warmups: int = 2, before_warmup=None, pool=None):
    """(graph, outputs of the captured call). `fn` is run `warmups` times eagerly on a side stream first (lazy
    library initialization, e.g. cuBLAS handles, must not happen inside a capture); `before_warmup()` may put the
    buffers in a state where those runs change nothing that is read later."""
    import torch

    if before_warmup is not None:
        before_warmup()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = fn()
    count_graph_capture()
    return graph, outputs


class GraphRunner:
    """What the training paths that replay CUDA graphs share (`KeyedGraphs`, `training.loss_graphs.LossGraphs`):
    whether a call can be served, captures into one memory pool (counted in `captures`), and giving up for good
    after a failed capture, logged once with `off_hint`, the setting that skips the attempt."""

    def __init__(self, what: str, off_hint: str):
        self.what, self.off_hint = what, off_hint
        self.failed: str | None = None
        self.captures = 0
        self._pool = None  # the graphs' shared memory pool, made at the first capture

    def serves(self, tensor) -> bool:
        """Whether calls on `tensor`'s device can be replayed (CUDA, and no capture has failed)."""
        return tensor.device.type == "cuda" and self.failed is None

    def _counted_capture(self, fn):
        """(graph, outputs) of `fn` (`_capture`), counted."""
        self.captures += 1
        return self._capture(fn)

    def _capture(self, fn):
        """(graph, outputs) of `fn` captured in the shared pool, after `capture`'s warm-ups."""
        import torch

        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return capture(fn, pool=self._pool)

    def _give_up(self, err: Exception) -> None:
        """After a failed capture: every later call is served None (the caller's plain path runs), said once."""
        self.failed = f"{type(err).__name__}: {err}"
        logger.warning("%s runs without CUDA graphs (capture failed: %s); %s skips the attempt", self.what,
                       self.failed, self.off_hint)  # fmt: skip
        self._pool = None


class KeyedGraphs(GraphRunner):
    """Calls of a function replayed from CUDA graphs, one graph per key (the caller's settings plus the shapes,
    dtypes and devices of the call's tensors); training's online target forward uses it.

    `runner(key, fn, inputs)` returns `fn(*inputs)`'s outputs (a tuple / list nest of tensors and None), or None
    where it cannot serve the call and the caller runs `fn` itself: a key's first call (one-off shapes, such as an
    epoch's last smaller batch, cost no warm-up and capture and keep no graph memory), more than `max_graphs` keys,
    or after a capture failed (logged once, with `off_hint`, the setting that skips the attempt). A key's second
    call captures (`capture`'s warm-ups, inside `context` when given: compiled layers swapped in), later calls
    copy their inputs into the graph's static ones and replay. `fn` may read other tensors (weights) only where they
    keep their storage between calls: a graph reads the addresses it was captured with.
    All graphs share one memory pool: a graph may reuse memory another graph's intermediates and outputs took,
    which is safe because every replay's outputs are copied before anything else runs on the stream (one call's
    worth of intermediates for all keys, not one per key)."""

    def __init__(self, what: str, off_hint: str, max_graphs: int = 8, context=None):
        super().__init__(what, off_hint)
        self.max_graphs, self.context = max_graphs, context
        self.graphs: dict[tuple, tuple] = {}
        self.seen: set[tuple] = set()  # keys called once, not captured (yet)

    def __call__(self, key: tuple, fn: Callable, inputs: tuple):
        if self.failed is not None:
            return None
        key = (key, tuple(None if t is None else (tuple(t.shape), t.dtype, t.device) for t in inputs))
        entry = self.graphs.get(key)
        if entry is None:
            if key not in self.seen:
                if len(self.seen) >= 16 * self.max_graphs:  # keys that never come back (bounded bookkeeping)
                    self.seen.clear()
                self.seen.add(key)
                return None
            if len(self.graphs) >= self.max_graphs:
                return None
            entry = self._captured(fn, inputs)
            if entry is None:
                return None
            self.graphs[key] = entry
        graph, statics, outputs = entry
        for static, tensor in zip(statics, inputs):
            if static is not None:
                static.copy_(tensor, non_blocking=True)
        graph.replay()
        return _cloned(outputs)

    def _captured(self, fn, inputs):
        """(graph, static inputs, outputs), or None after a failure (then every later call is served None)."""
        import contextlib

        statics = tuple(None if t is None else t.clone() for t in inputs)
        try:
            with self.context if self.context is not None else contextlib.nullcontext():
                graph, outputs = self._counted_capture(lambda: fn(*statics))
        except Exception as err:  # noqa: BLE001 - the caller's uncaptured call computes the same outputs
            self._give_up(err)
            self.graphs.clear()
            return None
        return graph, statics, outputs


def _cloned(outputs):
    """Copies of the tensors in a tuple / list nest (a replay overwrites the graph's own), None kept."""
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(_cloned(o) for o in outputs)
    return None if outputs is None else outputs.clone()


def one_time_work_mark() -> tuple[dict, int]:
    """A mark for `one_time_work_since`: (`compile_mark()`, graph captures so far)."""
    return compile_mark(), graph_captures()


def one_time_work_since(mark: tuple[dict, int]) -> tuple[float, int]:
    """(torch.compile seconds, CUDA graphs captured) since `mark`: what a timed call spent on one-time work."""
    return compile_seconds_since(mark[0]), graph_captures() - mark[1]


@dataclass
class WarmRun:
    """What `run_warm` kept: the call's result, the one-time work done inside it, whether it was run twice."""

    result: Any
    compile_s: float
    captures: int
    retimed: bool


# What a timing says about itself: calls run twice because their first run compiled or captured (the warm second
# timing kept), and the torch.compile seconds / CUDA graph captures left in the kept timings.
TIMING_CHECKS = ("retimed_calls", "compile_s_in_timing", "graph_captures_in_timing")


def timing_checks(runs) -> dict:
    """`TIMING_CHECKS` summed over timed calls that carry `retimed`, `compile_s` and `captures` (a `WarmRun`, or
    a record copied from one)."""
    runs = list(runs)
    return {
        "retimed_calls": sum(r.retimed for r in runs),
        "compile_s_in_timing": round(sum(r.compile_s for r in runs), 3),
        "graph_captures_in_timing": sum(r.captures for r in runs),
    }


def run_warm(call: Callable[[], Any], retime: bool = True, rehearse: bool = False) -> WarmRun:
    """`call()`, with the one-time work it did (torch.compile seconds, CUDA graph captures). With `retime`, a call
    that did some (a shape its warm-up missed) runs again from the random state it started from, so it samples the
    same outputs, and the second run is kept: what a timing inside `call` then measures is warm code.

    With `rehearse`, the call always runs once first, untimed, from the same random state. For cheap calls whose
    first run of a shape pays for work neither counter sees: a draft's first prefill of an evaluation batch took
    0.82 s against 0.07 s for the next batches on an H200, with nothing compiled or captured (the eager target,
    when it ran the same batches first, had hidden it)."""
    import torch

    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    rng = torch.get_rng_state(), torch.cuda.get_rng_state_all() if cuda else None

    def restore():
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state_all(rng[1])

    if rehearse:
        call()
        restore()
    mark = one_time_work_mark()
    result = call()
    compile_s, captures = one_time_work_since(mark)
    retimed = retime and bool(compile_s or captures)
    if retimed:
        restore()
        mark = one_time_work_mark()
        result = call()
        compile_s, captures = one_time_work_since(mark)
    return WarmRun(result, compile_s, captures, retimed)


__all__ = [
    "TIMING_CHECKS",
    "GraphRunner",
    "KeyedGraphs",
    "WarmRun",
    "compile_mark",
    "compile_report",
    "compile_seconds_since",
    "capture",
    "count_graph_capture",
    "graph_captures",
    "keep_compilation_records",
    "one_time_work_mark",
    "one_time_work_since",
    "run_warm",
    "timing_checks",
]
