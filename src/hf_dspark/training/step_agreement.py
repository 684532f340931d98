"""Several training processes agreeing on a few numbers at step ends, without waiting.

A callback that stops a run (a time budget, a stop signal) must stop every process at the same step, or the one that
stops first leaves the others waiting in their next gradient all-reduce. Agreeing through a device collective costs a
host sync each time (the host waits for every kernel queued before it). `StepAgreement` instead launches, at each step
end, an asynchronous all-reduce (max) of this step's values over a CPU (gloo) group of its own, and returns the one
launched a step before, long complete: every process reads the same values at the same step, one step late, with no
device synchronization. With one process it does nothing (`active` is False) and the caller decides alone.
"""

from __future__ import annotations

from typing import Sequence

import torch


class StepAgreement:
    def __init__(self):
        self._group = None  # the gloo group of the all-reduces (several processes only)
        self._pending = None  # (work, tensor) of the all-reduce launched at the last exchange

    def open(self) -> bool:
        """Every process calls this at the same point (it creates a process group); whether there are several."""
        dist = torch.distributed
        if self._group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo")
        return self.active

    @property
    def active(self) -> bool:
        return self._group is not None

    def exchange(self, values: Sequence[float]) -> list[float] | None:
        """The element-wise max over processes of the values each sent at its previous exchange (None at the first);
        sends these for the next. Every process must exchange at the same step ends, with as many values."""
        agreed = None
        if self._pending is not None:
            work, sent = self._pending
            work.wait()  # launched a whole step ago by every process: complete, or nearly
            agreed = sent.tolist()
        sent = torch.tensor([float(v) for v in values], dtype=torch.float64)  # exact for step counts
        work = torch.distributed.all_reduce(sent, op=torch.distributed.ReduceOp.MAX, group=self._group, async_op=True)
        self._pending = (work, sent)
        return agreed

    def finish(self) -> None:
        """At the end of training: the last all-reduce completes (every process launched as many)."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None

    def close(self) -> None:
        """The group gone (also after a failed run, without waiting on the others)."""
        self._pending = None
        if self._group is not None:
            group, self._group = self._group, None
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group(group)


__all__ = ["StepAgreement"]
