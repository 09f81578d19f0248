"""What the training-state callbacks share: `TrainingStateCallback`, the
base of `kd.callbacks.ShardedCheckpoint` (`checkpoint_callback`) and
`kd.callbacks.BackupAndRestore` (`backup_callback`).

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
from typing import Any
from typing import Dict
from typing import List
from typing import Optional
from typing import TypeVar

import keras

from keras_distribute.backend import interface
from keras_distribute.callbacks.training_state import NOT_SCALAR
from keras_distribute.callbacks.training_state import CallbackArrays
from keras_distribute.callbacks.training_state import MetricVariables
from keras_distribute.callbacks.training_state import capture_rng
from keras_distribute.callbacks.training_state import json_scalar
from keras_distribute.callbacks.training_state import keyed_callbacks
from keras_distribute.checkpoint.checkpointer import finish_background_saves
from keras_distribute.checkpoint.options import CheckpointOptions
from keras_distribute.checkpoint.sharded_checkpoint import (
    ShardedCheckpoint as _Checkpoint,
)
from keras_distribute.checkpoint.storage import object_store
from keras_distribute.checkpoint.storage import paths as ckpt_paths
from keras_distribute.integration import training as integration_training


def _check_save_freq(save_freq: Any) -> None:
    if save_freq != "epoch" and not (
            isinstance(save_freq, int) and not isinstance(save_freq, bool)
            and save_freq > 0):
        raise ValueError(
            "save_freq must be 'epoch' or a positive number of batches. "
            f"Received: save_freq={save_freq!r}.")


class TrainingStateCallback(keras.callbacks.Callback):
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
        self.directory = ckpt_paths.checkpoint_path(directory, "directory")
        if not object_store.is_remote(self.directory):
            self.directory = os.path.abspath(self.directory)
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
    @property
    def _state(self) -> _Checkpoint:
        """The checkpoint of `fit`'s state, made by `on_train_begin`."""
        return made_at_train_begin(self._checkpoint,
                                   "checkpoint of fit's state", self)

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
        self._state.resolve_engine().barrier(
            "keras_distribute.callbacks.begin")
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
        engine = self._state.resolve_engine()
        if not isinstance(engine, interface.TorchDdpEngine):
            return contextlib.nullcontext()
        return engine.global_metric_states(self.model.metrics_variables)

    def _options(self) -> CheckpointOptions:
        return CheckpointOptions(enable_async=self.async_save)

    def _save(self, epoch: int, step: int, logs) -> None:
        raise NotImplementedError


T = TypeVar("T")


def made_at_train_begin(value: Optional[T], what: str, callback: Any) -> T:
    """`value`, which `on_train_begin` made; an error if it has not run."""
    if value is None:
        raise RuntimeError(
            f"{type(callback).__name__} has no {what} yet: it is made when "
            "`fit` begins (`on_train_begin`). Received a call before it. "
            "Pass the callback to `model.fit(callbacks=[...])`.")
    return value
