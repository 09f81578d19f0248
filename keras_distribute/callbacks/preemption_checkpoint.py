"""`kd.callbacks.PreemptionCheckpoint`: save on SIGTERM, then exit.

Spot VMs, TPU maintenance and cluster schedulers stop a job with SIGTERM
and a grace period. With this callback every process records the signal,
the processes agree at a step boundary that one of them was signalled (a
flag combined over processes after every `check_every` batches), all save
one consistent backup there — the whole training state, as
`BackupAndRestore` — and exit with `PREEMPTION_EXIT_CODE` (42, what
tf.distribute's `PreemptionCheckpointHandler` uses for "restart me").
Started again, the same callback restores the backup and the run ends with
the same weights as one never interrupted.
"""

import signal
import sys
from typing import Any
from typing import Optional
from typing import Sequence

from keras_distribute.callbacks.backup_and_restore import BackupAndRestore
from keras_distribute.checkpoint.preemption_handler import PreemptionSignals
from keras_distribute.job.exit_codes import PREEMPTION_EXIT_CODE


class PreemptionCheckpoint(BackupAndRestore):
    """Saves the training state on a termination signal, then exits.

    The Keras-callback form of tf.distribute's `PreemptionCheckpointHandler`,
    on every backend. While `fit` runs, SIGTERM (or the `signals` given) no
    longer kills the process: it is recorded, and at the next agreement
    point (a batch end; every `check_every` batches) every process learns
    that one was signalled. All of them then save a backup at that same
    step — model, optimizer, metric and RNG state, other callbacks'
    progress — wait until it is committed, and exit with `exit_code`.
    Started again with the same callback, `fit` resumes from that backup at
    the exact step and ends bit-identical to an uninterrupted run. The
    backup is removed once `fit` completes (`delete_checkpoint`).

    Args:
        directory: Where the backup goes (one per run).
        save_freq: Also back up every that many batches, or each `"epoch"`
            (a crash without a signal then loses less). Defaults to `None`:
            only on a signal.
        signals: The signals that mean "preempted". Defaults to SIGTERM.
        exit_code: The exit code after the save (`PREEMPTION_EXIT_CODE`,
            42, by default: restart me), or `None` to stop `fit` and return
            instead (`preempted` is then true).
        check_every: Batches between agreement points (each is one small
            collective over the processes). Defaults to 1.
        delete_checkpoint: Delete the backup once `fit` completes.
        async_save: Periodic backups in the background (the preemption save
            is always waited for).

    Attributes:
        preempted: Whether this `fit` stopped for a signal.

    Raises:
        ValueError: for a bad `save_freq`, `signals`, `exit_code` or
            `check_every`.

    Example:

    ```python
    preemption = kd.callbacks.PreemptionCheckpoint("/shared/run-7/backup")
    model.fit(dataset, epochs=10, callbacks=[preemption])
    # SIGTERM: every process saves at the same step and exits with 42;
    # started again, fit goes on from that step.
    ```
    """

    def __init__(self, directory: str, save_freq: Any = None,
                 signals: Sequence[int] = (signal.SIGTERM,),
                 exit_code: Optional[int] = PREEMPTION_EXIT_CODE,
                 check_every: int = 1, delete_checkpoint: bool = True,
                 async_save: bool = False):
        super().__init__(directory, save_freq or "epoch", delete_checkpoint,
                         async_save, max_to_keep=2)
        self._periodic = save_freq is not None
        self._signals = PreemptionSignals(signals)
        if exit_code is not None and (isinstance(exit_code, bool) or not (
                isinstance(exit_code, int) and 0 < exit_code < 256)):
            raise ValueError(
                "Expected `exit_code` to be an exit status in [1, 255] or "
                f"None (return from fit). Received: exit_code={exit_code!r}.")
        if isinstance(check_every, bool) or not isinstance(
                check_every, int) or check_every < 1:
            raise ValueError(
                "Expected `check_every` to be a positive number of batches. "
                f"Received: check_every={check_every!r}.")
        self.signals = self._signals.signals
        self.exit_code = exit_code
        self.check_every = check_every
        self.preempted = False
        self._batches_since_check = 0

    # ------------------------------------------------------------ callbacks
    def on_train_begin(self, logs=None):
        self.preempted = False
        self._signals.received = None
        self._batches_since_check = 0
        super().on_train_begin(logs)
        self._signals.install()

    def on_train_batch_end(self, batch, logs=None):
        if self._periodic:
            super().on_train_batch_end(batch, logs)
        else:  # keep the step count the backup needs
            self._steps_in_epoch = batch + 1
        self._batches_since_check += 1
        if self._batches_since_check < self.check_every:
            return
        self._batches_since_check = 0
        if not self._signals.anyone(self._state.resolve_engine()):
            return
        self.preempted = True
        self._sync_model_state()
        with self._global_metric_states():
            self._save(self._epoch, self._steps_in_epoch, logs)
        self._state.sync()  # committed before anyone leaves
        engine = self._state.resolve_engine()
        engine.barrier("keras_distribute.PreemptionCheckpoint.saved")
        self._signals.uninstall()
        if self.exit_code is None:
            self.model.stop_training = True
            return
        print(f"PreemptionCheckpoint: saved epoch {self._epoch + 1}, step "
              f"{self._steps_in_epoch} to {self.directory} after "
              f"{self._signals.name()}; "
              f"exiting with {self.exit_code} (restart me).",
              file=sys.stderr)
        sys.exit(self.exit_code)

    def on_epoch_end(self, epoch, logs=None):
        if self._periodic:
            super().on_epoch_end(epoch, logs)

    def on_train_end(self, logs=None):
        self._signals.uninstall()
        if self.preempted:
            # Stopped for a signal (exit_code=None): the backup stays for
            # the next run.
            self._state.sync()
            if self._manager is not None:
                self._manager.close()
            return
        super().on_train_end(logs)
