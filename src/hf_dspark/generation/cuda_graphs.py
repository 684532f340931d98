"""Keeping the runners that own CUDA graphs for later calls, and capturing with a fallback: what the draft,
verification and whole-round runners share (`draft_graphs.py`, `target_graphs.py`, `round_graph.py`). The capture
itself is `compilation.capture` (training's online target uses it too)."""

from __future__ import annotations

import logging

from ..compilation import capture

logger = logging.getLogger(__name__)


def captured_or_warned(what: str, capture_fn) -> bool:
    """Run `capture_fn` (it captures and stores a runner's graphs); on any failure log that `what` runs without
    CUDA graphs and return False: the runner then runs the same function eagerly."""
    try:
        capture_fn()
        return True
    except Exception as err:  # noqa: BLE001 - whatever capture refuses, the eager path computes the same function
        logger.warning("%s without CUDA graphs (capture failed: %s: %s)", what, type(err).__name__, err)
        return False


def capture_or_uncompiled(what: str, capture_fn, compiled: bool, uncompile):
    """`capture_fn()`; where it fails while compiled functions are in use (`compiled`), log a warning, call
    `uncompile()` (the runner swaps in the plain functions) and capture once more. Safe because a capture's warm-up
    runs commit nothing (see `capture`), so the second attempt starts from the same state."""
    try:
        return capture_fn()
    except Exception as err:  # noqa: BLE001 - the plain functions compute the same thing
        if not compiled:
            raise
        logger.warning("compiled %s failed (%s: %s); capturing uncompiled", what, type(err).__name__, err)
        uncompile()
        return capture_fn()


# Cache capacities are rounded up to this, so calls with nearby lengths share one runner.
CAPACITY_STEP = 256


def kept_runner(registry, owner, key, capacity: int, capacity_of, build):
    """The runner kept in `registry` (a WeakKeyDictionary) for `owner` when it was built for `key` and its capacity
    fits this call (at least `capacity`, at most 4x it rounded: attention reads every column), else `build(capacity
    rounded up)`, kept in its place (the old one's buffers and graphs are freed first)."""
    rounded = -(-int(capacity) // CAPACITY_STEP) * CAPACITY_STEP
    held = registry.get(owner)
    if held is not None and held[0] == key and capacity <= capacity_of(held[1]) <= 4 * rounded:
        return held[1]
    registry.pop(owner, None)
    runner = build(rounded)
    registry[owner] = (key, runner)
    return runner


__all__ = ["CAPACITY_STEP", "capture", "capture_or_uncompiled", "captured_or_warned", "kept_runner"]
