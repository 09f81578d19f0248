"""The training-state callbacks: `ShardedCheckpoint` and `BackupAndRestore`
(exported as `kd.callbacks.*`).

`kd.callbacks.ShardedCheckpoint` keeps the latest (and, with `monitor`, the
best) checkpoints of a run; `kd.callbacks.BackupAndRestore` resumes an
interrupted `fit` at the exact epoch and step, with the optimizer, RNG and
callback state, so that the resumed run ends with the same weights as an
uninterrupted one. Both work on every backend and in multi-process jobs
(every process writes its shards; the chief commits and deletes).

This module imports Keras (and so the backend framework): it is loaded on
first use of `kd.callbacks`.
"""

import contextlib
import os
import warnings
from typing import Any, Callable, Dict, List, Optional

import keras

from keras_distribute.checkpoint import format as ckpt_format
from keras_distribute.integration import training as integration_training
from keras_distribute.checkpoint import reading
from keras_distribute.checkpoint.checkpoint_manager import CheckpointManager
from keras_distribute.checkpoint.format import CheckpointError
from keras_distribute.checkpoint.options import CheckpointOptions
from keras_distribute.checkpoint.sharded_checkpoint import ShardedCheckpoint as _Checkpoint
from keras_distribute.checkpoint.sharded_checkpoint import finish_background_saves
from keras_distribute.checkpoint.committed import checkpoints_in
from keras_distribute.checkpoint.committed import read_metadata
from keras_distribute.training_state import CallbackArrays
from keras_distribute.training_state import NOT_SCALAR
from keras_distribute.training_state import MetricVariables
from keras_distribute.training_state import capture_rng
from keras_distribute.training_state import json_scalar
from keras_distribute.training_state import keyed_callbacks
from keras_distribute.training_state import link_checkpoint
from keras_distribute.training_state import restore_rng


def _check_save_freq(save_freq: Any) -> None:
    if save_freq != "epoch" and not (
            isinstance(save_freq, int) and not isinstance(save_freq, bool)
            and save_freq > 0):
        raise ValueError(
            "save_freq must be 'epoch' or a positive number of batches. "
            f"Received: save_freq={save_freq!r}.")


class _TrainingStateCallback(keras.callbacks.Callback):
    """What both callbacks share: the checkpoint of the whole training state
    (model, optimizer, metric state, RNG, other callbacks' progress), saved
    with the epoch and step it was taken at."""

    def __init__(self, directory: str, save_freq: Any, async_save: bool):
        super().__init__()
        if not directory:
            raise ValueError(
                "directory must name a directory for the checkpoints. "
                f"Received: directory={directory!r}.")
        _check_save_freq(save_freq)
        self.directory = os.path.abspath(os.fspath(directory))
        self.save_freq = save_freq
        self.async_save = bool(async_save)
        self._checkpoint: Optional[_Checkpoint] = None
        self._others: List[Any] = []
        self._epoch = 0
        self._steps_in_epoch = 0
        self._steps_since_save = 0
        self._rng_at_epoch_begin: Optional[Dict[str, Any]] = None
        self._data_epoch_offset: Optional[int] = None

    # --------------------------------------------------------------- state
    def _make_checkpoint(self) -> _Checkpoint:
        model = self.model
        if not model.built:
            raise ValueError(
                f"{type(self).__name__} needs a built model before fit() "
                f"starts. Received: the unbuilt model '{model.name}'. Build "
                "it first: call it on a batch, or model.build(input_shape).")
        objects = {"model": model}
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None:
            if not optimizer.built:
                optimizer.build(model.trainable_variables)
            objects["optimizer"] = optimizer
        objects["metrics"] = MetricVariables(model)
        objects["callback_arrays"] = CallbackArrays(self)
        return _Checkpoint(**objects)

    def _sync_model_state(self) -> None:
        sync = getattr(self.model, "jax_state_sync", None)
        if sync is not None:  # JAX fit keeps the state outside the model
            sync()

    def _callback_states(self) -> Dict[str, Dict[str, Any]]:
        states = {}
        for key, callback in keyed_callbacks(self._others):
            state = {}
            for name in integration_training.CALLBACK_STATE:
                if name in callback.__dict__:
                    value = json_scalar(callback.__dict__[name])
                    if value is not NOT_SCALAR:
                        state[name] = value
            if state:
                states[key] = state
        return states

    def _restore_callback_states(self, states: Dict[str, Any]) -> None:
        for key, callback in keyed_callbacks(self._others):
            for name, value in states.get(key, {}).items():
                setattr(callback, name, value)

    def _metadata(self, epoch: int, step: int,
                  logs: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        return {
            "epoch": epoch, "step": step, "rng": capture_rng(),
            # Mid-epoch, the epoch's data order was drawn at its start.
            "rng_epoch_begin": self._rng_at_epoch_begin if step else None,
            "data_epoch_offset": self._data_epoch_offset,
            "callbacks": self._callback_states(),
            "logs": {k: v for k, v in ((k, json_scalar(v)) for k, v in
                                       (logs or {}).items())
                     if v is not NOT_SCALAR},
        }

    # ------------------------------------------------------------ callbacks
    def on_train_begin(self, logs=None):
        self._checkpoint = self._make_checkpoint()
        # A fit stopped by an exception may have left a save running here
        # (and in the other processes): let every process finish its own,
        # then agree on what the directory holds.
        for error in finish_background_saves():
            warnings.warn(f"A background checkpoint save of an earlier, "
                          f"interrupted fit failed: {error}", stacklevel=2)
        self._checkpoint._engine().barrier("keras_distribute.callbacks.begin")
        callback_list = integration_training.calling_callback_list(self)
        if callback_list is not None:
            self._others = [c for c in callback_list.callbacks
                            if c is not self]
            # Save after the other callbacks updated their state at the end
            # of an epoch: dispatch to this callback last (a new list, so
            # the dispatch under way is not disturbed).
            callback_list.callbacks = self._others + [self]
        self._steps_since_save = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._steps_in_epoch = 0
        self._rng_at_epoch_begin = capture_rng()
        counter = integration_training.data_epoch()
        self._data_epoch_offset = None if counter is None else counter - epoch

    def on_train_batch_end(self, batch, logs=None):
        done = batch + 1
        self._steps_since_save += done - self._steps_in_epoch
        self._steps_in_epoch = done
        if self.save_freq != "epoch" and (
                self._steps_since_save >= self.save_freq):
            self._steps_since_save = 0
            self._sync_model_state()
            with self._global_metric_states():
                self._save(self._epoch, done, logs)

    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            self._sync_model_state()
            with self._global_metric_states():
                self._save(epoch + 1, 0, logs)

    def _global_metric_states(self):
        """While saving, metric variables hold their all-process values
        (torch processes each keep their own share; a collective)."""
        states = getattr(self._checkpoint._engine(), "global_metric_states",
                         None)
        if states is None:
            return contextlib.nullcontext()
        return states(self.model.metrics_variables)

    def _options(self) -> CheckpointOptions:
        return CheckpointOptions(enable_async=self.async_save)

    def _save(self, epoch: int, step: int, logs) -> None:
        raise NotImplementedError


class ShardedCheckpoint(_TrainingStateCallback):
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
                f"mode must be 'auto', 'min' or 'max'. Received: mode={mode!r}.")
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
        self._global_step = 0

    @property
    def best_directory(self) -> str:
        """Where the best checkpoints are kept (`<directory>/best`)."""
        return os.path.join(self.directory, "best")

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._latest = CheckpointManager(
            self._checkpoint, self.directory, max_to_keep=self.max_to_keep)
        latest = self._latest.latest_checkpoint
        self._global_step = int(os.path.basename(latest).rsplit("-", 1)[1]
                                ) if latest else 0
        self._checkpoint.save_counter = self._global_step

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

    def _best_ranked(self) -> List[tuple]:
        ranked = []
        for path in checkpoints_in(self.best_directory):
            try:
                value = read_metadata(path).get("monitor_value")
            except CheckpointError:  # removed meanwhile by a background save
                continue
            if value is not None:
                ranked.append((value, path))
        return sorted(ranked, reverse=self.mode == "max")

    def _improves(self, value: float) -> bool:
        values = [v for v, _ in self._best_ranked()]  # best first
        if self.save_best_only:
            return not values or self._better(value, values[0])
        return (self.max_to_keep is None or len(values) < self.max_to_keep
                or self._better(value, values[-1]))

    def _better(self, a: float, b: float) -> bool:
        return a < b if self.mode == "min" else a > b

    def _save(self, epoch: int, step: int, logs) -> None:
        value = self._value(logs)
        metadata = dict(self._metadata(epoch, step, logs),
                        monitor=self.monitor, monitor_value=value)
        keep_best = value is not None and self._improves(value)
        if self.save_best_only and not keep_best:
            return
        number = self._global_step
        if self.save_best_only:
            path = os.path.join(self.best_directory, f"ckpt-{number}")
            self._checkpoint.write(path, self._options(), metadata)
            self._after_best(path)
            return
        if self._latest.latest_checkpoint and os.path.basename(
                self._latest.latest_checkpoint) == f"ckpt-{number}":
            return  # already saved at this step (e.g. batch and epoch end)
        path = self._latest.save(checkpoint_number=number,
                                 options=self._options(), metadata=metadata)
        if keep_best:
            self._after_best(path)

    def _after_best(self, path: str) -> None:
        """Links `path` into `best/` once committed; trims `best/`."""
        checkpoint = self._checkpoint
        is_chief = checkpoint._engine().process_id == 0

        def keep():
            if not is_chief:
                return
            best = os.path.join(self.best_directory, os.path.basename(path))
            if os.path.dirname(path) != self.best_directory:
                link_checkpoint(path, best)
            ranked = self._best_ranked()
            if self.max_to_keep is not None:
                for _, old in ranked[self.max_to_keep:]:
                    ckpt_format.remove(old)

        checkpoint._then(keep)

    def on_train_end(self, logs=None):
        self._checkpoint.sync()  # a failed background save is raised here


class BackupAndRestore(_TrainingStateCallback):
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
    one never interrupted. The backup is deleted when `fit` completes,
    unless `delete_checkpoint=False`.

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

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._completed = False
        self._manager = CheckpointManager(
            self._checkpoint, self.directory, max_to_keep=self.max_to_keep,
            checkpoint_name="backup")
        self._resume = None
        latest = self._restore_newest_readable()
        if latest is None:
            return
        self._checkpoint.save_counter = int(self._resume["save_counter"])
        self._resume_path = latest
        integration_training.set_initial_epoch(self.model,
                                               self._resume["epoch"])

    def _restore_newest_readable(self) -> Optional[str]:
        """Restores the newest backup that reads back whole, falling back to
        older ones; returns its path (`None`: no backup, a fresh start).

        A corrupt backup is moved aside by the chief (`<name>.corrupt`),
        never deleted, so that the next backup can take its number.

        Raises:
            CheckpointError: if backups exist but none is readable.
        """
        # Model and optimizer now; the metric state only when resuming
        # mid-epoch (fit resets it at each epoch's start), the other
        # callbacks' state once they reset it (at their train begin).
        objects = dict(self._checkpoint._objects)
        objects.pop("metrics")
        objects.pop("callback_arrays")
        failures = []
        for path in reversed(self._manager.checkpoints):
            try:
                # Every variable is assigned again from an older backup, so
                # a partial read of a corrupt one leaves nothing behind.
                _Checkpoint(**objects).read(path
                                            ).assert_existing_objects_matched()
                self._resume = read_metadata(path)
            except CheckpointError as error:
                failures.append(f"{path}: {error}")
                self._manager.forget(path)
                if self._checkpoint._engine().process_id == 0:
                    ckpt_format.move_aside(path, ".corrupt")
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
        if resume is not None:
            # Keras 3.16 seeds each epoch's shuffle by a counter of the data
            # adapter: set it to where the interrupted run had it.
            offset = resume.get("data_epoch_offset")
            integration_training.set_data_epoch(
                None if offset is None else offset + epoch)
            skip = int(resume.get("step", 0))
            restore_rng(resume["rng_epoch_begin"] if skip else resume["rng"])
            self._restore_callback_states(resume.get("callbacks", {}))
            _Checkpoint(callback_arrays=self._checkpoint._objects[
                "callback_arrays"]).read(self._resume_path).expect_partial()
            if skip:
                # The order of the epoch's batches comes from the RNG at its
                # start; dropout & co. then go on from the state at the save.
                self._restore_epoch_metrics()
                integration_training.skip_train_steps(
                    self.model, skip, lambda: restore_rng(resume["rng"]),
                    on_first_batch=self._metrics_builder())
        super().on_epoch_begin(epoch, logs)
        if resume is not None and resume.get("step"):
            # The epoch restarted mid-way: its step count goes on from there.
            self._steps_in_epoch = int(resume["step"])

    def _metrics_builder(self) -> Optional[Callable[[Any], None]]:
        """What builds the compiled metrics from the first skipped batch and
        restores them, when they are not built yet: TensorFlow without a
        strategy makes their variables only when it traces the first step."""
        compiled = getattr(self.model, "_compile_metrics", None)
        if compiled is None or compiled.built:
            return None

        def build_and_restore(batch):
            self.model._symbolic_build(data_batch=batch)
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
        metrics = _Checkpoint(metrics=self._checkpoint._objects["metrics"])
        saved = reading.read_index(self._resume_path)["variables"]
        variables = metrics._variables_by_object()["metrics"]
        restoring = getattr(self._checkpoint._engine(),
                            "restoring_metric_states", None)
        with (restoring(list(variables.values())) if restoring is not None
              else contextlib.nullcontext()):
            metrics._restore(self._resume_path, saved, variables)

    def _save(self, epoch: int, step: int, logs) -> None:
        self._manager.save(options=self._options(),
                           metadata=self._metadata(epoch, step, logs))

    def on_train_end(self, logs=None):
        self._checkpoint.sync()
        integration_training.set_initial_epoch(self.model, None)
        engine = self._checkpoint._engine()
        # Every process has seen the last backup committed before the chief
        # deletes it (the others failed, reading a deleted backup).
        engine.barrier("keras_distribute.BackupAndRestore.end")
        if not self.delete_checkpoint:
            return
        try:
            if engine.process_id == 0:
                # Only our checkpoints: a user's file in the directory stays.
                ckpt_format.remove_all_in(self.directory)
        finally:
            # When fit returns anywhere, the backup is gone everywhere (a
            # process that looked at once still saw it on the chief's disk).
            engine.barrier("keras_distribute.BackupAndRestore.deleted")
