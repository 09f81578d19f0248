"""`kd.callbacks.ShardedCheckpoint`: the latest (and, with `monitor`, the
best) sharded checkpoints of a run, on every backend and in multi-process
jobs (every process writes its shards; the chief commits and deletes).
"""

import math
import os
from typing import Any
from typing import Optional

from keras_distribute.callbacks.training_state_callback import (
    TrainingStateCallback,
)
from keras_distribute.callbacks.training_state_callback import (
    made_at_train_begin,
)
from keras_distribute.checkpoint.checkpoint_manager import CheckpointManager


class ShardedCheckpoint(TrainingStateCallback):
    """Saves sharded checkpoints of the training state during `fit`.

    The sharded counterpart of `keras.callbacks.ModelCheckpoint`: model,
    optimizer, metric state, RNG and the other callbacks' progress go to
    `<directory>/ckpt-<global step>`, the latest `max_to_keep` kept. With a
    `monitor`, the best `max_to_keep` checkpoints (by that metric) are also
    kept, apart, in `<directory>/best/`; with `save_best_only=True` only
    those are written. Asynchronous by default: `fit` waits only while
    values are copied to host memory; a failed write is raised by the next
    save or at the end of `fit`.

    Args:
        directory: Where the checkpoints go.
        save_freq: `"epoch"`, or save every that many batches.
        max_to_keep: How many latest (and how many best) to keep.
        async_save: Write in the background.
        monitor: A logged metric (e.g. `"val_loss"`) ranking the best ones.
        save_best_only: Write only checkpoints that improve on `monitor`.
        mode: `"min"`, `"max"` or `"auto"` (`"max"` for accuracy-like names).

    Raises:
        ValueError: for a bad `save_freq`, `max_to_keep` or `mode`, or
            `save_best_only` without `monitor`.

    Example:

    ```python
    model.fit(x, y, epochs=10, callbacks=[
        kd.callbacks.ShardedCheckpoint("/tmp/run", monitor="val_loss")])
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=model)
    checkpoint.read(kd.checkpoint.latest_checkpoint("/tmp/run/best"))
    ```
    """

    def __init__(self, directory: str, save_freq: Any = "epoch",
                 max_to_keep: Optional[int] = 5, async_save: bool = True,
                 monitor: Optional[str] = None, save_best_only: bool = False,
                 mode: str = "auto"):
        super().__init__(directory, save_freq, async_save)
        if save_best_only and monitor is None:
            raise ValueError(
                "save_best_only=True needs a metric to compare: pass monitor= "
                "(e.g. monitor='val_loss').")
        if mode not in ("auto", "min", "max"):
            raise ValueError(
                "mode must be 'auto', 'min' or 'max'. "
                f"Received: mode={mode!r}.")
        if max_to_keep is not None and (not isinstance(max_to_keep, int)
                                        or max_to_keep < 1):
            raise ValueError(
                "max_to_keep must be a positive integer or None. Received: "
                f"max_to_keep={max_to_keep!r}.")
        if mode == "auto":
            mode = "max" if monitor is not None and any(
                word in monitor for word in ("acc", "auc", "precision",
                                             "recall", "f1")) else "min"
        self.max_to_keep = max_to_keep
        self.monitor = monitor
        self.save_best_only = save_best_only
        self.mode = mode
        self._latest: Optional[CheckpointManager] = None
        self._best: Optional[CheckpointManager] = None
        self._global_step = 0

    @property
    def best_directory(self) -> str:
        """Where the best checkpoints are kept (`<directory>/best`)."""
        return os.path.join(self.directory, "best")

    @property
    def _latest_manager(self) -> CheckpointManager:
        """The manager of this run's checkpoints, made by `on_train_begin`."""
        return made_at_train_begin(self._latest, "checkpoint manager", self)

    @property
    def _best_manager(self) -> CheckpointManager:
        """The manager of the best ones (with `monitor`)."""
        return made_at_train_begin(self._best, "checkpoint manager", self)

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._latest = CheckpointManager(
            self._state, self.directory, max_to_keep=self.max_to_keep)
        managers = [self._latest]
        if self.monitor is not None:
            # Ranked by the monitored value each save records.
            self._best = CheckpointManager(
                self._state, self.best_directory,
                max_to_keep=self.max_to_keep, best_metric="monitor_value",
                best_mode=self.mode)
            managers.append(self._best)
        self._global_step = max(
            (_number(manager.latest_checkpoint) for manager in managers
             if manager.latest_checkpoint is not None), default=0)
        self._state.save_counter = self._global_step

    def on_train_batch_end(self, batch, logs=None):
        self._global_step += 1 + batch - self._steps_in_epoch
        super().on_train_batch_end(batch, logs)

    def _value(self, logs) -> Optional[float]:
        if self.monitor is None:
            return None
        value = (logs or {}).get(self.monitor)
        if value is None:
            raise ValueError(
                f"kd.callbacks.ShardedCheckpoint monitors {self.monitor!r}, "
                f"which is not in the logs. Received logs: "
                f"{sorted(logs or {})}. Pass monitor= one of them (val_* "
                "metrics need validation_data, and save_freq='epoch').")
        return float(value)

    def _improves(self, value: float) -> bool:
        """Whether `value` is better than the best one kept (a NaN never
        is), as `ModelCheckpoint(save_best_only=True)` decides."""
        best = self._best_manager.best_value
        if math.isnan(value):
            return False
        if best is None or math.isnan(best):
            return True
        return value < best if self.mode == "min" else value > best

    def _save(self, epoch: int, step: int, logs) -> None:
        value = self._value(logs)
        metadata = dict(self._metadata(epoch, step, logs),
                        monitor=self.monitor, monitor_value=value)
        number = self._global_step
        if self.save_best_only:
            assert value is not None  # save_best_only needs a monitor
            if self._improves(value) and not _saved_at(self._best_manager,
                                                       number):
                self._best_manager.save(checkpoint_number=number,
                                        options=self._options(),
                                        metadata=metadata)
            return
        if _saved_at(self._latest_manager, number):
            return  # already saved at this step (e.g. batch and epoch end)
        saved = self._latest_manager.save(
            checkpoint_number=number, options=self._options(),
            metadata=metadata)
        if value is not None and saved is not None:
            self._best_manager.save_link(saved, checkpoint_number=number,
                                         metadata=metadata)

    def on_train_end(self, logs=None):
        self._state.sync()  # a failed background save is raised here
        for manager in (self._latest, self._best):
            if manager is not None:
                manager.close()  # the directory's lease: another job's now


def _number(path: str) -> int:
    return int(os.path.basename(path).rsplit("-", 1)[1])


def _saved_at(manager: CheckpointManager, number: int) -> bool:
    """Whether `manager` saved at step `number` already (or after it)."""
    latest = manager.latest_checkpoint
    return latest is not None and _number(latest) >= number
