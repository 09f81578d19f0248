"""Pieces both fit benchmarks share: the timed model and the step timer."""

import time

import keras


class StepTimer(keras.callbacks.Callback):
    """Records the wall time of every training step after `warmup` steps."""

    def __init__(self, warmup=5):
        super().__init__()
        self.warmup, self.times, self._start = warmup, [], None

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if batch >= self.warmup:
            self.times.append(time.perf_counter() - self._start)


def make_model():
    """The 3-layer MLP both benchmarks time (256 -> 512 -> 512 -> 10)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((256,)),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    return model


class EpochTimer(keras.callbacks.Callback):
    """Wall time per step of each epoch, with no per-batch hook.

    A per-batch hook changes what `fit` does (Keras and kd then prepare
    every batch's logs), so steady-state step time is taken per epoch.
    """

    def __init__(self):
        super().__init__()
        self.per_step, self._start = [], None

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        steps = self.params["steps"]
        self.per_step.append((time.perf_counter() - self._start) / steps)


def make_wide_mlp(width):
    """The model-parallel benchmarks' MLP: 256 -> width ("up") -> 256
    ("down") -> 10 ("head"); "up" and "down" are the kernels they shard."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((256,)),
        keras.layers.Dense(width, activation="relu", name="up"),
        keras.layers.Dense(256, name="down"),
        keras.layers.Dense(10, name="head"),
    ])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    return model


def sharded_vs_replicated(benchmark, unit, ms, nbytes, **extra):
    """The model-parallel benchmarks' JSON object: step times in ms and
    variable bytes per `unit` ("device" or "process"), with their ratios."""
    return {
        "benchmark": benchmark, **extra,
        "replicated_step_ms": round(ms["replicated"], 3),
        "sharded_step_ms": round(ms["sharded"], 3),
        "step_time_ratio": round(ms["sharded"] / ms["replicated"], 3),
        f"replicated_variable_bytes_per_{unit}": nbytes["replicated"],
        f"sharded_variable_bytes_per_{unit}": nbytes["sharded"],
        "memory_ratio": round(nbytes["sharded"] / nbytes["replicated"], 3),
    }
