"""A run told to stop by its scheduler saves a resumable checkpoint first (`checkpoint_on_signal`).

Preemptible and batch machines end a job with a signal and a grace period: SIGTERM (Kubernetes, cloud spot
instances, torchrun passing on its own SIGTERM, `timeout`), or SIGUSR1 a set time before the limit (SLURM's
`--signal=USR1@120`, where it reaches the training processes: torchrun passes on SIGTERM, SIGINT, SIGHUP and
SIGQUIT by default, and dies of a SIGUSR1 it was not told to handle). `StopOnSignal` catches them while `train()`
runs; the step in progress completes, then the trainer saves a checkpoint (optimizer, scheduler and RNG state
included, whatever `save_strategy` says) and stops.
The same command with `--resume_from_checkpoint true` continues the run where it stopped. A second signal while the
first is being honoured gets the handler that was there before (by default: terminate at once).

Several processes must stop at the same step: they agree on the flag at every step end through `StepAgreement` (an
asynchronous CPU all-reduce read a step later, no device synchronization), so they stop together one or two steps
after the signal. (Agreeing only every N steps would cost the grace period: 25 slow steps outlasted torchrun's 30 s
before it kills its workers.) A single process checks its flag at every step end, with no collective at all.
"""

from __future__ import annotations

import logging
import signal
import threading

from transformers import TrainerCallback

from .step_agreement import StepAgreement

logger = logging.getLogger(__name__)

STOP_SIGNALS = ("SIGTERM", "SIGUSR1")


class StopOnSignal(TrainerCallback):
    def __init__(self, signals=STOP_SIGNALS):
        self.signals = [getattr(signal, name) for name in signals if hasattr(signal, name)]
        self.received: int | None = None  # the signal number, once one came
        self.stopped_at: int | None = None  # the step the run stopped at because of it
        self._previous: dict = {}
        self._agreement = StepAgreement()  # several processes: the flag, agreed at every step end

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
        self._agreement.open()  # every process, here at the same point
        if threading.current_thread() is not threading.main_thread():  # its flag stays down; it still agrees
            logger.info("training runs outside the main thread: no checkpoint on %s", "/".join(STOP_SIGNALS))
            return
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)

    def on_step_end(self, args, state, control, **kwargs):
        stop = self.received is not None
        if self._agreement.active:  # any process's flag up at the last step end
            agreed = self._agreement.exchange([float(stop)])
            stop = bool(agreed and agreed[0])
        if stop and self.stopped_at is None:
            self.stopped_at = state.global_step
            what = self.signal_name or "a stop signal on another process"
            logger.warning("%s: saving a checkpoint at step %d and stopping; the same command with "
                           "--resume_from_checkpoint true continues the run", what, state.global_step)  # fmt: skip
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self._agreement.finish()
        self.close()

    def close(self) -> None:
        """Handlers back and the agreement's group gone (also after a failed run, without waiting on the others)."""
        self._restore()
        self._agreement.close()


__all__ = ["STOP_SIGNALS", "StopOnSignal"]
