"""Horovod's Keras callbacks, for programs ported from Horovod.

`hvd.callbacks.BroadcastGlobalVariablesCallback`, `MetricAverageCallback`
and `LearningRateWarmupCallback` with Horovod's semantics, on the processes
of a kd job (`kd.broadcast`, `kd.allreduce`). Under a kd strategy the
variables start equal and the logs are already global, so the first two
keep ported code working and make no difference to a run that did not
diverge; the warmup is what Horovod's is. Exported as `kd.callbacks.*`.
"""

from typing import Optional

import keras

from keras_distribute.common.context import model_strategy
from keras_distribute.training import collectives


class BroadcastGlobalVariables(keras.callbacks.Callback):
    """Sets every model and optimizer variable to process `root_rank`'s
    value when training begins and after the first batch (Horovod's
    `BroadcastGlobalVariablesCallback`).

    Args:
        root_rank: The process whose values everyone takes. Defaults to 0.

    Raises:
        ValueError: (when training begins) for a `root_rank` outside the
            job.

    Example:

    ```python
    model.fit(x, y, callbacks=[kd.callbacks.BroadcastGlobalVariables(0)])
    ```
    """

    def __init__(self, root_rank: int = 0):
        super().__init__()
        self.root_rank = root_rank
        self._first_batch_done = False

    def on_train_begin(self, logs=None):
        self._first_batch_done = False
        self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        # Again after the first batch, as Horovod does: optimizer slots made
        # by the first step, and (Keras 3.16 torch) the DDP Keras wraps the
        # model in at its first step broadcasts rank 0's values itself.
        if not self._first_batch_done:
            self._first_batch_done = True
            self._broadcast()

    def _broadcast(self):
        variables = list(self.model.variables)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and getattr(optimizer, "built", False):
            variables += list(optimizer.variables)
        for variable in variables:
            value = collectives.broadcast(
                variable.numpy(), self.root_rank)
            variable.assign(value)


class MetricAverage(keras.callbacks.Callback):
    """Averages the epoch's logs over the processes (Horovod's
    `MetricAverageCallback`). Put it before callbacks that read the logs
    (`ReduceLROnPlateau`, `ModelCheckpoint(save_best_only=True)`, ...).

    Under a kd strategy every process's logs are already the global values,
    so the average equals them; processes that disagree (a callback that
    wrote a local value) end up agreeing.

    Example:

    ```python
    model.fit(x, y, callbacks=[kd.callbacks.MetricAverage()])
    ```
    """

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        for name in sorted(logs):  # the same order in every process
            value = logs[name]
            if isinstance(value, (int, float)) or getattr(
                    value, "shape", None) == ():
                logs[name] = float(collectives.allreduce(float(value)))


class LearningRateWarmup(keras.callbacks.Callback):
    """Ramps the learning rate from `initial_lr / size` to `initial_lr`
    over the first `warmup_epochs` epochs, batch by batch (Horovod's
    `LearningRateWarmupCallback`, after Goyal et al., 2017).

    `size` is the number of replicas the model trains on (Horovod's
    `hvd.size()`: one worker per device), so `initial_lr` is the learning
    rate already scaled for the global batch (e.g. `0.001 * size`).

    Args:
        initial_lr: The learning rate at the end of the warmup.
        warmup_epochs: Epochs to ramp over. Defaults to 5.
        steps_per_epoch: Batches per epoch; defaults to what `fit` reports.
        verbose: 1 prints the learning rate when the warmup ends.

    Raises:
        ValueError: for a non-positive `initial_lr` or `warmup_epochs`; (when
            training begins) an optimizer whose learning rate is a schedule,
            or an unknown number of steps per epoch.

    Example:

    ```python
    size = strategy.num_replicas_in_sync
    warmup = kd.callbacks.LearningRateWarmup(initial_lr=0.001 * size,
                                             warmup_epochs=3)
    model.fit(dataset, epochs=10, callbacks=[warmup])
    ```
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5,
                 steps_per_epoch: Optional[int] = None, verbose: int = 0):
        super().__init__()
        if isinstance(initial_lr, bool) or not isinstance(
                initial_lr, (int, float)) or initial_lr <= 0:
            raise ValueError(
                "Expected `initial_lr` to be a positive number. Received: "
                f"initial_lr={initial_lr!r}.")
        if isinstance(warmup_epochs, bool) or not isinstance(
                warmup_epochs, (int, float)) or warmup_epochs <= 0:
            raise ValueError(
                "Expected `warmup_epochs` to be a positive number of epochs. "
                f"Received: warmup_epochs={warmup_epochs!r}.")
        self.initial_lr = float(initial_lr)
        self.warmup_epochs = warmup_epochs
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self._epoch = 0
        self._size = 1

    def _learning_rate(self):
        rate = self.model.optimizer.learning_rate
        if not isinstance(rate, keras.Variable):
            raise ValueError(
                "LearningRateWarmup sets the optimizer's learning rate, which "
                "must be a number (a variable). Received: an optimizer whose "
                "learning rate is computed by a learning rate schedule. Use "
                "a constant learning rate, or put the warmup in the schedule "
                "itself.")
        return rate

    def on_train_begin(self, logs=None):
        self._learning_rate()
        strategy = model_strategy(self.model)
        self._size = strategy.num_replicas_in_sync if strategy else 1
        steps = self.steps_per_epoch or self.params.get("steps")
        if not steps:
            raise ValueError(
                "LearningRateWarmup needs the number of batches per epoch. "
                "Received: steps_per_epoch=None and a `fit` that does not "
                "know it (a dataset of unknown length). Pass "
                "`steps_per_epoch` to the callback or to `fit`.")
        self._steps = steps

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self._epoch >= self.warmup_epochs:
            return
        progress = self._epoch + batch / self._steps
        multiplier = (progress * (self._size - 1) / self.warmup_epochs
                      + 1) / self._size
        self._learning_rate().assign(self.initial_lr * multiplier)

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.warmup_epochs - 1:
            self._learning_rate().assign(self.initial_lr)
            if self.verbose and collectives.process_index() == 0:
                print(f"\nEpoch {epoch + 1}: finished gradual learning rate "
                      f"warmup to {self.initial_lr:g}.")
