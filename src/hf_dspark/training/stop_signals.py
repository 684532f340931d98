"""A run told to stop by its scheduler saves a resumable checkpoint first (`checkpoint_on_signal`).

Preemptible and batch machines end a job with a signal and a grace period: SIGTERM (Kubernetes, cloud spot
instances, torchrun passing on its own SIGTERM, `timeout`), or SIGUSR1 a set time before the limit (SLURM's
`--signal=USR1@120`, where it reaches the training processes: torchrun passes on SIGTERM, SIGINT, SIGHUP and
SIGQUIT by default, and dies of a SIGUSR1 it was not told to handle). `StopOnSignal` catches them while `train()`
runs; the step in progress completes, then the trainer saves a checkpoint (optimizer, scheduler and RNG state
included, whatever `save_strategy` says) and stops.
The same command with `--resume_from_checkpoint true` continues the run where it stopped. A second signal while the
first is being honoured gets the handler that was there before (by default: terminate at once).

Several processes must stop at the same step, or the one that stops first leaves the others waiting in a collective.
At every step end each launches an asynchronous all-reduce (max) of its flag over a CPU (gloo) group of its own, and
acts on the one launched a step before, long complete: no device synchronization and no wait, and every process
reads the same result at the same step, so they stop together one or two steps after the signal. (Agreeing only every
N steps would cost the grace period: 25 slow steps outlasted torchrun's 30 s before it kills its workers.) A single
process checks its flag at every step end, with no collective at all.
"""

from __future__ import annotations

import logging
import signal
import threading

import torch
from transformers import TrainerCallback

logger = logging.getLogger(__name__)

STOP_SIGNALS = ("SIGTERM", "SIGUSR1")


class StopOnSignal(TrainerCallback):
    def __init__(self, signals=STOP_SIGNALS):
        self.signals = [getattr(signal, name) for name in signals if hasattr(signal, name)]
        self.received: int | None = None  # the signal number, once one came
        self.stopped_at: int | None = None  # the step the run stopped at because of it
        self._previous: dict = {}
        self._group = None  # several processes: the gloo group of the flags' all-reduce
        self._pending = None  # (work, flag tensor) of the all-reduce launched at the last step end

    @property
    def signal_name(self) -> str | None:
        return signal.Signals(self.received).name if self.received is not None else None

    def _handle(self, signum, frame) -> None:
        if self.received is not None:  # asked again: the old handler decides (default: terminate now)
            self._restore()
            signal.raise_signal(signum)
            return
        self.received = signum  # only a flag here: the step in progress completes, on_step_end acts

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def on_train_begin(self, args, state, control, **kwargs):
        self.received, self.stopped_at = None, None
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo")  # every process, here at the same point
        if threading.current_thread() is not threading.main_thread():  # its flag stays down; it still agrees
            logger.info("training runs outside the main thread: no checkpoint on %s", "/".join(STOP_SIGNALS))
            return
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)

    def _agreed(self, stop: bool) -> bool:
        """Whether any process had its flag up at the last step end; sends this step's flag for the next."""
        agreed = False
        if self._pending is not None:
            work, flag = self._pending
            work.wait()  # launched a whole step ago by every process: complete, or nearly
            agreed = bool(flag.item())
        flag = torch.tensor([float(stop)])
        work = torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._group, async_op=True)
        self._pending = (work, flag)
        return agreed

    def on_step_end(self, args, state, control, **kwargs):
        stop = self.received is not None
        if self._group is not None:
            stop = self._agreed(stop)
        if stop and self.stopped_at is None:
            self.stopped_at = state.global_step
            what = self.signal_name or "a stop signal on another process"
            logger.warning("%s: saving a checkpoint at step %d and stopping; the same command with "
                           "--resume_from_checkpoint true continues the run", what, state.global_step)  # fmt: skip
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self._pending is not None:  # every process launched the same number of all-reduces
            self._pending[0].wait()
        self.close()

    def close(self) -> None:
        """Handlers back and the flags' group gone (also after a failed run, without waiting on the others)."""
        self._restore()
        self._pending = None
        if self._group is not None:
            group, self._group = self._group, None
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group(group)


__all__ = ["STOP_SIGNALS", "StopOnSignal"]
