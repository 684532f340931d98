"""A run told to stop by its scheduler saves a resumable checkpoint first (`checkpoint_on_signal`).

Preemptible and batch machines end a job with a signal and a grace period: SIGTERM (Kubernetes, cloud spot
instances, torchrun passing on its own SIGTERM, `timeout`), or SIGUSR1 a set time before the limit (SLURM's
`--signal=USR1@120`). `StopOnSignal` catches them while `train()` runs; the step in progress completes, then the
trainer saves a checkpoint (optimizer, scheduler and RNG state included, whatever `save_strategy` says) and stops.
The same command with `--resume_from_checkpoint true` continues the run where it stopped. A second signal while the
first is being honoured gets the handler that was there before (by default: terminate at once).

Several processes must stop at the same step, or the one that stops first leaves the others waiting in a collective:
they agree every `AGREE_EVERY` steps (one small all-reduce, the stop if any process was signalled), so a signal is
honoured within that many steps. A single process checks at every step end, with no device work at all.
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
    AGREE_EVERY = 25  # steps between agreements of several processes (a host sync each)

    def __init__(self, signals=STOP_SIGNALS):
        self.signals = [getattr(signal, name) for name in signals if hasattr(signal, name)]
        self.received: int | None = None  # the signal number, once one came
        self.stopped_at: int | None = None  # the step the run stopped at because of it
        self._previous: dict = {}

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
        if threading.current_thread() is not threading.main_thread():
            logger.info("training runs outside the main thread: no checkpoint on %s", "/".join(STOP_SIGNALS))
            return
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)

    def on_step_end(self, args, state, control, **kwargs):
        stop = self.received is not None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            if state.global_step % self.AGREE_EVERY:
                return control
            flag = torch.tensor([float(stop)], device=args.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            stop = bool(flag.item())
        if stop and self.stopped_at is None:
            self.stopped_at = state.global_step
            what = self.signal_name or "a stop signal on another process"
            logger.warning("%s: saving a checkpoint at step %d and stopping; the same command with "
                           "--resume_from_checkpoint true continues the run", what, state.global_step)  # fmt: skip
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self._restore()


__all__ = ["STOP_SIGNALS", "StopOnSignal"]
