"""`kd.callbacks.BackupAndRestore`: resumes an interrupted `fit` at the exact
epoch and step, with the optimizer, RNG and callback state, so that the
resumed run ends with the same weights as an uninterrupted one.
"""

import contextlib
import warnings
from typing import Any
from typing import Callable
from typing import Dict
from typing import Optional

from keras_distribute.backend import interface
from keras_distribute.callbacks.training_state import restore_rng
from keras_distribute.callbacks.training_state_callback import (
    TrainingStateCallback,
)
from keras_distribute.callbacks.training_state_callback import (
    made_at_train_begin,
)
from keras_distribute.checkpoint.checkpoint_manager import CheckpointManager
from keras_distribute.checkpoint.sharded_checkpoint import (
    ShardedCheckpoint as _Checkpoint,
)
from keras_distribute.checkpoint.storage import object_store
from keras_distribute.checkpoint.storage import ownership
from keras_distribute.checkpoint.storage import remote_checkpoints
from keras_distribute.checkpoint.storage import writing as ckpt_writing
from keras_distribute.checkpoint.storage.committed import read_metadata
from keras_distribute.checkpoint.storage.format import CheckpointError
from keras_distribute.checkpoint.storage.format import CheckpointMismatchError
from keras_distribute.integration import training as integration_training

# The writer named in every backup's index (see `checkpoint.storage.ownership`):
# the clean-up deletes only checkpoints that name it.
BACKUP_OWNER = "keras_distribute.callbacks.BackupAndRestore"
BACKUP_STEM = "backup"
_CORRUPT = ".corrupt"  # the suffix of a backup found unreadable


class BackupAndRestore(TrainingStateCallback):
    """Resumes an interrupted `fit` exactly where its last backup was taken.

    The sharded counterpart of `keras.callbacks.BackupAndRestore`, which
    restarts at an epoch boundary with the weights only. Here a backup holds
    the model, the optimizer (slots and iteration count), the metric state,
    the seed-generator and host RNG states (numpy, `random`, torch) that
    decide dropout and shuffling, and the progress of the other callbacks
    (`EarlyStopping.best`, and its `best_weights` with
    `restore_best_weights=True`). When `fit` starts again with the same
    callback, it restores the latest backup and skips the epochs and the
    batches already done, so the resumed run ends with the same weights as
    one never interrupted. When `fit` completes, the backups this callback
    wrote are deleted (unless `delete_checkpoint=False`): only `backup-<n>`
    checkpoints directly in `directory` whose index names this callback as
    their writer, and `directory` itself only if this callback created it
    and nothing else is in it. Anything else there (a model you saved,
    another callback's checkpoints, your files) stays.

    A backup that cannot be read (corrupt, truncated) is moved aside as
    `<name>.corrupt` and the next older one is used. A model that differs
    from the backups (another architecture) is not corruption: `fit` stops
    with a `CheckpointMismatchError` and the backups stay as they are.

    Args:
        directory: Where the backups go (one per run).
        save_freq: `"epoch"`, or back up every that many batches.
        delete_checkpoint: Delete the backups once `fit` completes.
        async_save: Write in the background (`fit` waits only for the copy
            to host memory).
        max_to_keep: How many backups to keep (the older one is a fallback).

    Raises:
        ValueError: for a bad `save_freq` or `directory`; at the start of
            `fit`, for a model that is not built.
        CheckpointMismatchError: at the start of `fit`, for a model that
            differs from the one the backups hold.

    Example:

    ```python
    backup = kd.callbacks.BackupAndRestore("/tmp/backup", save_freq=50)
    model.fit(dataset, epochs=10, callbacks=[backup])  # interrupted? rerun it
    ```
    """

    def __init__(self, directory: str, save_freq: Any = "epoch",
                 delete_checkpoint: bool = True, async_save: bool = False,
                 max_to_keep: int = 2):
        super().__init__(directory, save_freq, async_save)
        if not isinstance(max_to_keep, int) or max_to_keep < 1:
            raise ValueError(
                "max_to_keep must be a positive integer. Received: "
                f"max_to_keep={max_to_keep!r}.")
        self.delete_checkpoint = delete_checkpoint
        self.max_to_keep = max_to_keep
        self._manager: Optional[CheckpointManager] = None
        self._resume: Optional[Dict[str, Any]] = None
        self._resume_path: Optional[str] = None
        self._completed = False

    @property
    def _backups(self) -> CheckpointManager:
        """The manager of this run's checkpoints, made by `on_train_begin`."""
        return made_at_train_begin(self._manager, "checkpoint manager", self)

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._completed = False
        if self._state.resolve_engine().process_id == 0:
            ownership.make_directory(self.directory, BACKUP_OWNER)
        self._manager = CheckpointManager(
            self._state, self.directory, max_to_keep=self.max_to_keep,
            checkpoint_name=BACKUP_STEM, owner=BACKUP_OWNER)
        self._resume = None
        latest = self._restore_newest_readable()
        resume = self._resume
        if latest is None or resume is None:
            return
        self._state.save_counter = int(resume["save_counter"])
        self._resume_path = latest
        integration_training.set_initial_epoch(self.model, resume["epoch"])

    def _restore_newest_readable(self) -> Optional[str]:
        """Restores the newest backup that reads back whole, falling back to
        older ones; returns its path (`None`: no backup, a fresh start).

        A corrupt backup is moved aside by the chief (`<name>.corrupt`),
        never deleted, so that the next backup can take its number. A
        model that does not fit a backup stops the search: every backup
        would fail the same way, and none is corrupt.

        Raises:
            CheckpointMismatchError: if the model differs from the backup's
                (nothing is restored, renamed or deleted).
            CheckpointError: if backups exist but none is readable.
        """
        # Model and optimizer now; the metric state only when resuming
        # mid-epoch (fit resets it at each epoch's start), the other
        # callbacks' state once they reset it (at their train begin).
        objects = self._state.objects_by_name()
        objects.pop("metrics")
        objects.pop("callback_arrays")
        failures = []
        for path in reversed(self._backups.checkpoints):
            try:
                # Every variable is assigned again from an older backup, so
                # a partial read of a corrupt one leaves nothing behind.
                _Checkpoint(**objects).read(path,
                                            require_existing_matched=True)
                self._resume = read_metadata(path)
            except CheckpointMismatchError as error:
                raise CheckpointMismatchError(
                    f"BackupAndRestore cannot resume from {path!r}: {error} "
                    f"The backups in {self.directory!r} are intact and were "
                    "left as they are. To resume, build the model as it was "
                    "when they were written; to train this model afresh, "
                    "pass another directory.") from None
            except CheckpointError as error:
                failures.append(f"{path}: {error}")
                self._backups.forget(path)
                if self._state.resolve_engine().process_id == 0:
                    if object_store.is_remote(path):
                        remote_checkpoints.move_aside(path, _CORRUPT)
                    else:
                        ckpt_writing.move_aside(path, _CORRUPT)
                continue
            if failures:
                warnings.warn(
                    f"BackupAndRestore: resuming from the older backup "
                    f"{path!r}; newer ones are unreadable and were moved "
                    f"aside: {failures}", stacklevel=2)
            return path
        if failures:
            raise CheckpointError(
                f"No backup in {self.directory!r} can be read: {failures}. "
                "Remove the directory to start training afresh.")
        return None

    def on_epoch_begin(self, epoch, logs=None):
        resume, self._resume = self._resume, None
        resume_path = self._resume_path
        if resume is not None and resume_path is not None:
            # Keras 3.16 seeds each epoch's shuffle by a counter of the data
            # adapter: set it to where the interrupted run had it.
            offset = resume.get("data_epoch_offset")
            integration_training.set_data_epoch(
                None if offset is None else offset + epoch)
            skip = int(resume.get("step", 0))
            restore_rng(resume["rng_epoch_begin"] if skip else resume["rng"])
            self._restore_callback_states(resume.get("callbacks", {}))
            _Checkpoint(callback_arrays=self._state.callback_arrays).read(
                resume_path).expect_partial()
            if skip:
                # The order of the epoch's batches comes from the RNG at its
                # start; dropout & co. then go on from the state at the save.
                self._restore_epoch_metrics()
                integration_training.skip_train_steps(
                    self.model, skip, lambda: restore_rng(resume["rng"]),
                    on_first_batch=self._metrics_builder(),
                    callback_list=integration_training.calling_callback_list(
                        self))
        super().on_epoch_begin(epoch, logs)
        if resume is not None and resume.get("step"):
            # The epoch restarted mid-way: its step count goes on from there.
            self._steps_in_epoch = int(resume["step"])

    def _metrics_builder(self) -> Optional[Callable[[Any], None]]:
        """What builds the compiled metrics from the first skipped batch and
        restores them, when they are not built yet: TensorFlow without a
        strategy makes their variables only when it traces the first step."""
        if not integration_training.compiled_metrics_unbuilt(self.model):
            return None

        def build_and_restore(batch):
            integration_training.build_from_batch(self.model, batch)
            self._restore_epoch_metrics()

        return build_and_restore

    def _restore_epoch_metrics(self) -> None:
        """Metric state mid-epoch (reset by `fit` at the epoch's start).

        The backup holds all-process values; where each replica's processes
        keep its share (torch), replica 0 takes a summed value and the others
        zero, so that reading them sums to it again.
        """
        # The metric variables that exist now (compiled metrics not built
        # yet are restored by `_metrics_builder` from the first batch).
        path = self._resume_path
        if path is None:
            return  # nothing to resume from
        metrics = self._state.metrics
        engine = self._state.resolve_engine()
        with (engine.restoring_metric_states(list(metrics.variables))
              if isinstance(engine, interface.TorchDdpEngine)
              else contextlib.nullcontext()):
            _Checkpoint(metrics=metrics).read(path,
                                              defer=False).expect_partial()

    def _save(self, epoch: int, step: int, logs) -> None:
        self._backups.save(options=self._options(),
                           metadata=self._metadata(epoch, step, logs))

    def on_train_end(self, logs=None):
        self._state.sync()
        if self._manager is not None:
            self._manager.close()  # the directory's lease: another job's now
        integration_training.set_initial_epoch(self.model, None)
        engine = self._state.resolve_engine()
        # Every process has seen the last backup committed before the chief
        # deletes it (the others failed, reading a deleted backup).
        engine.barrier("keras_distribute.BackupAndRestore.end")
        if not self.delete_checkpoint:
            return
        try:
            if engine.process_id == 0:
                self._remove_own_backups()
        finally:
            # When fit returns anywhere, the backup is gone everywhere (a
            # process that looked at once still saw it on the chief's disk).
            engine.barrier("keras_distribute.BackupAndRestore.deleted")

    def _remove_own_backups(self) -> None:
        """Chief only: deletes the backups this callback wrote (its owner
        in their index), then `directory` if it created it and it is empty.
        Never walks below `directory`, never touches another writer's."""
        for path in ownership.owned_checkpoints(
                self.directory, BACKUP_STEM, BACKUP_OWNER,
                moved_aside=_CORRUPT):
            if object_store.is_remote(path):
                remote_checkpoints.remove(path)
            else:
                ckpt_writing.remove(path)
        ownership.remove_directory(self.directory, BACKUP_OWNER)
